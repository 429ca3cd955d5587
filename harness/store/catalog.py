"""An owner's list of sessions: most recent activity first, in pages.

An owner's sessions are listed from a sorted set of its own (`OwnerKeys`: session id by its
latest activity, in ms), kept by the writes that change a session: its creation, a message, a
turn's end or pause (`touch`, a command that goes with the session's script, in the same round
trip), and its deletion (`untouch`). The set is in its owner's slot, not the session's, so on a
cluster it is written just after the session's script, not by it, and waits for no replica (a
`lazy` write: a lost one is repaired by the session's next activity, and the list's node never
holds a message up): the session's own meta is the truth, and a page reads it for every entry
(title, status, metadata, preview), drops the entries whose session is gone (deleted, expired)
and removes them from the set.

A page is cut by a cursor, the (activity, session id) of the last entry it gave: the next page
holds the entries below it. An entry's activity only grows, so a walk from the first page to
the last gives no session twice, and every session that had no activity during the walk
exactly once; one with activity during the walk moved above the cursor, to the top, where the
next walk from the first page finds it (it may have been given before it moved, or not).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from harness.errors import InvalidInput
from harness.ids import SESSION_ID
from harness.store.client import translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import OwnerKeys, SessionKeys
from harness.store.wire import raised
from harness.types import SESSIONS_PAGE_MAX, ListedSession, SessionPage, SessionStatus

PAGE_MAX = SESSIONS_PAGE_MAX
LOOKED_MAX = 1000  # entries a page looks through (filters may refuse them all: then a short page)
FILTERED_BATCH = 50  # a filtered page's first read (each next one twice as many)
TITLE_CHARS = 80  # a session's title until one is set: the start of its first message
PREVIEW_CHARS = 120  # an item's preview: the start of the session's last message
# the session's TTL, and this much more, past its latest activity: surely gone (it expires at
# most its TTL after its latest write, and a process's clock may run behind Redis's)
EXPIRED_MARGIN_MS = 3_600_000
_CURSOR = re.compile(r"^([0-9]{1,16})\.(ses_[0-9a-z]{26})$")
_FIELDS = ("owner", "status", "title", "metadata", "created_at", "updated_at", "preview")
_metadata = msgspec.json.Decoder(dict[str, Any])
_enc = msgspec.json.Encoder()


def cursor_of(text: str) -> tuple[int, str]:
    """A page's cursor, as a client sends it back: (activity ms, session id)."""
    found = _CURSOR.match(text)
    if found is None or not SESSION_ID.match(found.group(2)):
        raise InvalidInput("cursor is the next_cursor a page gave", code="invalid_cursor")
    return int(found.group(1)), found.group(2)


def touch(owner: str, sid: str, at: float, ttl_ms: int = 0) -> list[tuple[Any, ...]]:
    """The commands that list `sid` at activity `at` (seconds) under its owner, going with the
    session's script: never moved back (GT); the set expires with its last session."""
    key = OwnerKeys(owner).sessions
    commands: list[tuple[Any, ...]] = [("ZADD", key, "GT", int(at * 1000), sid)]
    if ttl_ms > 0:
        commands.append(("PEXPIRE", key, ttl_ms + EXPIRED_MARGIN_MS))
    return commands


def untouch(owner: str, sid: str) -> tuple[Any, ...]:
    return ("ZREM", OwnerKeys(owner).sessions, sid)


