"""Provider failures as keel's `ModelError`s: one mapping for every adapter.

Provider failures as keel's `ModelError`s, one mapping for every adapter: what failed (the
code a failed turn carries), whether another attempt may succeed, and after how long the
provider asked to wait (`harness.retry.retry_after`)."""

from __future__ import annotations

from collections.abc import Mapping

from harness.errors import ModelError
from harness.retry import retry_after

RETRYABLE_STATUS = {408, 409, 429}
# How providers say the prompt does not fit: Anthropic ("prompt is too long: ...", "input length
# and `max_tokens` exceed context limit: ..."), OpenAI (code context_length_exceeded, "maximum
# context length is ..."), OpenAI-compatible servers ("context window", "context length").
CONTEXT_HINTS = (
    "prompt is too long",
    "exceed context limit",
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "context window",
)


def from_status(status: int, message: str, *, kind: str = "", headers: Mapping[str, str] | None = None) -> ModelError:
    """The ModelError for an HTTP status (or, for an error that came inside a 200 stream, the
    provider's error `kind`, such as "overloaded_error")."""
    wait = retry_after(headers or {})
    lowered = f"{kind} {message}".lower()
    if status in (400, 413) and any(hint in lowered for hint in CONTEXT_HINTS):
        return ModelError(message, code="model_context_length")
    if "insufficient_quota" in lowered:  # a 429 that waiting does not cure
        return ModelError(message, code="model_quota")
    if status in (401, 403) or "authentication" in kind or "permission" in kind:
        return ModelError(message, code="model_auth")
    if status == 404 or kind == "not_found_error":
        return ModelError(message, code="model_not_found")
    if status == 429 or "rate_limit" in kind:
        return ModelError(message, code="model_rate_limited", retryable=True, retry_after=wait)
    if status == 529 or "overloaded" in kind:
        return ModelError(message, code="model_overloaded", retryable=True, retry_after=wait)
    if status in RETRYABLE_STATUS:
        return ModelError(message, code="model_unavailable", retryable=True, retry_after=wait)
    if status == 200 and "invalid" in kind:  # (a stream that began well, then refused the request)
        return ModelError(message, code="model_invalid_request")
    if status >= 500 or (status == 200 and kind):  # (an error event in a stream that began well)
        return ModelError(message, code="model_unavailable", retryable=True, retry_after=wait)
    return ModelError(message, code="model_invalid_request")


def timed_out(message: str) -> ModelError:
    """No connection within the connect timeout, or no event for the idle timeout."""
    return ModelError(message, code="model_timeout", retryable=True)


def unreachable(message: str) -> ModelError:
    return ModelError(message, code="model_connection", retryable=True)
