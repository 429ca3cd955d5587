"""Where an owner's sessions deliver to (`Subscriptions.targets`): cached for a second; the
callers that find the cache out of date together share one read of Redis (a hundred messages
at once after the second passed made a hundred reads); a change made here is seen at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from harness.store import new_subscription
from harness.store.clusterwire import wire_for
from harness.store.hooks import Subscriptions


@pytest.fixture
async def hooks(redis: Redis) -> AsyncIterator[Subscriptions]:
    wire = wire_for(redis)
    yield Subscriptions(redis, wire)
    await wire.close()


def sub(sub_id: str) -> Any:
    return new_subscription(sub_id, "o", url="https://example.com/h", events=["*"], secret="s", description="")


async def test_callers_at_once_share_one_read(hooks: Subscriptions, monkeypatch: pytest.MonkeyPatch) -> None:
    await hooks.add(sub("wh_1"))
    reads = 0
    of = hooks.of

    async def counted(owner: str) -> Any:
        nonlocal reads
        reads += 1
        return await of(owner)

    monkeypatch.setattr(hooks, "of", counted)
    got = await asyncio.gather(*(hooks.targets("o") for _ in range(100)))
    assert got == [["wh:wh_1"]] * 100 and reads == 1


async def test_a_change_made_during_a_read_is_read_again(hooks: Subscriptions, monkeypatch: pytest.MonkeyPatch) -> None:
    await hooks.add(sub("wh_1"))
    reading, release = asyncio.Event(), asyncio.Event()
    of = hooks.of

    async def slow(owner: str) -> Any:
        found = await of(owner)
        reading.set()
        await release.wait()
        return found

    monkeypatch.setattr(hooks, "of", slow)
    first = asyncio.create_task(hooks.targets("o"))
    await reading.wait()
    monkeypatch.setattr(hooks, "of", of)
    await hooks.add(sub("wh_2"))  # (changed here while the first read is out)
    assert sorted(await hooks.targets("o")) == ["wh:wh_1", "wh:wh_2"]
    release.set()
    assert await first == ["wh:wh_1"]  # (what it read: not kept as the answer)
    assert sorted(await hooks.targets("o")) == ["wh:wh_1", "wh:wh_2"]
