"""Outbound event webhook benchmark: every committed event of 100 sessions x 20 turns delivered
to one subscriber, with a healthy receiver and with one that fails a share of its requests.

    python deploy/bench/bench_delivery.py [--sessions 100] [--turns 20] [--fail 0.2] [--json PATH]

Each phase (healthy, then failing) runs on a fresh stack: a private Valkey, a receiver in a
process of its own (Starlette on uvicorn: it verifies every request with `standardwebhooks`,
answers 500 to a seeded random --fail share of the valid ones, 200 to the rest, and records
webhook-id, wall time and status) and keel (`python -m app`, the zero-latency agent in
`deploy.bench.agents`, `KEEL_WEBHOOK_ALLOW_PRIVATE=1`). One subscription, events `["*"]`, points
at the receiver; then every session runs its turns in sequence (`POST .../messages?wait=true`),
the sessions all at once over --connections keep-alive connections. The events committed are
read from each session's outbox in Valkey; the run waits (bounded) until the receiver accepted
them all. Lag runs from the commit (the ms part of the event id: Redis's clock, this machine's
wall clock) to the receiver's 2xx; deliveries/s is the accepted deliveries over the time from
the first accept to the last. keel's CPU is given over the whole phase (turns and deliveries)
and over the drain after the load (deliveries alone). Retry wait: per session, the seconds from
each 500 to that event's next attempt, summed; deliveries keep session order, so a session's
later events wait behind it too (it bounds the failing phase's lag). --fail 1 is a receiver
that is down (everything missing after the drain timeout).

It prints a table and one `RESULT {json}` line (--json PATH writes it too). A missing event,
an invalid signature, a body that is not its webhook-id's event, a delivery out of session
order or a failed turn makes the exit status 1. Everything is bounded by --deadline seconds;
every process started here is stopped in a `finally`."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from redis.asyncio import Redis
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from support import (  # the sibling module: this file runs as a script
    HOST,
    BenchError,
    Conn,
    Deadline,
    Server,
    cpu_seconds,
    free_port,
    keel_env,
    log_tail,
    new_loop,
    on_signal,
    percentile,
    positive,
    server_env,
    start_valkey,
    stop_all,
    wait_ready,
)

AGENT = "deploy.bench.agents:agent"
API_KEY = "bench"
REQUEST_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 300.0  # after the load: every committed event accepted by then
SETTLE_S = 1.0  # after the last delivery: a straggling duplicate is still counted


# ---- the receiver (its own process: --serve receiver) -------------------------------------------


def receiver_app(fail: float, seed: int) -> Starlette:
    rng = random.Random(seed)
    records: list[tuple[str, float, int]] = []  # (webhook-id, wall time of the answer, status)
    accepted: set[str] = set()
    bad: Counter[str] = Counter()
    signer: list[Webhook] = []  # set by the bench once the subscription exists

    async def hook(request: Request) -> Response:
        body = await request.body()
        try:
            signer[0].verify(body, dict(request.headers))  # (an IndexError before the secret came)
        except Exception:
            bad["invalid"] += 1
            return Response(status_code=400)
        wid = request.headers["webhook-id"]
        envelope = json.loads(body)
        if wid != f"{envelope.get('session_id')}:{envelope.get('id')}":
            bad["mismatched"] += 1  # answered 200: a retry would carry the same body
        status = 500 if rng.random() < fail else 200
        records.append((wid, time.time(), status))
        if status == 200:
            accepted.add(wid)
        return Response(status_code=status)

    async def secret(request: Request) -> Response:
        signer[:] = [Webhook((await request.json())["secret"])]
        return JSONResponse({"ok": True})

    async def stats(request: Request) -> Response:
        out: dict[str, Any] = {"accepted": len(accepted), "attempts": len(records), **bad}
        if request.query_params.get("records"):
            out["records"] = records
        return JSONResponse(out)

    async def readyz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [Route("/hook", hook, methods=["POST"]), Route("/bench/secret", secret, methods=["POST"])]
    return Starlette(routes=[*routes, Route("/bench/stats", stats), Route("/readyz", readyz)])


# ---- the load -----------------------------------------------------------------------------------


async def open_conn(port: int, auth: bool = True) -> Conn:
    conn = await Conn.open(port)
    if auth:  # (support's client sends no headers of its own: the API key rides with Host)
        conn._host += f"Authorization: Bearer {API_KEY}\r\n"
    return conn


class Pool:
    """Keep-alive connections to keel, one request at a time on each (opened when first needed)."""

    def __init__(self, port: int, size: int) -> None:
        self.port = port
        self.free: asyncio.Queue[Conn | None] = asyncio.Queue()
        for _ in range(size):
            self.free.put_nowait(None)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = await self.free.get()
        try:
            conn = conn or await open_conn(self.port)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status, raw = await conn.request(method, path, json.dumps(body).encode() if body is not None else b"")
            return status, json.loads(raw) if raw else None
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, BenchError):
            if conn is not None:
                await conn.close()
            conn = None  # a fresh connection next time
            raise
        finally:
            self.free.put_nowait(conn)

    async def close(self) -> None:
        while not self.free.empty():
            if (c := self.free.get_nowait()) is not None:
                await c.close()


@dataclass
class Phase:
    name: str
    fail: float
    sessions: list[str] = field(default_factory=list)
    turns: int = 0  # turns that completed
    turn_ms: list[float] = field(default_factory=list)
    reported: int = 0  # events the wait=true answers carried, plus session.created
    errors: list[str] = field(default_factory=list)
    committed: dict[str, list[str]] = field(default_factory=dict)  # session -> its outbox's event ids
    receiver: dict[str, Any] = field(default_factory=dict)  # the receiver's stats and records
    at: dict[str, float] = field(default_factory=dict)  # times, CPU seconds, counts at the marks below
    drained: bool = False

    def mark(self, name: str, keel: Server, receiver: Server, accepted: int = 0) -> None:
        self.at |= {f"{name}_t": time.monotonic(), f"{name}_wall": time.time(), f"{name}_accepted": accepted}
        self.at |= {f"{name}_cpu": cpu_seconds(keel.pid), f"{name}_rcpu": cpu_seconds(receiver.pid)}


async def one_session(pool: Pool, phase: Phase, turns: int) -> None:
    try:
        status, body = await pool.call("POST", "/v1/sessions", {})
        if status != 201:
            raise BenchError(f"POST /v1/sessions -> {status} {body}")
        sid = str(body["session_id"])
        phase.sessions.append(sid)
        phase.reported += 1  # session.created
        for t in range(turns):
            start = time.perf_counter()
            status, body = await pool.call("POST", f"/v1/sessions/{sid}/messages?wait=true", {"text": f"turn {t}"})
            if status != 200 or body.get("status") != "completed":
                phase.errors.append(f"turn {t} of {sid}: {status} {str(body)[:200]}")
                continue
            phase.turn_ms.append((time.perf_counter() - start) * 1000.0)
            phase.turns += 1
            phase.reported += len(body["events"])
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, BenchError) as exc:
        phase.errors.append(f"{type(exc).__name__}: {exc}"[:200])


async def outboxes(redis: Redis, sessions: list[str]) -> dict[str, list[str]]:
    """Every session's committed event ids, oldest first (from the outbox stream in Valkey)."""
    pipe = redis.pipeline(transaction=False)
    for sid in sessions:
        pipe.xrange(f"keel:{{{sid}}}:outbox")
    replies = await pipe.execute()
    return {sid: [i.decode() for i, _ in r] for sid, r in zip(sessions, replies, strict=True)}


