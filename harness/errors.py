"""keel's error hierarchy. Channels map these to wire errors; nothing here knows HTTP.

KeelError                  base; `code` is the stable machine-readable name
├── InvalidInput           the caller sent something malformed (I10: nothing was changed)
├── NotFound               unknown session (or one the caller may not see)
├── Conflict               the request contradicts the session's state
├── Limited                a quota says not now (rate limit, queue full): retry after `retry_after` s
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


class Limited(KeelError):
    code = "rate_limited"

    def __init__(self, message: str, *, code: str | None = None, retry_after: int = 1) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after  # whole seconds, at least 1


class StaleLease(KeelError):
    code = "stale_lease"


class Unavailable(KeelError):
    code = "unavailable"


class ToolError(KeelError):
    code = "tool_error"


class ModelError(KeelError):
    """A provider attempt failed. `retryable`: another attempt may succeed (after `retry_after`
    seconds, when the provider said so). Codes: model_auth, model_invalid_request,
    model_not_found, model_context_length, model_rate_limited, model_overloaded,
    model_unavailable, model_timeout, model_connection, model_error."""

    code = "model_error"

    def __init__(
        self, message: str, *, code: str | None = None, retryable: bool = False, retry_after: float | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retryable = retryable
        self.retry_after = retry_after


class CallbackError(KeelError):
    code = "input_callback_failed"
