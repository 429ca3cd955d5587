"""Runners: run each session's queued turns in order, one runner at a time per session (I4).

Work reaches a runner two ways. A process that accepts a message and runs turns itself starts
the session at once (`kick`). Every message also puts a job on the Redis stream, so that work
survives the process: any runner reading the stream (or reclaiming a dead runner's jobs) drains
the session's inbox. A job is acknowledged once a drain that began after the job was added has
finished: that drain saw the job's message, so the job needs no drain of its own.

When the process drains (`hand_over`), its sessions go to other runners at once: each running
turn stops at its model call without committing it, its lease is released, and a new job for
its session goes on the stream in place of the ones this runner read.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable

from harness.aio import cancel_and_wait
from harness.errors import StaleLease
from harness.ids import stream_key
from harness.loop.agent import Agent
from harness.loop.housekeeping import OpRunner
from harness.loop.modelcall import Calls, HandedOver
from harness.loop.outcomes import Final, Live, Publish
from harness.loop.turn import TurnRunner
from harness.runner.lease import Renewal
from harness.store import Begun, Busy, JobQueue, JobShards, Store
from harness.telemetry.logcontext import session_id, turn_id
from harness.telemetry.metrics import HarnessStats

log = logging.getLogger("keel.runner")
COVERED_MAX = 50_000  # sessions remembered as covered; past that the memo restarts (costs a BEGIN)
ACK_BATCH = 256  # acknowledge at once when this many jobs wait ...
ACK_DELAY_S = 0.05  # ... else after this long, together
READ_BATCH = 64  # jobs read from the stream at once
# Jobs of sessions in hand here need reading only for recovery, and one read per turn costs CPU:
# when reads bring only such jobs, less than twice this apart, the next read waits this long
# (a job of another process's waits at most this much longer).
OWN_JOBS_PAUSE_S = 0.005


class Runner:
    def __init__(
        self,
        store: Store,
        jobs: JobShards,
        agent: Agent,
        publish: Publish,
        *,
        live: Live | None = None,
        on_idle: Callable[[], None] = lambda: None,
        concurrency: int = 64,
        lease_ms: int = 5_000,
        block_ms: int = 1_000,
        stats: HarnessStats | None = None,
    ) -> None:
        self.stats = stats or HarnessStats()
        self.store = store
        self.jobs = jobs
        self.agent = agent
        self.publish = publish
        self.live = live
        self.calls = Calls()  # the model calls in progress here
        self._on_idle = on_idle  # a session stopped running here
        self.lease_ms = lease_ms
        self.block_ms = block_ms
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._active: set[str] = set()  # sessions this process is draining now
        self._holding: dict[str, str] = {}  # ... of which it holds the lease (its fence), running a turn
        self._again: set[str] = set()  # ... that got more work meanwhile: drain once more
        self._kicked: dict[str, str] = {}  # session -> newest job handed over locally, not yet drained
        self._covered: dict[str, str] = {}  # session -> newest job a finished drain has seen
        self._marks: dict[str, str] = {}  # session -> newest job the running drain began after
        self._jobs: dict[str, list[str]] = {}  # session -> jobs to acknowledge when its drain ends
        self._acks: list[tuple[str, str]] = []  # (session, job): done soon, together
        self._acking: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []  # one per job stream
        self._leaving = asyncio.Event()  # the process drains: sessions go to other runners
        self._given: dict[str, list[str]] = {}  # session -> its jobs read here, left to another runner
        self._busy: dict[str, asyncio.Event] = {}  # session -> set to end its wait for another's lease

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._loop(q), name=f"keel-runner-{n}") for n, q in enumerate(self.jobs.queues)
        ]

    async def stop(self) -> None:
        """Stop taking jobs, cancel running turns (their leases lapse; their jobs stay pending)."""
        await cancel_and_wait([*self._loops, *self._tasks])
        if self._acking is not None:
            with contextlib.suppress(Exception):
                await self._acking

    async def hand_over(self, timeout: float) -> int:
        """The process drains: read no more jobs; stop every turn running here at its model call
        (its provider stream closed; nothing of the call committed), release its lease, and put a
        job for its session on the stream for another runner, acknowledging the ones read here.
        A turn still running after `timeout` (a slow tool) is cancelled, its lease released all
        the same. Returns how many sessions were handed over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._leaving.set()
        self.calls.hand_over()
        for wake in self._busy.values():
            wake.set()
        # (the job readers end after their read; a turn at its model call; a reserved one once back)
        while (self._active or any(not t.done() for t in self._loops)) and loop.time() < deadline:
            running = {t for t in (*self._loops, *self._tasks) if not t.done()}
            if running:
                await asyncio.wait(running, timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0.01)
        held = dict(self._holding)  # leases of turns still running: cancelled now, released below
        await self.stop()
        for sid, fence in held.items():
            with contextlib.suppress(Exception):
                await self.store.release(sid, fence)
        given, self._given = self._given, {}
        for sid, jobs in given.items():
            await self.store.add_job(sid)
            if jobs:
                await self.jobs.of(sid).done(*jobs)
        self.stats.handed_over += len(given)
        return len(given)

    def kick(self, sid: str, job_id: str) -> None:
        """Run the session now: this process accepted a message for it (job `job_id`)."""
        mark = self._marks.get(sid)
        if mark is not None and stream_key(job_id) <= stream_key(mark):
            return  # the running drain began after this job was added (it came off the stream first)
        prev = self._kicked.get(sid)
        if prev is None or stream_key(job_id) > stream_key(prev):
            self._kicked[sid] = job_id
        self._run(sid)

    async def reserve(self, sid: str) -> bool:
        """Hold the session and a runner slot for a submit that may begin its turn (its lease is
        then renewed from the start; a job for it off the stream is only noted meanwhile). False
        if it runs here already, no slot is free or the process drains: submit as usual."""
        if sid in self._active or self._slots.locked() or self._leaving.is_set():
            return False
        await self._slots.acquire()  # free, so this returns without suspending
        self._active.add(sid)
        self._jobs[sid] = []
        return True

    def adopt(self, sid: str, job_id: str | None, begun: Begun | None) -> None:
        """The reserved submit is done: run the turn it began, or (None) drain as usual; with
        no job id (the submit failed) just let the session go, draining what came meanwhile."""
        if begun is None:
            self._slots.release()
            jobs = self._jobs.pop(sid, [])
            self._active.discard(sid)
            self._again.discard(sid)
            self._on_idle()
            for job in jobs:
                self._run(sid, job)
            if job_id is not None:
                self.kick(sid, job_id)
            return
        if job_id is not None:
            self._kicked[sid] = job_id
        self._start(sid, begun, held=True)

    # ---- jobs from the stream ----------------------------------------------------------

    async def _loop(self, queue: JobQueue) -> None:
        await queue.ensure_group()
        reclaim_every = max(self.lease_ms / 1000, 1.0)
        next_reclaim = last_own_read = 0.0
        loop = asyncio.get_running_loop()
        while not self._leaving.is_set():
            try:
                while len(self._tasks) >= 4 * self._concurrency:  # backpressure: stop reading jobs
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + reclaim_every
                    for job in await queue.reclaim(min_idle_ms=2 * self.lease_ms):
                        self._job(*job)
                jobs = await queue.take(count=READ_BATCH, block_ms=self.block_ms)
                now, last_read = loop.time(), last_own_read
                if jobs and sum(self._job(*job) for job in jobs) == len(jobs) < READ_BATCH:
                    last_own_read = now
                    if now - last_read < 2 * OWN_JOBS_PAUSE_S:  # they come often: batch them
                        await asyncio.sleep(OWN_JOBS_PAUSE_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("runner: %s; retrying in 1s", exc)
                await asyncio.sleep(1.0)

    def _job(self, job_id: str, sid: str) -> bool:
        """Take a job off the stream. True if its session was in hand here already (drained
        since the job was added, or running): a job this process added itself, most likely."""
        covered = self._covered.get(sid)
        if covered is not None and stream_key(job_id) <= stream_key(covered):
            self._ack(sid, job_id)
            return True
        mine = sid in self._active
        self._run(sid, job_id)
        return mine

    def _ack(self, sid: str, job_id: str) -> None:
        """Acknowledge soon, with others (lost in a crash, it is reclaimed and finds nothing)."""
        self._acks.append((sid, job_id))
        if self._acking is None:
            self._acking = asyncio.create_task(self._flush_acks())

    async def _flush_acks(self) -> None:
        try:
            if len(self._acks) < ACK_BATCH:
                await asyncio.sleep(ACK_DELAY_S)
            while self._acks:
                batch, self._acks = self._acks, []
                by_queue: dict[str, list[str]] = {}
                for sid, job_id in batch:
                    by_queue.setdefault(self.jobs.of(sid).stream, []).append(job_id)
                for queue in self.jobs.queues:
                    if queue.stream in by_queue:
                        await queue.done(*by_queue[queue.stream])
        except Exception as exc:
            log.warning("runner: acknowledging jobs failed (%s); they will be reclaimed", exc)
        finally:
            self._acking = None

    # ---- sessions ----------------------------------------------------------------------

    def _run(self, sid: str, job_id: str | None = None) -> None:
        if self._leaving.is_set() and sid not in self._active:  # another runner's now
            if job_id is not None:
                self._given.setdefault(sid, []).append(job_id)
            return
        if sid in self._active:
            if job_id is None:
                self._again.add(sid)  # a message after the drain began: go round once more
                return
            self._jobs[sid].append(job_id)
            if wake := self._busy.get(sid):  # (another runner's drain gave the session back, maybe)
                wake.set()
            mark = self._marks.get(sid)
            if mark is None or stream_key(job_id) > stream_key(mark):
                self._again.add(sid)
            return
        self._active.add(sid)
        self._jobs[sid] = [] if job_id is None else [job_id]
        self._start(sid, None)

    def _start(self, sid: str, first: Begun | None, *, held: bool = False) -> None:
        # A context of its own: log lines of the session's turns carry its ids, not those of
        # the request that happened to start it.
        task = asyncio.create_task(
            self._session(sid, first, held=held), name=f"keel-session-{sid}", context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def runs(self, sid: str) -> bool:
        """Whether this process runs a turn of the session now (holds its lease; not only waits)."""
        return sid in self._holding

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runner failed", exc_info=task.exception())

    async def _session(self, sid: str, first: Begun | None = None, *, held: bool = False) -> None:
        """Drain the session until no new work arrived meanwhile; then acknowledge its jobs,
        unless the lease went to another runner (which then owns the work, and the jobs stay).
        `held`: the slot was taken already (by `reserve`)."""
        session_id.set(sid)
        drained = False
        try:
            if not held:
                await self._slots.acquire()
            try:
                while True:
                    self._again.discard(sid)
                    mark = _newest(self._kicked.pop(sid, None), *self._jobs[sid])
                    if mark is not None:
                        self._marks[sid] = mark  # jobs up to here are seen by this drain
                    drained, first = await self._drain(sid, first), None
                    if not drained:
                        return
                    if mark is not None:
                        self._cover(sid, mark)
                    if sid not in self._again:
                        break
            finally:
                self._slots.release()
            drained = True
        except HandedOver:
            pass  # (the process drains: the session goes to another runner, below)
        finally:
            self._active.discard(sid)
            self._on_idle()
            self._marks.pop(sid, None)
            jobs = self._jobs.pop(sid, [])
            if drained:
                for job in jobs:
                    self._ack(sid, job)
            elif self._leaving.is_set():
                self._given.setdefault(sid, []).extend(jobs)

    def _cover(self, sid: str, job_id: str) -> None:
        if len(self._covered) >= COVERED_MAX:
            self._covered.clear()
        prev = self._covered.get(sid)
        if prev is None or stream_key(job_id) > stream_key(prev):
            self._covered[sid] = job_id

    async def _drain(self, sid: str, first: Begun | None = None) -> bool:
        """Run turns (from `first`, a turn already begun) until the inbox is empty. False if the
        lease was lost to another runner."""
        fence = ""
        while True:
            begun: Begun | Busy | None = first
            if first is not None:
                first = None
            elif self._leaving.is_set():
                raise HandedOver  # (before BEGIN: nothing held)
            else:
                begun = await self.store.begin(sid, fence, self.lease_ms)
            if begun is None:
                return True
            if isinstance(begun, Busy):
                # Another runner holds the session. If it is alive it drains the inbox; if it
                # died, its lease expires within lease_ms and we take over.
                await self._busy_wait(sid, min(begun.retry_ms, self.lease_ms) / 1000)
                continue
            fence = begun.fence
            if begun.took_over:
                self.stats.lease_takeovers += 1
            if begun.started is not None:
                self.publish(sid, [begun.started], False)
            self._holding[sid] = fence
            try:
                more = await self._run_turn(sid, begun)
            except StaleLease:
                return False
            finally:
                self._holding.pop(sid, None)
                self._on_idle()  # the poller watches this session's stream again
            if not more:
                return True

    async def _busy_wait(self, sid: str, seconds: float) -> None:
        """Wait while another runner holds the session: until its lease lapses (if it died), or
        less, when a job for the session comes (its runner may have handed it over) or a drain."""
        if self._leaving.is_set():
            return
        wake = self._busy[sid] = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await wake.wait()
        finally:
            del self._busy[sid]

    async def _run_turn(self, sid: str, begun: Begun) -> bool:
        renewal = Renewal(self.store, sid, begun.fence, self.lease_ms)
        turn_id.set(begun.message.turn_id)
        started = time.perf_counter()
        try:
            if begun.message.kind == "message":
                turn = TurnRunner(
                    self.store,
                    self.agent,
                    sid,
                    begun,
                    self.publish,
                    live=self.live,
                    calls=self.calls,
                    stats=self.stats,
                )
                outcome = await turn.run()
                self.stats.turn_seconds.observe(time.perf_counter() - started)
            else:
                outcome = await OpRunner(self.store, self.agent, sid, begun, self.publish).run()
        except HandedOver:
            renewal.cancel()
            await self.store.release(sid, begun.fence)  # at once: another runner takes the turn over
            raise
        finally:
            renewal.cancel()
            turn_id.set(None)
        if not isinstance(outcome, Final):
            await self.store.release(sid, begun.fence)  # paused: not ours to hold (a no-op if already let go)
        return isinstance(outcome, Final) and outcome.more


def _newest(*job_ids: str | None) -> str | None:
    ids = [j for j in job_ids if j is not None]
    return max(ids, key=stream_key) if ids else None
