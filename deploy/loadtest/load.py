"""The load generator: HTTP+SSE and websocket clients (deploy/loadtest/clients.py) spread over
the web ports of a topology (deploy/loadtest/topology.py), each running turns one after the
other on a session of its own, then each checked against its session's outbox.

    python deploy/loadtest/load.py --web 2 --workers 0 [--cluster] [--http 16 --ws 16] [--seconds 20]

Client n of each kind uses web port n mod N; an HTTP client follows its SSE stream on port
(n + n div N) mod N, so with two web processes half the streams are on the process that took
the POST and half on the other (events then cross processes through Redis). After
`--warmup-turns` turns per client, the measured phase runs for `--seconds` (or until `--turns`
turns began), the turns begun then finish, and then: turns/s, turn latency p50/p99 (message
sent -> its `turn.completed` seen), errors, and the CPU time of each kind of process (web,
worker, Redis, from /proc/<pid>/stat) and of this generator, per turn and in cores, with the
machine's other load (/proc/stat's busy time minus ours: how noisy the run was). The last line is
`RESULT {json}`. Exit status 1 if any client saw an error or an event was lost, repeated or
out of order. Sessions keep all their events here (`KEEL_EVENT_RETENTION`) so the check sees
them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from redis.asyncio import Redis  # noqa: E402
from redis.asyncio.cluster import RedisCluster  # noqa: E402

from deploy.bench.support import BenchError, Conn, cpu_seconds, new_loop, percentile  # noqa: E402
from deploy.loadtest.clients import Client, HttpClient, Stats, WsClient, check  # noqa: E402
from deploy.loadtest.topology import Topology, signals_exit  # noqa: E402

ENV = {"KEEL_EVENT_RETENTION": "1000000"}
SETUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Load:
    http: int = 16  # HTTP+SSE clients
    ws: int = 16  # websocket clients
    seconds: float = 20.0  # the measured phase ...
    turns: int = 0  # ... or this many turns (0: by time)
    warmup_turns: int = 3  # per client, before it


@dataclass(frozen=True)
class Snapshot:
    at: float  # perf_counter
    procs: dict[int, float]  # pid -> CPU seconds
    me: float  # this process's CPU seconds
    busy: float  # the machine's busy CPU seconds (/proc/stat)


def machine_busy() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def snapshot(pids: list[int]) -> Snapshot:
    return Snapshot(time.perf_counter(), {p: cpu_seconds(p) for p in pids}, time.process_time(), machine_busy())


def make_clients(ports: list[int], load: Load, stats: Stats) -> tuple[list[HttpClient], list[WsClient]]:
    n = len(ports)
    https = [HttpClient(f"h{i}", ports[i % n], ports[(i + i // n) % n], ports, stats) for i in range(load.http)]
    sockets = [WsClient(f"w{i}", ports[i % n], stats) for i in range(load.ws)]
    return https, sockets


async def setup(https: list[HttpClient], sockets: list[WsClient], tasks: list[asyncio.Task[None]]) -> None:
    """Sessions made, streams open and caught up (each saw its `session.created`)."""
    for h in https:
        await h.open()
        assert h.conn is not None
        await h.create(h.conn)
    for w in sockets:
        conn = await Conn.open(w.port)
        try:
            await w.create(conn)
        finally:
            await conn.close()
    everyone: list[Client] = [*https, *sockets]
    tasks += [asyncio.create_task(c.follow()) for c in everyone]
    async with asyncio.timeout(SETUP_TIMEOUT_S):
        await asyncio.gather(*(c.created.wait() for c in everyone))


async def drive(topo: Topology, load: Load, clients: list[Client], stats: Stats) -> tuple[Snapshot, Snapshot]:
    """The warm-up, then the measured phase: the CPU snapshots around it."""
    pids = [p for kind in ("web", "worker", "redis") for p in topo.pids(kind)]
    warm = dict.fromkeys((c.name for c in clients), 0)

    def warming(c: Client) -> Callable[[], bool]:
        def more() -> bool:
            warm[c.name] += 1
            return warm[c.name] <= load.warmup_turns

        return more

    await asyncio.gather(*(c.turns(warming(c)) for c in clients))
    begun = 0
    before = snapshot(pids)
    until = before.at + load.seconds

    def more() -> bool:
        nonlocal begun
        begun += 1
        return begun <= load.turns if load.turns else time.perf_counter() < until

    stats.measuring = True
    await asyncio.gather(*(c.turns(more) for c in clients))
    stats.measuring = False
    after = snapshot(pids)
    topo.check_alive()
    return before, after


def cpu_figures(topo: Topology, before: Snapshot, after: Snapshot, turns: int) -> dict[str, Any]:
    wall = after.at - before.at
    used = {p: after.procs[p] - before.procs[p] for p in before.procs}
    ms: dict[str, float | None] = {}
    cores: dict[str, Any] = {}
    for kind in ("web", "worker", "redis"):
        pids = topo.pids(kind)
        total = sum(used[p] for p in pids)
        ms[kind] = round(total * 1000 / turns, 3) if pids else None
        cores[kind] = [round(used[p] / wall, 3) for p in pids]
    if topo.cluster is not None:
        redis = topo.pids("redis")
        primaries, replicas = redis[: topo.primaries], redis[topo.primaries :]
        ms["redis_primaries"] = round(sum(used[p] for p in primaries) * 1000 / turns, 3)
        ms["redis_replicas"] = round(sum(used[p] for p in replicas) * 1000 / turns, 3)
        ms["redis_busiest_primary"] = round(max(used[p] for p in primaries) * 1000 / turns, 3)
    me = after.me - before.me
    ms["generator"] = round(me * 1000 / turns, 3)
    cores["generator"] = round(me / wall, 3)
    cores["machine_busy"] = round((after.busy - before.busy) / wall, 3)
    cores["others"] = round((after.busy - before.busy - sum(used.values()) - me) / wall, 3)
    return {"cpu_ms_per_turn": ms, "cpu_cores": cores}


async def measure(topo: Topology, load: Load) -> dict[str, Any]:
    stats = Stats()
    https, sockets = make_clients(topo.ports, load, stats)
    clients: list[Client] = [*https, *sockets]
    tasks: list[asyncio.Task[None]] = []
    redis: Any = RedisCluster.from_url(topo.redis_url) if topo.cluster else Redis.from_url(topo.redis_url)
    try:
        await setup(https, sockets, tasks)
        before, after = await drive(topo, load, clients, stats)
        checked = await check(clients, redis)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(h.conn.close() for h in https if h.conn is not None))
        await redis.aclose()
    if not stats.turns:
        raise BenchError(f"no turn completed in the measured phase; errors: {stats.examples}")
    wall = after.at - before.at  # (the turns begun in the phase, all finished)
    lat = stats.latencies_ms
    return {
        "turns": stats.turns,
        "seconds": round(wall, 2),
        "turns_per_s": round(stats.turns / wall, 1),
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "errors": stats.errors,
        "error_examples": stats.examples,
        "retried_503": stats.retried_503,
        "events_checked": checked.events,
        "lost": checked.lost,
        "duplicated": checked.duplicated,
        "problems": checked.problems[:10],
        **cpu_figures(topo, before, after, stats.turns),
    }


def run(topo: Topology, load: Load) -> dict[str, Any]:
    """One measured load on a running topology: the RESULT's figures."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        figures = runner.run(measure(topo, load))
    config: dict[str, Any] = {"web": len(topo.web), "workers": len(topo.workers), "web_turns": topo.web_turns}
    config |= {"redis": "cluster" if topo.cluster else "server", **asdict(load), "machine_cores": os.cpu_count()}
    return {"config": config, **figures}


