"""Runners: take turn jobs from the stream, lease the session, run its queued turns in order.

One runner per process serves many sessions concurrently (bounded). A session is run by at most
one runner at a time (the lease, I4); its messages run one turn at a time, in inbox order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from harness.agent import Agent
from harness.errors import StaleLease
from harness.queue import JobQueue
from harness.store import Begun, Busy, Store
from harness.turn import TurnRunner

log = logging.getLogger("keel.runner")


class Runner:
    def __init__(
        self,
        store: Store,
        queue: JobQueue,
        agent: Agent,
        publish: Callable[[str], None],
        *,
        concurrency: int = 64,
        lease_ms: int = 5_000,
        block_ms: int = 1_000,
    ) -> None:
        self.store = store
        self.queue = queue
        self.agent = agent
        self.publish = publish
        self.lease_ms = lease_ms
        self.block_ms = block_ms
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._active: set[str] = set()  # sessions this process is running now
        self._again: set[str] = set()  # ... and that got another job meanwhile
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._main = asyncio.create_task(self._loop(), name="keel-runner")

    async def stop(self) -> None:
        """Stop taking jobs and cancel running turns. Their leases expire; their jobs stay
        pending and another runner (or this process restarted) takes them up."""
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _loop(self) -> None:
        await self.queue.ensure_group()
        reclaim_every = max(self.lease_ms / 1000, 1.0)
        next_reclaim = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                if loop.time() >= next_reclaim:
                    next_reclaim = loop.time() + reclaim_every
                    for job in await self.queue.reclaim(min_idle_ms=2 * self.lease_ms):
                        await self._spawn(*job)
                free = max(self._concurrency - len(self._tasks), 1)
                for job in await self.queue.take(count=min(free, 64), block_ms=self.block_ms):
                    await self._spawn(*job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("runner: %s; retrying in 1s", exc)
                await asyncio.sleep(1.0)

    async def _spawn(self, job_id: str, sid: str) -> None:
        await self._slots.acquire()
        task = asyncio.create_task(self._handle(job_id, sid), name=f"keel-job-{sid}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("runner job failed", exc_info=task.exception())

    async def _handle(self, job_id: str, sid: str) -> None:
        """Drain the session's inbox, then acknowledge the job."""
        if sid in self._active:
            # This process is running the session now: that task drains again before it ends.
            self._again.add(sid)
            await self.queue.done(job_id)
            return
        self._active.add(sid)
        try:
            while True:
                self._again.discard(sid)
                await self._drain(sid)
                if sid not in self._again:
                    break
        finally:
            self._active.discard(sid)
        await self.queue.done(job_id)

    async def _drain(self, sid: str) -> None:
        fence = ""
        while True:
            begun = await self.store.begin(sid, fence, self.lease_ms)
            if begun is None:
                return
            if isinstance(begun, Busy):
                # Another runner holds the session. If it is alive it drains the inbox; if it
                # died, its lease expires within lease_ms and we take over.
                await asyncio.sleep(min(begun.retry_ms, self.lease_ms) / 1000)
                continue
            fence = begun.fence
            try:
                more = await self._run_turn(sid, begun)
            except StaleLease:
                return
            if not more:
                return

    async def _run_turn(self, sid: str, begun: Begun) -> bool:
        renewer = asyncio.create_task(self._renew(sid, begun.fence))
        try:
            final = await TurnRunner(self.store, self.agent, sid, begun, self.publish).run()
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        return final.more

    async def _renew(self, sid: str, fence: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            if not await self.store.renew(sid, fence, self.lease_ms):
                log.warning("session %s: lease %s lost", sid, fence)
                return
