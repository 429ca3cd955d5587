"""Runners: run each session's queued turns in order, one runner at a time per session (I4).

Work reaches a runner two ways. A process that accepts a message and runs turns itself starts
the session at once (`kick`). Every message also puts a job on the Redis stream, so that work
survives the process: any runner reading the stream (or reclaiming a dead runner's jobs) drains
the session's inbox. A job is acknowledged once a drain that began after the job was added has
finished: that drain saw the job's message, so the job needs no drain of its own. A drain that
fails (storage gone mid-turn) acknowledges none of the jobs it read: they are reclaimed. Each
session the runner has in hand is one `InHand` state (`state`).

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
from collections.abc import Awaitable, Callable

from harness.aio import after_ready, cancel_and_wait
from harness.errors import StaleLease
from harness.loop.agent import Agent
from harness.loop.housekeeping import Housekeeping
from harness.loop.modelcall import Calls, HandedOver
from harness.loop.outcomes import Final
from harness.loop.turn import Turn
from harness.runner.lease import Renewal
from harness.runner.state import InHand, Phase
from harness.store import Begun, Busy, JobId, JobQueue, NoWork, Store, Submitted
from harness.telemetry import tracing
from harness.telemetry.logcontext import session_id, turn_id
from harness.telemetry.metrics import HarnessStats
from harness.tools.toolbox import Toolbox

log = logging.getLogger("keel.runner")
COVERED_MAX = 50_000  # sessions remembered as covered; past that the memo restarts (costs a BEGIN)
READ_BATCH = 64  # jobs read from the stream at once
# Jobs of sessions in hand here need reading only for recovery, and one read per turn costs CPU:
# when a stream's reads bring only such jobs, less than twice its pause apart, its next read waits
# that long: this times the number of job streams (8 on a cluster: 40 ms each, so that together
# they are read as often as one stream is), and a job of another process's on a stream read so
# waits at most that much longer.
OWN_JOBS_PAUSE_S = 0.005


class Runner:
    def __init__(
        self,
        store: Store,
        agent: Agent,
        *,
        concurrency: int = 256,
        lease_ms: int = 5_000,
        block_ms: int = 1_000,
        stats: HarnessStats | None = None,
        toolbox: Callable[[], Toolbox] | None = None,
    ) -> None:
        self.stats = stats or HarnessStats()
        self.store = store
        self.jobs = store.jobs
        self.agent = agent
        # the tools a turn that begins now has (the agent's, and its MCP servers' as they are)
        self.toolbox = toolbox or (lambda: agent.toolbox)
        self.calls = Calls()  # the model calls in progress here (a drain stops them)
        self.lease_ms = lease_ms
        self.block_ms = block_ms
        self._concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._hand: dict[str, InHand] = {}  # the sessions in hand here, each in its phase
        self._covered: dict[str, JobId] = {}  # session -> newest job a finished drain has seen
        self._given: dict[str, list[JobId]] = {}  # session -> its jobs read here, left to another runner
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []  # one per job stream
        self._leaving = asyncio.Event()  # the process drains: sessions go to other runners
        store.hub.written_here = self._writes  # (a waiter of a turn written here needs no notices)

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._loop(q), name=f"keel-runner-{n}") for n, q in enumerate(self.jobs.queues)
        ]

    async def stop(self) -> None:
        """Stop taking jobs, cancel running turns (their leases lapse; their jobs stay pending).
        A drain that one of them starts as it ends (a cancelled submit lets its session go, to
        drain as usual) is cancelled too: none is left running."""
        while running := [t for t in (*self._loops, *self._tasks) if not t.done()]:
            await cancel_and_wait(running)
        await self.jobs.flush()

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
        for held in self._hand.values():
            if held.wake is not None:
                held.wake.set()
        # (the job readers end after their read; a turn at its model call; a reserved one once back)
        while (self._hand or any(not t.done() for t in self._loops)) and loop.time() < deadline:
            running = {t for t in (*self._loops, *self._tasks) if not t.done()}
            if running:
                await asyncio.wait(running, timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0.01)
        # leases of turns still running: cancelled now, released below
        leases = {sid: h.fence for sid, h in self._hand.items() if h.phase is Phase.RUNNING}
        await self.stop()
        for sid, fence in leases.items():
            with contextlib.suppress(Exception):
                await self.store.release(sid, fence)
        given, self._given = self._given, {}
        for sid, jobs in given.items():
            await self.store.add_job(sid)
            await self.jobs.done(jobs)
        self.stats.handed_over += len(given)
        return len(given)

    def kick(self, sid: str, job: JobId) -> None:
        """Run the session now: this process accepted a message for it (job `job`)."""
        held = self._hand.get(sid)
        if held is None:
            if not self._leaving.is_set():  # (leaving: the job is another runner's)
                self._take(sid, Phase.QUEUED).kick(job)
                self._start(sid, None)
        elif not held.covers(job):  # (else the running drain began after it: it came off the stream first)
            held.kick(job)
            held.again = True

    async def reserve(self, sid: str) -> bool:
        """Hold the session and a runner slot for a submit that may begin its turn (its lease is
        then renewed from the start; a job for it off the stream is only noted meanwhile). False
        if it runs here already, no slot is free or the process drains: submit as usual."""
        if sid in self._hand or self._slots.locked() or self._leaving.is_set():
            return False
        await self._slots.acquire()  # free, so this returns without suspending
        self._take(sid, Phase.RESERVED)
        return True

    def launch(self, sid: str, submit: Callable[[int], Awaitable[Submitted]]) -> asyncio.Future[Submitted]:
        """The reserved session's SUBMIT (`submit(lease_ms)`, which may begin its turn), made by
        the session's own task, which then runs the turn it began (or lets the session go, to
        drain as usual): what the caller does meanwhile (it may go away) changes neither.
        The SUBMIT's outcome comes in the future returned."""
        outcome: asyncio.Future[Submitted] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            self._launched(sid, submit, outcome), name=f"keel-session-{sid}", context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return outcome

    async def _launched(
        self, sid: str, submit: Callable[[int], Awaitable[Submitted]], outcome: asyncio.Future[Submitted]
    ) -> None:
        try:
            submitted = await submit(self.lease_ms)
        except BaseException as exc:
            self._let_go(sid, None)
            if not outcome.done():
                if isinstance(exc, asyncio.CancelledError):
                    outcome.cancel()
                else:
                    outcome.set_exception(exc)  # (the caller's to answer: not the runner's failure)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not outcome.done():
            outcome.set_result(submitted)
        if submitted.began is None:
            self._let_go(sid, submitted.job)
            return
        self._hand[sid].kick(submitted.job)
        await self._session(sid, submitted.began, held=True)

    def _let_go(self, sid: str, job: JobId | None) -> None:
        """A reserved SUBMIT began no turn (or failed: no job): the session goes, its jobs read
        meanwhile and messages accepted meanwhile (and `job`) drained as usual."""
        held = self._hand.pop(sid)
        self._slots.release()
        for read in held.jobs:
            self._run(sid, read)
        for kicked in (held.kicked, job):
            if kicked is not None:
                self.kick(sid, kicked)

    def _writes(self, sid: str) -> bool:
        """Whether this process writes a turn of the session now, or is about to (a SUBMIT that
        may begin it, reserved here)."""
        held = self._hand.get(sid)
        return held is not None and held.phase in (Phase.RUNNING, Phase.RESERVED)

    def runs(self, sid: str) -> bool:
        """Whether this process runs a turn of the session now (holds its lease; not only waits)."""
        held = self._hand.get(sid)
        return held is not None and held.phase is Phase.RUNNING

    def _take(self, sid: str, phase: Phase) -> InHand:
        held = self._hand[sid] = InHand(phase)
        return held

    # ---- jobs from the stream ----------------------------------------------------------

    async def _loop(self, queue: JobQueue) -> None:
        await queue.ensure_group()
        reclaim_every = max(self.lease_ms / 1000, 1.0)
        next_reclaim = last_own_read = 0.0
        pause = OWN_JOBS_PAUSE_S * len(self.jobs.queues)  # (the streams together: one read every 5 ms)
        loop = asyncio.get_running_loop()
        while not self._leaving.is_set():
            try:
                while len(self._tasks) >= 4 * self._concurrency:  # backpressure: stop reading jobs
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + reclaim_every
                    for job, sid in await queue.reclaim(min_idle_ms=2 * self.lease_ms):
                        self._job(job, sid)
                jobs = await queue.take(count=READ_BATCH, block_ms=self.block_ms)
                now, last_read = loop.time(), last_own_read
                if jobs and sum(self._job(job, sid) for job, sid in jobs) == len(jobs) < READ_BATCH:
                    last_own_read = now
                    if now - last_read < 2 * pause:  # they come often: batch them
                        await asyncio.sleep(pause)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("runner: %s; retrying in 1s", exc)
                await asyncio.sleep(1.0)

    def _job(self, job: JobId, sid: str) -> bool:
        """Take a job off the stream. True if its session was in hand here already (drained
        since the job was added, or running): a job this process added itself, most likely."""
        covered = self._covered.get(sid)
        if covered is not None and job.seen_by(covered):
            self.jobs.ack(job)
            return True
        mine = sid in self._hand
        self._run(sid, job)
        return mine

    def _run(self, sid: str, job: JobId) -> None:
        """A job for the session: noted if it is in hand, else its drain starts (or, when the
        process drains, the job is left to another runner)."""
        held = self._hand.get(sid)
        if held is not None:
            held.got(job)
        elif self._leaving.is_set():  # another runner's now
            self._given.setdefault(sid, []).append(job)
        else:
            self._take(sid, Phase.QUEUED).jobs.append(job)
            self._start(sid, None)

    # ---- sessions ----------------------------------------------------------------------

    def _start(self, sid: str, first: Begun | None, *, held: bool = False) -> None:
        # A context of its own: log lines of the session's turns carry its ids, not those of
        # the request that happened to start it.
        task = asyncio.create_task(
            self._session(sid, first, held=held), name=f"keel-session-{sid}", context=contextvars.Context()
        )
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runner failed", exc_info=task.exception())

    async def _session(self, sid: str, first: Begun | None = None, *, held: bool = False) -> None:
        """Drain the session until no new work arrived meanwhile; then acknowledge its jobs,
        unless the lease went to another runner (which then owns the work, and the jobs stay).
        `held`: the slot was taken already (by `reserve`). A drain that fails (storage gone
        mid-turn) acknowledges nothing either, whatever rounds it finished before: a job read
        for the failed round stands for work not done, and is reclaimed."""
        session_id.set(sid)
        state = self._hand[sid]
        drained, slot = False, held
        try:
            if not held:
                await self._slots.acquire()
                slot = True
                state.to(Phase.DRAINING)
            while True:
                mark = state.round()
                if not await self._drain(sid, state, first):
                    return
                if state.phase is Phase.ENDED:  # (let go as its last turn ended: `_ended`)
                    return
                first = None
                if mark is not None:
                    self._cover(sid, mark)
                if not state.again:
                    break
            drained = True
        except HandedOver:
            pass  # (the process drains: the session goes to another runner, below)
        finally:
            if state.phase is not Phase.ENDED:
                self._end_drain(sid, state, drained=drained, slot=slot)

    def _end_drain(self, sid: str, state: InHand, *, drained: bool, slot: bool) -> None:
        """The session's drain is over: its runner slot given back (`slot`: it took one), out of
        hand, its jobs acknowledged if it drained (else, as the process drains, left to another
        runner; else pending, to be reclaimed)."""
        if slot:
            self._slots.release()
        del self._hand[sid]
        if drained:
            for job in state.jobs:
                self.jobs.ack(job)
        elif self._leaving.is_set():
            self._given.setdefault(sid, []).extend(state.jobs)

    def _ended(self, sid: str, state: InHand) -> bool:
        """The session's turn run here ended with its final commit, which left the inbox empty.
        If no work came for the session since its drain began (and the process is not handing
        its sessions over), the drain is over now: the session is let go before its task
        unwinds (ENDED: so a message sent as the turn's answer arrives finds it idle here), and
        True."""
        if state.again or self._leaving.is_set():
            return False
        state.to(Phase.ENDED)
        if state.mark is not None:
            self._cover(sid, state.mark)
        self._end_drain(sid, state, drained=True, slot=True)
        return True

    def _cover(self, sid: str, job: JobId) -> None:
        if len(self._covered) >= COVERED_MAX:
            self._covered.clear()
        prev = self._covered.get(sid)
        if prev is None or not job.seen_by(prev):  # (a mark of another stream: the newer one wins)
            self._covered[sid] = job

    async def _drain(self, sid: str, state: InHand, first: Begun | None = None) -> bool:
        """Run turns (from `first`, a turn already begun) until the inbox is empty. False if the
        lease was lost to another runner."""
        fence = ""
        while True:
            if first is not None:
                begun, first = first, None
            elif self._leaving.is_set():
                raise HandedOver  # (before BEGIN: nothing held)
            else:
                match await self.store.begin(sid, fence, self.lease_ms):
                    case NoWork():
                        return True
                    case Busy(retry_ms=retry_ms):
                        # Another runner holds the session. If it is alive it drains the inbox;
                        # if it died, its lease expires within lease_ms and we take over.
                        await self._busy_wait(state, min(retry_ms, self.lease_ms) / 1000)
                        continue
                    case Begun() as begun:
                        pass
            fence = begun.fence
            if begun.took_over:
                self.stats.lease_takeovers += 1
            state.to(Phase.RUNNING)
            state.fence = fence
            try:
                with self.store.hub.writing(sid):
                    more = await self._run_turn(sid, begun, state)
            except StaleLease:
                return False
            finally:
                if state.phase is not Phase.ENDED:
                    state.to(Phase.DRAINING)
            if not more:
                return True

    async def _busy_wait(self, state: InHand, seconds: float) -> None:
        """Wait while another runner holds the session: until its lease lapses (if it died), or
        less, when a job for the session comes (its runner may have handed it over) or a drain."""
        if self._leaving.is_set():
            return
        state.to(Phase.WAITING)
        wake = state.wake = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await wake.wait()
        finally:
            state.to(Phase.DRAINING)

    async def _run_turn(self, sid: str, begun: Begun, state: InHand) -> bool:
        renewal = Renewal(self.store, sid, begun.fence, self.lease_ms)
        turn_id.set(begun.message.turn_id)
        started = time.perf_counter()
        try:
            if begun.message.kind == "message":
                turn = Turn(
                    self.store, self.agent, sid, begun, calls=self.calls, stats=self.stats, tools=self.toolbox()
                )
                with tracing.span(
                    f"invoke_agent {self.agent.name}",
                    lambda: {  # (made only if traced)
                        "gen_ai.operation.name": "invoke_agent",
                        "gen_ai.agent.name": self.agent.name,
                        "gen_ai.conversation.id": sid,
                        "keel.turn.id": begun.message.turn_id,
                        "keel.message.id": begun.message.message_id,
                        "keel.turn.took_over": begun.took_over,
                    },
                    parent=begun.message.trace,
                    signals=(HandedOver,),
                ):
                    outcome = await turn.run()
                self.stats.turn_seconds.observe(time.perf_counter() - started)
            else:
                outcome = await Housekeeping(self.store, self.agent, sid, begun).run()
        except HandedOver:
            renewal.cancel()
            await self.store.release(sid, begun.fence)  # at once: another runner takes the turn over
            raise
        finally:
            renewal.cancel()
            turn_id.set(None)
        if not isinstance(outcome, Final):
            await self.store.release(sid, begun.fence)  # paused: not ours to hold (a no-op if already let go)
            return False
        if not outcome.more and self._ended(sid, state):
            # the turn's waiters answer first, and a message one of them sends at once goes out
            # before this task's unwinding, which then runs while Valkey runs that SUBMIT
            await after_ready()
        return outcome.more
