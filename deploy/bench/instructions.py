"""Python instructions per turn, counted by callgrind: repeatable where timings on this machine
are not (the same count whatever else runs, for sequential turns).

    python deploy/bench/instructions.py [--mode plain|tool|http] [--short 100] [--long 900]
    python deploy/bench/instructions.py --side valkey [--mode plain|tool] ...
    python deploy/bench/instructions.py --redis cluster [--mode plain|tool|http] ...

Each mode runs keel twice under `valgrind --tool=callgrind`, once for --short turns and once for
--long, against a private Valkey (not under valgrind), and prints the difference divided by the
difference in turns: what one more turn costs, start-up and imports subtracted. With `--side
valkey` it is the other way round: a fresh private Valkey under callgrind for each run, keel
in-process and not counted: the server's instructions a turn (its scripts, the commands, the
append-only file, its network reads and writes).

- plain: in-process, one session, sequential `submit_and_wait` turns (as bench_keel.py);
- tool: the same with one tool call a turn;
- http: `python -m app` with the benchmark agent, driven over HTTP by a client outside valgrind:
  sequential `POST /v1/sessions/{id}/messages?wait=true` turns, counted in the web process.

`--redis cluster` runs keel's side against a Valkey Cluster of 3 primaries (no replicas) instead
of one Valkey: with the count on one Valkey, what a cluster's routing costs a turn.

Needs Debian's valgrind. One RESULT line: {"mode", "turns", "instructions_per_turn"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents import add, plain, with_tool  # the sibling module  # noqa: E402
from support import Deadline, free_port, start_valkey, stop_process  # the sibling module  # noqa: E402

from app import build_harness  # noqa: E402
from app.settings import Settings  # noqa: E402
from harness import Agent  # noqa: E402
from harness.models import ScriptedModel  # noqa: E402
from tests.cluster import ValkeyCluster  # noqa: E402

COLLECTED = re.compile(r"Collected : (\d+)")


async def drive(mode: str, turns: int, port: int) -> None:
    """The counted process: `turns` sequential turns in-process."""
    agent = Agent(instructions="t", tools=[add], model=ScriptedModel(with_tool if mode == "tool" else plain, keep=0))
    harness = build_harness(Settings(), f"redis://127.0.0.1:{port}", agent)
    await harness.redis.flushall()
    await harness.start()
    try:
        sid = await harness.sessions.create("bench")
        for _ in range(turns):
            turn = await harness.sessions.submit_and_wait(
                sid, "bench", "hello", context=None, message_id=None, timeout=60
            )
            assert turn.status == "completed", turn
    finally:
        await harness.stop()


def counted(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    callgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    return subprocess.Popen([*callgrind, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def instructions(log: Path) -> int:
    found = COLLECTED.search(log.read_text(errors="replace"))
    if found is None:
        raise SystemExit(f"callgrind counted nothing:\n{log.read_text(errors='replace')[-2000:]}")
    return int(found.group(1))


def in_process(mode: str, turns: int, port: int, log: Path) -> int:
    argv = [sys.executable, __file__, "--drive", mode, "--turns", str(turns), "--port", str(port)]
    proc = counted(argv, dict(os.environ), log)
    if proc.wait() != 0:
        raise SystemExit(f"the driver failed:\n{log.read_text(errors='replace')[-2000:]}")
    return instructions(log)


def valkey_side(mode: str, turns: int, data: Path) -> int:
    """A fresh Valkey under callgrind, `turns` turns driven at it in-process: its count."""
    log = data / f"valkey-callgrind-{turns}.log"
    store = data / f"valkey-{turns}"
    store.mkdir()
    prefix = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", f"--log-file={log}"]
    valkey, port = start_valkey(store, Deadline(600), prefix=prefix)
    try:
        asyncio.run(drive(mode, turns, port))
    finally:
        stop_process(valkey)  # (it shuts down on SIGTERM: callgrind writes its count)
    return instructions(log)


def over_http(turns: int, port: int, log: Path) -> int:
    web = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_") and k != "REDIS_URL"}
    env |= {"REDIS_URL": f"redis://127.0.0.1:{port}", "KEEL_HOST": "127.0.0.1", "KEEL_PORT": str(web)}
    env |= {"KEEL_LOG_LEVEL": "warning", "KEEL_AGENT": "deploy.bench.agents:agent"}
    proc = counted([sys.executable, "-m", "app"], env, log)
    base = f"http://127.0.0.1:{web}"
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            deadline = time.monotonic() + 300
            while True:  # (valgrind starts Python slowly)
                try:
                    if c.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.5)
            c.post("/v1/sessions", json={})  # (warm)
            sid = c.post("/v1/sessions").json()["session_id"]
            for _ in range(turns):
                r = c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hello"})
                assert r.json()["status"] == "completed", r.text
        proc.send_signal(signal.SIGTERM)  # it drains and exits: callgrind writes its count
        proc.wait(timeout=300)
    finally:
        stop_process(proc)
    return instructions(log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mode", choices=["plain", "tool", "http"], default="plain")
    ap.add_argument("--side", choices=["keel", "valkey"], default="keel", help="whose instructions (default keel)")
    ap.add_argument(
        "--redis", choices=["server", "cluster"], default="server", help="keel's side against (default server)"
    )
    ap.add_argument("--short", type=int, default=100, help="turns of the shorter run")
    ap.add_argument("--long", type=int, default=900, help="turns of the longer run")
    ap.add_argument("--drive", choices=["plain", "tool"], help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        asyncio.run(drive(args.drive, args.turns, args.port))
        return 0
    if shutil.which("valgrind") is None:
        print("needs valgrind (Debian's package valgrind)", file=sys.stderr)
        return 2
    if args.side == "valkey" and args.redis == "cluster":
        print("--side valkey counts one Valkey: not with --redis cluster", file=sys.stderr)
        return 2
    if args.side == "valkey" and args.mode == "http":
        print("--side valkey counts in-process turns: --mode plain or tool", file=sys.stderr)
        return 2
    data = Path(tempfile.mkdtemp(prefix="keel-instr-"))
    if args.side == "valkey":
        try:
            counts = [valkey_side(args.mode, n, data) for n in (args.short, args.long)]
        finally:
            shutil.rmtree(data, ignore_errors=True)
        return report(args, counts)
    cluster = ValkeyCluster(primaries=3, replicas_each=0) if args.redis == "cluster" else None
    if cluster is not None:
        cluster.start()
        port = cluster.primaries[0]  # (any node's address: keel asks it for the others)
    else:
        valkey, port = start_valkey(data, Deadline(600))
    try:
        counts = []
        for n in (args.short, args.long):
            log = data / f"callgrind-{n}.log"
            counts.append(over_http(n, port, log) if args.mode == "http" else in_process(args.mode, n, port, log))
    finally:
        if cluster is not None:
            cluster.stop()
        else:
            stop_process(valkey)
        shutil.rmtree(data, ignore_errors=True)
    return report(args, counts)


def report(args: argparse.Namespace, counts: list[int]) -> int:
    per_turn = (counts[1] - counts[0]) / (args.long - args.short)
    whose = ("" if args.side == "keel" else f" ({args.side})") + (" on a cluster" if args.redis == "cluster" else "")
    print(f"{args.mode}{whose}: {per_turn / 1e6:.2f} M instructions per turn ({args.short} and {args.long} turns)")
    result = {
        "mode": args.mode,
        "side": args.side,
        "redis": args.redis,
        "turns": args.long - args.short,
        "instructions_per_turn": per_turn,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
