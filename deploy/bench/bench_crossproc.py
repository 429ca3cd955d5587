"""Cross-process event latency: how long a committed event takes to reach an SSE reader held by
another keel process, against a reader on the process that committed it, in the same run.

Two keel processes on one Redis (one Valkey server, or with `--cluster` a Valkey Cluster of 3
primaries and 3 replicas): A runs the turns, B runs none (a web process in front). Each turn is
posted to A; one SSE reader follows the session on A (same process: events handed over in
memory) and one on B (the commit's notice comes by sharded pub/sub, then B reads the outbox).
Latency is the reader's receipt time minus the event's `at` (stamped just before the commit is
sent), so both include the commit's own round trip; B's minus A's is what crossing processes
costs. The turns begin once both processes are named among the session's readers (live deltas
are best-effort until then). Prints a table and a RESULT json line.

With `--deltas N` the agent's model streams each reply as N live `message.delta` events,
`--pace-ms` apart (`deploy/bench/agents.py`, `Stamped`: each delta's text begins with the time
it was sent), and the readers time those too: on A they are handed over in memory, on B they
come by the session's channel (published because B is named in the session's `readers`). Each
reader must get every delta once.

With `--pin`, A runs alone on the first CPU and everything else (B, Valkey, this driver) on the
others: on a small machine, where A lands otherwise decides whether it is descheduled as it
writes a commit's events to its reader (docs/benchmarks.md), and so how A compares with B.

    .venv/bin/python deploy/bench/bench_crossproc.py [--turns 300] [--cluster] [--deltas 20 --pace-ms 5] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import (
    HOST,
    BenchError,
    Deadline,
    Server,
    free_port,
    keel_env,
    new_loop,
    on_signal,
    percentile,
    positive,
    show_failure,
    start_valkey,
    stop_all,
    wait_ready,
)

from harness.store.keys import SessionKeys

AGENT = "deploy.bench.agents:agent"
# Runs the command after the CPU's number on that CPU alone (its threads inherit the mask).
PINNED = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"


def pin_apart() -> list[str]:
    """This process (and so what it starts from now on) on every CPU but the first; the prefix
    that starts a command on the first alone."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs")
    os.sched_setaffinity(0, set(cpus[1:]))
    return [sys.executable, "-c", PINNED, str(cpus[0])]


class Reader:
    """One SSE reader of the session: each event's id -> latency (s) as this reader saw it."""

    def __init__(self, base: str, sid: str) -> None:
        self.url = f"{base}/v1/sessions/{sid}/events"
        self.got: dict[str, float] = {}
        self.deltas: dict[str, float] = {}  # a live delta's stamp and index -> its latency (s)
        self.repeated = 0  # deltas seen twice
        self.ready = asyncio.Event()
        self.last = ""  # the run's last event id, once known
        self.done = asyncio.Event()  # ... and seen

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=None) as c, c.stream("GET", self.url) as r:
            self.ready.set()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    now = time.time()
                    event = json.loads(line[6:])
                    if event.get("type") == "message.delta":
                        key = event["data"]["delta"][:22]
                        self.repeated += key in self.deltas
                        self.deltas[key] = now - int(key[:19]) / 1e9
                    elif "id" in event:
                        self.got[event["id"]] = now - event["at"]
                        if event["id"] == self.last:
                            self.done.set()

    def expect(self, last: str) -> None:
        self.last = last
        if last in self.got:
            self.done.set()


async def both_named(redis: Redis | RedisCluster, sid: str) -> None:
    """Wait until the two processes are named among the session's readers (at most 10 s)."""
    async with asyncio.timeout(10):
        while await redis.hlen(SessionKeys(sid).readers) < 2:  # noqa: ASYNC110 (Redis state)
            await asyncio.sleep(0.005)


