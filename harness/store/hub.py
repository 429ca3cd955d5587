"""The store's news of a session in this process: wake-ups, its events, cancels.

The store's news of a session in this process: it wakes the readers of a session's outbox when
new events are committed, hands them the events this process committed and the live (transient)
events of the session, from this process or, through the `Bus`, from the one running the turn;
and it tells a running model call of a cancel of its turn, made here or elsewhere.

The store publishes its own commits here with the events they wrote (byte for byte what a read
of the outbox returns); commits made by other processes are heard as the notice their script
publishes on the session's channel (sharded pub/sub, see `bus`), which every watch subscribes
to; each confirmation of the subscription has its readers read the stream. A reader takes
published events only when they continue exactly where it is (the next seq, no gap); otherwise
it reads the outbox stream, which is always the truth. While a session's turn is being written
here (`writing`), notices of its commits are passed over: its events come published here, and
its readers read the stream once it stops. A session that ends (deleted) ends its watches here
and, through the `Bus`, in the processes that have readers of it (`ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Literal

from harness.events import LiveEvent, StoredEvent
from harness.store import streamids
from harness.store.bus import Bus
from harness.store.client import Client
from harness.store.clusterwire import AnyWire

log = logging.getLogger("keel.hub")


PUSHED_MAX = 512  # events a watch holds for its reader; past that it reads the stream instead
LIVE_MAX = 1024  # live events a watch holds for a reader that does not take them; older ones go


class Watch:
    def __init__(self, *, settled_only: bool = False, live: bool = True) -> None:
        self._woken = False  # woken since its reader last waited
        self._news = False  # ... by a commit (not only by live events): the reader reads
        self._live: list[LiveEvent] = []
        # how many of `_live` came before the commits handed over here and not read yet (None:
        # none are waiting). A commit made elsewhere is heard as a notice, and read from the
        # stream with any made after it: the live events waiting go out before them all.
        self._live_before: int | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self.last_seq: int | None = None  # the seq its reader has read up to (None: read the stream)
        self.settled_only = settled_only  # local wake-ups only for commits that settle a turn
        self.live = live and not settled_only  # takes live events (message.delta)
        self._pushed: list[StoredEvent] = []
        self._overflow = False
        self.ended: Literal["deleted", "gone"] | None = None  # why the session ended: its reader stops
        self._elsewhere = False  # woken for a commit not handed over here: the reader reads the stream

    def end(self, reason: Literal["deleted", "gone"]) -> None:
        """The session ended: the reader is woken to stop."""
        self.ended = reason
        self._signal()

    def wake(self) -> None:
        """Something was committed: the reader should read."""
        self._news = True
        self._signal()

    def wake_elsewhere(self) -> None:
        """A commit was made in another process (or its notice may have been lost): the reader
        reads the stream, even if events handed over here meanwhile continue where it is."""
        self._elsewhere = True
        self.wake()

    def push_live(self, event: LiveEvent) -> None:
        if len(self._live) >= LIVE_MAX:
            del self._live[: LIVE_MAX // 2]
            if self._live_before is not None:
                self._live_before = max(0, self._live_before - LIVE_MAX // 2)
        self._live.append(event)
        self._signal()

    def take_live(self, *, before_news: bool = False) -> list[LiveEvent]:
        """The live events waiting; `before_news`: only those that came before the commits not
        read yet (they go out before them; the others after)."""
        n = len(self._live) if not before_news or self._live_before is None else self._live_before
        live, self._live = self._live[:n], self._live[n:]
        if self._live_before is not None:
            self._live_before -= n
        return live

    @property
    def asleep(self) -> bool:
        """Its reader waits for a wake-up now (not woken yet)."""
        return self._waiter is not None and not self._waiter.done()

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
        if self._live_before is None:  # (committed here: the live events after them go out after them)
            self._live_before = len(self._live)
        if len(self._pushed) + len(events) > PUSHED_MAX:
            self._overflow = True
        else:
            self._pushed.extend(events)

    def take(self) -> list[StoredEvent] | None:
        """The events published since the reader's position, if they continue it with no gap;
        None when the reader must read the stream (nothing published, a gap, an unknown place,
        or a commit made elsewhere since it last looked)."""
        pushed, overflow, elsewhere = self._pushed, self._overflow, self._elsewhere
        self._pushed, self._overflow, self._elsewhere = [], False, False
        self._live_before = None  # (what the reader reads now, or from the stream, is all there was)
        if overflow or elsewhere or self.last_seq is None or not pushed:
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
            self.last_seq = batch[-1].seq

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
    def __init__(self, redis: Client | None = None, wire: AnyWire | None = None, origin: str = "") -> None:
        self._watches: dict[str, set[Watch]] = {}
        self._last: dict[str, str] = {}  # session -> the newest event id its watches were woken for
        self._writing: set[str] = set()  # sessions whose turn is being written here now
        self._passed: set[str] = set()  # ... whose notice was passed over meanwhile
        # watches that do not follow their session's channel (yet): the turn they wait for is
        # written here, so its commits come published here (`open_watch`'s `deferred`)
        self._deferred: dict[str, set[Watch]] = {}
        # whether a turn of the session is (about to be) written here: the runner says
        self.written_here: Callable[[str], bool] = self._writing.__contains__
        self._cancellable: dict[str, tuple[str, Callable[[], None]]] = {}  # session -> (turn, stop it)
        self._bus = None
        if redis is not None and wire is not None:
            self._bus = Bus(
                redis,
                wire,
                self._arrived,
                cancelled=self._cancelled,
                committed=self._committed,
                missed=self._missed,
                ended=self._ended_here,
                origin=origin,
            )

    def publish(self, sid: str, events: list[StoredEvent], *, settled: bool) -> None:
        """The store committed `events` here (`settled`: a commit that ended or paused a turn):
        hand them to the session's watches and wake them. The notice of the same commit, when it
        comes, is then passed over."""
        watches = self._watches.get(sid)
        if not watches:
            return
        everyone = True
        for w in watches:
            w.push(events)
            if settled or not w.settled_only:
                w.wake()
            else:
                everyone = False
        if events and everyone:  # (else the notice wakes the rest: this commit may settle a turn after all)
            self._advance(sid, events[-1].id)

    def _advance(self, sid: str, event_id: str) -> bool:
        """Note `event_id` as woken for; False if an event as new was already."""
        last = self._last.get(sid)
        if last is not None and streamids.key(event_id) <= streamids.key(last):
            return False
        self._last[sid] = event_id
        return True

    def _committed(self, sid: str, event_id: str) -> None:
        """A commit's notice (from any process) for a session watched here."""
        if sid not in self._watches:
            return
        if sid in self._writing:  # its events come published here; anything else is read with them
            self._passed.add(sid)
            return
        if self._advance(sid, event_id):
            for w in self._watches[sid]:
                w.wake_elsewhere()

    def _missed(self, sid: str) -> None:
        """Notices for the session may have been lost (its subscription was made again): its
        readers read the stream."""
        for w in self._watches.get(sid, ()):
            w.wake_elsewhere()

    @contextlib.contextmanager
    def writing(self, sid: str) -> Iterator[None]:
        """A runner here writes the session's turn (it holds the lease): its commits' notices are
        not needed until it stops; then, if one was passed over (perhaps for a commit made
        elsewhere), the session's readers read the stream."""
        self._writing.add(sid)
        try:
            yield
        finally:
            self._writing.discard(sid)
            if sid in self._passed:
                self._passed.discard(sid)
                self._missed(sid)
            # deferred watches asleep now hear commits made elsewhere from now on (their
            # subscription's confirmation has them read what came before it); one its last
            # commit just woke decides when it waits again (`listen`)
            for w in [w for w in self._deferred.get(sid, ()) if w.asleep]:
                self.follow(sid, w)

    def listen(self, sid: str, w: Watch) -> None:
        """A deferred watch is about to wait: unless the session's turn is written here, it
        follows the channel now."""
        waiting = self._deferred.get(sid)
        if waiting is not None and w in waiting and not self.written_here(sid):
            self.follow(sid, w)

    # ---- live events and cancels -----------------------------------------------------------

    def streaming(self, sid: str) -> None:
        """A model call of the session begins to stream here: its live events go to the readers
        other processes have now (`Bus.fresh_look`)."""
        if self._bus is not None:
            self._bus.fresh_look(sid)

    def live(self, sid: str, event: LiveEvent) -> None:
        """A turn this process runs produced a live event: to the session's readers here, and
        to those of other processes."""
        self._arrived(sid, event)
        if self._bus is not None:
            self._bus.send(sid, event)

    async def flush_live(self) -> None:
        """Return once the live events handed over so far have left for other processes (a
        commit follows: their readers get them before they hear of the commit)."""
        if self._bus is not None:
            await self._bus.flush()

    def cancel(self, sid: str, turn_id: str) -> None:
        """A cancel of the turn was committed: the process running it (this one or another)
        stops its model call now rather than at its next commit."""
        self._cancelled(sid, turn_id)
        if self._bus is not None:
            self._bus.cancel(sid, turn_id)

    @contextlib.contextmanager
    def cancellable(self, sid: str, turn_id: str, stop: Callable[[], None]) -> Iterator[None]:
        """While this lasts, a cancel of the turn, asked here or in another process, calls `stop`
        (a model call of the turn, which closes its provider's stream)."""
        self._cancellable[sid] = (turn_id, stop)
        try:
            yield
        finally:
            if self._cancellable.get(sid, (None,))[0] == turn_id:
                del self._cancellable[sid]

    def _cancelled(self, sid: str, turn_id: str) -> None:
        running = self._cancellable.get(sid)
        if running is not None and running[0] == turn_id:
            running[1]()

    def ended(self, sid: str) -> None:
        """The session was deleted: its watches here and in other processes end."""
        self._ended_here(sid)
        if self._bus is not None:
            self._bus.ended(sid)

    def _ended_here(self, sid: str) -> None:
        for w in self._watches.get(sid, ()):
            w.end("deleted")

    def _arrived(self, sid: str, event: LiveEvent) -> None:
        for w in self._watches.get(sid, ()):
            if w.live:
                w.push_live(event)

    # ---- readers ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(
        self, sid: str, *, settled_only: bool = False, live: bool = True, deferred: bool = False
    ) -> AsyncIterator[Watch]:
        """Wake-ups for the session's new events. Its channel is subscribed (if it is not yet)
        and the watch woken once Redis confirms it, so a commit made elsewhere after the
        caller's read, before or after the subscription, wakes it. Commits in this process wake
        every watch of the session (a `settled_only` one: only those that settle a turn).
        Without `live` (or with `settled_only`) it takes no live events."""
        w = self.open_watch(sid, settled_only=settled_only, live=live, deferred=deferred)
        try:
            yield w
        finally:
            self.close_watch(sid, w)

    def open_watch(self, sid: str, *, settled_only: bool = False, live: bool = True, deferred: bool = False) -> Watch:
        """`watch` without its block: the caller closes it (`close_watch`), however it ends.
        `deferred` (a wait for one turn): it does not follow the session's channel until told
        (`follow`), until it waits when no turn of the session is written here (`listen`), or
        until a turn written here ends while it waits: the turn it waits for may be one this
        process writes, whose commits come published here, not from Redis."""
        w = Watch(settled_only=settled_only, live=live)
        self._watches.setdefault(sid, set()).add(w)
        if deferred:
            self._deferred.setdefault(sid, set()).add(w)
        elif self._bus is not None:
            self._bus.follow(sid)
        return w

    def follow(self, sid: str, w: Watch) -> None:
        """A deferred watch hears commits made elsewhere from now on (one that does: nothing)."""
        waiting = self._deferred.get(sid)
        if waiting is None or w not in waiting:
            return
        waiting.discard(w)
        if not waiting:
            del self._deferred[sid]
        if self._bus is not None:
            self._bus.follow(sid)

    def close_watch(self, sid: str, w: Watch) -> None:
        ws = self._watches.get(sid)
        if ws is None or w not in ws:
            return  # (closed already)
        waiting = self._deferred.get(sid)
        if waiting is not None and w in waiting:
            waiting.discard(w)
            if not waiting:
                del self._deferred[sid]
        elif self._bus is not None:
            self._bus.unfollow(sid)
        ws.discard(w)
        if not ws:
            del self._watches[sid]
            self._last.pop(sid, None)
            self._passed.discard(sid)

    def start(self) -> None:
        if self._bus is not None:
            self._bus.start()

    async def stop(self) -> None:
        if self._bus is not None:
            await self._bus.stop()
