"""Fixtures of the harness tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from harness.store import Store


@pytest.fixture
async def stores(redis: Redis) -> AsyncIterator[Callable[[], Store]]:
    """`stores()` -> a Store on the test's Redis, as a process has one (closed after the test)."""
    made: list[Store] = []

    def make() -> Store:
        made.append(Store(redis))
        return made[-1]

    yield make
    for store in made:
        await store.close()
