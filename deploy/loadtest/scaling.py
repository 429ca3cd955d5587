"""Throughput from 1 to 2 keel processes, on one Valkey and on a Valkey Cluster, and what a
16-core host and a 3-node cluster should carry, projected from the CPU per turn measured.

    python deploy/loadtest/scaling.py [--repeat 3] [--seconds 20] [--redis server,cluster]

For each kind of Redis, `--repeat` rounds of three topologies, one after the other in each
round so that the machine's changing load falls on all three alike: 1 web process running
turns; 2 web processes running turns; 1 web process with `KEEL_RUN_TURNS=0` and 1 worker.
Each run is deploy/loadtest/load.py's, on processes and a Redis started for it. Prints the
medians (with ranges), the growth from 1 to 2 processes, the projection, and `RESULT {json}`.
Exit status 1 if any run saw an error or lost or repeated an event.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from deploy.bench.support import BenchError  # noqa: E402
from deploy.loadtest.load import ENV, Load, run, show  # noqa: E402
from deploy.loadtest.topology import Topology, signals_exit  # noqa: E402

CONFIGS = {"1 web": (1, 0), "2 web": (2, 0), "web+worker": (1, 1)}  # (web processes, workers)
CPU_KEYS = ("web", "worker", "redis", "redis_primaries", "redis_replicas", "redis_busiest_primary", "generator")
HOST_CORES = 16
VALKEY_CORES = 1  # Valkey runs commands (and Lua) on one thread: one core per server, whatever the host
CLUSTER_PRIMARIES = 3
MODEL_TURN_S = 5.0  # a real model's turn, for the concurrency a real load needs
RUNNER_CONCURRENCY = 256  # KEEL_RUNNER_CONCURRENCY's default: sessions one process runs at once


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges of one topology's runs; errors and checks summed."""
    out: dict[str, Any] = {k: spread([r[k] for r in runs]) for k in ("turns_per_s", "p50_ms", "p99_ms")}
    out["cpu_ms_per_turn"] = {
        k: spread([r["cpu_ms_per_turn"][k] for r in runs])
        for k in CPU_KEYS
        if all(r["cpu_ms_per_turn"].get(k) is not None for r in runs)
    }
    out["cpu_allowed_turns_per_s"] = spread([cpu_allowed(r) for r in runs])
    out["others_cores"] = spread([r["cpu_cores"]["others"] for r in runs])
    out["generator_cores"] = spread([r["cpu_cores"]["generator"] for r in runs])
    for k in ("turns", "errors", "retried_503", "events_checked", "lost", "duplicated"):
        out[k] = sum(r[k] for r in runs)
    out["problems"] = sum(len(r["problems"]) for r in runs)
    return out


def cpu_allowed(r: dict[str, Any]) -> float:
    """The turns/s the CPU left to the run (the machine's cores less the other load on it)
    allowed at the CPU per turn it measured (keel, Redis and the generator together)."""
    ms = r["cpu_ms_per_turn"]
    total = sum(ms[k] or 0 for k in ("web", "worker", "redis", "generator"))
    cores = r["config"].get("machine_cores") or os.cpu_count() or 1
    return float((cores - r["cpu_cores"]["others"]) * 1000 / total)


def growth(rounds: list[dict[str, dict[str, Any]]], name: str) -> dict[str, float]:
    """Turns/s of `name` over those of 1 web process, round by round (same moment's load)."""
    return spread([r[name]["turns_per_s"] / r["1 web"]["turns_per_s"] for r in rounds])


def med(summary: dict[str, Any], key: str) -> float:
    return float(summary["cpu_ms_per_turn"][key]["median"])


