"""What a failed outbound call means to the delivery relay, read the same way for event webhooks,
Slack and Linear: the destination's answer (its status, its `Retry-After`) or a connection that
failed becomes `Retry` (not now: after the wait it named, else the relay's backoff) or
`Undeliverable` (never: a dead letter)."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from harness.relay import Retry, Undeliverable
from harness.retry import retry_after

# What a connection that failed raises: a timeout, aiohttp's errors, the socket's.
UNREACHABLE = (TimeoutError, aiohttp.ClientError, OSError)
NOT_NOW = frozenset({408, 425, 429})  # statuses that say "not now" (besides every 5xx)


def not_now(status: int) -> bool:
    """Whether a status says "not now" (try again later) rather than "never"."""
    return status in NOT_NOW or status >= 500


def answered(
    what: str, status: int, headers: Mapping[str, str], *, transient: bool = False, error: str = ""
) -> Retry | Undeliverable:
    """`what` answered `status` (not a success), perhaps with an `error` of its own: a Retry when
    that says "not now" (408, 425, 429, any 5xx) or the caller knows it to be `transient`, after
    the `Retry-After` it sent (else the relay's backoff); anything else is Undeliverable."""
    if transient or not_now(status):
        return Retry(f"{what} answered {status} {error}".rstrip(), retry_after(headers))
    return Undeliverable(f"{what} refused: {error or status}")


def unreachable(what: str, exc: BaseException) -> Retry:
    """The call got no answer (a timeout, a refused or broken connection)."""
    return Retry(f"{what} is unreachable: {type(exc).__name__}", None)
