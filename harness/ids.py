"""Identifiers: short, random, URL-safe, sortable by creation time."""

from __future__ import annotations

import os
import time

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _b32(n: int, width: int) -> str:
    out = []
    for _ in range(width):
        out.append(_ALPHABET[n & 31])
        n >>= 5
    return "".join(reversed(out))


def new_id(prefix: str) -> str:
    """`prefix_` + 10 chars of milliseconds + 16 chars of randomness (80 bits)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    return f"{prefix}_{_b32(ms, 10)}{_b32(rand, 16)}"


def stream_key(eid: str) -> tuple[int, int]:
    """A Redis stream id as (ms, seq), for comparing: stream ids never compare as strings."""
    ms, _, seq = eid.partition("-")
    return int(ms), int(seq or 0)
