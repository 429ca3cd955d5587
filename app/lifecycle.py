"""A web process's lifecycle: SIGTERM (or SIGINT) drains it, then it exits 0 (docs/production.md "Process
lifecycle").

The drain, bounded by `KEEL_DRAIN_S`: `/readyz` and new requests answer 503 `draining` with
Retry-After, SSE streams end and websockets close with 1012 (`channels.drain`), and the turns
running here go to other processes at once (`Harness.hand_over`). The listener stays open until
nothing is in flight and no request came for `QUIET_S` (a client that still comes gets its 503,
not a refused connection); then uvicorn shuts down as usual. A second signal stops the process
as uvicorn does (the turns still running are left to their leases)."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from channels.drain import Drain
from harness import Harness

log = logging.getLogger("keel")
QUIET_S = 0.5  # the listener closes once no request came for this long (and nothing is open)
HAND_OVER_MARGIN_S = 1.0  # of the bound, kept for what follows the hand-over (releases, jobs, shutdown)


@dataclass(frozen=True)
class Drained:
    handed_over: int  # sessions whose turn went to another process
    refused: int  # requests answered 503 draining
    settled: bool  # nothing was left open at the end (False: the bound cut what was)


async def drain(app: Starlette, seconds: float) -> Drained:
    """Drain this process (its harness, its streams, its clients) within `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    state: Drain = app.state.drain
    state.begin()
    harness: Harness | None = getattr(app.state, "harness", None)
    handed = 0
    if harness is not None:
        try:
            handed = await harness.hand_over(max(seconds - HAND_OVER_MARGIN_S, seconds / 2))
        except Exception as exc:  # (Redis gone: the jobs stay pending, and are reclaimed)
            log.warning("drain: handing the turns over failed: %s", exc)
    settled = await state.settled(QUIET_S, deadline)
    return Drained(handed, state.refused, settled)


class KeelServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or SIGINT before it stops."""

    def __init__(self, config: uvicorn.Config, app: Starlette, drain_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_s = drain_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None
        self._signalled = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # a second signal (or one before startup): as uvicorn does
            return
        self._signalled = True
        log.info("%s: draining (at most %.1f s)", signal.Signals(sig).name, self.drain_s)
        self._loop.call_soon_threadsafe(self._begin)

    def _begin(self) -> None:
        self._draining = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        try:
            done = await drain(self.app, self.drain_s)
            log.info(
                "drained: %d turns handed over, %d requests refused%s",
                done.handed_over,
                done.refused,
                "" if done.settled else "; the bound cut what was still open",
            )
        finally:
            # what uvicorn's shutdown still waits for (open connections) gets what is left
            self.config.timeout_graceful_shutdown = max(1, math.ceil(deadline - loop.time()))
            self.should_exit = True
