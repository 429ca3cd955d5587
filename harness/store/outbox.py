"""Reading a session's committed events: a replay, then live.

Reading a session's committed events: a replay of its outbox stream after a position, then
what follows, live. The events this process committed come from the hub (the same bytes a read
gives) when they continue exactly where the reader is; anything else is read from the stream,
which is always the truth. A reader of a session that ends is told (`session.deleted`, the last
thing it gets): at once when the session is deleted, or at its next periodic look when it finds
the session gone (the notice lost, or the session expired)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import msgspec

from harness.events import (
    InputRequested,
    InputRequestedData,
    InputResolved,
    LiveEvent,
    MessageCompleted,
    MessageReceived,
    StoredEvent,
    envelope,
    session_deleted,
)
from harness.store import streamids
from harness.store.client import Client, translated
from harness.store.clusterwire import AnyWire
from harness.store.hub import EventHub, Watch
from harness.store.keys import SessionKeys
from harness.store.wire import REPLICATED, NotReplicated, raised

BATCH = 200  # events read from the stream at once
SCAN_MAX = 20_000  # events looked through, newest first, for where a turn began
COMPLETED_KEPT = 32  # items a reader remembers as completed, to drop their late live events
_enc = msgspec.json.Encoder()


class _Asked(msgspec.Struct):
    data: InputRequestedData


_asked = msgspec.json.Decoder(_Asked)


class Outbox:
    def __init__(self, redis: Client, wire: AnyWire, hub: EventHub) -> None:
        self.redis = redis
        self.wire = wire
        self.hub = hub
        # a reader shown less than the stream holds looks again after this long, unwoken: the
        # writer's WAIT is over by then, its mark made or never to be (with replicas)
        self.recheck = 2 * wire.replicas.timeout_ms / 1000 if wire.replicas is not None else 0.0

    async def events(self, sid: str, after: str = streamids.START, count: int = BATCH) -> list[StoredEvent]:
        """Events after stream id `after` (START: from the first). By the wire: a reader's read,
        on its path, and cancellable (redis-py's write, in `wait_for` on Python 3.11, can swallow
        the cancellation of a reader that goes away). With replicas, those a replica has."""
        return (await self._read(sid, after, count))[0]

    @translated
    async def _read(self, sid: str, after: str, count: int) -> tuple[list[StoredEvent], bool]:
        """`events`, and whether the read found events no replica is known to have yet."""
        keys = SessionKeys(sid)
        read = ("XRANGE", keys.outbox, f"({after}" if after != streamids.START else "-", "+", "COUNT", count)
        if self.wire.replicas is None:
            (raw,) = raised(await self.wire.call([read]))
            held = False
        else:  # (the mark first, then the stream: all up to the mark are on a replica)
            shown, found = raised(await self.wire.call([("HGET", keys.meta, REPLICATED), read]))
            raw = _up_to(found, shown)
            held = len(raw) < len(found)
        return [envelope(sid, eid, dict(zip(f[::2], f[1::2], strict=True))) for eid, f in raw], held

    async def event(self, sid: str, event_id: str) -> StoredEvent | None:
        """The event `event_id`, if the outbox still holds it."""
        found = await self.events(sid, streamids.before(event_id), count=1)
        return found[0] if found and found[0].id == event_id else None

    @translated
    async def find_back(
        self,
        sid: str,
        etypes: tuple[str, ...],
        found: Callable[[bytes, bytes], bool],
        *,
        within: int = SCAN_MAX,
        unshown: bool = False,
    ) -> StoredEvent | None:
        """The newest event of one of `etypes` whose type and stored body `found` accepts,
        looked for from the newest event back, at most `within` events; None if there is none.
        With replicas, among those a replica has (`unshown`: all, for a look that shows none)."""
        keys, end, wanted = SessionKeys(sid), "+", {t.encode() for t in etypes}
        if self.wire.replicas is not None and not unshown:  # (from the newest event a replica has)
            shown = await self._shown(keys)
            if shown is None:
                return None
            end = shown
        looked = 0
        while looked < within:
            (raw,) = raised(await self.wire.call([("XREVRANGE", keys.outbox, end, "-", "COUNT", BATCH)]))
            for eid, f in raw:
                fields = dict(zip(f[::2], f[1::2], strict=True))
                if fields[b"t"] in wanted and found(fields[b"t"], fields[b"b"]):
                    return envelope(sid, eid, fields)
            if len(raw) < BATCH:
                return None
            looked += len(raw)
            end = "(" + raw[-1][0].decode()
        return None

    async def turn_begins(self, sid: str, turn_id: str) -> str | None:
        """The stream id of `turn_id`'s message.received: the first event of a turn, written
        once, however often the turn begins again after a crash."""
        head = b'"turn_id":' + _enc.encode(turn_id) + b","
        event = await self.find_back(sid, (MessageReceived.TYPE,), lambda _, b: b.startswith(head))
        return event.id if event is not None else None

    async def answers_kept(self, sid: str, request_ids: Collection[str]) -> bool:
        """Whether an input.requested that asked one of `request_ids`, or an input.resolved that
        answered one, is still kept (one look back)."""
        mentions = _mentioning(request_ids)
        return await self.find_back(sid, (InputRequested.TYPE, InputResolved.TYPE), mentions) is not None

    async def asked_kept(self, sid: str, request_ids: Collection[str]) -> bool:
        """Whether the input.requested that asked one of `request_ids` is still in the outbox
        (with replicas, shown to readers or still to be: a reader will read it)."""
        found = await self.find_back(sid, (InputRequested.TYPE,), _mentioning(request_ids), unshown=True)
        return found is not None

    @translated
    async def newest(self, sid: str) -> str:
        """The id of the newest event a reader would read now (START with none): with replicas,
        the newest a replica is known to have."""
        keys = SessionKeys(sid)
        if self.wire.replicas is not None:
            return await self._shown(keys) or streamids.START
        (raw,) = raised(await self.wire.call([("XREVRANGE", keys.outbox, "+", "-", "COUNT", 1)]))
        return raw[0][0].decode() if raw else streamids.START

    async def _shown(self, keys: SessionKeys) -> str | None:
        """With replicas: the newest event a replica is known to have (its mark), if any."""
        (shown,) = raised(await self.wire.call([("HGET", keys.meta, REPLICATED)]))
        return shown.decode() if shown is not None else None

    @translated
    async def exists(self, sid: str) -> bool:
        """Whether the session is there (a reader's look: no owner check)."""
        return bool(await self.redis.exists(SessionKeys(sid).meta))

    @translated
    async def settle(self, sid: str) -> None:
        """With replicas, on a reader's periodic look: show the session's events past its mark
        that a replica has. (A mark lost in a failover, made on the old primary just before it
        died, would hide them until the session's next write.) Nothing if no replica has them."""
        if self.wire.replicas is None:
            return
        keys = SessionKeys(sid)
        read = [("HGET", keys.meta, REPLICATED), ("XREVRANGE", keys.outbox, "+", "-", "COUNT", 1)]
        shown, newest = raised(await self.wire.call(read))
        if newest and (shown is None or streamids.key(newest[0][0].decode()) > streamids.key(shown.decode())):
            with contextlib.suppress(NotReplicated):
                await self.wire.settle([keys.meta, keys.outbox])

    async def next(
        self, sid: str, watch: Watch, after: str, *, deadline: float | None = None
    ) -> tuple[list[StoredEvent], bool]:
        """The events after `after`: those this process handed the watch, if they continue it,
        else a read of the stream (TimeoutError past `deadline`, the loop's time, if given).
        Second: a full read, so more may be waiting right now."""
        batch, more, _ = await self._next(sid, watch, after, deadline)
        return batch, more

    async def _next(
        self, sid: str, watch: Watch, after: str, deadline: float | None = None
    ) -> tuple[list[StoredEvent], bool, bool]:
        """`next`, and whether its read found events no replica is known to have yet."""
        batch, held = watch.take(), False
        from_stream = batch is None
        if batch is None:
            if deadline is None:
                batch, held = await self._read(sid, after, BATCH)
            else:
                async with asyncio.timeout_at(deadline):
                    batch, held = await self._read(sid, after, BATCH)
        watch.advance(batch)
        return batch, from_stream and len(batch) == BATCH, held

    async def tail(
        self,
        sid: str,
        after: str,
        *,
        heartbeat: float,
        gate: asyncio.Semaphore | None = None,
        deltas: bool = True,
        opened: Watch | None = None,
    ) -> AsyncIterator[StoredEvent | LiveEvent | None]:
        """Events after `after`, then live ones, forever, with the session's live events
        (`message.delta`) as they come, except those of an item whose message.completed this
        reader has had (none without `deltas`). Yields None after `heartbeat` seconds without an
        event (for keep-alives). Ends with a `session.deleted` live event when the session ends.
        The caller checks ownership first. `gate` bounds how many readers do their
        first (replay) read at once. `opened`: a watch the caller opened before (so that it missed
        no live event since) and closes."""
        completed: deque[str] = deque(maxlen=COMPLETED_KEPT)
        watching = contextlib.nullcontext(opened) if opened is not None else self.hub.watch(sid, live=deltas)
        async with watching as watch:
            read, held = True, False
            if gate is not None:
                async with gate:
                    first, held = await self._read(sid, after, BATCH)
                for event in first:
                    yield event
                    _note_completed(completed, event)
                watch.advance(first)
                after = first[-1].id if first else after
                read = len(first) == BATCH
            replayed = gate is not None and not read
            look = False  # this read is a periodic look (no wake-up for a while)
            while True:
                if watch.ended is not None:
                    yield session_deleted(sid, watch.ended)
                    return
                if replayed:  # live events that came before a commit go out before it (not later ones)
                    for live in watch.take_live(before_news=True):
                        if live.item_id not in completed:
                            yield live
                if read:
                    if look:
                        await self.settle(sid)
                    batch, more, held = await self._next(sid, watch, after)
                    for event in batch:
                        yield event
                        _note_completed(completed, event)
                    if batch:
                        after = batch[-1].id
                    if more:
                        continue
                    if look and not batch and not await self.exists(sid):
                        yield session_deleted(sid, "gone")
                        return
                replayed = True
                for live in watch.take_live(before_news=True):  # (those after a commit: once it is read)
                    if live.item_id not in completed:
                        yield live
                # (events held back, were their mark not to come: a look soon, not at the heartbeat)
                woken = await watch.wait(min(heartbeat, self.recheck) if held else heartbeat)
                if not woken:
                    yield None
                # a commit (here or elsewhere), or a periodic look in case a wake-up was lost
                look = not woken
                read = look or watch.take_news()


def _up_to(raw: list[Any], shown: bytes | None) -> list[Any]:
    """The entries of a stream read up to the event `shown` (a replica has them), in order."""
    if shown is None:
        return []
    last = streamids.key(shown.decode())
    n = len(raw)
    while n and streamids.key(raw[n - 1][0].decode()) > last:
        n -= 1
    return raw[:n]


def _mentioning(request_ids: Collection[str]) -> Callable[[bytes, bytes], bool]:
    """`find_back`'s test for an input.requested that asked, or an input.resolved that
    answered, one of `request_ids`."""
    needles = [b'"request_id":' + _enc.encode(r) + b"," for r in request_ids]
    resolved = InputResolved.TYPE.encode()

    def mentions(etype: bytes, body: bytes) -> bool:
        if not any(n in body for n in needles):
            return False
        if etype == resolved:
            return True
        # (in an input.requested the needle could be inside a tool's arguments too)
        return any(r.request_id in request_ids for r in _asked.decode(b"{" + body).data.requests)

    return mentions


def _note_completed(completed: deque[str], event: StoredEvent) -> None:
    done = event.of(MessageCompleted)
    if done is not None:
        completed.append(done.data.item_id)