async def receiver_call(receiver: Server, method: str, path: str, body: bytes = b"") -> dict[str, Any]:
    conn = await open_conn(receiver.port, auth=False)
    try:
        status, raw = await asyncio.wait_for(conn.request(method, path, body), 30.0)
    finally:
        await conn.close()
    if status != 200:
        raise BenchError(f"receiver {method} {path} -> {status} {raw[:200]!r}")
    out: dict[str, Any] = json.loads(raw)
    return out


async def measure(phase: Phase, keel: Server, receiver: Server, valkey_port: int, args: argparse.Namespace) -> None:
    deadline: Deadline = args.deadline_obj
    for s in (receiver, keel):
        await wait_ready(s, deadline)
    pool = Pool(keel.port, args.connections)
    redis = Redis(host=HOST, port=valkey_port)
    try:
        url = f"http://{HOST}:{receiver.port}/hook"
        status, sub = await pool.call("POST", "/v1/webhooks", {"url": url, "events": ["*"]})
        if status != 201:
            raise BenchError(f"POST /v1/webhooks -> {status} {sub}")
        await receiver_call(receiver, "POST", "/bench/secret", json.dumps({"secret": sub["secret"]}).encode())
        phase.mark("start", keel, receiver)
        async with asyncio.timeout(deadline.left()):
            await asyncio.gather(*(one_session(pool, phase, args.turns) for _ in range(args.sessions)))
        phase.mark("load", keel, receiver, (await receiver_call(receiver, "GET", "/bench/stats"))["accepted"])
        end = time.monotonic() + deadline.left(DRAIN_TIMEOUT_S)
        while True:  # until every committed event is accepted (session.waiting may commit late: read again)
            keel.check_alive()
            receiver.check_alive()
            accepted = (await receiver_call(receiver, "GET", "/bench/stats"))["accepted"]
            if accepted >= sum(map(len, phase.committed.values())):
                phase.committed = await outboxes(redis, phase.sessions)
                phase.drained = accepted >= sum(map(len, phase.committed.values()))
                if phase.drained:
                    break
            if time.monotonic() > end:
                break
            await asyncio.sleep(0.2)
        phase.mark("drained", keel, receiver, accepted)
        await asyncio.sleep(SETTLE_S)
        phase.committed = await outboxes(redis, phase.sessions)
        phase.receiver = await receiver_call(receiver, "GET", "/bench/stats?records=1")
    finally:
        await pool.close()
        await redis.aclose()


