"""Reading a session's committed events: a replay of its outbox stream after a position, then
what follows, live. The events this process committed come from the hub (the same bytes a read
gives) when they continue exactly where the reader is; anything else is read from the stream,
which is always the truth."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from harness.events import StoredEvent
from harness.store.hub import EventHub, Watch
from harness.store.sessions import Store

BATCH = 200  # events read from the stream at once


class Outbox:
    def __init__(self, store: Store, hub: EventHub) -> None:
        self.store = store
        self.hub = hub

    async def next(self, sid: str, watch: Watch, after: str) -> tuple[list[StoredEvent], bool]:
        """The events after `after`: those this process handed the watch, if they continue it,
        else a read of the stream. Second: a full read, so more may be waiting right now."""
        batch = watch.take()
        from_stream = batch is None
        if batch is None:
            batch = await self.store.events(sid, after, count=BATCH)
        watch.advance(batch)
        return batch, from_stream and len(batch) == BATCH

    async def tail(
        self, sid: str, after: str, *, heartbeat: float, gate: asyncio.Semaphore | None = None
    ) -> AsyncIterator[StoredEvent | None]:
        """Events after `after`, then live ones, forever. Yields None after `heartbeat` seconds
        without an event (for keep-alives). The caller checks ownership first. `gate` bounds how
        many readers do their first (replay) read at once."""
        async with self.hub.watch(sid, after) as watch:
            if gate is not None:
                async with gate:
                    first = await self.store.events(sid, after, count=BATCH)
                for event in first:
                    yield event
                watch.advance(first)
                after = first[-1].id if first else after
                if len(first) < BATCH and not await watch.wait(heartbeat):
                    yield None  # all read: the next read waits for news
            while True:
                batch, more = await self.next(sid, watch, after)
                for event in batch:
                    yield event
                if batch:
                    after = batch[-1].id
                if not more and not await watch.wait(heartbeat):
                    yield None
