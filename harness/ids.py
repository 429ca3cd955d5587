"""Identifiers: the ids keel makes, and the shapes of the ids callers give.

Identifiers: short, random, URL-safe, sortable by creation time; and the shapes of the ids
callers give (a session's, a message's)."""

from __future__ import annotations

import os
import re
import time

SESSION_ID = re.compile(r"^ses_[0-9a-z]{26}$")
MESSAGE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # a client's idempotency key (and a request id)

REQUEST_PREFIX = "req_"  # a tool call's approval request id is this and the call's id


def request_id(call_id: str) -> str:
    """A call's approval request id: derived from the committed call id, so it is the same
    after any crash or retry (I2, I3)."""
    return REQUEST_PREFIX + call_id


def call_of(request_id: str) -> str:
    """The id of the tool call an approval request asks about."""
    return request_id.removeprefix(REQUEST_PREFIX)


_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


# every 10 bits as their two characters: 80 random bits are 8 lookups
_PAIRS = [_ALPHABET[n >> 5] + _ALPHABET[n & 31] for n in range(1024)]


def _ms_text(ms: int) -> str:
    """The milliseconds as 10 characters (50 bits), by the same table as the randomness."""
    p = _PAIRS
    return p[(ms >> 40) & 1023] + p[(ms >> 30) & 1023] + p[(ms >> 20) & 1023] + p[(ms >> 10) & 1023] + p[ms & 1023]


class _Random:
    """os.urandom drawn 4 KiB at a time (one system call per 409 ids); a forked child starts
    with none of its parent's, so the two never hand out the same bytes."""

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        if self._at + n > len(self._pool):
            self._pool, self._at = os.urandom(4096), 0
        self._at += n
        return self._pool[self._at - n : self._at]

    def forget(self) -> None:
        self._pool, self._at = b"", 0


_random = _Random()
_RAND_LIMIT = 1 << 80


class _Last:
    """The last id this process made, as (milliseconds, randomness): an id made in the same
    millisecond (or after the clock stepped back) is the last one plus a random step, so this
    process's ids sort in the order they were made (a listing's tie on one millisecond is
    broken by the id), and still no two neighbours can be guessed from each other."""

    ms = -1
    rand = 0


def _forget() -> None:
    _random.forget()
    _Last.ms = -1  # the child's next id starts fresh randomness, never its parent's sequence


os.register_at_fork(after_in_child=_forget)


def new_id(prefix: str) -> str:
    """`prefix_` + 10 chars of milliseconds + 16 chars of randomness (80 bits); monotonic
    within a process."""
    ms = time.time_ns() // 1_000_000
    if ms > _Last.ms:
        n = int.from_bytes(_random.take(10))
    else:  # the same millisecond: the last randomness and a step of 1 to 2**64
        ms = _Last.ms
        n = _Last.rand + 1 + int.from_bytes(_random.take(8))
        if n >= _RAND_LIMIT:  # (2**16 ids in a millisecond at the least): the next millisecond's
            ms, n = ms + 1, int.from_bytes(_random.take(10))
    _Last.ms, _Last.rand = ms, n
    p = _PAIRS
    rand = (
        p[n >> 70]
        + p[(n >> 60) & 1023]
        + p[(n >> 50) & 1023]
        + p[(n >> 40) & 1023]
        + p[(n >> 30) & 1023]
        + p[(n >> 20) & 1023]
        + p[(n >> 10) & 1023]
        + p[n & 1023]
    )
    return f"{prefix}_{_ms_text(ms)}{rand}"
