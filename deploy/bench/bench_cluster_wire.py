"""keel's cluster wire against redis-py's cluster client, in the same run: the same script
(EVALSHA with a session's two keys, as keel's) sent N times in a row through
`ClusterWire.script` and through `RedisCluster.evalsha`, the two alternating over rounds, on a
Valkey Cluster of 3 primaries and 3 replicas. Reports the client's CPU and the wall time per
call (medians over rounds) and their ratio. A RESULT json line at the end.

    .venv/bin/python deploy/bench/bench_cluster_wire.py [--calls 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from support import new_loop, positive

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.ids import new_id
from harness.store.client import connect
from harness.store.clusterwire import ClusterWire
from harness.store.keys import SessionKeys
from tests.cluster import started

SOURCE = "redis.call('HINCRBY', KEYS[1], 'n', 1) return redis.call('XLEN', KEYS[2])"
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


async def measure(url: str, calls: int, rounds: int) -> dict[str, Any]:
    client: Any = connect(url)
    wire = ClusterWire(client)
    keys = [SessionKeys(new_id("ses")) for _ in range(64)]  # sessions on every primary
    try:
        await client.script_load(SOURCE)
        got: dict[str, list[tuple[float, float]]] = {"wire": [], "redis-py": []}

        async def via_wire(k: SessionKeys) -> Any:
            return await wire.script(SHA, SOURCE, [k.meta, k.outbox], [])

        async def via_redis_py(k: SessionKeys) -> Any:
            return await client.evalsha(SHA, 2, k.meta, k.outbox)

        for r in range(rounds):
            order = [("wire", via_wire), ("redis-py", via_redis_py)]
            for name, send in order if r % 2 == 0 else order[::-1]:
                for k in keys:  # warm: connections to every node
                    await send(k)
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for n in range(calls):
                    await send(keys[n % len(keys)])
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                got[name].append((cpu * 1e6 / calls, wall * 1e6 / calls))
    finally:
        await wire.close()
        await client.aclose()
    out: dict[str, Any] = {"calls": calls, "rounds": rounds}
    for name, xs in got.items():
        out[name] = {
            "cpu_us": round(statistics.median(c for c, _ in xs), 1),
            "wall_us": round(statistics.median(w for _, w in xs), 1),
        }
    out["ratio_cpu"] = round(out["redis-py"]["cpu_us"] / out["wire"]["cpu_us"], 2)
    out["ratio_wall"] = round(out["redis-py"]["wall_us"] / out["wire"]["wall_us"], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=positive, default=5000)
    p.add_argument("--rounds", type=positive, default=5)
    args = p.parse_args()
    with started() as cluster, asyncio.Runner(loop_factory=new_loop) as runner:
        out = runner.run(measure(cluster.url, args.calls, args.rounds))
    print(f"{'path':<10}{'CPU us/call':>13}{'wall us/call':>14}")
    for name in ("wire", "redis-py"):
        print(f"{name:<10}{out[name]['cpu_us']:>13.1f}{out[name]['wall_us']:>14.1f}")
    print(f"redis-py / wire: CPU {out['ratio_cpu']}x, wall {out['ratio_wall']}x")
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
