"""`make bench`: keel against its baselines, each ratio keel is held to, in one run.

    .venv/bin/python deploy/bench/suite.py [--runs 3] [--only inprocess,http,cluster,memory] [--readme]

1. in-process: the floor (deploy/bench/floor/bench_bare.py) and keel (bench_keel.py) on the
   peers' workload (floor/common.py), each in a fresh process on a fresh Valkey, alternating,
   --runs times: sequential p50 and turns/s at 50 sessions; keel/floor per run. Both processes
   have their garbage collector set as keel's own processes set theirs (settled.py).
2. HTTP: bench_http.py, --runs times (keel and the bare endpoint in each run, the bare one with
   keel's collector settings too): sequential p50 and turns/s at 100 sessions; keel/bare per run.
3. cluster: deploy/loadtest/load.py with one web process that runs turns, on one Valkey and on
   a Valkey Cluster (3 primaries, 3 replicas), alternating, --runs times: the web process's CPU
   per turn; cluster/one server per pair.
4. memory: session_memory.py, 2 sessions of 1,000 demo turns with the event and idempotency
   windows set to 2 s: the bytes a turn of the session's keys once the windows passed.

This machine is noisy: a ratio is taken within one run (or one alternating pair), and the
median of the runs' ratios is the figure. Writes deploy/bench/results.json (when, the commit,
the command, every run's figures, the medians, each target and whether it is met) and prints
the table; with --readme, README.md's benchmark table (between its `bench:` markers) is made
again from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from results import RESULTS, render, write_readme  # the sibling module  # noqa: E402
from support import BenchError, Deadline, start_valkey, stop_process  # noqa: E402

KINDS = ("inprocess", "http", "cluster", "memory")
CLUSTER_SECONDS = 8.0  # the measured phase of each load test


def result_line(out: str, what: str) -> dict[str, Any]:
    """The `RESULT {json}` line a benchmark printed last."""
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise BenchError(f"{what} printed no RESULT line:\n{out[-2000:]}")
    parsed: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return parsed


def run(argv: list[str], what: str, deadline: Deadline, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=deadline.left(900),
        check=False,
    )
    if proc.returncode != 0:
        raise BenchError(f"{what} exited {proc.returncode}:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return result_line(proc.stdout, what)


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


# ---- the four measurements -----------------------------------------------------------------


def inprocess(runs: int, deadline: Deadline) -> dict[str, Any]:
    env = {"PYTHONPATH": str(HERE / "floor")}
    rows = []
    for n in range(runs):
        row = {}
        for name, script in (("floor", HERE / "floor" / "bench_bare.py"), ("keel", HERE / "bench_keel.py")):
            with tempfile.TemporaryDirectory(prefix="keel-bench-") as tmp:
                valkey, port = start_valkey(Path(tmp), deadline)
                try:
                    # (both with the collector set as keel's processes set theirs: settled.py)
                    argv = [str(HERE / "settled.py"), str(script), "--port", str(port), "--datadir", tmp]
                    row[name] = run(argv, f"{name} in-process (run {n + 1})", deadline, env)
                finally:
                    stop_process(valkey)
        rows.append(row)
        say(
            f"in-process run {n + 1}: floor {row['floor']['seq_p50_ms']:.3f} ms, "
            f"{row['floor']['conc_turns_per_s']:,.0f}/s; keel {row['keel']['seq_p50_ms']:.3f} ms, "
            f"{row['keel']['conc_turns_per_s']:,.0f}/s"
        )
    seq = [r["keel"]["seq_p50_ms"] / r["floor"]["seq_p50_ms"] for r in rows]
    tps = [r["keel"]["conc_turns_per_s"] / r["floor"]["conc_turns_per_s"] for r in rows]
    return {
        "runs": [
            {
                who: {k: r[who][k] for k in ("seq_p50_ms", "conc_turns_per_s", "redis_cmds_per_turn")}
                for who in ("floor", "keel")
            }
            for r in rows
        ],
        "seq_p50_ratio": median(seq),
        "turns_per_s_ratio": median(tps),
        "keel_seq_p50_ms": median([r["keel"]["seq_p50_ms"] for r in rows]),
        "floor_seq_p50_ms": median([r["floor"]["seq_p50_ms"] for r in rows]),
        "keel_turns_per_s": median([r["keel"]["conc_turns_per_s"] for r in rows]),
        "floor_turns_per_s": median([r["floor"]["conc_turns_per_s"] for r in rows]),
    }


def http(runs: int, deadline: Deadline) -> dict[str, Any]:
    rows = []
    for n in range(runs):
        got = run([str(HERE / "bench_http.py")], f"bench_http (run {n + 1})", deadline)
        rows.append(got)
        r = got["ratio_keel_over_bare"]
        say(f"HTTP run {n + 1}: keel/bare seq p50 x{r['seq_p50']:.2f}, turns/s x{r['turns_per_s']:.2f}")
    keys = ("seq_p50_ms", "turns_per_s", "conc_server_cpu_ms_per_turn", "redis_cmds_per_turn")
    return {
        "runs": [{who: {k: r[who][k] for k in keys} for who in ("keel", "bare")} for r in rows],
        "seq_p50_ratio": median([r["ratio_keel_over_bare"]["seq_p50"] for r in rows]),
        "turns_per_s_ratio": median([r["ratio_keel_over_bare"]["turns_per_s"] for r in rows]),
        "keel_seq_p50_ms": median([r["keel"]["seq_p50_ms"] for r in rows]),
        "bare_seq_p50_ms": median([r["bare"]["seq_p50_ms"] for r in rows]),
        "keel_turns_per_s": median([r["keel"]["turns_per_s"] for r in rows]),
        "bare_turns_per_s": median([r["bare"]["turns_per_s"] for r in rows]),
        "keel_cpu_ms_per_turn": median([r["keel"]["conc_server_cpu_ms_per_turn"] for r in rows]),
    }


def cluster(runs: int, deadline: Deadline) -> dict[str, Any]:
    load = [str(REPO / "deploy" / "loadtest" / "load.py"), "--web", "1", "--seconds", str(CLUSTER_SECONDS)]
    rows = []
    for n in range(runs):
        one = run(load, f"load test on one Valkey (run {n + 1})", deadline)
        many = run([*load, "--cluster"], f"load test on a cluster (run {n + 1})", deadline)
        rows.append({"server": one, "cluster": many})
        say(
            f"cluster run {n + 1}: web CPU {one['cpu_ms_per_turn']['web']:.3f} ms a turn on one Valkey, "
            f"{many['cpu_ms_per_turn']['web']:.3f} on the cluster"
        )
    keys = ("turns_per_s", "p50_ms")
    return {
        "runs": [
            {
                where: {"web_cpu_ms_per_turn": r[where]["cpu_ms_per_turn"]["web"], **{k: r[where][k] for k in keys}}
                for where in ("server", "cluster")
            }
            for r in rows
        ],
        "cpu_ratio": median(
            [r["cluster"]["cpu_ms_per_turn"]["web"] / r["server"]["cpu_ms_per_turn"]["web"] for r in rows]
        ),
        "server_cpu_ms_per_turn": median([r["server"]["cpu_ms_per_turn"]["web"] for r in rows]),
        "cluster_cpu_ms_per_turn": median([r["cluster"]["cpu_ms_per_turn"]["web"] for r in rows]),
    }


def memory(runs: int, deadline: Deadline) -> dict[str, Any]:
    argv = [str(HERE / "session_memory.py"), "--idle", "0", "--hundred", "0", "--thousand", "2", "--windows", "2"]
    got = run(argv, "session_memory", deadline)
    per_turn = got["phases"]["1,000 turns"]["bytes_per_turn"]
    say(f"memory: {per_turn:,.0f} bytes a turn of a 1,000-turn session once the windows passed")
    return {"bytes_per_turn": round(per_turn, 1), "keys_per_session": got["phases"]["1,000 turns"]["keys_per_session"]}


MEASURES: dict[str, Callable[[int, Deadline], dict[str, Any]]] = {
    "inprocess": inprocess,
    "http": http,
    "cluster": cluster,
    "memory": memory,
}


def say(line: str) -> None:
    print(line, flush=True)


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=3, help="runs (pairs) of each, for the medians (default 3)")
    ap.add_argument("--only", default=",".join(KINDS), help="which, comma-separated (default all)")
    ap.add_argument("--readme", action="store_true", help="then make README.md's table again from the results")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole run (default 3600)")
    args = ap.parse_args()
    kinds = [k for k in args.only.split(",") if k]
    if unknown := [k for k in kinds if k not in KINDS] or args.runs < 1:
        ap.error(f"--only takes {', '.join(KINDS)} (not {unknown}); --runs at least 1")
    deadline = Deadline(args.deadline)
    began = time.perf_counter()
    previous: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": "make bench" if len(kinds) == len(KINDS) and args.runs == 3 else " ".join(sys.argv),
        "runs": args.runs,
        # (a measurement not made this time is kept as it was, with its own date and commit)
        **{k: previous[k] for k in KINDS if k in previous and k not in kinds},
    }
    try:
        for kind in kinds:
            results[kind] = {
                **MEASURES[kind](args.runs, deadline),
                "date": results["date"],
                "commit": results["commit"],
            }
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    say(f"\n{render(results)}\n")
    say(f"wrote {RESULTS.relative_to(REPO)} in {time.perf_counter() - began:.0f} s")
    if args.readme:
        write_readme(results)
        say("README.md's table made again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
