"""When to try again: the one `Retry-After` reader, and keel's backoff.

When to try again: the one reader of a `Retry-After` (a provider's, a webhook receiver's,
Slack's, Linear's) and the backoff keel falls back on when none was given."""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping

RETRY_AFTER_MAX_S = 120.0  # a provider's wait is honoured up to this (more: a retry is not worth it)
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0


def retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait, from a response's `retry-after-ms` (milliseconds, as OpenAI and
    Anthropic send it) or `Retry-After` (seconds, or an HTTP date: RFC 9110); None when there is
    neither or it cannot be read (a negative number, a date already past: the caller backs off
    as it would without one). Header names in any case."""
    lowered = {k.lower(): v for k, v in headers.items() if k.lower() in ("retry-after-ms", "retry-after")}
    ms = _number(lowered.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    seconds = _number(raw)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(raw.strip())
    except (TypeError, ValueError, IndexError):
        return None
    left = when.timestamp() - (time.time() if now is None else now)
    return left if left > 0 else None


def _number(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def backoff(retry: int, after: float | None = None) -> float:
    """Seconds before retry number `retry` (1, 2, ...) of a model call: the provider's
    `retry-after` when it gave one (at most RETRY_AFTER_MAX_S), else exponential with full
    jitter (0.5 s doubling, at most 30 s)."""
    if after is not None:
        return min(max(after, 0.0), RETRY_AFTER_MAX_S)
    return random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (retry - 1)))