def project_host(s: dict[str, Any]) -> dict[str, Any]:
    """One 16-core host, CPU per turn from the web+worker runs on one Valkey: with one Valkey
    on it (one core: Valkey runs commands on one thread), and with Redis elsewhere (keel on
    all 16 cores, and the Redis CPU that would need)."""
    web, worker, redis = med(s["web+worker"], "web"), med(s["web+worker"], "worker"), med(s["web+worker"], "redis")
    keel = web + worker
    keel_cap = (HOST_CORES - VALKEY_CORES) * 1000 / keel
    valkey_cap = VALKEY_CORES * 1000 / redis
    turns = min(keel_cap, valkey_cap)
    used = turns * keel / 1000  # keel cores busy at that rate
    webs = max(1, round(used * web / keel))
    alone = HOST_CORES * 1000 / keel  # keel on every core, Redis elsewhere
    alone_webs = round(HOST_CORES * web / keel)
    return {
        "cpu_ms_per_turn": {"web": web, "worker": worker, "valkey": redis},
        "valkey_share": round(redis / (keel + redis), 3),
        "keel_cap_turns_per_s": round(keel_cap),
        "valkey_cap_turns_per_s": round(valkey_cap),
        "turns_per_s": round(turns),
        "bound_by": "valkey" if valkey_cap < keel_cap else "keel",
        "keel_cores_used": round(used, 1),
        "web_processes": webs,
        "workers": max(1, math.ceil(used) - webs),
        "all_in_one_cap_turns_per_s": round((HOST_CORES - VALKEY_CORES) * 1000 / med(s["1 web"], "web")),
        "redis_elsewhere": {
            "turns_per_s": round(alone),
            "web_processes": alone_webs,
            "workers": HOST_CORES - alone_webs,
            "redis_cores_needed": round(alone * redis / 1000, 1),
        },
        "concurrent_turns_at_model_latency": round(turns * MODEL_TURN_S),
        "processes_for_that_concurrency": math.ceil(turns * MODEL_TURN_S / RUNNER_CONCURRENCY),
    }


def project_cluster(c: dict[str, Any]) -> dict[str, Any]:
    """3 primaries, each a node of its own (one core each for commands), replicas beside them;
    keel's CPU per turn as measured on the cluster (web+worker runs)."""
    ww = c["web+worker"]
    web, worker = med(ww, "web"), med(ww, "worker")
    primaries, busiest, replicas = (
        med(ww, "redis_primaries"),
        med(ww, "redis_busiest_primary"),
        med(ww, "redis_replicas"),
    )
    even = CLUSTER_PRIMARIES * 1000 / primaries
    skewed = 1000 / busiest
    keel_cores = even * (web + worker) / 1000
    return {
        "cpu_ms_per_turn": {"web": web, "worker": worker, "primaries": primaries, "replicas": replicas},
        "busiest_primary_ms_per_turn": busiest,
        "even_split_cap_turns_per_s": round(even),
        "measured_split_cap_turns_per_s": round(skewed),
        "keel_cores_needed": round(keel_cores, 1),
        "keel_hosts_of_16_cores": math.ceil(keel_cores / HOST_CORES),
        "replica_cores_at_cap": round(even * replicas / 1000 / CLUSTER_PRIMARIES, 2),
    }


def lines(
    summaries: dict[str, dict[str, Any]], growths: dict[str, Any], proj: dict[str, Any], rounds: int
) -> list[str]:
    out = []
    for redis, by_config in summaries.items():
        out.append(f"\n{redis}: median (min-max) of {rounds} rounds")
        out.append("config        turns/s              p50 ms            p99 ms             CPU ms/turn (median)")
        for name, s in by_config.items():
            cpu = ", ".join(f"{k} {v['median']}" for k, v in s["cpu_ms_per_turn"].items())
            tps, p50, p99 = _fmt(s["turns_per_s"], 0), _fmt(s["p50_ms"], 1), _fmt(s["p99_ms"], 1)
            out.append(f"{name:<12} {tps:<20} {p50:<17} {p99:<18} {cpu}")
            out.append(
                f"{'':<12} errors {s['errors']}, lost {s['lost']}, duplicated {s['duplicated']} of"
                f" {s['events_checked']:,} events; other load on the machine {_fmt(s['others_cores'], 2)} cores;"
                f" the CPU left allowed {_fmt(s['cpu_allowed_turns_per_s'], 0)} turns/s"
            )
        for name, g in growths[redis].items():
            out.append(f"growth 1 web -> {name}: x{_fmt(g, 2)}")
    if "host" in proj:
        h = proj["host"]
        out.append(
            f"\nprojection, one {HOST_CORES}-core host with one Valkey: keel could carry {h['keel_cap_turns_per_s']:,}"
            f" turns/s on {HOST_CORES - VALKEY_CORES} cores, Valkey {h['valkey_cap_turns_per_s']:,} on its core"
            f" ({h['valkey_share']:.0%} of a turn's CPU) -> {h['turns_per_s']:,} turns/s, bound by {h['bound_by']};"
            f" {h['web_processes']} web + {h['workers']} worker processes ({h['keel_cores_used']} cores)"
        )
        e = h["redis_elsewhere"]
        out.append(
            f"  with Redis elsewhere: {e['web_processes']} web + {e['workers']} worker processes carry"
            f" {e['turns_per_s']:,} turns/s, which needs {e['redis_cores_needed']} cores of Redis at this cost per turn"
        )
    if "cluster" in proj:
        c = proj["cluster"]
        out.append(
            f"projection, {CLUSTER_PRIMARIES} primaries: {c['even_split_cap_turns_per_s']:,} turns/s split evenly"
            f" ({c['measured_split_cap_turns_per_s']:,} with the busiest primary measured), fed by"
            f" {c['keel_cores_needed']} cores of keel ({c['keel_hosts_of_16_cores']} {HOST_CORES}-core hosts)"
        )
    return out


