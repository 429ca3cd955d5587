"""The delivery relay: committed events to webhook destinations, in order, once.

The delivery relay: a session's committed events reach a webhook channel's destination (a
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
ran out of attempts, becomes a dead letter (listed and retried with `python -m app.deadletters`)
and the relay moves on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from harness.aio import cancel_and_wait
from harness.ids import new_id
from harness.relay.destination import Destination, Outbound, Parked, RelayStats, Retry, RetryPolicy, Undeliverable
from harness.relay.session import LeaseLost, Session
from harness.store import Failing, JobId, Store, relay_queue
from harness.telemetry import tracing

log = logging.getLogger("keel.relay")
REPORT_EVERY_S = 60.0
DEFAULT_RETRY = RetryPolicy()
DEFER_S = 0.5  # a job for a destination at its limit of sessions comes back after this


@dataclass
class _Task:
    jobs: list[JobId]
    kicked: bool = False


class Relay:
    def __init__(
        self,
        store: Store,
        destinations: list[Destination],
        *,
        resolve: Callable[[str], Awaitable[Destination | None]] | None = None,
        resolves: str = "wh:",
        lease_ms: int = 5_000,
        retry: RetryPolicy = DEFAULT_RETRY,
        working_after: float = 1.0,
        concurrency: int = 256,
        per_destination: int = 64,
    ) -> None:
        self.store = store
        self.outbox = store.outbox
        self.deliveries = store.deliveries
        self.queue = relay_queue(store.redis)
        self.destinations = {d.name: d for d in destinations}
        self.resolve = resolve  # destinations made on demand (an API key's webhook subscriptions) ...
        self.resolves = resolves  # ... whose names start so (any other unknown one is another process's)
        self.lease_ms = lease_ms
        self.retry = retry
        self.working_after = working_after
        self.concurrency = concurrency
        self.stats = RelayStats()
        self._tasks: dict[tuple[str, str, str], _Task] = {}
        self._busy: dict[str, int] = {}  # destination -> sessions being delivered to it here
        self.per_destination = per_destination
        self._running: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        await self.queue.ensure_group()
        self._loop = asyncio.create_task(self._take_jobs(), name="relay")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._running) if t is not None]
        # (cancelled again while any runs on: on 3.11 a cancel can be lost inside a Redis call)
        await cancel_and_wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # read: a task that failed as it was stopped is not news

    # ---- jobs ----------------------------------------------------------------------------

    async def _take_jobs(self) -> None:
        loop = asyncio.get_running_loop()
        next_reclaim = next_promote = 0.0
        next_report, reported = loop.time() + REPORT_EVERY_S, 0
        while True:
            try:
                if loop.time() >= next_report:  # the relay's figures in the log, when it worked
                    next_report = loop.time() + REPORT_EVERY_S
                    if self.stats.delivered + self.stats.dead != reported:
                        reported = self.stats.delivered + self.stats.dead
                        log.info("relay: %s", self.stats.summary())
                jobs = []
                if loop.time() >= next_promote:  # deliveries that waited for their destination
                    next_promote = loop.time() + 0.5
                    await self.deliveries.promote()
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + max(self.lease_ms / 1000, 1.0)
                    jobs = await self.queue.reclaim(min_idle_ms=2 * self.lease_ms)
                # (the channels' deliveries and the subscribers' have `concurrency` slots each)
                free = self.concurrency * (2 if self.resolve is not None else 1) - len(self._tasks)
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

    def _dispatch(self, job_id: JobId, what: str) -> None:
        sid, _, rest = what.partition(" ")
        dest, _, event_id = rest.partition(" ")
        if dest not in self.destinations and not (self.resolve is not None and dest.startswith(self.resolves)):
            log.warning("relay: a job for %s, which this process does not serve: left for another", dest)
            return
        key = (sid, dest, event_id)
        task = self._tasks.get(key)
        if task is not None:
            task.jobs.append(job_id)
            task.kicked = True
            return
        if self._busy.get(dest, 0) >= self._cap(dest):
            # a destination holds its share of the slots at most (a channel: the slots over the
            # channels; a subscriber's URL: `per_destination`); its further sessions wait a
            # moment, so a slow or failing destination holds up only its own deliveries
            self._defer(job_id, sid, dest, event_id)
            return
        self._busy[dest] = self._busy.get(dest, 0) + 1
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
                destination = self.destinations.get(dest) or (await self.resolve(dest) if self.resolve else None)
                if destination is None:  # (a subscription deleted meanwhile)
                    finished = True
                    break
                await self._follow(sid, destination, event_id)
                if not task.kicked:
                    finished = True
                    break
        except Parked as parked:  # (a redelivery stays one: its event goes with it)
            await self.deliveries.delay(sid, dest, parked.until, event_id)
            finished = True
        except LeaseLost:
            log.info("relay: %s lost its lease on %s; another relay delivers", dest, sid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("relay: delivering %s to %s stopped (%s); its job will be taken again", sid, dest, exc)
        finally:
            del self._tasks[key]
            if dest in self._busy:
                self._busy[dest] -= 1
                if self._busy[dest] <= 0:
                    del self._busy[dest]
        if finished:
            with contextlib.suppress(Exception):
                await self.queue.done(*task.jobs)

    def _cap(self, dest: str) -> int:
        if dest in self.destinations:
            return max(1, self.concurrency // len(self.destinations))
        return self.per_destination

    def _defer(self, job_id: JobId, sid: str, dest: str, event_id: str) -> None:
        async def later() -> None:
            try:
                await self.deliveries.delay(sid, dest, time.time() + DEFER_S, event_id)
                await self.queue.done(job_id)
            except Exception as exc:  # the job stays pending: reclaimed later
                log.warning("relay: deferring a job for %s failed (%s)", dest, exc)

        task = asyncio.create_task(later())
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    # ---- one session ---------------------------------------------------------------------

    async def _follow(self, sid: str, dest: Destination, redeliver: str = "") -> None:
        """Deliver the session's events until it is quiet (and the dead letter `redeliver`).
        A session another relay holds is left to it: the holder gives the lease back only once
        the session is quiet, so it delivers what this job is for (a redelivery, which only
        this job knows of, waits for the lease instead)."""
        token = new_id("rly")
        while True:
            taken = await self.deliveries.take(sid, dest.name, token, self.lease_ms)
            if isinstance(taken, int):
                if not redeliver:
                    return
                await asyncio.sleep(min(taken, 250) / 1000)
                continue
            if taken.exists:
                break
            # no such session: quiet, unless its first message made it meanwhile (then the
            # lease is still ours: take it again for the state)
            if await self.deliveries.mark(sid, dest.name, token, self.lease_ms, check="", release=True):
                return
        session = Session(self, sid, dest, token, taken, redeliver=redeliver)
        async with session.held():
            try:
                await session.recover()
                await session.follow()
            except Parked:
                seq = session.cursor_seq if session.cursor_seq >= 0 else None  # (the cursor's place, once known)
                await session.mark(release=True, failing=session.failing, seq=seq)
                session.released = True
                raise

    async def attempt(self, call: Any, session: Session, *, resets: bool = True) -> Any:
        """`call()` until it succeeds, waiting as each Retry says (or the destination's policy
        backs off): Undeliverable once the policy gives up; Parked when the wait is long. The
        failing state lives on the session (and in Redis when it parks), so a delivery that
        resumes later, or in another process, goes on with the same backoff and deadline. A
        call that does not `resets` (a reconcile) leaves the failing state as it was when it
        succeeds: only the delivery itself ends a failure."""
        policy = session.dest.retry or self.retry
        while True:
            failing = session.failing
            if failing is not None:
                wait = failing.retry_at - time.time()
                if wait > policy.park_after:
                    raise Parked(failing.retry_at)
                if wait > 0:
                    await asyncio.sleep(wait)
            try:
                # (the destination's request carries this span's traceparent: tracing.headers())
                tried = (failing.fails if failing else 0) + 1
                attributes = {"gen_ai.conversation.id": session.sid, "keel.destination": session.dest.name}
                with tracing.span(f"deliver {session.dest.name}", {**attributes, "keel.delivery.try": tried}):
                    result = await call()
            except Retry as exc:
                now = time.time()
                fails = (failing.fails if failing else 0) + 1
                since = failing.since if failing else now
                if (policy.attempts is not None and fails >= policy.attempts) or (
                    policy.give_up_after is not None and now - since >= policy.give_up_after
                ):
                    session.failing, session.gave_up_after = None, fails
                    raise Undeliverable(f"{exc} (gave up after {fails} attempts)") from exc
                self.stats.retries += 1
                backoff = min(policy.first * 2.0 ** (fails - 1), policy.cap) * random.uniform(0.8, 1.2)
                wait = min(exc.after, policy.cap) if exc.after is not None else backoff  # (a huge Retry-After too)
                session.failing = Failing(fails, since, now + wait)
                continue
            if resets:
                session.failing = None
            return result


__all__ = ["Destination", "Outbound", "Relay", "RelayStats", "Retry", "RetryPolicy", "Undeliverable"]
