"""cancel_and_wait ends a task that is in the middle of Redis calls, however the cancellation
lands (redis-py sends inside asyncio.wait_for, which on Python 3.11 can lose a cancellation)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from harness.aio import cancel_and_wait


async def test_a_task_busy_with_redis_is_stopped(redis: Redis) -> None:
    await redis.xadd("s", {"a": "b"})
    calls = 0

    async def worker() -> None:
        nonlocal calls
        while True:
            await redis.xrange("s", count=5)
            calls += 1

    for i in range(60):
        task = asyncio.create_task(worker())
        for _ in range(i % 7):  # cancel at every phase of a command
            await asyncio.sleep(0)
        async with asyncio.timeout(5):
            await cancel_and_wait([task])
        assert task.done()
        after = calls
        await asyncio.sleep(0)
        assert calls == after  # it really stopped
