"""One relay's hold on one session's deliveries to one destination.

One relay's hold on one session's deliveries to one destination: the lease kept while it
works, refs in doubt reconciled, events followed from the cursor until the session is quiet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from harness import failpoints
from harness.aio import cancel_and_wait
from harness.events import SETTLING, StoredEvent, TurnStarted
from harness.relay.destination import Destination, Outbound, Undeliverable
from harness.store import GONE, DeliveryState, streamids

if TYPE_CHECKING:
    from harness.relay import Relay

log = logging.getLogger("keel.relay")


class LeaseLost(Exception):
    """Another relay holds the session now (this one stalled past its lease)."""


class Session:
    """One relay's hold on one session's deliveries to one destination."""

    def __init__(
        self, relay: Relay, sid: str, dest: Destination, token: str, state: DeliveryState, *, redeliver: str = ""
    ) -> None:
        self.relay = relay
        self.sid = sid
        self.dest = dest
        self.token = token
        self.where = state.metadata
        # delivered up to here (written); a destination made later than the session starts
        # at its own beginning (`since`: an event webhook gets events from its creation on)
        since: float = getattr(dest, "since", 0.0)  # (epoch seconds; 0: from the session's start)
        fresh = state.cursor == streamids.START
        self.cursor = streamids.at(since) if fresh and since else state.cursor
        self.seen = self.cursor  # read up to here (written lazily when nothing was posted)
        # the seqs of `cursor` and `seen` (-1: not known): the next event read should be the one
        # after (events are numbered one by one; a session's first is 1). A destination made later
        # than the session starts at a time: the first event read there tells its place.
        self.cursor_seq = state.seq if not fresh or state.seq >= 0 else (-1 if since else 0)
        self.seen_seq = self.cursor_seq
        self.doubt = state.doubt
        self.last = state.last
        self.refs = dict(state.refs)
        self.open_turn: str | None = None  # a turn that began and has shown nothing yet
        self.open_since = 0.0
        self.released = False
        self.redeliver = redeliver  # an event an operator asked to deliver again (a dead letter)
        self.failing = state.failing  # the destination's failures of the next call, if any
        self.failing_stored = state.failing is not None  # (so that a success clears it in Redis)
        self.gave_up_after = 1  # attempts of the last call given up on
        self.valid_until = time.monotonic() + relay.lease_ms / 1000  # the lease, as far as we know

    async def mark(self, **fields: Any) -> bool | None:
        asked = time.monotonic()
        done = await self.relay.deliveries.mark(self.sid, self.dest.name, self.token, self.relay.lease_ms, **fields)
        if done is False:
            raise LeaseLost
        self.valid_until = asked + self.relay.lease_ms / 1000
        return done

    def _check_lease(self) -> None:
        """Before a call to the destination: a lease that may have lapsed (renewals failing,
        Redis away) could be another relay's by now, and its posts ours twice."""
        if time.monotonic() >= self.valid_until:
            raise LeaseLost

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """The lease renewed every third of its time for as long as this relay works on the
        session (a slow call to the destination does not let it lapse); if it is lost anyway
        (this process stalled), the work stops: the relay that took over goes on."""
        work = asyncio.current_task()
        assert work is not None
        lost = False

        async def keep() -> None:
            nonlocal lost
            while True:
                await asyncio.sleep(self.relay.lease_ms / 3000)
                if self.released:
                    return
                try:
                    await self.mark()
                except LeaseLost:
                    if not self.released:  # (not lost: given back meanwhile)
                        lost = True
                        work.cancel()
                    return
                except Exception as exc:  # Redis away for a moment: the work fails the same way
                    log.warning("relay: renewing the lease on %s failed (%s)", self.sid, exc)

        keeper = asyncio.create_task(keep(), name=f"keel-relay-lease-{self.sid}")
        try:
            yield
        except asyncio.CancelledError:
            if lost:
                raise LeaseLost from None
            raise
        finally:
            await cancel_and_wait([keeper])

    async def recover(self) -> None:
        """Refs left in doubt by a relay that died: learn which posts were made (kept ones are
        written with the event they belong to). A destination that refuses to say is taken to
        have them all: a post is never made twice (the log names the ones not checked)."""
        if not self.doubt:
            return
        try:
            found = await self.relay.attempt(
                lambda: self.dest.find(self.doubt, self.where, self.last), self, resets=False
            )
        except Undeliverable as exc:
            log.warning(
                "relay: %s/%s cannot check posts %s (%s); not posting them again",
                self.sid,
                self.dest.name,
                self.doubt,
                exc,
            )
            found = dict.fromkeys(self.doubt, "")
        self.refs.update(found)
        log.info(
            "relay: %s/%s took over with %d post(s) in doubt, %d found",
            self.sid,
            self.dest.name,
            len(self.doubt),
            len(found),
        )

    async def follow(self) -> None:
        heartbeat = min(self.relay.working_after, self.relay.lease_ms / 3000)
        stream = self.relay.outbox.tail(self.sid, self.cursor, heartbeat=heartbeat, deltas=False)
        try:
            async for item in stream:
                if item is None:
                    await self._silence()
                    if await self._quiet():
                        return
                    continue
                if not isinstance(item, StoredEvent):
                    continue  # live events (message.delta) are not delivered
                if self.seen_seq < 0:  # (a place first known: right before the first event read)
                    self.cursor_seq = self.seen_seq = item.seq - 1
                elif item.seq > self.seen_seq + 1:
                    await self._lost(item.seq - 1)
                await self.deliver(item)
                started = item.of(TurnStarted)
                if started is not None:
                    self.open_turn, self.open_since = started.turn_id or "", time.monotonic()
                if item.type in SETTLING and await self._quiet():
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _quiet(self) -> bool:
        """Give the lease back if the session has nothing more to deliver (caught up, and not
        running, or waiting for an answer: the answer queues a relay job of its own). A
        dead letter to deliver again goes first, once caught up."""
        if self.redeliver:
            await self._redeliver()
        if self.seen_seq >= 0:  # (read before the check: events it counts were in the outbox, or left it)
            newest = await self.relay.deliveries.session_seq(self.sid)
            if newest is not None and newest > self.seen_seq:
                await self._lost(newest, quiet=True)
        cursor = self.seen if self.seen != self.cursor else None
        seq = self.seen_seq if cursor is not None and self.seen_seq >= 0 else None
        self.released = bool(await self.mark(cursor=cursor, seq=seq, check=self.seen, release=True))
        return self.released

    async def _silence(self) -> None:
        """Nothing new: a turn silent for a while gets its working post."""
        if self.open_turn is not None and time.monotonic() - self.open_since >= self.relay.working_after:
            out = self.dest.working(self.open_turn, self.where)
            self.open_turn = None
            if out is not None and out.ref not in self.refs:
                await self._post_all([out], event_id=None)

    async def _redeliver(self) -> None:
        """The operator's retry of a dead letter: the event's posts that the destination does
        not have are made (after what came later: out of order by then); the cursor stays."""
        event_id, self.redeliver = self.redeliver, ""
        relay, dest = self.relay, self.dest
        event = await relay.outbox.event(self.sid, event_id)
        if event is None:  # (listed again, so that it is not dropped unsaid: a retry clears it)
            error = f"retried: {GONE}"
            relay.stats.dead += 1
            log.warning("relay: event %s of %s for %s: %s", event_id, self.sid, dest.name, error)
            await relay.deliveries.bury(self.sid, event_id, dest.name, error, 0, gone=True)
            return
        outs = dest.render(event, self.where, self.refs)
        posts = [o.ref for o in outs if o.kind == "post" and o.ref not in self.refs]
        if posts:
            try:
                self.refs.update(await relay.attempt(lambda: dest.find(posts, self.where, ""), self, resets=False))
            except Undeliverable as exc:
                await self._bury(event, str(exc))
                return
        if outs:
            await self._post_all(outs, event_id=event_id, event=event, move_cursor=False)

    async def _bury(self, event: StoredEvent, error: str) -> None:
        relay = self.relay
        relay.stats.dead += 1
        log.warning("relay: event %s of %s could not reach %s: %s", event.id, self.sid, self.dest.name, error)
        await relay.deliveries.bury(self.sid, event.id, self.dest.name, error, self.gave_up_after)

    async def _lost(self, last: int, *, quiet: bool = False) -> None:
        """The events after `seen`, up to seq `last`, left the outbox unread (the relay fell
        further behind than the outbox keeps: KEEL_EVENT_RETENTION_HOURS, KEEL_EVENT_RETENTION):
        listed as a loss after `seen`, so that nothing goes unsaid; those of the destination's
        types were never delivered. They count as read from now on. `quiet`: with the session's
        newest (none kept after `seen`: a check that the session is quiet says so, or not)."""
        if quiet and not await self.mark(check=self.seen):
            return  # (not quiet: they are there to read after all)
        if self.seen != self.cursor:  # (first what was read: a relay that dies next finds the same loss)
            await self.mark(cursor=self.seen, seq=self.seen_seq)
            self.cursor, self.cursor_seq = self.seen, self.seen_seq
        n, first = last - self.seen_seq, self.seen_seq + 1
        error = f"{n} event(s) after this one (seq {first}-{last}) left the outbox before delivery"
        self.relay.stats.dead += 1
        log.warning("relay: %s/%s: %s", self.sid, self.dest.name, error)
        await self.relay.deliveries.bury(self.sid, self.seen, self.dest.name, error, 0, lost=(n, first))
        # all up to them is accounted for now (a delivery that parks next resumes after them)
        await self.mark(seq=last)
        self.cursor_seq = self.seen_seq = last

    async def deliver(self, event: StoredEvent, *, move_cursor: bool = True) -> None:
        outs = self.dest.render(event, self.where, self.refs)
        if move_cursor:
            self.seen, self.seen_seq = event.id, event.seq
        if not outs:
            return
        self.open_turn = None
        await self._post_all(outs, event_id=event.id, event=event, move_cursor=move_cursor)

    async def _post_all(
        self, outs: list[Outbound], *, event_id: str | None, event: StoredEvent | None = None, move_cursor: bool = True
    ) -> None:
        relay, dest = self.relay, self.dest
        posts = [o.ref for o in outs if o.kind == "post" and o.ref not in self.refs]
        if posts:
            await self.mark(doubt=posts)
        made: dict[str, str] = {}
        forget: list[str] = []
        error = None
        try:
            for out in outs:
                if out.kind == "forget":
                    forget.append(out.ref)
                elif out.kind == "post":
                    if out.ref in self.refs:
                        continue
                    failpoints.reached("relay.before_send")
                    self._check_lease()
                    handle = await relay.attempt(lambda o=out: dest.send(o, self.where, None), self)
                    failpoints.reached("relay.after_send")
                    self.refs[out.ref] = made[out.ref] = self.last = handle
                else:
                    target = self.refs.get(out.ref)
                    if target:  # ("" : a post made, but its handle unknown)
                        self._check_lease()
                        await relay.attempt(lambda o=out, h=target: dest.send(o, self.where, h), self)
        except Undeliverable as exc:
            error = str(exc)
        for ref in forget:
            self.refs.pop(ref, None)
        # kept refs: the ones posted now, and the ones a takeover found already made
        keep = {o.ref: self.refs[o.ref] for o in outs if o.kind == "post" and o.keep and self.refs.get(o.ref)}
        if event is not None and error is not None:
            await self._bury(event, error)
        cursor = event.id if event is not None and move_cursor else None
        clear = self.failing is None and self.failing_stored
        await self.mark(
            cursor=cursor,
            seq=event.seq if event is not None and move_cursor else None,
            doubt=[],
            last=self.last if made else None,
            keep=keep,
            forget=forget,
            failing=None if clear else False,
        )
        self.failing_stored = self.failing_stored and not clear
        if cursor is not None and event is not None:
            self.cursor = self.seen = cursor
            self.cursor_seq = event.seq
        if event is not None and error is None:
            relay.stats.delivered_after(time.time() - streamids.ms_of(event.id) / 1000)
