"""Linear channel benchmark: signed `AgentSessionEvent` `created` webhooks at rising rates; how soon
keel's first agent activity (a `thought`: Linear wants one within 10 s) and its `response` arrive.

    python deploy/bench/bench_linear.py [--rates 10,50,100] [--seconds 10] [--json PATH]

A private Valkey, a fake Linear GraphQL API in a process of its own (`agentActivityCreate`,
idempotent on the activity id as Linear is; it logs each activity's arrival, session, id, type)
and keel (`python -m app`, the zero-latency agent of `deploy.bench.agents`). At each rate keel
gets --seconds of open-loop load, each event a `created` for a new agent session sent at its
scheduled time over keep-alive connections. Latencies run from the scheduled time (queueing
counts) to the ack, and to each activity's arrival at the fake. Every session must get one
thought and one response: an ack error, a missing one, an id sent twice or a second thought or
response makes the exit status 1. It prints a table and one `RESULT {json}` line (--json PATH
writes it too). All is bounded by --deadline; every process started here is stopped in a `finally`."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import uvicorn
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
    show_failure,
    start_valkey,
    stop_all,
    wait_ready,
)

AGENT = "deploy.bench.agents:agent"
SECRET = "bench-linear-webhook-secret"
API_KEY = "lin_api_bench"
ORG = "org-bench"
POOL = 32  # keep-alive connections, used in turn (FIFO: none idles past uvicorn's 5 s)
ACK_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 120.0
WARMUP_EVENTS = 30
LIMIT_MS = 10_000.0  # Linear: the first activity within 10 s of `created`
GOAL_MS = 1_000.0  # the issue: p99 well under 1 s with a zero-latency model
CONTEXT = (  # the issue as Linear gives it (a few hundred characters)
    "<issue identifier='ENG-{n}'><title>Checkout times out for large carts</title><description>Carts of more than"
    " 50 items get a gateway timeout on /checkout: the pricing service is called once per line item; batch the calls"
    " or cache the price list per request.</description><team name='Engineering'/></issue>"
)


# ---- the fake Linear GraphQL API (its own process: --serve linear) ---------------------------
def linear_app() -> Starlette:
    records: list[tuple[str, str, str, float, bool]] = []  # (type, agent session, activity id, wall time, repeat)
    ids: set[str] = set()
    calls: Counter[str] = Counter()

    def error(message: str, code: str = "INVALID_INPUT") -> Response:
        calls[code] += 1
        return JSONResponse({"errors": [{"message": message, "extensions": {"code": code}}]})

    async def graphql(request: Request) -> Response:
        calls["requests"] += 1
        if request.headers.get("authorization") != API_KEY:
            calls["unauthenticated"] += 1
            return JSONResponse({"errors": [{"message": "Authentication required"}]}, 401)
        body = json.loads(await request.body())
        data = (body.get("variables") or {}).get("input") or {}
        if "agentActivityCreate" not in str(body.get("query")):
            return error("unknown operation", "UNKNOWN")
        aid, session, content = data.get("id"), data.get("agentSessionId"), data.get("content")
        if not isinstance(aid, str) or not isinstance(session, str) or not isinstance(content, dict):
            return error("invalid input")
        records.append((str(content.get("type")), session, aid, time.time(), aid in ids))
        if aid in ids:
            return error("Entity already exists")
        ids.add(aid)
        calls[records[-1][0]] += 1
        return JSONResponse({"data": {"agentActivityCreate": {"success": True, "agentActivity": {"id": aid}}}})

    async def log(request: Request) -> Response:
        return JSONResponse({"records": records[int(request.query_params["start"]) :], "calls": calls})

    async def readyz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [Route("/graphql", graphql, methods=["POST"]), Route("/bench/log", log), Route("/readyz", readyz)]
    return Starlette(routes=routes)


# ---- the load --------------------------------------------------------------------------------
async def send(conn: Conn, raw: bytes) -> int:
    """Write one whole request on `conn`; read the response; its status."""
    conn._w.write(raw)
    await conn._w.drain()
    head = await conn._r.readuntil(b"\r\n\r\n")
    lengths = [int(h[15:]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length:")]
    if not lengths:
        raise ValueError(f"a response without a Content-Length: {head[:200]!r}")
    await conn._r.readexactly(lengths[0])
    return int(head[9:12])


def created_request(port: int, session: str, n: int, at: float) -> bytes:
    """A `created` for a new agent session, stamped `at` (its send time) and signed as Linear signs."""
    issue = {"id": f"issue-{n}", "identifier": f"ENG-{n}", "title": "Checkout page times out"}
    agent_session: dict[str, Any] = {"id": session, "issue": issue, "creator": {"id": "user-alice"}}
    agent_session["comment"] = {"id": f"comment-{n}", "body": f"@keel hello {n}"}
    payload: dict[str, Any] = {"type": "AgentSessionEvent", "action": "created", "organizationId": ORG}
    payload |= {"oauthClientId": "client-bench", "appUserId": "app-user-bench", "webhookId": "wh-bench"}
    payload["createdAt"] = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(at))
    payload |= {"webhookTimestamp": int(at * 1000), "agentSession": agent_session, "promptContext": CONTEXT.format(n=n)}
    body = json.dumps(payload).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    head = (
        f"POST /v1/linear/webhook HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nLinear-Signature: {signature}\r\nLinear-Delivery: {uuid.uuid4()}\r\n"
        "Linear-Event: AgentSessionEvent\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Phase:
    rate: int
    acks: list[float] = field(default_factory=list)  # ms, scheduled time -> response read
    late: list[float] = field(default_factory=list)  # ms the client was behind its schedule
    errors: list[str] = field(default_factory=list)
    sent: dict[str, float] = field(default_factory=dict)  # agent session -> scheduled wall time
    acked: set[str] = field(default_factory=set)  # the agent sessions keel answered 200
    cpu_ms: float = 0.0  # keel's CPU per event, activities included


async def drive(keel: Server, phase: Phase, n: int, ids: count[int], deadline: Deadline) -> None:
    clock = time.perf_counter
    start = clock() + 0.3 + n * 0.0001  # time to sign every event and open the pool first
    wall = time.time() - clock()
    events = [(str(uuid.uuid4()), next(ids), start + k / phase.rate) for k in range(n)]
    raws = [created_request(keel.port, sid, i, wall + due) for sid, i, due in events]
    pool: asyncio.Queue[Conn | None] = asyncio.Queue()
    for conn in await asyncio.gather(*(Conn.open(keel.port) for _ in range(POOL))):
        pool.put_nowait(conn)

    async def fire(sid: str, due: float, raw: bytes) -> None:
        conn = await pool.get()
        try:
            conn = conn or await Conn.open(keel.port)
            async with asyncio.timeout(ACK_TIMEOUT_S):
                status = await send(conn, raw)
            if status == 200:
                phase.acks.append((clock() - due) * 1000.0)
                phase.acked.add(sid)
            else:
                phase.errors.append(f"HTTP {status}")
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            phase.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if conn is not None:
                await conn.close()
            conn = None  # a fresh connection next time
        finally:
            pool.put_nowait(conn)

    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(deadline.left(n / phase.rate + ACK_TIMEOUT_S + 30)):
            for (sid, _, due), raw in zip(events, raws, strict=True):
                if (ahead := due - clock()) > 0:
                    await asyncio.sleep(ahead)
                phase.late.append(max(clock() - due, 0.0) * 1000.0)
                phase.sent[sid] = wall + due
                tasks.append(asyncio.create_task(fire(sid, due, raw)))
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        while not pool.empty():
            if (c := pool.get_nowait()) is not None:
                await c.close()


async def linear_log(port: int, start: int) -> dict[str, Any]:
    """The fake's records from `start` on, and its call counts."""
    conn = await Conn.open(port)
    try:
        status, body = await asyncio.wait_for(conn.request("GET", f"/bench/log?start={start}"), 10.0)
    finally:
        await conn.close()
    if status != 200:
        raise BenchError(f"fake Linear GET /bench/log -> {status} {body[:200]!r}")
    result: dict[str, Any] = json.loads(body)
    return result


