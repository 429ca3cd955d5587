"""Wakes readers of a session's outbox when new events are committed, and hands them the events
this process committed and the live (transient) events of the session, from this process or,
through the `LiveRelay`, from the one running the turn.

Commits made in this process are published here with the events they wrote (byte for byte what
a read of the outbox returns); a single background poller notices commits made by other
processes (XREAD BLOCK over the watched sessions). A reader takes published events only when
they continue exactly where it is (the next seq, no gap); otherwise it reads the outbox stream,
which is always the truth. A session that ends (deleted) ends its watches here and, through the
`LiveRelay`, in the processes that have readers of it (`ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from redis.asyncio import Redis

from harness.aio import cancel_and_wait
from harness.events import LiveEvent, StoredEvent
from harness.ids import stream_key
from harness.store.client import count_error
from harness.store.keys import SessionKeys, session_of
from harness.store.live import LiveRelay

log = logging.getLogger("keel.hub")


def _never(sid: str) -> bool:
    return False


PUSHED_MAX = 512  # events a watch holds for its reader; past that it reads the stream instead
LIVE_MAX = 1024  # live events a watch holds for a reader that does not take them; older ones go


class Watch:
    def __init__(self, after: str | None, *, settled_only: bool = False, live: bool = True) -> None:
        self._woken = False  # woken since its reader last waited
        self._news = False  # ... by a commit (not only by live events): the reader reads
        self._live: list[LiveEvent] = []
        self._waiter: asyncio.Future[bool] | None = None
        self.seen = after  # the newest event id its reader has read (None: not known yet)
        self.last_seq: int | None = None  # ... and its seq (None: not known: read the stream)
        self.settled_only = settled_only  # local wake-ups only for commits that settle a turn
        self.live = live and not settled_only  # takes live events (message.delta)
        self._pushed: list[StoredEvent] = []
        self._overflow = False
        self.ended: str | None = None  # why the session ended ("deleted"): its reader stops

    def end(self, reason: str) -> None:
        """The session ended: the reader is woken to stop."""
        self.ended = reason
        self._signal()

    def wake(self) -> None:
        """Something was committed: the reader should read."""
        self._news = True
        self._signal()

    def push_live(self, event: LiveEvent) -> None:
        if len(self._live) >= LIVE_MAX:
            del self._live[: LIVE_MAX // 2]
        self._live.append(event)
        self._signal()

    def take_live(self) -> list[LiveEvent]:
        live, self._live = self._live, []
        return live

    def take_news(self) -> bool:
        news, self._news = self._news, False
        return news

    def _signal(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        else:
            self._woken = True

    def push(self, events: list[StoredEvent]) -> None:
        if len(self._pushed) + len(events) > PUSHED_MAX:
            self._overflow = True
        else:
            self._pushed.extend(events)

    def take(self) -> list[StoredEvent] | None:
        """The events published since the reader's position, if they continue it with no gap;
        None when the reader must read the stream (nothing published, a gap, or unknown place)."""
        pushed, overflow = self._pushed, self._overflow
        self._pushed, self._overflow = [], False
        if overflow or self.last_seq is None or not pushed:
            return None
        fresh = sorted((e for e in pushed if e.seq > self.last_seq), key=lambda e: e.seq)
        if not fresh:
            return None
        for n, event in enumerate(fresh, start=self.last_seq + 1):
            if event.seq != n:
                return None  # something in between was written elsewhere
        return fresh

    def advance(self, batch: list[StoredEvent]) -> None:
        """The reader has read up to the end of `batch`."""
        if batch:
            self.seen, self.last_seq = batch[-1].id, batch[-1].seq

    async def wait(self, timeout: float) -> bool:
        """True if woken, False on timeout. A future and a timer: no asyncio.timeout (and no
        wait_for, which on Python 3.11 swallows a cancellation that arrives as it is woken);
        a cancellation of the waiting task cancels the future and goes through."""
        if self._woken:
            self._woken = False
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            woken: bool = await waiter
            return woken
        finally:  # (a wake-up after the timer fired stays in _woken: the next wait returns)
            timer.cancel()
            self._waiter = None


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class EventHub:
    def __init__(
        self,
        redis: Redis | None = None,
        *,
        poll_block_ms: int = 100,
        runs_here: Callable[[str], bool] = _never,
        cancelled: Callable[[str, str], None] = lambda sid, turn_id: None,
    ) -> None:
        self._redis = redis
        # Sessions this process runs now write (and announce) their turn's events here: the
        # poller leaves them out until their drain ends (`poke`).
        self._runs_here = runs_here
        self._block = poll_block_ms
        self._watches: dict[str, set[Watch]] = {}
        self._last: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._followed = asyncio.Event()  # set when a session gets a position to poll from
        self._cancelled = cancelled  # (session, turn) a cancel was asked for, here or elsewhere
        self._relay = LiveRelay(redis, self._arrived, cancelled, self._ended_here) if redis is not None else None

    def publish(self, sid: str, events: list[StoredEvent], *, settled: bool = True) -> None:
        """This process committed `events` (`settled`: a commit that ended a turn): hand them to
        the session's watches and wake them. The poller needs to look only past the newest: any
        earlier event, from elsewhere, is read by the woken readers now."""
        watches = self._watches.get(sid)
        if not watches:
            return
        for w in watches:
            w.push(events)
            if settled or not w.settled_only:
                w.wake()
        event_id = events[-1].id if events else None
        last = self._last.get(sid)
        if event_id is not None and last is not None and stream_key(event_id) > stream_key(last):
            self._last[sid] = event_id

    def live(self, sid: str, event: LiveEvent) -> None:
        """A turn this process runs produced a live event: to the session's readers here, and
        to those of other processes."""
        self._arrived(sid, event)
        if self._relay is not None:
            self._relay.send(sid, event)

    def cancel(self, sid: str, turn_id: str) -> None:
        """A cancel of the turn was committed: the process running it (this one or another)
        stops its model call now rather than at its next commit."""
        self._cancelled(sid, turn_id)
        if self._relay is not None:
            self._relay.cancel(sid, turn_id)

    def ended(self, sid: str) -> None:
        """The session was deleted: its watches here and in other processes end."""
        self._ended_here(sid)
        if self._relay is not None:
            self._relay.ended(sid)

    def _ended_here(self, sid: str) -> None:
        for w in self._watches.get(sid, ()):
            w.end("deleted")

    async def flush_live(self) -> None:
        if self._relay is not None:
            await self._relay.flush()

    def _arrived(self, sid: str, event: LiveEvent) -> None:
        for w in self._watches.get(sid, ()):
            if w.live:
                w.push_live(event)

    @contextlib.asynccontextmanager
    async def watch(
        self, sid: str, after: str | None, *, settled_only: bool = False, live: bool = True
    ) -> AsyncIterator[Watch]:
        """Wake-ups for events after `after`, the id the caller has read up to. The poller
        starts from the oldest such id, so an event committed elsewhere after the caller's
        read can only wake it (perhaps needlessly), never be missed. Commits in this process
        wake every watch of the session. A watch opened with None learns its position later
        (`follow`); until then only local commits wake it. Without `live` (or with
        `settled_only`) it takes no live events, and costs no pub/sub subscription."""
        w = Watch(after, settled_only=settled_only, live=live)
        self._watches.setdefault(sid, set()).add(w)
        if after is not None:
            self.follow(sid, w, after)
        relay = self._relay if w.live else None
        try:
            if relay is not None:
                await relay.follow(sid)
            yield w
        finally:
            if relay is not None:
                relay.unfollow(sid)
            ws = self._watches.get(sid)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._watches[sid]
                    self._last.pop(sid, None)

    def poke(self) -> None:
        """Something changed what the poller should watch (a session stopped running here)."""
        self._followed.set()

    def follow(self, sid: str, w: Watch, after: str) -> None:
        self._followed.set()
        w.seen = after
        last = self._last.get(sid)
        if last is None or stream_key(after) < stream_key(last):
            self._last[sid] = after

    def start(self) -> None:
        if self._redis is not None and self._task is None:
            self._task = asyncio.create_task(self._poll(), name="keel-hub-poller")
        if self._relay is not None:
            self._relay.start()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._relay is not None:
            await self._relay.stop()

    async def _poll(self) -> None:
        assert self._redis is not None
        redis = self._redis
        while True:
            try:
                sids = [s for s in self._watches if s in self._last and not self._runs_here(s)]
                if not sids:
                    self._followed.clear()
                    await self._followed.wait()
                    continue
                for s in sids:  # readers that caught up need no wake-up for what they read
                    seen = [w.seen for w in self._watches.get(s, ()) if w.seen is not None]
                    slowest = min(seen, key=stream_key, default=None)
                    if slowest is not None and s in self._last and stream_key(slowest) > stream_key(self._last[s]):
                        self._last[s] = slowest
                streams: Any = {SessionKeys(s).outbox: self._last[s] for s in sids if s in self._last}
                res: Any = await redis.xread(streams, count=1, block=self._block)
                for key, entries in res:
                    sid = session_of(key.decode())
                    eid = entries[-1][0].decode()
                    last = self._last.get(sid)
                    if last is None or stream_key(eid) <= stream_key(last):
                        continue  # no longer watched, or written (and announced) by this process
                    self._last[sid] = eid
                    for w in self._watches.get(sid, ()):
                        w.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep serving local notifications, retry
                count_error()
                log.warning("event poller: %s; retrying", exc)
                await asyncio.sleep(1.0)
