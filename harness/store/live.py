"""Transient events between processes: Redis pub/sub, one channel per session, and one for
cancel notices that every process hears.

A process publishes the live events of the turns it runs (`send`, batched: a burst of deltas
is one pipeline) and subscribes to the channels of the sessions it has readers for (`follow`,
`unfollow`). Live events are best-effort by design (the committed `message.completed` is the
truth): one lost while Redis is away, or before a subscription is in place, is not resent. A
process skips what it published itself (each message names its origin). A cancel notice
(`cancel`) only hurries the process running the turn: the cancel itself is committed first, and
that process sees it at its next commit anyway. A session's end (`ended`: it was deleted) goes
on its channel as a line of its own, `ENDED`, to the readers of the session in every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from redis.asyncio import Redis

from harness.aio import cancel_and_wait
from harness.events import LiveEvent, live_event
from harness.store.client import count_error
from harness.store.keys import CANCELS, SessionKeys, session_of

log = logging.getLogger("keel.live")
RETRY_S = 1.0
FLUSH_WAIT_S = 1.0  # a commit waits at most this long for its deltas to be published
ENDED = b"!ended"  # a line on a session's channel: the session was deleted (no event envelope starts so)


class LiveRelay:
    def __init__(
        self,
        redis: Redis,
        deliver: Callable[[str, LiveEvent], None],
        cancelled: Callable[[str, str], None] = lambda sid, turn_id: None,
        ended: Callable[[str], None] = lambda sid: None,
    ) -> None:
        self._redis = redis
        self._deliver = deliver  # an event another process published, for this process's readers
        self._cancelled = cancelled  # a cancel notice from another process: (session, turn)
        self._ended = ended  # a session another process deleted
        self._origin = os.urandom(8).hex().encode()
        self._outgoing: list[tuple[str, bytes]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._next: asyncio.Future[None] | None = None  # done when the batch being gathered is sent
        self._sending: asyncio.Future[None] | None = None  # ... the batch being sent
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._readers: dict[str, int] = {}  # session -> readers here that want its live events
        self._dropped: set[str] = set()  # sessions whose channel is to be unsubscribed
        self._subscribing: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="keel-live-listener")

    async def stop(self) -> None:
        await cancel_and_wait(t for t in (self._listener, self._flusher, *self._subscribing) if t is not None)
        self._listener = self._flusher = None
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    # ---- out ---------------------------------------------------------------------------

    def send(self, sid: str, event: LiveEvent) -> None:
        self._queue(SessionKeys(sid).live, event.raw)

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
                    count_error()
                    log.warning("live events not published: %s", type(exc).__name__)
                finally:
                    if self._sending is not None and not self._sending.done():
                        self._sending.set_result(None)
                    self._sending = None
        finally:
            self._flusher = None

    async def _publish(self, batch: list[tuple[str, bytes]]) -> None:
        """One message per channel: a session's live events of this batch, a line each (an
        envelope has no raw newline); every cancel notice on its own."""
        lines: dict[str, list[bytes]] = {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for channel, data in batch:
                if channel == CANCELS:
                    pipe.publish(channel, self._origin + b" " + data)
                else:
                    lines.setdefault(channel, []).append(data)
            for channel, events in lines.items():
                pipe.publish(channel, self._origin + b" " + b"\n".join(events))
            await pipe.execute()

    # ---- in ----------------------------------------------------------------------------

    async def follow(self, sid: str) -> None:
        """A reader of `sid` opened here: subscribe to its channel (if it is the first). The
        SUBSCRIBE runs in a task of its own: redis-py sends it inside `wait_for`, which on
        Python 3.11 can swallow a cancellation of the reader that arrives meanwhile."""
        self._readers[sid] = self._readers.get(sid, 0) + 1
        if self._readers[sid] == 1:
            task = asyncio.ensure_future(self._subscribe([SessionKeys(sid).live]))
            self._subscribing.add(task)
            task.add_done_callback(self._subscribing.discard)
            await asyncio.shield(task)

    def unfollow(self, sid: str) -> None:
        """The reader went: the listener unsubscribes from the channel of a session that has no
        reader left here (no Redis call in the reader's clean-up, which may be cancelled)."""
        left = self._readers.get(sid, 0) - 1
        if left > 0:
            self._readers[sid] = left
            return
        self._readers.pop(sid, None)
        self._dropped.add(sid)

    async def _subscribe(self, channels: list[str]) -> None:
        try:
            await self._pubsub.subscribe(*channels)
        except Exception as exc:  # Redis away: the listener subscribes again when it is back
            count_error()
            log.warning("live events: subscribing failed: %s", type(exc).__name__)

    async def _listen(self) -> None:
        await self._subscribe([CANCELS])
        while True:
            try:
                if self._dropped:
                    dropped, self._dropped = self._dropped, set()
                    gone = [SessionKeys(s).live for s in dropped if s not in self._readers]
                    try:
                        if gone:
                            await self._pubsub.unsubscribe(*gone)
                    except Exception:
                        self._dropped |= dropped  # (tried again when Redis is back)
                        raise
                message = await self._pubsub.get_message(timeout=1.0)
                if message is None or message.get("type") != "message":
                    continue
                origin, _, data = message["data"].partition(b" ")
                if origin == self._origin:
                    continue
                channel = message["channel"].decode()
                if channel == CANCELS:
                    sid, _, turn_id = data.decode().partition(" ")
                    self._cancelled(sid, turn_id)
                else:
                    sid = session_of(channel)
                    for raw in data.split(b"\n"):
                        if raw == ENDED:
                            self._ended(sid)
                        else:
                            self._deliver(sid, live_event(raw))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                count_error()
                log.warning("live events: %s; subscribing again in %ss", type(exc).__name__, RETRY_S)
                await asyncio.sleep(RETRY_S)
                await self._subscribe([CANCELS, *(SessionKeys(s).live for s in self._readers)])
