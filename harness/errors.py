"""keel's error hierarchy. Channels map these to wire errors; nothing here knows HTTP.

KeelError                  base; `code` is the stable machine-readable name
├── InvalidInput           the caller sent something malformed (I10: nothing was changed)
├── NotFound               unknown session (or one the caller may not see)
├── Conflict               the request contradicts the session's state
├── StaleLease             a commit by a runner that no longer owns the session (I4)
├── Unavailable            storage did not answer (or failed); nothing is known to be done:
│                          the caller retries (a repeated message_id or answer is safe)
├── ToolError              a tool failed; becomes an error tool result, not a failed turn
├── ModelError             the model call failed; the turn fails with this code
└── CallbackError          the agent's input callback failed; the turn fails with this code
"""

from __future__ import annotations


class KeelError(Exception):
    code = "keel_error"

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}  # extra fields of the wire error, e.g. a recorded decision
        if code is not None:
            self.code = code


class InvalidInput(KeelError):
    code = "invalid_request"


class NotFound(KeelError):
    code = "not_found"


class Conflict(KeelError):
    code = "conflict"


class StaleLease(KeelError):
    code = "stale_lease"


class Unavailable(KeelError):
    code = "unavailable"


class ToolError(KeelError):
    code = "tool_error"


class ModelError(KeelError):
    code = "model_error"


class CallbackError(KeelError):
    code = "input_callback_failed"