async def await_responses(linear: Server, sessions: set[str], start: int, deadline: Deadline) -> int:
    """Wait (bounded) until each of these sessions has its response; the log's length then."""
    missing = set(sessions)
    end = time.monotonic() + deadline.left(REPLY_TIMEOUT_S)
    while missing and time.monotonic() < end:
        linear.check_alive()
        records = (await linear_log(linear.port, start))["records"]
        start += len(records)
        missing -= {session for kind, session, *_ in records if kind == "response"}
        await asyncio.sleep(0.1 if missing else 0)
    return start


# ---- a run ----------------------------------------------------------------------------------
async def measure(keel: Server, linear: Server, args: argparse.Namespace) -> dict[str, Any]:
    deadline: Deadline = args.deadline_obj
    for s in (linear, keel):
        await wait_ready(s, deadline)
    ids, phases = count(), []
    warm = Phase(20)  # warm-up: connections, imports, the first sessions
    await drive(keel, warm, WARMUP_EVENTS, ids, deadline)
    if warm.errors:
        raise BenchError(f"{len(warm.errors)} warm-up event(s) failed: {warm.errors[:3]}")
    cursor = await await_responses(linear, warm.acked, 0, deadline)
    for rate in args.rate_list:
        phase = Phase(rate)
        cpu0 = cpu_seconds(keel.pid)
        await drive(keel, phase, max(1, round(rate * args.seconds)), ids, deadline)
        cursor = await await_responses(linear, phase.acked, cursor, deadline)
        phase.cpu_ms = (cpu_seconds(keel.pid) - cpu0) * 1000.0 / len(phase.sent)
        keel.check_alive()
        phases.append(phase)
    await asyncio.sleep(1.0)  # a straggling repeat or extra activity: still counted
    final = await linear_log(linear.port, 0)
    return {"phases": phases, "records": final["records"], "calls": final["calls"]}


