"""Slack channel benchmark: signed Events API deliveries at rising rates, keel against a bare
endpoint that only verifies and acks.

    python deploy/bench/bench_slack.py [--rates 50,100,200,400] [--seconds 10] [--json PATH]

One run starts a private Valkey, a fake Slack Web API in a process of its own (`auth.test`,
`chat.postMessage`, `chat.update`, `conversations.replies`; it logs when each post arrives and
in which thread), keel (`python -m app`, the zero-latency agent in `deploy.bench.agents`, the
Slack channel pointed at the fake) and a bare baseline (Starlette on uvicorn: `POST
/v1/slack/events` reads the body, checks the signature with slack_sdk's SignatureVerifier,
answers 200). At each rate, bare then keel get --seconds of open-loop load: each event an
`app_mention` that starts a thread of its own, sent at its scheduled time over a pool of
keep-alive connections whatever the earlier requests are doing. Ack latency runs from the
scheduled time to the response (queueing counts); reply latency from the scheduled time to the
reply's arrival at the fake Slack (wall clock). keel must post exactly one reply per event;
duplicates and missing replies are counted after the last rate.

It prints a table, the keel/bare ack ratios and one `RESULT {json}` line (--json PATH writes
it too). An ack error, a missing or a duplicate reply makes the exit status 1. Everything is
bounded by --deadline seconds; every process started here is stopped in a `finally`."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from slack_sdk.signature import SignatureVerifier
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
SECRET = "bench-signing-secret"
TOKEN = "xoxb-bench-token"
BOT, TEAM, CHANNEL, USER = "U0BOT", "T0BENCH", "C0BENCH", "U0USER"
POOL = 32  # keep-alive connections per phase, used in turn (FIFO: none idles past uvicorn's 5 s)
ACK_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 120.0
WARMUP_EVENTS = 50
TARGET = (200, 50.0)  # keel's ack p99 at 200 events/s: at most 50 ms
REPLY_KINDS = ("post", "update")  # a reply is posted, or replaces a working post


# ---- the fake Slack Web API (its own process: --serve slack) --------------------------------


async def readyz(request: Request) -> Response:
    return JSONResponse({"ok": True})


@dataclass
class SlackLog:
    records: list[tuple[str, str, float]] = field(default_factory=list)  # (kind, thread_ts, wall time)
    replies: list[int] = field(default_factory=lambda: [0])  # replies among the first i records
    thread_of: dict[str, str] = field(default_factory=dict)  # post ts -> its thread
    posts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # thread -> its messages
    calls: Counter[str] = field(default_factory=Counter)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    clock: float = 0.0

    def add(self, kind: str, thread: str) -> None:
        self.records.append((kind, thread, time.time()))
        self.replies.append(self.replies[-1] + (kind in REPLY_KINDS))
        self.changed.set()
        self.changed = asyncio.Event()


def slack_app() -> Starlette:
    s = SlackLog()

    async def api(request: Request) -> Response:
        method = request.path_params["method"]
        s.calls[method] += 1
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"ok": False, "error": "invalid_auth"})
        a: dict[str, Any] = dict(request.query_params)
        body = await request.body()
        if body and request.headers.get("content-type", "").startswith("application/json"):
            a.update(json.loads(body))
        elif body:
            a.update({k: v[0] for k, v in parse_qs(body.decode()).items()})
        if method == "auth.test":
            return JSONResponse({"ok": True, "user_id": BOT, "team_id": TEAM, "bot_id": "B0BOT"})
        if method == "chat.postMessage":
            s.clock = max(time.time(), s.clock + 0.000001)
            ts, thread, text = f"{s.clock:.6f}", str(a.get("thread_ts") or ""), str(a.get("text") or "")
            s.thread_of[ts] = thread
            meta = a.get("metadata")
            s.posts.setdefault(thread, []).append({"type": "message", "ts": ts, "text": text, "metadata": meta})
            s.add("working" if text.startswith("_Working") else "post", thread)
            return JSONResponse({"ok": True, "channel": a.get("channel"), "ts": ts})
        if method == "chat.update":
            of = s.thread_of.get(str(a.get("ts")))
            if of is None:
                return JSONResponse({"ok": False, "error": "message_not_found"})
            s.add("update", of)
            return JSONResponse({"ok": True, "channel": a.get("channel"), "ts": a.get("ts")})
        if method == "conversations.replies":
            messages = s.posts.get(str(a.get("ts")), [])
            return JSONResponse({"ok": True, "messages": messages, "response_metadata": {"next_cursor": ""}})
        return JSONResponse({"ok": False, "error": "unknown_method"})

    async def log(request: Request) -> Response:
        """The records from `start` on, once `want` of them are replies (or `timeout` passed)."""
        q = request.query_params
        start, want, timeout = int(q["start"]), int(q["want"]), float(q["timeout"])
        end = time.monotonic() + timeout
        while s.replies[-1] - s.replies[min(start, len(s.records))] < want and time.monotonic() < end:
            try:
                await asyncio.wait_for(s.changed.wait(), end - time.monotonic())
            except TimeoutError:
                break
        return JSONResponse({"records": s.records[start:], "calls": s.calls})

    routes = [Route("/api/{method}", api, methods=["GET", "POST"]), Route("/bench/log", log), Route("/readyz", readyz)]
    return Starlette(routes=routes)


# ---- the bare baseline (its own process: --serve bare) --------------------------------------


def bare_app() -> Starlette:
    verifier = SignatureVerifier(SECRET)

    async def events(request: Request) -> Response:
        body = await request.body()
        timestamp = request.headers.get("x-slack-request-timestamp") or ""
        signature = request.headers.get("x-slack-signature") or ""
        ok = timestamp.isdigit() and verifier.is_valid(body, timestamp, signature)
        return Response(b"", status_code=200 if ok else 401)

    return Starlette(routes=[Route("/v1/slack/events", events, methods=["POST"]), Route("/readyz", readyz)])


# ---- the load --------------------------------------------------------------------------------


class EventConn(Conn):
    async def send(self, raw: bytes) -> int:
        """Write one whole request; read the response; its status."""
        self._w.write(raw)
        await self._w.drain()
        head = await self._r.readuntil(b"\r\n\r\n")
        length, chunked = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
        if chunked:
            await self._read_chunked()
        elif length:
            await self._r.readexactly(length)
        return int(head[9:12])


async def open_conn(port: int) -> EventConn:
    conn = await Conn.open(port)
    return EventConn(conn._r, conn._w, port)


def event_request(port: int, ts: str, n: int, verifier: SignatureVerifier) -> bytes:
    """An `app_mention` of the bot in a new thread, signed as Slack signs it."""
    event = {"type": "app_mention", "user": USER, "text": f"<@{BOT}> hello {n}", "ts": ts, "channel": CHANNEL}
    envelope = {
        "token": "bench",
        "team_id": TEAM,
        "api_app_id": "A0BENCH",
        "type": "event_callback",
        "event_id": f"Ev{ts.replace('.', '')}",
        "event_time": int(float(ts)),
        "authorizations": [{"team_id": TEAM, "user_id": BOT, "is_bot": True}],
        "event": {**event, "event_ts": ts},
    }
    body = json.dumps(envelope).encode()
    stamp = str(int(time.time()))
    signature = verifier.generate_signature(timestamp=stamp, body=body)
    head = (
        f"POST /v1/slack/events HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nX-Slack-Request-Timestamp: {stamp}\r\nX-Slack-Signature: {signature}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Phase:
    system: str
    rate: int
    acks: list[float] = field(default_factory=list)  # ms, scheduled time -> response read
    late: list[float] = field(default_factory=list)  # ms the client was behind its schedule
    errors: list[str] = field(default_factory=list)
    sent: dict[str, float] = field(default_factory=dict)  # event ts -> scheduled wall time
    cpu_ms: float = 0.0  # the server's CPU per event, replies included


async def drive(server: Server, phase: Phase, n: int, ids: Iterator[int], deadline: Deadline) -> None:
    verifier, clock, epoch = SignatureVerifier(SECRET), time.perf_counter, int(time.time())
    events = [(f"{epoch}.{i:06d}", i) for i in (next(ids) for _ in range(n))]
    raws = [event_request(server.port, ts, i, verifier) for ts, i in events]
    pool: asyncio.Queue[EventConn | None] = asyncio.Queue()
    for conn in await asyncio.gather(*(open_conn(server.port) for _ in range(POOL))):
        pool.put_nowait(conn)

    async def fire(due: float, raw: bytes) -> None:
        conn = await pool.get()
        try:
            conn = conn or await open_conn(server.port)
            async with asyncio.timeout(ACK_TIMEOUT_S):
                status = await conn.send(raw)
            if status == 200:
                phase.acks.append((clock() - due) * 1000.0)
            else:
                phase.errors.append(f"HTTP {status}")
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            phase.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if conn is not None:
                await conn.close()
            conn = None  # a fresh connection next time
        finally:
            pool.put_nowait(conn)

    start = clock() + 0.05
    wall = time.time() - clock()
    tasks: list[asyncio.Task[None]] = []
    try:
        async with asyncio.timeout(deadline.left(n / phase.rate + ACK_TIMEOUT_S + 30)):
            for k, ((ts, _), raw) in enumerate(zip(events, raws, strict=True)):
                due = start + k / phase.rate
                if (ahead := due - clock()) > 0:
                    await asyncio.sleep(ahead)
                phase.late.append(max(clock() - due, 0.0) * 1000.0)
                phase.sent[ts] = wall + due
                tasks.append(asyncio.create_task(fire(due, raw)))
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        while not pool.empty():
            if (c := pool.get_nowait()) is not None:
                await c.close()


async def slack_log(port: int, start: int, want: int, timeout: float) -> dict[str, Any]:
    conn = await Conn.open(port)
    try:
        path = f"/bench/log?start={start}&want={want}&timeout={timeout:.3f}"
        status, body = await asyncio.wait_for(conn.request("GET", path), timeout + 10)
    finally:
        await conn.close()
    if status != 200:
        raise BenchError(f"fake Slack GET /bench/log -> {status} {body[:200]!r}")
    result: dict[str, Any] = json.loads(body)
    return result


async def await_replies(slack: Server, sent: dict[str, float], start: int, deadline: Deadline) -> int:
    """Wait (bounded) until every event's thread has a reply; the log's length then."""
    missing = set(sent)
    end = time.monotonic() + deadline.left(REPLY_TIMEOUT_S)
    while missing and time.monotonic() < end:
        slack.check_alive()
        records = (await slack_log(slack.port, start, len(missing), min(5.0, end - time.monotonic())))["records"]
        start += len(records)
        missing -= {thread for kind, thread, _ in records if kind in REPLY_KINDS}
    return start


# ---- a run ----------------------------------------------------------------------------------


async def measure(keel: Server, bare: Server, slack: Server, args: argparse.Namespace) -> dict[str, Any]:
    deadline: Deadline = args.deadline_obj
    for s in (slack, bare, keel):
        await wait_ready(s, deadline)
    ids, phases = count(), []
    for s in (bare, keel):  # warm-up: connections, imports, the first sessions
        await drive(s, Phase(s.name, 50), WARMUP_EVENTS, ids, deadline)
    cursor = len((await slack_log(slack.port, 0, WARMUP_EVENTS, deadline.left(REPLY_TIMEOUT_S)))["records"])
    for rate in args.rate_list:
        for s in (bare, keel):
            phase = Phase(s.name, rate)
            cpu0 = cpu_seconds(s.pid)
            await drive(s, phase, max(1, round(rate * args.seconds)), ids, deadline)
            if s is keel:
                cursor = await await_replies(slack, phase.sent, cursor, deadline)
            phase.cpu_ms = (cpu_seconds(s.pid) - cpu0) * 1000.0 / len(phase.sent)
            s.check_alive()
            phases.append(phase)
    final = await slack_log(slack.port, 0, 0, 0.0)  # after the last rate: duplicates too
    return {"phases": phases, "records": final["records"], "calls": final["calls"]}


def figures(phase: Phase, replies: dict[str, list[tuple[str, float]]]) -> dict[str, Any]:
    acks = phase.acks or [float("nan")]
    out: dict[str, Any] = {
        "events": len(phase.sent),
        "errors": len(phase.errors),
        "ack_p50_ms": statistics.median(acks),
        "ack_p99_ms": percentile(acks, 99),
        "ack_max_ms": max(acks),
        "client_late_p99_ms": percentile(phase.late, 99),
        "server_cpu_ms_per_event": phase.cpu_ms,
    }
    if phase.system == "keel":
        mine = [[r for r in replies.get(ts, []) if r[0] in REPLY_KINDS] for ts in phase.sent]
        lat = [(min(w for _, w in rs) - phase.sent[ts]) * 1000.0 for ts, rs in zip(phase.sent, mine, strict=True) if rs]
        lat = lat or [float("nan")]
        out |= {
            "reply_p50_ms": statistics.median(lat),
            "reply_p99_ms": percentile(lat, 99),
            "replied_once": sum(len(rs) == 1 for rs in mine),
            "duplicated": sum(len(rs) > 1 for rs in mine),
            "missing": sum(not rs for rs in mine),
            "working_posts": sum(k == "working" for ts in phase.sent for k, _ in replies.get(ts, [])),
        }
    return out


def report(result: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    replies: dict[str, list[tuple[str, float]]] = {}
    for kind, thread, wall in result["records"]:
        replies.setdefault(thread, []).append((kind, wall))
    rows: dict[int, dict[str, Any]] = {}
    for phase in result["phases"]:
        rows.setdefault(phase.rate, {"rate": phase.rate})[phase.system] = figures(phase, replies)
    print(f"\nopen loop, {args.seconds:g} s per rate, {POOL} keep-alive connections; bare then keel at each rate")
    print("ack: scheduled send -> response read; reply: scheduled send -> chat.postMessage at the fake Slack\n")
    head = "rate/s system events err ack-p50 ack-p99 ack-max reply-p50 reply-p99 once dup miss late99 CPU-ms"
    print("{:>6} {:<6} {:>6} {:>4} {:>8} {:>8} {:>8} {:>9} {:>9} {:>6} {:>4} {:>4} {:>7} {:>7}".format(*head.split()))
    bad = False
    for row in rows.values():
        for name in ("bare", "keel"):
            f = row[name]
            reply = f"{f['reply_p50_ms']:>9.1f} {f['reply_p99_ms']:>9.1f}" if name == "keel" else f"{'-':>9} {'-':>9}"
            once = f"{f['replied_once']:>6} {f['duplicated']:>4} {f['missing']:>4}" if name == "keel" else " " * 16
            print(
                f"{row['rate']:>6} {name:<6} {f['events']:>6} {f['errors']:>4} {f['ack_p50_ms']:>8.2f}"
                f" {f['ack_p99_ms']:>8.2f} {f['ack_max_ms']:>8.1f} {reply} {once}"
                f" {f['client_late_p99_ms']:>7.2f} {f['server_cpu_ms_per_event']:>7.3f}"
            )
            bad |= f["errors"] > 0 or f.get("duplicated", 0) > 0 or f.get("missing", 0) > 0
        row["ratio_keel_over_bare"] = {
            k: row["keel"][f"ack_{k}_ms"] / row["bare"][f"ack_{k}_ms"] for k in ("p50", "p99")
        }
    print("(ms; late99: the client's p99 lag behind its schedule; CPU ms: the server's, per event, replies included)")
    ratios = [(r["rate"], r["ratio_keel_over_bare"]) for r in rows.values()]
    print("\nkeel/bare ack: " + ", ".join(f"{n}/s p50 x{x['p50']:.2f} p99 x{x['p99']:.2f}" for n, x in ratios))
    print(f"fake Slack calls: {dict(result['calls'])}")
    working = sum(r["keel"]["working_posts"] for r in rows.values())
    if working:
        print(f"NOTE: {working} working post(s): some turns were silent for a second")
    rate, limit = TARGET
    if rate in rows:
        p99 = rows[rate]["keel"]["ack_p99_ms"]
        print(f"target: keel ack p99 <= {limit:g} ms at {rate}/s: {'met' if p99 <= limit else 'MISSED'} ({p99:.1f} ms)")
    config = {"rates": args.rate_list, "seconds": args.seconds, "pool": POOL, "warmup_events": WARMUP_EVENTS}
    out = {"command": args.command, "config": config, "rates": list(rows.values()), "slack_calls": result["calls"]}
    print("RESULT " + json.dumps(out), flush=True)
    for phase in result["phases"]:
        for e in phase.errors[:3]:
            print(f"error ({phase.system}, {phase.rate}/s): {e}", file=sys.stderr)
    return out, bad


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rates", default="50,100,200,400", help="events/s, in order (default 50,100,200,400)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per rate and system (default 10)")
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    ap.add_argument("--deadline", type=float, default=300.0, help="global time budget in seconds (default 300)")
    ap.add_argument("--serve", choices=["bare", "slack"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=positive, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.rate_list = [positive(r) for r in args.rates.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        ap.error("--rates is a comma-separated list of whole numbers of at least 1")
    if len(set(args.rate_list)) < len(args.rate_list):
        ap.error("--rates: each rate once")
    if max(args.rate_list) > 5_000 or not 0.1 <= args.seconds <= 120:
        ap.error("keep each rate <= 5000 and 0.1 <= --seconds <= 120 (signatures last 300 s)")
    return args


def run(args: argparse.Namespace) -> int:
    args.deadline_obj = deadline = Deadline(args.deadline)
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-slack-"))
    valkey: subprocess.Popen[bytes] | None = None
    servers: list[Server] = []
    try:
        (tmp / "valkey").mkdir()
        valkey, valkey_port = start_valkey(tmp / "valkey", deadline)
        slack, bare, keel = (Server(n, free_port(), tmp / f"{n}.log") for n in ("slack", "bare", "keel"))
        servers = [slack, bare, keel]
        me = [sys.executable, str(Path(__file__).resolve())]
        for s in (slack, bare):
            s.start([*me, "--serve", s.name, "--port", str(s.port)], server_env({}))
        extra = {"SLACK_SIGNING_SECRET": SECRET, "SLACK_BOT_TOKEN": TOKEN} | {
            "KEEL_SLACK_API_URL": f"http://{HOST}:{slack.port}/api/"
        }
        keel.start([sys.executable, "-m", "app"], keel_env(valkey_port, keel, tmp / "keel", AGENT, extra))
        with asyncio.Runner(loop_factory=new_loop) as runner:
            result = runner.run(measure(keel, bare, slack, args))
        out, bad = report(result, args)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        if bad:
            print(f"--- keel log (tail) ---\n{log_tail(keel.log)}", file=sys.stderr)
        return 1 if bad else 0
    except (BenchError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        return show_failure("bench_slack", exc, servers)
    finally:
        stop_all(servers, valkey)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if args.serve is not None:
        if args.port is None:
            print("--serve needs --port", file=sys.stderr)
            return 2
        app = slack_app() if args.serve == "slack" else bare_app()
        uvicorn.run(app, host=HOST, port=args.port, log_level="warning")
        return 0
    args.command = shlex.join(sys.orig_argv)
    print(f"$ {args.command}", flush=True)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
