"""asyncio helpers keel needs beyond the standard library."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.05


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | asyncio.Task[None]]) -> None:
    """Cancel the tasks and return once every one has ended, cancelling again any that runs on.

    On Python 3.11, `asyncio.wait_for` loses a cancellation that arrives just as what it waits
    for completes, and redis-py sends every command inside `wait_for(..., socket_timeout)`: a
    task cancelled in the middle of a Redis call can carry on as if nothing happened."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)


async def after_ready() -> None:
    """Let the tasks ready now run first, and those they make ready at once: two turns of the
    loop (a task woken now runs in the next; one it starts, in the one after)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)