def stats(name: str, xs: list[float]) -> dict[str, float]:
    xs = xs or [float("nan")]
    return {f"{name}_p50_ms": statistics.median(xs), f"{name}_p99_ms": percentile(xs, 99), f"{name}_max_ms": max(xs)}


def figures(phase: Phase, by_session: dict[str, list[tuple[str, str, float, bool]]]) -> dict[str, Any]:
    thoughts: list[float] = []
    responses: list[float] = []
    n: Counter[str] = Counter()
    for sid, at in phase.sent.items():
        acts = by_session.get(sid, [])  # (type, activity id, wall time, repeat)
        t = [w for kind, _, w, repeat in acts if kind == "thought" and not repeat]
        r = [w for kind, _, w, repeat in acts if kind == "response" and not repeat]
        thoughts += [(min(t) - at) * 1000.0] if t else []
        responses += [(min(r) - at) * 1000.0] if r else []
        n["once"] += len(t) == 1 and len(r) == 1
        n["missing"] += not t or not r
        n["repeated"] += any(a[3] for a in acts)
        n["extra"] += len(t) > 1 or len(r) > 1
        n["other"] += any(a[0] not in ("thought", "response") for a in acts)
        n["response_first"] += bool(t and r and min(r) < min(t))
        n["over_10s"] += bool(t) and (min(t) - at) * 1000.0 > LIMIT_MS
    out: dict[str, Any] = {"events": len(phase.sent), "errors": len(phase.errors), **stats("ack", phase.acks)}
    out |= {**stats("thought", thoughts), **stats("response", responses), **n}
    return out | {"client_late_p99_ms": percentile(phase.late, 99), "server_cpu_ms_per_event": phase.cpu_ms}


