"""A running turn's lease, kept alive while the turn runs (I4)."""

from __future__ import annotations

import asyncio
import logging

from harness.store import Store

log = logging.getLogger("keel.runner")


class Renewal:
    """Extends a turn's lease every third of its TTL, from a timer: a turn shorter than that
    (most of them) costs no task and no Redis call."""

    def __init__(self, store: Store, sid: str, fence: str, lease_ms: int) -> None:
        self.store, self.sid, self.fence, self.lease_ms = store, sid, fence, lease_ms
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = self._loop.call_later(lease_ms / 3000, self._fire)

    def _fire(self) -> None:
        self._task = self._loop.create_task(self._renew())

    async def _renew(self) -> None:
        try:
            held = await self.store.renew(self.sid, self.fence, self.lease_ms)
        except Exception as exc:  # Redis unreachable for a moment: try again soon, the TTL allows it
            log.warning("session %s: renewing lease %s failed: %s", self.sid, self.fence, exc)
            self._timer = self._loop.call_later(self.lease_ms / 10000, self._fire)
            return
        if held:
            self._timer = self._loop.call_later(self.lease_ms / 3000, self._fire)
        else:
            log.warning("session %s: lease %s lost", self.sid, self.fence)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