# ---- the figures --------------------------------------------------------------------------------


def event_key(event_id: str) -> tuple[int, int]:
    ms, _, n = event_id.partition("-")
    return int(ms), int(n)


def figures(phase: Phase) -> dict[str, Any]:
    expected = {f"{sid}:{e}" for sid, ids in phase.committed.items() for e in ids}
    first: dict[str, float] = {}  # webhook-id -> its first accept
    accepts: Counter[str] = Counter()
    last: dict[str, tuple[int, int]] = {}  # session -> the newest event accepted so far
    out_of_order = 0
    failed_at: dict[str, float] = {}  # webhook-id -> its last 500
    retry_wait: dict[str, float] = defaultdict(float)  # session -> seconds its deliveries waited after 500s
    failed = 0
    for wid, at, status in phase.receiver["records"]:
        sid, _, eid = wid.rpartition(":")
        if wid in failed_at:
            retry_wait[sid] += at - failed_at.pop(wid)
        if status != 200:
            failed += 1
            failed_at[wid] = at
            continue
        accepts[wid] += 1
        first.setdefault(wid, at)
        key = event_key(eid)
        out_of_order += key < last.get(sid, (0, 0))  # (a duplicate of an older event counts too)
        last[sid] = max(key, last.get(sid, (0, 0)))
    lags = [(at - event_key(w.rpartition(":")[2])[0] / 1000.0) * 1000.0 for w, at in first.items() if w in expected]
    nan = float("nan")
    lags = lags or [nan]
    times = sorted(first.values())
    waits = [retry_wait.get(sid, 0.0) for sid in phase.sessions] or [0.0]
    delivered, m = len(expected & first.keys()), phase.at
    out: dict[str, Any] = {"phase": phase.name, "fail_share": phase.fail, "sessions": len(phase.sessions)}
    out |= {"turns": phase.turns, "turn_errors": len(phase.errors)}
    out["turn_p50_ms"] = statistics.median(phase.turn_ms or [nan])
    out |= {"events_committed": len(expected), "events_reported": phase.reported, "events_delivered": delivered}
    out |= {"missing": len(expected) - delivered, "unexpected": len(first.keys() - expected)}
    out |= {"duplicates": sum(n - 1 for n in accepts.values()), "out_of_order": out_of_order}
    rx = phase.receiver
    out |= {"invalid_signatures": rx.get("invalid", 0), "mismatched_bodies": rx.get("mismatched", 0)}
    out |= {"attempts": rx["attempts"], "answered_500": failed}
    out |= {"retry_wait_per_session_p50_s": statistics.median(waits), "retry_wait_per_session_max_s": max(waits)}
    out |= {"lag_p50_ms": statistics.median(lags), "lag_p99_ms": percentile(lags, 99), "lag_max_ms": max(lags)}
    out["deliveries_per_s"] = len(first) / (times[-1] - times[0]) if len(times) > 1 else nan
    cpu, after_load = m["drained_cpu"] - m["start_cpu"], m["drained_accepted"] - m["load_accepted"]
    out |= {"keel_cpu_ms_per_turn": cpu * 1000.0 / max(phase.turns, 1)}
    out |= {"keel_cpu_ms_per_delivery": cpu * 1000.0 / delivered if delivered else nan}
    drain_cpu = (m["drained_cpu"] - m["load_cpu"]) * 1000.0
    out["keel_cpu_ms_per_delivery_drain"] = drain_cpu / after_load if after_load else nan
    out["receiver_cpu_s"] = m["drained_rcpu"] - m["start_rcpu"]
    out |= {"delivered_during_load": m["load_accepted"], "load_s": m["load_t"] - m["start_t"]}
    out["drain_s"] = times[-1] - m["load_wall"] if times else nan  # from the end of the load to the last 2xx
    out |= {"wall_s": m["drained_t"] - m["start_t"], "drained": phase.drained}
    return out