def show(result: dict[str, Any]) -> str:
    c, ms, cores = result["config"], result["cpu_ms_per_turn"], result["cpu_cores"]
    web = f"{c['web']} web ({'running turns' if c['web_turns'] else 'KEEL_RUN_TURNS=0'})"
    lines = [
        f"{web} + {c['workers']} worker(s) on {c['redis']}; {c['http']} HTTP+SSE + {c['ws']} websocket clients",
        f"turns {result['turns']} in {result['seconds']} s = {result['turns_per_s']:,.0f} turns/s;"
        f" latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms",
        f"errors {result['errors']} (503s retried {result['retried_503']}); events checked"
        f" {result['events_checked']:,}: lost {result['lost']}, duplicated {result['duplicated']},"
        f" other problems {len(result['problems'])}",
        "CPU ms per turn: " + ", ".join(f"{k} {v}" for k, v in ms.items() if v is not None),
        "CPU cores: " + ", ".join(f"{k} {v}" for k, v in cores.items() if v != []),
    ]
    lines += [f"  {e}" for e in [*result["error_examples"], *result["problems"]]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--web", type=int, default=1, help="web processes (default 1)")
    p.add_argument("--workers", type=int, default=0, help="workers (default 0)")
    p.add_argument("--cluster", action="store_true", help="a Valkey Cluster (3 primaries, 3 replicas)")
    p.add_argument("--web-turns", choices=("auto", "on", "off"), default="auto", help="web processes run turns")
    p.add_argument("--http", type=int, default=Load.http, help=f"HTTP+SSE clients (default {Load.http})")
    p.add_argument("--ws", type=int, default=Load.ws, help=f"websocket clients (default {Load.ws})")
    p.add_argument("--seconds", type=float, default=Load.seconds, help="the measured phase (default 20)")
    p.add_argument("--turns", type=int, default=0, help="measure this many turns instead of --seconds")
    p.add_argument("--warmup-turns", type=int, default=Load.warmup_turns, help="per client (default 3)")
    args = p.parse_args(argv)
    if args.http < 0 or args.ws < 0 or args.http + args.ws < 1 or args.seconds <= 0 or args.turns < 0:
        p.error("at least one client, a positive --seconds, no negative --turns")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = Load(args.http, args.ws, args.seconds, args.turns, args.warmup_turns)
    web_turns = None if args.web_turns == "auto" else args.web_turns == "on"
    with signals_exit():
        try:
            with Topology.start(args.web, args.workers, cluster=args.cluster, web_turns=web_turns, env=ENV) as topo:
                result = run(topo, load)
        except BenchError as exc:
            print(f"load: {exc}", file=sys.stderr)
            return 1
    print(show(result))
    print("RESULT " + json.dumps(result), flush=True)
    clean = not result["errors"] and not result["lost"] and not result["duplicated"] and not result["problems"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
