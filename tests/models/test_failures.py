"""How provider failures map to keel's model errors (codes a failed turn carries, and whether an
attempt is tried again)."""

from __future__ import annotations

import pytest

from harness.models.failures import from_status
from harness.retry import retry_after

TOO_LONG, INVALID = "model_context_length", "model_invalid_request"


@pytest.mark.parametrize(
    ("status", "message", "kind", "code", "retryable"),
    [
        (
            400,
            "prompt is too long: 210000 tokens > 200000 maximum",
            "invalid_request_error",
            "model_context_length",
            False,
        ),
        (
            400,
            "input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000",
            "invalid_request_error",
            "model_context_length",
            False,
        ),
        (
            400,
            "This model's maximum context length is 128000 tokens.",
            "context_length_exceeded",
            "model_context_length",
            False,
        ),
        (
            400,
            "Invalid 'tools[0].description': string too long.",
            "string_above_max_length",
            "model_invalid_request",
            False,
        ),
        (401, "invalid x-api-key", "authentication_error", "model_auth", False),
        (403, "not allowed", "permission_error", "model_auth", False),
        (404, "model: claude-nope", "not_found_error", "model_not_found", False),
        (429, "Rate limit reached", "rate_limit_exceeded", "model_rate_limited", True),
        (429, "You exceeded your current quota", "insufficient_quota", "model_quota", False),
        (529, "Overloaded", "overloaded_error", "model_overloaded", True),
        (200, "Overloaded", "overloaded_error", "model_overloaded", True),
        (200, "server had an error", "server_error", "model_unavailable", True),
        (200, "the prompt was flagged", "invalid_prompt", "model_invalid_request", False),
        (503, "unavailable", "", "model_unavailable", True),
        (408, "timeout", "", "model_unavailable", True),
    ],
)
def test_statuses_and_kinds_map_to_codes(status: int, message: str, kind: str, code: str, retryable: bool) -> None:
    error = from_status(status, message, kind=kind)
    assert (error.code, error.retryable) == (code, retryable)


def test_retry_after_in_milliseconds_wins_and_a_date_is_read() -> None:
    assert retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after({"Retry-After": "3"}) == 3.0  # (a header's name in any case)
    now = 1_790_000_000.0  # 2026-09-21 14:13:20 UTC
    assert retry_after({"retry-after": "Mon, 21 Sep 2026 14:13:50 GMT"}, now=now) == 30.0
    # what cannot say how long to wait says nothing (the caller backs off): a date already past
    # (a clock behind keel's), a negative number, no number at all
    assert retry_after({"retry-after": "Wed, 21 Jan 2026 07:28:00 GMT"}, now=now) is None
    assert retry_after({"retry-after": "soon"}) is None and retry_after({"retry-after": "-5"}) is None
    assert retry_after({"retry-after": "inf"}) is None and retry_after({}) is None
    assert retry_after({"retry-after": "0"}) == 0.0  # (at once, as asked)
