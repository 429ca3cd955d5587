"""A primary of the cluster killed with kill -9 under load, its replica promoted at once
(CLUSTER FAILOVER TAKEOVER). So that the replica is behind when it happens (on loopback it is
otherwise a fraction of a millisecond behind, and a test could not tell the modes apart), the
replica is cut off for a second before the kill: stopped (SIGSTOP) and its link dropped by the
primary (CLIENT KILL TYPE replica). With `KEEL_DURABILITY=replica` every
message keel acknowledged is still there afterwards (the writes of that second are refused with
503 and retried); with the default, the acknowledged writes of that second are lost, and the
test counts them (README: "Redis Cluster")."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ClusterDownError

from channels.auth import owner_of
from harness.store.keys import OwnerKeys, SessionKeys, job_shard, job_streams
from harness.store.queue import CLUSTER_SHARDS
from tests.cluster import ValkeyCluster, started
from tests.conftest import ON_CLUSTER, free_port
from tests.service import Service

# (each makes a cluster of its own: once per `make test`, in the one-server pass)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(ON_CLUSTER, reason="makes a cluster of its own")]

SESSIONS = 12
HELD_S = 1.0  # how long the replica is stopped before its primary is killed


@pytest.fixture
def fresh_cluster() -> Iterator[ValkeyCluster]:
    with started() as c:
        yield c


@dataclass
class Outcome:
    acked: dict[str, list[str]] = field(default_factory=dict)  # session -> message ids keel acknowledged
    refused: int = 0  # 5xx answers and broken connections (retried with the same message id)
    lost: list[str] = field(default_factory=list)  # acknowledged, and not in the session afterwards


async def fail_over(cluster: ValkeyCluster, sids: list[str]) -> int:
    """Cut the replica of the primary with the most sessions off for HELD_S (stopped, its link
    dropped by the primary), kill the primary, promote the replica; its port."""
    owners = [await asyncio.to_thread(cluster.owner_of, key_slot(SessionKeys(s).meta.encode())) for s in sids]
    victim = max(set(owners), key=owners.count)
    replica = cluster.replica_of(victim)
    cluster.signal(replica, signal.SIGSTOP)  # (stopped, it cannot connect again ...)
    await asyncio.to_thread(cluster.cut_replicas, victim)  # (... once the primary dropped it)
    await asyncio.sleep(HELD_S)  # (the fault: the replica falls behind for this long)
    await asyncio.to_thread(cluster.kill9, victim)
    cluster.signal(replica, signal.SIGCONT)
    await asyncio.to_thread(cluster.take_over, replica)
    return replica


async def load_through_failover(cluster: ValkeyCluster, tmp_path: Path, durability: str) -> Outcome:
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=cluster.url,
        KEEL_DURABILITY=durability,
        KEEL_LEASE_MS="2000",
        KEEL_AGENT="tests.crash_agent:agent",  # (replies at once: the demo types its replies out, ~1 s a turn)
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
    )
    await asyncio.to_thread(svc.start)
    out = Outcome()
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=svc.base, timeout=20) as c:
            made = [(await c.post("/v1/sessions")).json() for _ in range(SESSIONS)]
            assert all("session_id" in m for m in made), made[:2]
            sids = [m["session_id"] for m in made]

            async def talk(sid: str) -> None:
                out.acked[sid] = []
                n = 0
                while not stop.is_set():
                    mid = f"{sid}-m{n}"
                    try:
                        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi", "message_id": mid})
                    except httpx.HTTPError:
                        out.refused += 1
                        continue  # the same message again
                    if r.status_code >= 500 or r.status_code == 429:
                        out.refused += 1
                        await asyncio.sleep(0.05)  # (its Retry-After, shortened)
                        continue
                    assert r.status_code == 202, r.text
                    out.acked[sid].append(mid)
                    n += 1

            talkers = [asyncio.create_task(talk(s)) for s in sids]
            async with asyncio.timeout(30):  # load under way
                while sum(len(v) for v in out.acked.values()) < 100:  # noqa: ASYNC110 (counts)
                    await asyncio.sleep(0.01)
            survivor = await fail_over(cluster, sids)
            before = sum(len(v) for v in out.acked.values())
            async with asyncio.timeout(30):  # and keel goes on with the new primary
                while sum(len(v) for v in out.acked.values()) < before + 200:  # noqa: ASYNC110 (counts)
                    await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*talkers), 30)
        out.lost = await unrecorded(survivor, out.acked)
    finally:
        stop.set()
        await asyncio.to_thread(svc.stop)
    return out


async def unrecorded(port: int, acked: dict[str, list[str]]) -> list[str]:
    """The acknowledged message ids the cluster (through node `port`) has no record of."""
    client = RedisCluster.from_url(f"redis://127.0.0.1:{port}")
    try:
        async with asyncio.timeout(20):  # (a node may still say CLUSTERDOWN as the takeover settles)
            while True:
                try:
                    return [
                        mid
                        for sid, mids in acked.items()
                        for mid in mids
                        if not await client.hexists(SessionKeys(sid).mids, mid)
                    ]
                except ClusterDownError:
                    await asyncio.sleep(0.1)
    finally:
        await client.aclose()


async def test_replica_durability_loses_no_acknowledged_message(fresh_cluster: ValkeyCluster, tmp_path: Path) -> None:
    out = await load_through_failover(fresh_cluster, tmp_path, "replica")
    print(f"replica mode: {sum(map(len, out.acked.values()))} acked, {out.refused} refused, {len(out.lost)} lost")
    assert out.lost == []


async def test_default_durability_goes_on_and_counts_what_it_lost(fresh_cluster: ValkeyCluster, tmp_path: Path) -> None:
    out = await load_through_failover(fresh_cluster, tmp_path, "primary")
    print(f"default mode: {sum(map(len, out.acked.values()))} acked, {out.refused} refused, {len(out.lost)} lost")
    assert out.lost  # what the README warns of: acknowledged, then gone with the primary


def replica_port(primary: int) -> int:
    """The port of the replica the primary on `primary` names in its INFO replication."""
    info = redis_sync.Redis(port=primary).info("replication")
    return int(info["slave0"]["port"])


async def test_the_owners_list_waits_for_no_replica(fresh_cluster: ValkeyCluster, tmp_path: Path) -> None:
    """With replica durability, the owner's list of sessions (in a slot of its own) is written
    after the message, not waited for: its node's replica cut off, a message to a session on
    another node is still acknowledged (it was refused with 503 while the list waited for it)."""
    cluster = fresh_cluster
    key = "key-0"
    index_node = await asyncio.to_thread(cluster.owner_of, key_slot(OwnerKeys(owner_of(key)).sessions.encode()))
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=cluster.url,
        KEEL_DURABILITY="replica",
        KEEL_API_KEYS=key,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
    )
    await asyncio.to_thread(svc.start)
    try:
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=svc.base, timeout=20, headers=headers) as c:
            sids = [(await c.post("/v1/sessions")).json()["session_id"] for _ in range(16)]

            def nodes(sid: str) -> set[int]:  # the session's node and its turn jobs' (a shard of its own)
                streams = job_streams(CLUSTER_SHARDS)
                job_stream = streams[job_shard(sid, len(streams))]
                return {cluster.owner_of(key_slot(k.encode())) for k in (SessionKeys(sid).meta, job_stream)}

            sid = next(s for s in sids if index_node not in nodes(s))
            replica = replica_port(index_node)  # (the one that replicates it, as it says)
            cluster.signal(replica, signal.SIGSTOP)
            try:
                await asyncio.to_thread(cluster.cut_replicas, index_node)
                r = await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=15", json={"text": "hello"})
                assert r.status_code == 200 and r.json()["status"] == "completed", r.text
            finally:
                cluster.signal(replica, signal.SIGCONT)
            listed = (await c.get("/v1/sessions?limit=100")).json()["items"]
            assert sid in [i["session_id"] for i in listed]
    finally:
        await asyncio.to_thread(svc.stop)