def report(result: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    by_session: dict[str, list[tuple[str, str, float, bool]]] = {}
    for kind, session, aid, wall, repeat in result["records"]:
        by_session.setdefault(session, []).append((kind, aid, wall, repeat))
    rows = [{"rate": p.rate, **figures(p, by_session)} for p in result["phases"]]
    print(f"\nopen loop, {args.seconds:g} s per rate, {POOL} keep-alive connections, one new agent session per event")
    print("ack: scheduled send -> 200 read; thought / response: scheduled send -> its arrival at the fake Linear\n")
    head = "rate/s events err ack-p50 ack-p99 ack-max think-p50 think-p99 think-max resp-p50 resp-p99 resp-max"
    head += " once miss rep extra late99 CPU-ms"
    fmt = "{:>6} {:>6} {:>4} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>5} {:>4} {:>4} {:>5} {:>6} {:>6}"
    print(fmt.format(*head.split()))
    bad = False
    for f in rows:
        print(
            f"{f['rate']:>6} {f['events']:>6} {f['errors']:>4} {f['ack_p50_ms']:>7.2f} {f['ack_p99_ms']:>7.2f}"
            f" {f['ack_max_ms']:>7.1f} {f['thought_p50_ms']:>9.1f} {f['thought_p99_ms']:>9.1f}"
            f" {f['thought_max_ms']:>9.1f} {f['response_p50_ms']:>8.1f} {f['response_p99_ms']:>8.1f}"
            f" {f['response_max_ms']:>8.1f} {f['once']:>5} {f['missing']:>4} {f['repeated']:>4} {f['extra']:>5}"
            f" {f['client_late_p99_ms']:>6.2f} {f['server_cpu_ms_per_event']:>6.2f}"
        )
        bad |= any(f[k] > 0 for k in ("errors", "missing", "repeated", "extra"))
    print("(ms; once: sessions with one thought and one response; rep: with an activity id sent again; extra: with")
    print(" two thoughts or responses; late99: the client's p99 lag behind schedule; CPU-ms: keel's, per event)")
    print(f"fake Linear calls: {dict(result['calls'])}")
    notes = {"other": "other activities", "over_10s": "a thought after 10 s", "response_first": "the response first"}
    for f in rows:
        for key in [k for k in notes if f[k]]:
            print(f"NOTE: {f['rate']}/s: {f[key]} sessions with {notes[key]}")
    worst = max((f["thought_p99_ms"] for f in rows), default=float("nan"))
    met = ["met" if worst < limit else "MISSED" for limit in (LIMIT_MS, GOAL_MS)]
    print(f"thought p99 at worst {worst:.1f} ms: Linear's 10 s limit {met[0]}; the goal, well under 1 s, {met[1]}")
    config = {"rates": args.rate_list, "seconds": args.seconds, "pool": POOL, "warmup_events": WARMUP_EVENTS}
    out = {"command": args.command, "config": config, "rates": rows, "linear_calls": result["calls"]}
    print("RESULT " + json.dumps(out), flush=True)
    for phase in result["phases"]:
        for e in phase.errors[:3]:
            print(f"error ({phase.rate}/s): {e}", file=sys.stderr)
    return out, bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rates", default="10,50,100", help="events/s, in order (default 10,50,100)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per rate (default 10)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--deadline", type=float, default=300.0, help="global time budget in seconds (default 300)")
    ap.add_argument("--serve", choices=["linear"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve and args.port is None:
        ap.error("--serve needs --port")
    try:
        args.rate_list = [positive(r) for r in args.rates.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        ap.error("--rates is a comma-separated list of whole numbers of at least 1")
    if max(args.rate_list) > 2_000 or not 0.1 <= args.seconds <= 120:
        ap.error("keep each rate <= 2000 and 0.1 <= --seconds <= 120")
    return args


def run(args: argparse.Namespace) -> int:
    args.deadline_obj = deadline = Deadline(args.deadline)
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-linear-"))
    valkey: subprocess.Popen[bytes] | None = None
    servers: list[Server] = []
    try:
        (tmp / "valkey").mkdir()
        valkey, valkey_port = start_valkey(tmp / "valkey", deadline)
        linear, keel = (Server(n, free_port(), tmp / f"{n}.log") for n in ("linear", "keel"))
        servers = [linear, keel]
        me = [sys.executable, str(Path(__file__).resolve())]
        linear.start([*me, "--serve", "linear", "--port", str(linear.port)], server_env({}))
        extra = {"LINEAR_WEBHOOK_SECRET": SECRET, "LINEAR_API_KEY": API_KEY} | {
            "KEEL_LINEAR_API_URL": f"http://{HOST}:{linear.port}/graphql"
        }
        keel.start([sys.executable, "-m", "app"], keel_env(valkey_port, keel, tmp / "keel", AGENT, extra))
        with asyncio.Runner(loop_factory=new_loop) as runner:
            result = runner.run(measure(keel, linear, args))
        out, bad = report(result, args)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        if bad:
            print(f"--- keel log (tail) ---\n{log_tail(keel.log)}", file=sys.stderr)
        return 1 if bad else 0
    except (BenchError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        return show_failure("bench_linear", exc, servers)
    finally:
        stop_all(servers, valkey)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if args.serve is not None:
        uvicorn.run(linear_app(), host=HOST, port=args.port, log_level="warning")
        return 0
    args.command = shlex.join(sys.orig_argv)
    print(f"$ {args.command}", flush=True)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
