"""keel on a Redis Cluster whose slots move under it: sessions run turns while their slots (and
a job stream's) are migrated from one primary to another and back, as a resharding does. No
turn fails, and every reader gets every event once, in order, as the outbox has them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from harness import Harness
from harness.errors import KeelError
from harness.store.keys import SessionKeys, job_shard, job_streams
from tests.channels.slack_support import echo_agent
from tests.cluster import ValkeyCluster
from tests.conftest import ON_CLUSTER

# (each makes a cluster of its own: once per `make test`, in the one-server pass)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(ON_CLUSTER, reason="makes a cluster of its own")]

SESSIONS = 8
ROUNDS = 3  # each session's slot moves this many times (24 moves of session slots, 3 of a job stream's)


class Load:
    """Sessions that each run turns one after another, with an SSE-like reader each."""

    def __init__(self, h: Harness, sids: list[str]) -> None:
        self.h = h
        self.sids = sids
        self.turns = dict.fromkeys(sids, 0)
        self.seen: dict[str, list[dict[str, Any]]] = {s: [] for s in sids}
        self.failures: list[str] = []
        self.stop = asyncio.Event()
        self.talkers = [asyncio.create_task(self._talk(s)) for s in sids]
        self.readers = [asyncio.create_task(self._read(s)) for s in sids]

    async def _talk(self, sid: str) -> None:
        while not self.stop.is_set():
            try:
                r = await self.h.sessions.submit_and_wait(
                    sid, "o", f"m{self.turns[sid]}", context={}, message_id=None, timeout=30
                )
                assert r.status == "completed", r
                self.turns[sid] += 1
            except (KeelError, AssertionError) as exc:
                self.failures.append(f"{sid}: {type(exc).__name__}: {exc}")
                return

    async def _read(self, sid: str) -> None:
        async for event in self.h.sessions.tail(sid, "0-0", heartbeat=0.5):
            if event is not None and event.id:
                self.seen[sid].append(json.loads(event.raw))

    async def until(self, more: int) -> None:
        """Until every session ran `more` turns from now (or one failed)."""
        goal = {s: n + more for s, n in self.turns.items()}
        async with asyncio.timeout(30):
            while any(self.turns[s] < goal[s] for s in self.sids) and not self.failures:  # noqa: ASYNC110 (counts)
                await asyncio.sleep(0.01)

    async def end(self) -> dict[str, list[dict[str, Any]]]:
        """Stop; every session's outbox, once the readers have read it all."""
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.talkers), 30)
        outboxes = {
            s: [json.loads(e.raw) for e in await self.h.store.outbox.events(s, "0-0", count=100_000)] for s in self.sids
        }
        async with asyncio.timeout(10):
            while any(len(self.seen[s]) < len(outboxes[s]) for s in self.sids):  # noqa: ASYNC110 (counts)
                await asyncio.sleep(0.01)
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        return outboxes


async def test_turns_run_on_while_their_slots_move(cluster: ValkeyCluster) -> None:
    h = Harness.connect(cluster.url, echo_agent())
    await h.start()
    client = RedisCluster.from_url(cluster.url)
    try:
        sids = [await h.sessions.create("o") for _ in range(SESSIONS)]
        load = Load(h, sids)
        await load.until(1)  # turns under way before the first slot moves
        slots = [key_slot(SessionKeys(s).meta.encode()) for s in sids]
        jobs_slot = key_slot(job_streams(8)[job_shard(sids[0], 8)].encode())
        moved = 0
        for _ in range(ROUNDS):  # each slot to the next primary, and on again
            for slot in [*slots, jobs_slot]:
                owner = await asyncio.to_thread(cluster.owner_of, slot)
                target = cluster.primaries[(cluster.primaries.index(owner) + 1) % 3]
                moved += await asyncio.to_thread(cluster.move_slot, slot, target)
        await load.until(2)  # every session goes on after the last move
        outboxes = await load.end()
        assert not load.failures, load.failures
        assert moved > 0 and sum(load.turns.values()) >= SESSIONS * 4
        await client.initialize()
        for sid in sids:
            outbox = outboxes[sid]
            assert [e["seq"] for e in outbox] == list(range(1, len(outbox) + 1))  # nothing lost, nothing twice
            assert [e["id"] for e in load.seen[sid]] == [e["id"] for e in outbox]  # each reader: all, once, in order
            assert len([e for e in outbox if e["type"] == "turn.completed"]) == load.turns[sid]
            owner = client.get_node_from_key(SessionKeys(sid).meta)  # the client followed the moves
            assert owner.port == cluster.owner_of(key_slot(SessionKeys(sid).meta.encode()))
    finally:
        await h.stop()
        await client.aclose()
