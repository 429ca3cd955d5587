"""A bounded, per-process cache of each session's active history, decoded.

History is append-only between compactions (I6) and its start moves only when it is compacted
or cleared, so (start, length) identify what a cache entry holds, within one incarnation of the
session (`epoch`, its created_at: a session deleted or expired and made again under the same id
is another): BEGIN sends Redis only the items past it, and a commit appends what it wrote.
Anything that does not line up is dropped and read again; the cache can make a read smaller,
never different."""

from __future__ import annotations

from collections import OrderedDict

from harness.types import Item


class HistoryCache:
    def __init__(self, max_sessions: int = 1024) -> None:
        self._max = max_sessions
        self._entries: OrderedDict[str, tuple[int, list[Item], str]] = OrderedDict()

    def get(self, sid: str) -> tuple[int, list[Item], str] | None:
        """(start, items, epoch) of the session's cached history."""
        entry = self._entries.get(sid)
        if entry is not None:
            self._entries.move_to_end(sid)
        return entry

    def put(self, sid: str, start: int, items: list[Item], epoch: str) -> None:
        if self._max <= 0:
            return
        self._entries[sid] = (start, items, epoch)
        self._entries.move_to_end(sid)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def extend(self, sid: str, appended: list[Item], new_length: int) -> None:
        """A commit appended `appended`, leaving the list `new_length` long."""
        entry = self._entries.get(sid)
        if entry is None:
            return
        start, items, _ = entry
        if start + len(items) + len(appended) == new_length:
            items.extend(appended)
        else:
            del self._entries[sid]

    def drop(self, sid: str) -> None:
        self._entries.pop(sid, None)