ROWS = """
turns              d    turns completed
turn_errors        d    turn errors
turn_p50_ms        .1f  turn p50 (ms, wait=true)
events_committed   d    events committed (outboxes)
events_reported    d    events in wait answers + created
events_delivered   d    events delivered (distinct 2xx)
missing            d    missing
duplicates         d    duplicates (2xx more than once)
out_of_order       d    out of order (per session)
invalid_signatures d    invalid signatures
attempts           d    requests to the receiver
answered_500       d    answered 500
retry_wait_per_session_p50_s .2f retry wait per session p50 (s)
retry_wait_per_session_max_s .2f retry wait per session max (s)
lag_p50_ms         .1f  lag p50 (ms, commit -> 2xx)
lag_p99_ms         .1f  lag p99 (ms)
lag_max_ms         .1f  lag max (ms)
deliveries_per_s   .0f  deliveries/s (first -> last 2xx)
delivered_during_load d delivered during the load
keel_cpu_ms_per_turn .2f keel CPU ms per turn (+deliveries)
keel_cpu_ms_per_delivery .3f keel CPU ms per delivery (+turns)
keel_cpu_ms_per_delivery_drain .3f keel CPU ms per delivery, drain only
receiver_cpu_s     .1f  receiver CPU (s)
load_s             .1f  load (s)
drain_s            .1f  last 2xx after the load (s)
wall_s             .1f  wall (s)
"""