async def measure(a: Server, b: Server, redis: Redis | RedisCluster, turns: int, deltas: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{a.port}", timeout=30) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        readers = [Reader(f"http://{HOST}:{s.port}", sid) for s in (a, b)]
        tasks = [asyncio.create_task(r.run()) for r in readers]
        try:
            await asyncio.wait_for(asyncio.gather(*(r.ready.wait() for r in readers)), 10)
            # (a reader's stream is open before its process is named among the session's readers,
            # and live deltas are best-effort until it is: the turns begin once both are named)
            await both_named(redis, sid)
            last = ""
            for n in range(turns):
                r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"t{n}"})
                if r.status_code != 200:
                    raise BenchError(f"turn {n}: {r.status_code} {r.text[:200]}")
                last = r.json()["events"][-1]["id"]
            for reader in readers:
                reader.expect(last)
            await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in readers)), 10)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    out: dict[str, Any] = {"turns": turns, "events": len(readers[0].got)}
    out.update(compared("", readers[0].got, readers[1].got, "events"))
    if deltas:
        if any(r.repeated for r in readers) or len(readers[0].deltas) != turns * deltas:
            counts = ", ".join(f"{len(r.deltas)} ({r.repeated} twice)" for r in readers)
            raise BenchError(f"{turns * deltas} deltas sent, the readers on A and B got {counts}")
        out["deltas"] = len(readers[0].deltas)
        out.update(compared("delta_", readers[0].deltas, readers[1].deltas, "deltas"))
    return out


def compared(prefix: str, same: dict[str, float], cross: dict[str, float], what: str) -> dict[str, Any]:
    """p50 and p99 of the latencies on A (same), on B (cross), and of B's minus A's, in ms."""
    if set(same) != set(cross):
        raise BenchError(f"the readers saw different {what}: {len(same)} on A, {len(cross)} on B")
    extra = sorted((cross[k] - same[k]) * 1000 for k in same)
    ms = (("same", sorted(v * 1000 for v in same.values())), ("cross", sorted(v * 1000 for v in cross.values())))
    return {
        prefix + name: {"p50_ms": round(percentile(xs, 50), 3), "p99_ms": round(percentile(xs, 99), 3)}
        for name, xs in (*ms, ("cross_minus_same", extra))
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=positive, default=300)
    p.add_argument("--cluster", action="store_true", help="a Valkey Cluster (3 primaries, 3 replicas)")
    p.add_argument("--deltas", type=int, default=0, help="live deltas a reply, timed too (0: none)")
    p.add_argument("--pace-ms", type=float, default=5.0, help="with --deltas: the model's pause between two deltas")
    p.add_argument("--pin", action="store_true", help="A alone on the first CPU; B, Valkey and this driver on the rest")
    args = p.parse_args()
    alone = pin_apart() if args.pin else []
    agent, env = AGENT, {}
    if args.deltas:
        agent = "deploy.bench.agents:stamped"
        env = {"KEEL_BENCH_DELTAS": str(args.deltas), "KEEL_BENCH_PACE_MS": str(args.pace_ms)}
    signal.signal(signal.SIGTERM, on_signal)
    deadline = Deadline(300)
    work = Path(tempfile.mkdtemp(prefix="keel-bench-crossproc-"))
    valkey = cluster = None
    servers: list[Server] = []
    try:
        if args.cluster:
            from tests.cluster import ValkeyCluster

            cluster = ValkeyCluster()
            cluster.start()
            port = cluster.primaries[0]
        else:
            valkey, port = start_valkey(work, deadline)
        for name, extra, prefix in (("A", env, alone), ("B", {**env, "KEEL_RUN_TURNS": "0"}, [])):
            s = Server(name, free_port(), work / f"{name}.log")
            (work / name).mkdir()
            s.start([*prefix, sys.executable, "-m", "app"], keel_env(port, s, work / name, agent, extra))
            servers.append(s)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            for s in servers:
                runner.run(wait_ready(s, deadline))
            redis = RedisCluster(host=HOST, port=port) if args.cluster else Redis(host=HOST, port=port)
            try:
                result = runner.run(measure(servers[0], servers[1], redis, args.turns, args.deltas))
            finally:
                runner.run(redis.aclose())
    except (BenchError, OSError, httpx.HTTPError) as exc:
        return show_failure("bench_crossproc", exc, servers)
    finally:
        stop_all(servers, valkey)
        if cluster is not None:
            cluster.stop()
    result["redis"] = "cluster" if args.cluster else "server"
    result["pinned"] = args.pin
    print(f"{'reader':<22}{'p50 ms':>10}{'p99 ms':>10}")
    for name in (
        "same",
        "cross",
        "cross_minus_same",
        *(("delta_same", "delta_cross", "delta_cross_minus_same") if args.deltas else ()),
    ):
        print(f"{name:<22}{result[name]['p50_ms']:>10.3f}{result[name]['p99_ms']:>10.3f}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
