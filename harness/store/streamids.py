"""Redis stream ids: the one place keel reads, compares and steps them.

Redis stream ids, the one place keel reads them: an event's id (the outbox's) and a job's
(the job streams') are `<ms>-<seq>`, compared as those two numbers, never as strings."""

from __future__ import annotations

import re
from typing import NamedTuple

from harness.errors import InvalidInput

_ID = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")  # ASCII digits only (\d takes any script's)
START = "0-0"  # before the first event: a read after it reads from the start
MAX = 2**64 - 1


class StreamId(NamedTuple):
    """A stream id as (ms, seq): ordered as Redis orders them."""

    ms: int
    seq: int

    @classmethod
    def parse(cls, text: str) -> StreamId:
        ms, _, seq = text.partition("-")
        return cls(int(ms), int(seq or 0))

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"


# `newer(a, b)` for scripts: whether stream id `a` comes after `b` (an id that is not one, '' say,
# comes first). Lua's numbers hold the milliseconds of any real clock exactly.
LUA_NEWER = """
local function newer(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams or 0), tonumber(aseq or 0), tonumber(bms or 0), tonumber(bseq or 0)
  return ams > bms or (ams == bms and aseq > bseq)
end
"""


def key(eid: str) -> StreamId:
    """`eid` for comparing (as `sorted(..., key=key)` would)."""
    return StreamId.parse(eid)


def before(eid: str) -> str:
    """The stream id just before `eid`, so a read 'after' it includes `eid` itself."""
    ms, seq = StreamId.parse(eid)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{MAX}" if ms > 0 else START


def ms_of(eid: str) -> int:
    """When the event or job `eid` was added (Unix milliseconds, the server's clock)."""
    return StreamId.parse(eid).ms


def at(epoch_s: float) -> str:
    """The position at `epoch_s` (its millisecond's first id): a read after it gets what came later."""
    return f"{int(epoch_s * 1000)}-0"


def check_event_id(eid: str) -> str:
    """An event id a client may resume after: `<ms>-<seq>`, both below 2**64, not the last one."""
    if _ID.match(eid):
        ms, seq = StreamId.parse(eid)
        if ms <= MAX and seq <= MAX and (ms, seq) != (MAX, MAX):
            return eid
    raise InvalidInput("an event id looks like 1700000000000-0", code="invalid_event_id")


def newest(*eids: str) -> str:
    """The newest of `eids` (START if none)."""
    return max(eids, key=StreamId.parse, default=START)
