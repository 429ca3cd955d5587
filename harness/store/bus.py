"""The bus between processes: live events, and commit, cancel and end notices.

The bus between processes: sharded pub/sub (`shardsub`), one channel per session in the
session's own slot, and one for cancel notices that every process hears.

Three kinds of message travel on a session's channel. A commit's notice, "@<event id>", is
published by the script that commits (so it cannot be lost to a crash after the commit):
readers elsewhere read the outbox at once instead of after a poll. Only where someone hears it:
a process with readers of a session names itself in the session's `readers` (for READERS_TTL_S,
renewed while it has them; named once its subscription is confirmed, before its readers read),
and a script publishes only if a process other than the writer is named there. A process's own
readers get its commits from the hub, never back from Redis. Live events (`send`, batched:
a burst of deltas is one message per session) go out by the same rule: only while another
process is named in the session's `readers`, as a look at it (in a flush's round trip, at most
every LIVE_LOOK_S while the session streams, and again as each model call begins to stream)
last found; while no look is that recent, they go.
They are best-effort by design (the committed `message.completed` is the truth): one lost while
Redis is away, before a subscription is in place, or before the next look finds a process that
was named since, is not resent. A process skips the live events it published itself (each
message names its origin). A subscription confirmed again after a gap (a lost connection, a slot
that moved) tells the hub to have the session's readers read what they may have missed. A
cancel notice (`cancel`) only hurries the process running the turn: the cancel itself is
committed first, and that process sees it at its next commit anyway. A session's end (`ended`:
it was deleted) goes on its channel as a line of its own, `ENDED`, to the readers of the
session in every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from harness.aio import cancel_and_wait
from harness.events import LiveEvent, live_event
from harness.store.client import Client
from harness.store.clusterwire import AnyWire
from harness.store.keys import CANCELS, SessionKeys, session_of
from harness.store.protocol import READERS, ReadersArgs
from harness.store.shardsub import ShardSubscriber
from harness.telemetry.metrics import count_redis_error

log = logging.getLogger("keel.live")
FLUSH_WAIT_S = 1.0  # a commit waits at most this long for its deltas to be published
READERS_TTL_S = 60.0  # a process is named as a session's reader for this long ...
READERS_RENEW_S = 20.0  # ... renewed this often while it has readers of the session
ENDED = b"!ended"  # a line on a session's channel: the session was deleted (no event envelope starts so)
LIVE_LOOK_S = 0.5  # what a look at a session's `readers` found stands this long for its live events
LOOKS_MAX = 10_000  # sessions whose last look is remembered (a bounded memo: forgotten ones are looked at again)
_LOOK = ""  # (not a channel: a session to look at, queued with the live events)


class Bus:
    def __init__(
        self,
        redis: Client,
        wire: AnyWire,
        deliver: Callable[[str, LiveEvent], None],
        *,
        cancelled: Callable[[str, str], None] = lambda sid, turn_id: None,
        committed: Callable[[str, str], None] = lambda sid, event_id: None,
        missed: Callable[[str], None] = lambda sid: None,
        ended: Callable[[str], None] = lambda sid: None,
        origin: str = "",
    ) -> None:
        self._wire = wire
        self._deliver = deliver  # an event another process published, for this process's readers
        self._cancelled = cancelled  # a cancel notice from another process: (session, turn)
        self._committed = committed  # a commit's notice: (session, newest event id)
        self._missed = missed  # a session whose notices may have been missed
        self._ended = ended  # a session another process deleted
        self._name = origin or os.urandom(8).hex()  # (the scripts' ARGV[2]: see `lua._EMIT`)
        self._origin = self._name.encode()
        self._outgoing: list[tuple[str, bytes]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._next: asyncio.Future[None] | None = None  # done when the batch being gathered is sent
        self._sending: asyncio.Future[None] | None = None  # ... the batch being sent
        self._readers: dict[str, int] = {}  # session -> readers here
        self._listened: dict[str, tuple[bool, float]] = {}  # session -> (read elsewhere, looked at: loop time)
        self._looking: set[str] = set()  # sessions with a look queued or in flight
        self._sub = ShardSubscriber(redis, self._heard, self._again, self._wanted, left=self._left)
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewing: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._sub.add([CANCELS])
            self._renewing = asyncio.create_task(self._renew(), name="keel-readers")

    async def stop(self) -> None:
        await cancel_and_wait(t for t in (self._flusher, self._renewing, *self._tasks) if t is not None)
        self._flusher = self._renewing = None
        await self._sub.stop()

    # ---- out ---------------------------------------------------------------------------

    def send(self, sid: str, event: LiveEvent) -> None:
        """A live event of a turn this process runs, for the session's readers in other processes:
        sent unless a look at most LIVE_LOOK_S old found none. An older look (or none) is made
        again, in the flush that sends this event."""
        known = self._listened.get(sid)
        stale = known is None or asyncio.get_running_loop().time() - known[1] >= LIVE_LOOK_S
        if known is None or stale or known[0]:  # (an old look counts for nothing: a reader may be named since)
            self._queue(SessionKeys(sid).live, event.raw)
        if stale and sid not in self._looking:
            self._looking.add(sid)
            self._queue(_LOOK, sid.encode())

    def fresh_look(self, sid: str) -> None:
        """A model call of the session begins to stream here: what the last look found stands no
        longer, so a process named a reader since then gets this reply's live events from the
        first (which goes with a new look)."""
        self._listened.pop(sid, None)

    def cancel(self, sid: str, turn_id: str) -> None:
        """Tell every process that the turn is to be cancelled (the one running it stops its
        model call at once)."""
        self._queue(CANCELS, f"{sid} {turn_id}".encode())

    def ended(self, sid: str) -> None:
        """Tell the readers of the session in every other process that it was deleted."""
        self._queue(SessionKeys(sid).live, ENDED)

    def _queue(self, channel: str, data: bytes) -> None:
        self._outgoing.append((channel, data))
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())

    async def flush(self) -> None:
        """Return once what was handed over so far has been published (or failed to be), or
        after FLUSH_WAIT_S: it waits for the batch holding the caller's last event, not for
        what others send after it."""
        batch = self._next or self._sending
        if batch is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(batch), FLUSH_WAIT_S)

    async def _flush(self) -> None:
        try:
            while self._outgoing:
                batch, self._outgoing = self._outgoing, []
                self._sending, self._next = self._next, None
                try:
                    await self._publish(batch)
                except Exception as exc:  # Redis away: those live events are lost, as documented
                    count_redis_error()
                    log.warning("live events not published: %s", type(exc).__name__)
                finally:
                    if self._sending is not None and not self._sending.done():
                        self._sending.set_result(None)
                    self._sending = None
        finally:
            self._flusher = None

    async def _publish(self, batch: list[tuple[str, bytes]]) -> None:
        """One message per channel: a session's live events of this batch, a line each (an
        envelope has no raw newline); every cancel notice on its own. SPUBLISH: the message
        goes to the subscribers on the channel's slot's node only."""
        lines: dict[str, list[bytes]] = {}
        looks: list[str] = []  # (their HGETALLs first, in this order)
        commands: list[tuple[str, ...] | tuple[str, str, bytes]] = []
        for channel, data in batch:
            if channel == _LOOK:
                looks.append(data.decode())
            elif channel == CANCELS:
                commands.append(("SPUBLISH", channel, self._origin + b" " + data))
            else:
                lines.setdefault(channel, []).append(data)
        for channel, events in lines.items():
            commands.append(("SPUBLISH", channel, self._origin + b" " + b"\n".join(events)))
        try:
            replies = await self._wire.call([*(("HGETALL", SessionKeys(sid).readers) for sid in looks), *commands])
        finally:
            self._looking.difference_update(looks)
        at = asyncio.get_running_loop().time()
        if len(self._listened) + len(looks) > LOOKS_MAX:
            self._listened.clear()
        for sid, found in zip(looks, replies, strict=False):
            if isinstance(found, Exception):
                self._listened.pop(sid, None)  # (not known: its live events go, and it is looked at again)
            else:
                self._listened[sid] = (self._others_in(found), at)
        for reply in replies[len(looks) :]:
            if isinstance(reply, Exception):
                raise reply

    def _others_in(self, readers: Any) -> bool:
        """Whether a `readers` hash (HGETALL's reply: a flat list, or a map) names another process
        whose deadline (Valkey's clock, ms) has not passed by this process's clock, give or take
        READERS_RENEW_S (the clocks may differ; a process that died stops counting that long
        after its deadline, not at once as in the scripts' check, which has Valkey's clock)."""
        pairs = readers.items() if isinstance(readers, dict) else zip(readers[0::2], readers[1::2], strict=False)
        now_ms = time.time() * 1000
        return any(name != self._origin and int(until) > now_ms - READERS_RENEW_S * 1000 for name, until in pairs)

    # ---- in ----------------------------------------------------------------------------

    def follow(self, sid: str) -> None:
        """A reader of `sid` opened here: subscribe to its channel (if it is the first). The
        reader does not wait for it: when Redis confirms the subscription, the session's readers
        are told to read (`missed`), so a commit made between their read and the subscription
        is not missed. (Waiting instead cost a burst of new readers up to the whole wait when
        the listener was behind with notices.)"""
        self._readers[sid] = self._readers.get(sid, 0) + 1
        self._sub.add([SessionKeys(sid).live])

    def unfollow(self, sid: str) -> None:
        """The reader went: the channel of a session with no reader left here is left soon."""
        left = self._readers.get(sid, 0) - 1
        if left > 0:
            self._readers[sid] = left
            return
        self._readers.pop(sid, None)
        self._sub.drop(SessionKeys(sid).live)

    def _wanted(self, channel: str) -> bool:
        return channel == CANCELS or session_of(channel) in self._readers

    def _again(self, channel: str) -> None:
        """The channel's subscription was confirmed (first or again): the process is named as
        the session's reader, then its readers read what they may have missed."""
        if channel != CANCELS:
            self._spawn(self._named(session_of(channel)))

    async def _named(self, sid: str) -> None:
        try:
            await self._name_as_reader(sid, READERS_TTL_S)
        except Exception as exc:  # (Redis away: the readers' periodic looks still find commits)
            count_redis_error()
            log.warning("live events: naming this process a reader failed: %s", type(exc).__name__)
        self._missed(sid)

    def _left(self, channel: str) -> None:
        """The channel was left (no reader here for a while): no notices for this process."""
        if channel != CANCELS:
            self._spawn(self._unnamed(session_of(channel)))

    async def _unnamed(self, sid: str) -> None:
        if sid in self._readers:  # (a reader came back meanwhile: its subscription names it again)
            return
        with contextlib.suppress(Exception):  # (else its name lapses after READERS_TTL_S)
            await self._name_as_reader(sid, 0)

    async def _name_as_reader(self, sid: str, ttl_s: float) -> None:
        script = READERS
        args = script.args(ReadersArgs(self._name, int(ttl_s * 1000)))
        await self._wire.script(script.sha, script.source, script.keys(SessionKeys(sid)), args)

    async def _renew(self) -> None:
        """Every READERS_RENEW_S: the sessions with readers here named again."""
        while True:
            await asyncio.sleep(READERS_RENEW_S)
            sids = list(self._readers)
            for start in range(0, len(sids), 256):  # (at most 256 scripts in flight at once)
                got = await asyncio.gather(
                    *(self._name_as_reader(s, READERS_TTL_S) for s in sids[start : start + 256]),
                    return_exceptions=True,
                )
                failed = [g for g in got if isinstance(g, Exception)]
                if failed:
                    count_redis_error()
                    log.warning(
                        "live events: renewing %d reader names failed: %s", len(failed), type(failed[0]).__name__
                    )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _heard(self, channel: str, message: bytes) -> None:
        if message.startswith(b"@"):
            self._committed(session_of(channel), message[1:].decode())
            return
        origin, _, data = message.partition(b" ")
        if origin == self._origin:
            return
        if channel == CANCELS:
            sid, _, turn_id = data.decode().partition(" ")
            self._cancelled(sid, turn_id)
        else:
            sid = session_of(channel)
            for raw in data.split(b"\n"):
                if raw == ENDED:
                    self._ended(sid)
                    continue
                try:
                    event = live_event(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):  # (a type this version lacks)
                    log.warning("live events: skipped one this process cannot read: %r", raw[:80])
                    continue
                self._deliver(sid, event)
