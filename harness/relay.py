"""The delivery relay: a session's committed events reach a webhook channel's destination (a
Slack thread, a Linear agent session, a subscriber's URL) from the outbox, not from the process
that ran the turn, so a crash anywhere loses nothing and repeats nothing.

Per session and destination one relay delivers at a time (a lease in Redis, fenced by its
token), from a durable cursor, in session order. A destination renders each event into
`Outbound` calls; a post is named by a `ref`, unique in the session, that the destination
carries with the post (Slack: in the message's metadata). Before a post the relay writes the
refs it is about to post as *in doubt*; after them it moves the cursor and clears the doubt. A
relay that takes over a session with refs in doubt asks the destination which of them it has
(`find`) and posts only the others: a crash between a post and the cursor repeats nothing.
Updates (`chat.update`) are idempotent and simply made again.

Work comes as relay jobs ("session S has events for destination D"), queued with the write that
makes the events (a webhook message, an answer): a relay follows the session until it is quiet
(not running, nothing queued, every event delivered), then gives the lease back and
acknowledges its jobs. A relay that died leaves its jobs pending: another process reclaims them
and, once the lease lapsed, goes on from the cursor.

A call the destination cannot take now (`Retry`: rate limited, unreachable) is tried again
after the delay it names, up to `attempts` times; one it refuses (`Undeliverable`), or one that
ran out of attempts, becomes a dead letter (listed and retried with `python -m app.relay`)
and the relay moves on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from harness import failpoints
from harness.events import StoredEvent, decode_data
from harness.ids import just_before, new_id
from harness.store import Deliveries, DeliveryState, Outbox, Store, relay_queue

log = logging.getLogger("keel.relay")
SETTLING = frozenset(
    {"turn.completed", "turn.failed", "turn.cancelled", "input.requested", "compaction.completed", "context.cleared"}
)


class Outbound(msgspec.Struct, frozen=True):
    """One call to a destination. `post`: a new message named `ref` (kept for later updates
    when `keep`); `update`: change the post named `ref` (skipped if it was never made);
    `forget`: drop a kept ref."""

    kind: Literal["post", "update", "forget"]
    ref: str
    body: dict[str, Any] = {}
    keep: bool = False


class Retry(Exception):
    """The destination cannot take the call now; try again after `after` seconds (None: after
    a backoff that doubles from one second)."""

    def __init__(self, reason: str, after: float | None) -> None:
        super().__init__(reason)
        self.after = after


class Undeliverable(Exception):
    """The destination refused the call; trying again would not help."""


class Destination(Protocol):
    """A webhook channel's outbound side. `where` is the session's metadata (the channel put
    there where its conversation lives)."""

    name: str

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        """The calls that tell the destination about a committed event (often none)."""
        ...

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        """A post that says a turn is running, made when it has been silent for a while."""
        ...

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        """Make the call (`handle`: the post an update changes); returns the new post's handle.
        Raises Retry or Undeliverable."""
        ...

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        """Which of `refs` the destination has (posted at or after `since`, if not ""): ref ->
        handle. Raises Retry or Undeliverable."""
        ...


@dataclass
class RelayStats:
    """What the relay has done since the process started; `lags` are the seconds from an
    event's commit to its delivery, for the newest deliveries."""

    delivered: int = 0
    dead: int = 0
    retries: int = 0
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))


@dataclass
class _Task:
    jobs: list[str]
    kicked: bool = False


class _LeaseLost(Exception):
    pass