def matches(metadata: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    """Whether every `wanted` key's value is the given text: a string as it is, another value
    as its JSON (`5`, `true`, `null`)."""
    for key, text in wanted.items():
        if key not in metadata:
            return False
        value = metadata[key]
        if (value if isinstance(value, str) else _enc.encode(value).decode()) != text:
            return False
    return True


class Catalog:
    def __init__(self, wire: AnyWire, ttl_ms: int = 0) -> None:
        self.wire = wire
        self.ttl_ms = ttl_ms

    @translated
    async def page(
        self,
        owner: str,
        *,
        limit: int,
        cursor: tuple[int, str] | None = None,
        status: SessionStatus | None = None,
        metadata: Mapping[str, str] | None = None,
        now: float,
    ) -> SessionPage:
        """The owner's sessions below `cursor` (from the most recent when None), at most `limit`,
        those with `status` and `metadata` only; looks through at most LOOKED_MAX entries."""
        key = OwnerKeys(owner).sessions
        if cursor is None and self.ttl_ms > 0:  # (a walk's first page clears out the surely expired)
            cutoff = int(now * 1000) - self.ttl_ms - EXPIRED_MARGIN_MS
            raised(await self.wire.call([("ZREMRANGEBYSCORE", key, "-inf", f"({cutoff}")]))
        items: list[ListedSession] = []
        looked, last = 0, cursor
        filtered = status is not None or bool(metadata)
        size = max(limit, FILTERED_BATCH) if filtered else limit
        while looked < LOOKED_MAX:
            # unfiltered, a page reads what it lacks (more only if some were gone); filtered, in
            # batches that double, since most entries may be refused
            want = size if filtered else limit - len(items)
            batch = await self._below(key, last, min(want, LOOKED_MAX - looked))
            size *= 2
            if not batch:
                return SessionPage(items, None)
            looked += len(batch)
            for (score, sid), listed in zip(
                batch, await self._read(owner, key, [sid for _, sid in batch]), strict=True
            ):
                last = (score, sid)
                if listed is None or (status is not None and listed.status != status):
                    continue
                if metadata and not matches(listed.metadata, metadata):
                    continue
                items.append(listed)
                if len(items) == limit:
                    return SessionPage(items, f"{score}.{sid}")
        return SessionPage(items, f"{last[0]}.{last[1]}" if last is not None else None)

    async def _below(self, key: str, cursor: tuple[int, str] | None, count: int) -> list[tuple[int, str]]:
        """Up to `count` entries below `cursor`, highest first: (activity, session id), ties
        by id, highest first, as Redis orders them."""
        top = "+inf" if cursor is None else cursor[0]
        # (entries of the cursor's own ms that come before it in the order are read again: skipped)
        ties = 0
        while True:
            (raw,) = raised(
                await self.wire.call(
                    [("ZRANGE", key, top, "-inf", "BYSCORE", "REV", "LIMIT", 0, count + ties, "WITHSCORES")]
                )
            )
            pairs = raw if raw and isinstance(raw[0], list) else zip(raw[::2], raw[1::2], strict=True)  # (RESP3, 2)
            entries = [(int(float(score)), member.decode()) for member, score in pairs]
            if cursor is None:
                return entries
            kept = [e for e in entries if e[0] < cursor[0] or e[1] < cursor[1]]
            skipped = len(entries) - len(kept)  # (the first ones: of the cursor's ms, at or above it)
            if len(kept) >= count or len(entries) < count + ties or skipped <= ties:
                return kept[:count]
            ties = skipped  # (read again, that many further)

    async def _read(self, owner: str, key: str, sids: Sequence[str]) -> list[ListedSession | None]:
        """Each session as listed, from its meta; None for one that is no more (or not the
        owner's), which leaves the owner's list too."""
        replies = raised(await self.wire.call([("HMGET", SessionKeys(sid).meta, *_FIELDS) for sid in sids]))
        out: list[ListedSession | None] = []
        gone: list[str] = []
        for sid, fields in zip(sids, replies, strict=True):
            found, status, title, metadata, created_at, updated_at, preview = fields
            if found is None or found.decode() != owner:
                out.append(None)
                if found is None:
                    gone.append(sid)
                continue
            created = float(created_at)
            out.append(
                ListedSession(
                    session_id=sid,
                    title=title.decode() if title is not None else None,
                    status=status.decode(),
                    metadata=_metadata.decode(metadata),
                    created_at=created,
                    updated_at=float(updated_at) if updated_at is not None else created,
                    preview=preview.decode() if preview is not None else "",
                )
            )
        if gone:
            raised(await self.wire.call([("ZREM", key, *gone)]))
        return out