def _fmt(s: dict[str, float], digits: int) -> str:
    return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


def report(runs: dict[str, list[dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """Summaries, growth and projection of the runs, printed; the RESULT."""
    summaries = {r: {name: summarize([x[name] for x in rs]) for name in CONFIGS} for r, rs in runs.items()}
    growths = {r: {name: growth(rs, name) for name in ("2 web", "web+worker")} for r, rs in runs.items()}
    proj: dict[str, Any] = {}
    if "server" in summaries:
        proj["host"] = project_host(summaries["server"])
    if "cluster" in summaries:
        proj["cluster"] = project_cluster(summaries["cluster"])
    rounds = max(len(rs) for rs in runs.values())
    print("\n".join(lines(summaries, growths, proj, rounds)))
    return {"summaries": summaries, "growth": growths, "projection": proj, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="rounds per kind of Redis (default 3)")
    p.add_argument("--seconds", type=float, default=20.0, help="each run's measured phase (default 20)")
    p.add_argument("--redis", default="server,cluster", help="server, cluster or both (default)")
    p.add_argument("--http", type=int, default=Load.http, help=f"HTTP+SSE clients (default {Load.http})")
    p.add_argument("--ws", type=int, default=Load.ws, help=f"websocket clients (default {Load.ws})")
    p.add_argument("--report", type=Path, help="run nothing: summarize the runs of a saved RESULT (json)")
    args = p.parse_args(argv)
    kinds = [k for k in args.redis.split(",") if k]
    if args.repeat < 1 or not kinds or set(kinds) - {"server", "cluster"}:
        p.error("--repeat at least 1; --redis: server, cluster or both")
    if args.report is not None:
        saved = json.loads(args.report.read_text().removeprefix("RESULT "))
        print("RESULT " + json.dumps({"load": saved.get("load"), **report(saved["runs"])}), flush=True)
        return 0
    load = Load(args.http, args.ws, args.seconds)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {k: [] for k in kinds}
    with signals_exit():
        try:
            for redis in kinds:
                for n in range(args.repeat):
                    rounds: dict[str, dict[str, Any]] = {}
                    for name, (web, workers) in CONFIGS.items():
                        with Topology.start(web, workers, cluster=redis == "cluster", env=ENV) as topo:
                            rounds[name] = run(topo, load)
                        print(f"--- {redis}, round {n + 1}, {name}\n{show(rounds[name])}", flush=True)
                    runs[redis].append(rounds)
        except BenchError as exc:
            print(f"scaling: {exc}", file=sys.stderr)
            return 1
    result = {"load": {k: v for k, v in vars(args).items() if k != "report"}, **report(runs)}
    print("RESULT " + json.dumps(result), flush=True)
    summaries = result["summaries"]
    bad = sum(s["errors"] + s["lost"] + s["duplicated"] + s["problems"] for b in summaries.values() for s in b.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
