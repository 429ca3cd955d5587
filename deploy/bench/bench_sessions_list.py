"""What `GET /v1/sessions` costs beside `GET /v1/sessions/{id}`, for a key with 10,000 sessions:
keel (`python -m app`, two API keys) on a private Valkey; the sessions made through the API (32
at a time), each with metadata `{"n": i, "team": "t<i % 10>"}`, and a few hundred of a second
key besides. Then, in rounds, 300 sequential requests of each kind on one keep-alive connection,
the kinds' order turned each round: one session by id (the baseline), the first page, a deep
page (page 250 of 20, or the middle one below 10,000 sessions; its cursor found once), a page of
100, and a page filtered by `?metadata.team=t3`. Reports each kind's p50 and p99, their p50's
ratio to the baseline's, keel's CPU and Valkey's commands per request (medians over rounds), and
the Redis memory of the owner's index per session beside one session's meta hash. Pages are
checked as they come: only the key's own sessions, newest first, the whole list walked once. A
RESULT json line at the end.

    .venv/bin/python deploy/bench/bench_sessions_list.py [--sessions 10000] [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (this worktree's keel, not an installed one)

from support import (  # the sibling module: this file runs as a script
    HOST,
    BenchError,
    Conn,
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
    start_valkey,
    stop_all,
    wait_ready,
)

from channels.auth import owner_of
from harness.store.keys import OwnerKeys, SessionKeys

AGENT = "deploy.bench.agents:agent"
KEY, OTHER_KEY = "bench-sessions-key", "bench-other-key"
OTHER_SESSIONS = 300  # the second key's: never in the first key's list
CONCURRENCY = 32  # sessions made at a time
DEEP_PAGE = 250  # the deep page's number, at 20 a page (the middle one, when there are fewer than 500)
TEAM = "t3"
KINDS = ("by_id", "first_page", "deep_page", "page_of_100", "filtered")


async def open_conn(port: int, key: str) -> Conn:
    conn = await Conn.open(port)
    conn._host += f"Authorization: Bearer {key}\r\n"  # (support's client sends no headers of its own)
    return conn


async def get_json(conn: Conn, path: str) -> Any:
    status, body = await conn.request("GET", path)
    if status != 200:
        raise BenchError(f"GET {path}: {status} {body[:200]!r}")
    return json.loads(body)


async def make_sessions(port: int, n: int, n_other: int) -> tuple[list[str], set[str], float]:
    """`n` sessions of KEY and `n_other` of OTHER_KEY, mixed, CONCURRENCY at a time: KEY's ids
    in the order made, OTHER_KEY's, and the sessions made per second."""
    work: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    every = max(n // max(n_other, 1), 1)
    other_left = n_other
    for i in range(n):
        work.put_nowait((KEY, i))
        if i % every == 0 and other_left:
            work.put_nowait((OTHER_KEY, n_other - other_left))
            other_left -= 1
    for j in range(n_other - other_left, n_other):
        work.put_nowait((OTHER_KEY, j))
    mine: list[tuple[int, str]] = []
    theirs: set[str] = set()

    async def worker() -> None:
        conns = {KEY: await open_conn(port, KEY), OTHER_KEY: await open_conn(port, OTHER_KEY)}
        try:
            while not work.empty():
                key, i = work.get_nowait()
                body = json.dumps({"metadata": {"n": i, "team": f"t{i % 10}"}}).encode()
                status, raw = await conns[key].request("POST", "/v1/sessions", body)
                if status != 201:
                    raise BenchError(f"POST /v1/sessions: {status} {raw[:200]!r}")
                sid = json.loads(raw)["session_id"]
                if key == KEY:
                    mine.append((i, sid))
                else:
                    theirs.add(sid)
        finally:
            for c in conns.values():
                await c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    took = time.perf_counter() - t0
    return [sid for _, sid in sorted(mine)], theirs, (n + n_other) / took


def check_page(page: dict[str, Any], mine: set[str], limit: int, team: str | None = None) -> None:
    """A page holds only KEY's sessions (of `team`, when filtered), newest first, `limit` of them
    when it has a next (unfiltered)."""
    items = page["items"]
    if team is None and page["next_cursor"] is not None and len(items) != limit:
        raise BenchError(f"a page of {len(items)} items, {limit} asked, with a next")
    stray = [it["session_id"] for it in items if it["session_id"] not in mine]
    if stray:
        raise BenchError(f"another key's sessions (or unknown ones) listed: {stray[:3]}")
    ms = [int(it["updated_at"] * 1000) for it in items]  # (the list is ordered by ms, ties by id)
    if any(a < b for a, b in itertools.pairwise(ms)):
        raise BenchError(f"a page out of order: {ms}")
    if team is not None and any(it["metadata"].get("team") != team for it in items):
        raise BenchError(f"a filtered page with another team: {[it['metadata'] for it in items]}")


async def walk(conn: Conn, mine: set[str], deep_page: int) -> str:
    """The whole list, 100 a page, checked (each of KEY's sessions exactly once); and then the
    cursor of page `deep_page` at 20 a page, followed there page by page."""
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page = await get_json(conn, "/v1/sessions?limit=100" + (f"&cursor={cursor}" if cursor else ""))
        check_page(page, mine, 100)
        seen += [it["session_id"] for it in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    if len(seen) != len(mine) or set(seen) != mine:
        raise BenchError(f"a walk gave {len(seen)} items, {len(set(seen))} distinct, of {len(mine)} sessions")
    deep: str | None = None
    for _ in range(deep_page - 1):
        page = await get_json(conn, "/v1/sessions" + (f"?cursor={deep}" if deep else ""))
        check_page(page, mine, 20)
        deep = page["next_cursor"]
        if deep is None:
            break
    if deep is None:
        raise BenchError(f"fewer than {deep_page} pages of 20")
    return deep


async def command_calls(valkey: Redis) -> dict[str, int]:
    """Valkey's commands run so far, by name, less the INFO calls that ask."""
    stats: dict[str, Any] = await valkey.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if k != "cmdstat_info"}


async def timed(
    conn: Conn, paths: list[str], check: Any, *, keel: Server, valkey: Redis, valkey_pid: int
) -> dict[str, float]:
    """The requests in turn: their p50 and p99 (ms); per request, keel's and Valkey's CPU (ms),
    Valkey's commands and ZRANGEs (a page's batches of entries, each then read in one more round
    trip), the body's size (bytes)."""
    for path in paths[:10]:  # warm up
        await get_json(conn, path)
    took: list[float] = []
    size = 0
    calls0 = await command_calls(valkey)
    cpu0, vcpu0 = cpu_seconds(keel.pid), cpu_seconds(valkey_pid)
    for path in paths:
        t0 = time.perf_counter()
        status, body = await conn.request("GET", path)
        took.append((time.perf_counter() - t0) * 1000)
        if status != 200:
            raise BenchError(f"GET {path}: {status} {body[:200]!r}")
        size += len(body)
        check(json.loads(body))
    cpu, vcpu = cpu_seconds(keel.pid) - cpu0, cpu_seconds(valkey_pid) - vcpu0
    calls = await command_calls(valkey)
    n = len(paths)
    return {
        "p50_ms": percentile(took, 50),
        "p99_ms": percentile(took, 99),
        "keel_cpu_ms": cpu * 1000 / n,
        "valkey_cpu_ms": vcpu * 1000 / n,
        "valkey_cmds": (sum(calls.values()) - sum(calls0.values())) / n,
        "zrange_calls": (calls.get("zrange", 0) - calls0.get("zrange", 0)) / n,
        "bytes": size / n,
    }


async def memory(valkey: Redis, owner: str, sids: list[str], n: int) -> dict[str, float]:
    """The owner's index (its sorted set) per session, beside one session's meta hash (the
    median of a few), in bytes."""
    index = await valkey.memory_usage(OwnerKeys(owner).sessions, samples=0)
    metas = [await valkey.memory_usage(SessionKeys(sid).meta, samples=0) for sid in random.sample(sids, 9)]
    return {
        "index_bytes": float(index or 0),
        "index_bytes_per_session": (index or 0) / n,
        "meta_bytes_per_session": float(statistics.median(m or 0 for m in metas)),
        "index_entries": float(await valkey.zcard(OwnerKeys(owner).sessions)),
    }


async def bench(
    keel: Server, valkey_port: int, valkey_pid: int, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, dict[str, float]]]]:
    sids, others, rate = await make_sessions(keel.port, args.sessions, OTHER_SESSIONS)
    mine = set(sids)
    valkey = Redis(host=HOST, port=valkey_port)
    conn = await open_conn(keel.port, KEY)
    try:
        other_conn = await open_conn(keel.port, OTHER_KEY)
        theirs = await get_json(other_conn, "/v1/sessions?limit=100")
        await other_conn.close()
        if not {it["session_id"] for it in theirs["items"]} <= others:
            raise BenchError("the second key's list holds sessions that are not its own")
        first = await get_json(conn, "/v1/sessions")
        if len(first["items"]) != 20:
            raise BenchError(f"the first page has {len(first['items'])} items")
        check_page(first, mine, 20)
        deep = await walk(conn, mine, deep_page_of(args.sessions))
        setup = {"made_per_s": rate} | await memory(valkey, owner_of(KEY), sids, args.sessions)
        rng = random.Random(7)
        n = args.requests

        def plain(page: dict[str, Any]) -> None:
            check_page(page, mine, 20)

        def hundred(page: dict[str, Any]) -> None:
            check_page(page, mine, 100)

        def filtered(page: dict[str, Any]) -> None:
            check_page(page, mine, 20, TEAM)

        def one(info: dict[str, Any]) -> None:
            if info["metadata"].get("team") is None:
                raise BenchError(f"a session without its metadata: {info}")

        kinds: dict[str, tuple[Any, Any]] = {
            "by_id": (lambda: [f"/v1/sessions/{rng.choice(sids)}" for _ in range(n)], one),
            "first_page": (lambda: ["/v1/sessions"] * n, plain),
            "deep_page": (lambda: [f"/v1/sessions?cursor={deep}"] * n, plain),
            "page_of_100": (lambda: ["/v1/sessions?limit=100"] * n, hundred),
            "filtered": (lambda: [f"/v1/sessions?metadata.team={TEAM}"] * n, filtered),
        }
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            this: dict[str, dict[str, float]] = {}
            for kind in order:
                paths, check = kinds[kind]
                this[kind] = await timed(conn, paths(), check, keel=keel, valkey=valkey, valkey_pid=valkey_pid)
                keel.check_alive()
            rounds.append(this)
        return setup, rounds
    finally:
        await conn.close()
        await valkey.aclose()


