"""Identifiers: short, random, URL-safe, sortable by creation time."""

from __future__ import annotations

import base64
import functools
import os
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(n: int, width: int) -> str:
    out = []
    for _ in range(width):
        out.append(_ALPHABET[n & 31])
        n >>= 5
    return "".join(reversed(out))


# base64's base32 alphabet (A-Z, 2-7) in index order, to keel's: b32encode, then translate
_FROM_STD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _ALPHABET.encode())


@functools.lru_cache(maxsize=4)
def _ms_text(ms: int) -> str:
    return _b32(ms, 10)


def new_id(prefix: str) -> str:
    """`prefix_` + 10 chars of milliseconds + 16 chars of randomness (80 bits)."""
    rand = base64.b32encode(os.urandom(10)).translate(_FROM_STD).decode()
    return f"{prefix}_{_ms_text(time.time_ns() // 1_000_000)}{rand}"


def stream_key(eid: str) -> tuple[int, int]:
    """A Redis stream id as (ms, seq), for comparing: stream ids never compare as strings."""
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)