def report(phases: list[Phase], args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    rows = [figures(p) for p in phases]
    print(f"\n{args.sessions} sessions x {args.turns} turns (wait=true, {args.connections} connections), one")
    print("subscription (events *); a fresh Valkey, keel and receiver per phase\n")
    heads = [f"{r['phase']} ({r['fail_share']:.0%} 500)" for r in rows]
    print(f"{'':<36}" + "".join(f"{h:>22}" for h in heads))
    for key, fmt, label in (line.split(maxsplit=2) for line in ROWS.strip().splitlines()):
        print(f"{label:<36}" + "".join(f"{format(r[key], fmt):>22}" for r in rows))
    problems = {"turn_errors": "failed turns", "missing": "events never accepted", "unexpected": "ids in no outbox"}
    problems |= {"out_of_order": "deliveries out of session order", "invalid_signatures": "invalid signatures"}
    problems["mismatched_bodies"] = "bodies that are not their webhook-id's event"
    bad = False
    for r in rows:
        for key, what in problems.items():
            if r[key]:
                bad = True
                print(f"FAIL: {r['phase']}: {r[key]} {what}")
        if r["duplicates"]:
            print(f"NOTE: {r['phase']}: {r['duplicates']} event(s) accepted more than once (at least once)")
        if not r["drained"]:
            print(f"NOTE: {r['phase']}: not every event was accepted within {DRAIN_TIMEOUT_S:g} s")
    print("(lag: the receiver's clock at its 2xx minus the event id's ms; retry wait: per session, the seconds")
    print(" from each 500 to that event's next try, summed; keel CPU: the whole phase, or the drain alone)")
    config = {k: getattr(args, k) for k in ("sessions", "turns", "connections", "fail", "seed")}
    out = {"command": args.command, "config": config, "phases": rows}
    print("RESULT " + json.dumps(out), flush=True)
    for p in phases:
        for e in p.errors[:3]:
            print(f"error ({p.name}): {e}", file=sys.stderr)
    return out, bad


# ---- a run --------------------------------------------------------------------------------------


def run_phase(phase: Phase, tmp: Path, args: argparse.Namespace, runner: asyncio.Runner) -> None:
    deadline: Deadline = args.deadline_obj
    base = tmp / phase.name
    (base / "valkey").mkdir(parents=True)
    valkey: subprocess.Popen[bytes] | None = None
    servers: list[Server] = []
    try:
        valkey, valkey_port = start_valkey(base / "valkey", deadline)
        receiver, keel = (Server(n, free_port(), base / f"{n}.log") for n in ("receiver", "keel"))
        servers = [receiver, keel]
        me = [sys.executable, str(Path(__file__).resolve()), "--serve", "receiver", "--port", str(receiver.port)]
        receiver.start([*me, "--fail", str(phase.fail), "--seed", str(args.seed)], server_env({}))
        extra = {"KEEL_API_KEYS": API_KEY, "KEEL_WEBHOOK_ALLOW_PRIVATE": "1"}
        keel.start([sys.executable, "-m", "app"], keel_env(valkey_port, keel, base / "keel", AGENT, extra))
        runner.run(measure(phase, keel, receiver, valkey_port, args))
        if keel.log.stat().st_size:  # warnings (the relay's among them)
            print(f"--- keel log, {phase.name} (tail) ---\n{log_tail(keel.log, 20)}", file=sys.stderr)
    except BaseException:
        for s in servers:
            print(f"--- {s.name} log, {phase.name} (tail) ---\n{log_tail(s.log, 20)}", file=sys.stderr)
        raise
    finally:
        stop_all(servers, valkey)


def run(args: argparse.Namespace) -> int:
    args.deadline_obj = Deadline(args.deadline)
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-delivery-"))
    try:
        phases = [Phase("healthy", 0.0), Phase("failing", args.fail)]
        with asyncio.Runner(loop_factory=new_loop) as runner:
            for phase in phases:
                run_phase(phase, tmp, args, runner)
        out, bad = report(phases, args)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return 1 if bad else 0
    except (BenchError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        print(f"bench_delivery: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sessions", type=positive, default=100, help="sessions, run at once (default 100)")
    ap.add_argument("--turns", type=positive, default=20, help="turns per session, in sequence (default 20)")
    ap.add_argument("--connections", type=positive, default=50, help="keep-alive connections to keel (default 50)")
    ap.add_argument("--fail", type=float, default=0.2, help="the failing receiver's share of 500s (default 0.2)")
    ap.add_argument("--seed", type=int, default=1, help="the failing receiver's random seed (default 1)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--deadline", type=float, default=900.0, help="global time budget in seconds (default 900)")
    ap.add_argument("--serve", choices=["receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve and args.port is None:
        ap.error("--serve needs --port")
    if not 0.0 <= args.fail <= 1.0:
        ap.error("--fail is a share of requests, from 0 to 1")
    if args.sessions * args.turns > 100_000:
        ap.error("keep --sessions x --turns <= 100000")
    return args


def main() -> int:
    args = parse_args()
    if args.serve is not None:
        uvicorn.run(receiver_app(args.fail, args.seed), host=HOST, port=args.port, log_level="warning")
        return 0
    args.command = shlex.join(sys.orig_argv)
    print(f"$ {args.command}", flush=True)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