def deep_page_of(sessions: int) -> int:
    return min(DEEP_PAGE, max(sessions // 40, 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=positive, default=10_000)
    p.add_argument("--requests", type=positive, default=300)
    p.add_argument("--rounds", type=positive, default=3)
    args = p.parse_args()
    if args.sessions < 60:
        p.error("--sessions is at least 60 (a deep page needs three pages of 20)")
    signal.signal(signal.SIGTERM, on_signal)
    deadline = Deadline(600)
    work = Path(tempfile.mkdtemp(prefix="keel-bench-sessions-list-"))
    valkey = None
    keel = Server("keel", free_port(), work / "keel.log")
    try:
        valkey, port = start_valkey(work, deadline)
        (work / "keel").mkdir()
        keel.start(
            [sys.executable, "-m", "app"],
            keel_env(port, keel, work / "keel", AGENT, {"KEEL_API_KEYS": f"{KEY},{OTHER_KEY}"}),
        )
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(wait_ready(keel, deadline))
            setup, rounds = runner.run(asyncio.wait_for(bench(keel, port, valkey.pid, args), deadline.left()))
    except (BenchError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        return show_failure("bench_sessions_list", exc, [keel])
    finally:
        stop_all([keel], valkey)
    fields = ("p50_ms", "p99_ms", "keel_cpu_ms", "valkey_cpu_ms", "valkey_cmds", "zrange_calls", "bytes")
    out: dict[str, Any] = {"sessions": args.sessions, "requests": args.requests, "rounds": args.rounds}
    out["deep_page_number"] = deep_page_of(args.sessions)
    out["setup"] = {k: round(v, 1) for k, v in setup.items()}
    for kind in KINDS:
        out[kind] = {f: round(statistics.median(r[kind][f] for r in rounds), 3) for f in fields}
    base = out["by_id"]["p50_ms"]
    out["p50_ratio"] = {kind: round(out[kind]["p50_ms"] / base, 2) for kind in KINDS}
    print(
        f"{'request':<13}{'p50 ms':>8}{'p99 ms':>8}{'x by_id':>8}{'keel CPU ms':>12}{'Valkey CPU':>11}"
        f"{'commands':>9}{'ZRANGEs':>8}{'bytes':>7}"
    )
    for kind in KINDS:
        m = out[kind]
        print(
            f"{kind:<13}{m['p50_ms']:>8.3f}{m['p99_ms']:>8.3f}{out['p50_ratio'][kind]:>8.2f}{m['keel_cpu_ms']:>12.3f}"
            f"{m['valkey_cpu_ms']:>11.3f}{m['valkey_cmds']:>9.1f}{m['zrange_calls']:>8.1f}{m['bytes']:>7.0f}"
        )
    s = out["setup"]
    print(
        f"made {args.sessions + OTHER_SESSIONS} sessions at {s['made_per_s']:.0f}/s; the owner's index: "
        f"{s['index_bytes_per_session']:.1f} bytes a session ({s['index_bytes']:.0f} in all), one meta hash "
        f"{s['meta_bytes_per_session']:.0f} bytes"
    )
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