class Relay:
    def __init__(
        self,
        store: Store,
        outbox: Outbox,
        destinations: list[Destination],
        *,
        lease_ms: int = 5_000,
        attempts: int = 6,
        max_wait: float = 60.0,
        working_after: float = 1.0,
        concurrency: int = 256,
    ) -> None:
        self.store = store
        self.outbox = outbox
        self.deliveries = Deliveries(store.redis, store.wire)
        self.queue = relay_queue(store.redis)
        self.destinations = {d.name: d for d in destinations}
        self.lease_ms = lease_ms
        self.attempts = attempts
        self.max_wait = max_wait
        self.working_after = working_after
        self.concurrency = concurrency
        self.stats = RelayStats()
        self._tasks: dict[tuple[str, str, str], _Task] = {}
        self._running: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        await self.queue.ensure_group()
        self._loop = asyncio.create_task(self._take_jobs(), name="relay")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- jobs ----------------------------------------------------------------------------

    async def _take_jobs(self) -> None:
        loop = asyncio.get_running_loop()
        next_reclaim = 0.0
        while True:
            try:
                jobs = []
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + max(self.lease_ms / 1000, 1.0)
                    jobs = await self.queue.reclaim(min_idle_ms=2 * self.lease_ms)
                free = self.concurrency - len(self._tasks)
                if free > 0:
                    jobs += await self.queue.take(count=min(free, 100), block_ms=1000)
                else:
                    await asyncio.sleep(0.05)
                for job_id, what in jobs:
                    self._dispatch(job_id, what)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: wait and go on; jobs stay in the stream
                log.warning("relay: reading jobs failed (%s); trying again", exc)
                await asyncio.sleep(1.0)

    def _dispatch(self, job_id: str, what: str) -> None:
        sid, _, rest = what.partition(" ")
        dest, _, event_id = rest.partition(" ")
        if dest not in self.destinations:
            log.warning("relay: a job for %s, which this process does not serve: left for another", dest)
            return
        key = (sid, dest, event_id)
        task = self._tasks.get(key)
        if task is not None:
            task.jobs.append(job_id)
            task.kicked = True
            return
        self._tasks[key] = _Task([job_id])
        runner = asyncio.create_task(self._serve(key), name=f"relay {sid} {dest}")
        self._running.add(runner)
        runner.add_done_callback(self._running.discard)

    async def _serve(self, key: tuple[str, str, str]) -> None:
        """Deliver until the session is quiet, then acknowledge the jobs (those that came in
        meanwhile too); a failure leaves them to be taken again."""
        sid, dest, event_id = key
        task = self._tasks[key]
        finished = False
        try:
            while True:
                task.kicked = False
                if event_id:
                    await self._redeliver(sid, self.destinations[dest], event_id)
                else:
                    await self._follow(sid, self.destinations[dest])
                if not task.kicked:
                    finished = True
                    break
        except _LeaseLost:
            log.info("relay: %s lost its lease on %s; another relay delivers", dest, sid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("relay: delivering %s to %s stopped (%s); its job will be taken again", sid, dest, exc)
        finally:
            del self._tasks[key]
        if finished:
            with contextlib.suppress(Exception):
                await self.queue.done(*task.jobs)

    # ---- one session ---------------------------------------------------------------------

    async def _take(self, sid: str, dest: Destination, token: str) -> DeliveryState:
        while True:
            state = await self.deliveries.take(sid, dest.name, token, self.lease_ms)
            if isinstance(state, DeliveryState):
                return state
            await asyncio.sleep(min(state, 250) / 1000)  # another relay delivers: it gives back soon

    async def _follow(self, sid: str, dest: Destination) -> None:
        token = new_id("rly")
        state = await self._take(sid, dest, token)
        if not state.exists:
            await self.deliveries.mark(sid, dest.name, token, self.lease_ms, release=True)
            return
        session = _Session(self, sid, dest, token, state)
        async with session.held():
            await session.recover()
            await session.follow()

    async def _redeliver(self, sid: str, dest: Destination, event_id: str) -> None:
        """An operator's retry of a dead letter: the event's posts that the destination does
        not have are made (out of order by then); the cursor is not moved."""
        token = new_id("rly")
        state = await self._take(sid, dest, token)
        session = _Session(self, sid, dest, token, state)
        async with session.held():
            events = await self.store.events(sid, just_before(event_id), count=1)
            if events and events[0].id == event_id and state.exists:
                outs = dest.render(events[0], state.metadata, session.refs)
                posts = [o.ref for o in outs if o.kind == "post" and o.ref not in session.refs]
                if posts:
                    session.refs.update(await self._attempt(lambda: dest.find(posts, state.metadata, "")))
                await session.deliver(events[0], move_cursor=False)
        await session.mark(release=True)
        session.released = True

    async def _attempt(self, call: Any) -> Any:
        """`call()` until it succeeds, waiting as each Retry says; Undeliverable once the
        attempts are spent."""
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except Retry as exc:
                if attempt == self.attempts:
                    raise Undeliverable(f"{exc} (gave up after {attempt} attempts)") from exc
                self.stats.retries += 1
                backoff = 2.0 ** (attempt - 1) * random.uniform(0.8, 1.2)
                await asyncio.sleep(min(max(exc.after if exc.after is not None else backoff, 0.0), self.max_wait))
        raise AssertionError("unreachable")


class _Session:
    """One relay's hold on one session's deliveries to one destination."""

    def __init__(self, relay: Relay, sid: str, dest: Destination, token: str, state: DeliveryState) -> None:
        self.relay = relay
        self.sid = sid
        self.dest = dest
        self.token = token
        self.where = state.metadata
        self.cursor = state.cursor  # delivered up to here (written)
        self.seen = state.cursor  # read up to here (written lazily when nothing was posted)
        self.doubt = state.doubt
        self.last = state.last
        self.refs = dict(state.refs)
        self.open_turn: str | None = None  # a turn that began and has shown nothing yet
        self.open_since = 0.0
        self.released = False

    async def mark(self, **fields: Any) -> bool | None:
        done = await self.relay.deliveries.mark(self.sid, self.dest.name, self.token, self.relay.lease_ms, **fields)
        if done is False:
            raise _LeaseLost
        return done

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
                except _LeaseLost:
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
                raise _LeaseLost from None
            raise
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def recover(self) -> None:
        """Refs left in doubt by a relay that died: learn which posts were made."""
        if not self.doubt:
            return
        found = await self.relay._attempt(lambda: self.dest.find(self.doubt, self.where, self.last))
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
        stream = self.relay.outbox.tail(self.sid, self.cursor, heartbeat=heartbeat)
        try:
            async for item in stream:
                if item is None:
                    await self._silence()
                    if await self._quiet():
                        return
                    continue
                if not isinstance(item, StoredEvent):
                    continue  # live events (message.delta) are not delivered
                await self.deliver(item)
                if item.type == "turn.started":
                    self.open_turn, self.open_since = _turn_of(item), time.monotonic()
                if item.type in SETTLING and await self._quiet():
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def _quiet(self) -> bool:
        """Give the lease back if the session has nothing more to deliver."""
        cursor = self.seen if self.seen != self.cursor else None
        self.released = bool(await self.mark(cursor=cursor, check=self.seen, release=True))
        return self.released

    async def _silence(self) -> None:
        """Nothing new: a turn silent for a while gets its working post."""
        if self.open_turn is not None and time.monotonic() - self.open_since >= self.relay.working_after:
            out = self.dest.working(self.open_turn, self.where)
            self.open_turn = None
            if out is not None and out.ref not in self.refs:
                await self._post_all([out], event_id=None)

    async def deliver(self, event: StoredEvent, *, move_cursor: bool = True) -> None:
        outs = self.dest.render(event, self.where, self.refs)
        self.seen = event.id if move_cursor else self.seen
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
                    handle = await relay._attempt(lambda o=out: dest.send(o, self.where, None))
                    failpoints.reached("relay.after_send")
                    self.refs[out.ref] = made[out.ref] = self.last = handle
                else:
                    target = self.refs.get(out.ref)
                    if target is not None:
                        await relay._attempt(lambda o=out, h=target: dest.send(o, self.where, h))
        except Undeliverable as exc:
            error = str(exc)
        for ref in forget:
            self.refs.pop(ref, None)
        keep = {o.ref: made[o.ref] for o in outs if o.kind == "post" and o.keep and o.ref in made}
        if event is not None and error is not None:
            relay.stats.dead += 1
            log.warning("relay: event %s of %s could not reach %s: %s", event.id, self.sid, dest.name, error)
            letter = relay.deliveries.letter(self.sid, event.id, dest.name, error, relay.attempts)
            await relay.deliveries.bury(letter)
        cursor = event.id if event is not None and move_cursor else None
        await self.mark(cursor=cursor, doubt=[], last=self.last if made else None, keep=keep, forget=forget)
        if cursor is not None:
            self.cursor = self.seen = cursor
        if event is not None and error is None:
            relay.stats.delivered += 1
            relay.stats.lags.append(time.time() - int(event.id.split("-")[0]) / 1000)


def _turn_of(event: StoredEvent) -> str:
    turn: Any = decode_data(event.raw).get("turn_id")
    return str(turn or "")


__all__ = ["Destination", "Outbound", "Relay", "RelayStats", "Retry", "Undeliverable"]
