"""End-to-end HTTP turn benchmark: keel against a bare Starlette+Redis baseline.

    python deploy/bench/bench_http.py [--turns 300] [--sessions 100] [--rounds 3]

One run starts a private Valkey (AOF, appendfsync everysec) on a free loopback port, keel
(`python -m app` with the zero-latency agent in `deploy.bench.agents`) and a bare baseline (a
Starlette app served the same way, doing per turn what `/work/shared/bench/peers/bench_bare.py`
does: LRANGE the last 20 items, then one Lua script that RPUSHes two items and XADDs an event;
its garbage collector set as keel sets its own, `app/heap.py`, --bare-gc-threshold). Both are
driven by the same small keep-alive HTTP/1.1 client on asyncio streams, one connection per
session:

- sequential: one session, 20 warm-up turns then --turns timed turns; p50/p99 latency;
- concurrent: --sessions sessions doing 20 turns each at once, --rounds rounds with fresh
  sessions, the two systems alternating round by round; median turns/s.

It prints a table, the keel/bare ratios, and one `RESULT {json}` line. Any failed turn is
printed (with the tail of the server's log) and the exit status is 1. Everything is bounded by
--deadline seconds; every process started here is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from redis.asyncio import Redis
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
    log_tail,
    new_loop,
    on_signal,
    percentile,
    positive,
    server_env,
    start_valkey,
    stop_process,
    wait_ready,
)

from app import heap  # (keel's collector settings, for the bare endpoint when asked)

AGENT = "deploy.bench.agents:agent"
SEQ_WARMUP = 20
CONC_TURNS = 20
PHASE_TIMEOUT_S = 180.0
BODY = b'{"text":"hello"}'


class TurnReply(msgspec.Struct):
    status: str


class Created(msgspec.Struct):
    session_id: str


turn_decoder = msgspec.json.Decoder(TurnReply)
created_decoder = msgspec.json.Decoder(Created)


@dataclass
class Failures:
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(what)


@dataclass
class System:
    """How the client talks to one system: make a session, then run turns in it."""

    server: Server
    new_session: Callable[[Conn], Awaitable[str]]
    turn_path: Callable[[str], str]
    valkey: tuple[int, int] | None = None  # its own Valkey (port, pid), if not the shared one

    @property
    def name(self) -> str:
        return self.server.name

    async def turn(self, conn: Conn, path: str, failures: Failures) -> bool:
        status, body = await conn.request("POST", path, BODY)
        if status == 200:
            try:
                if turn_decoder.decode(body).status == "completed":
                    return True
            except msgspec.DecodeError:
                pass
        failures.add(f"{self.name} POST {path} -> {status} {body[:300]!r}")
        return False


async def keel_session(conn: Conn) -> str:
    status, body = await conn.request("POST", "/v1/sessions", b"{}")
    if status != 201:
        raise BenchError(f"keel POST /v1/sessions -> {status} {body[:300]!r}")
    return created_decoder.decode(body).session_id


_bare_ids = iter(range(10**9))


async def bare_session(conn: Conn) -> str:
    return f"b{os.getpid()}-{next(_bare_ids)}"


# ---- measurements ------------------------------------------------------------------------


async def counters(redis: Redis, server_pid: int, valkey_pid: int) -> tuple[int, int, float, float]:
    """Valkey's commands run (counting those inside Lua scripts) and socket reads (with one turn
    at a time, reads per turn is about the round trips per turn: a pipeline is one read); the
    CPU seconds of the server and of Valkey."""
    info = await redis.info("stats")
    commands, reads = int(info["total_commands_processed"]), int(info["total_reads_processed"])
    return commands, reads, cpu_seconds(server_pid), cpu_seconds(valkey_pid)


@asynccontextmanager
async def phase(system: System, deadline: Deadline) -> AsyncIterator[None]:
    """Bound a phase in time; on a timeout or a broken connection, say which system and show its log."""
    try:
        async with asyncio.timeout(deadline.left(PHASE_TIMEOUT_S)):
            yield
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        alive = system.server.proc is not None and system.server.proc.poll() is None
        raise BenchError(
            f"{system.name}: {type(exc).__name__}: {exc} (server {'running' if alive else 'exited'}):\n"
            f"{log_tail(system.server.log)}"
        ) from exc


async def sequential(
    system: System, turns: int, redis: Redis, valkey_pid: int, *, deadline: Deadline, failures: Failures
) -> dict[str, float]:
    latencies: list[float] = []
    async with phase(system, deadline):
        conn = await Conn.open(system.server.port)
        try:
            path = system.turn_path(await system.new_session(conn))
            for _ in range(SEQ_WARMUP):
                await system.turn(conn, path, failures)
            cmds0, reads0, cpu0, vk0 = await counters(redis, system.server.pid, valkey_pid)
            clock = time.perf_counter
            for _ in range(turns):
                t0 = clock()
                await system.turn(conn, path, failures)
                latencies.append((clock() - t0) * 1000.0)
            cmds1, reads1, cpu1, vk1 = await counters(redis, system.server.pid, valkey_pid)
        finally:
            await conn.close()
    return {
        "seq_p50_ms": statistics.median(latencies),
        "seq_p99_ms": percentile(latencies, 99),
        "seq_mean_ms": statistics.fmean(latencies),
        "redis_cmds_per_turn": (cmds1 - cmds0 - 1) / turns,  # -1: the INFO itself
        "redis_round_trips_per_turn": (reads1 - reads0 - 1) / turns,  # -1: the INFO itself
        "seq_server_cpu_ms_per_turn": (cpu1 - cpu0) * 1000.0 / turns,
        "seq_valkey_cpu_ms_per_turn": (vk1 - vk0) * 1000.0 / turns,
    }


async def concurrent_round(
    system: System, sessions: int, valkey_pid: int, deadline: Deadline, failures: Failures
) -> dict[str, Any]:
    conns: list[Conn] = []
    latencies: list[float] = []
    clock = time.perf_counter

    async def setup() -> tuple[Conn, str]:
        conn = await Conn.open(system.server.port)
        conns.append(conn)
        return conn, system.turn_path(await system.new_session(conn))

    async def worker(conn: Conn, path: str) -> None:
        for _ in range(CONC_TURNS):
            t0 = clock()
            ok = await system.turn(conn, path, failures)
            latencies.append((clock() - t0) * 1000.0)
            if not ok:
                return

    async with phase(system, deadline):
        try:
            ready = await asyncio.gather(*(setup() for _ in range(sessions)))
            cpu0, vk0, me0 = cpu_seconds(system.server.pid), cpu_seconds(valkey_pid), time.process_time()
            t0 = clock()
            await asyncio.gather(*(worker(conn, path) for conn, path in ready))
            wall = clock() - t0
            cpu1, vk1, me1 = cpu_seconds(system.server.pid), cpu_seconds(valkey_pid), time.process_time()
        finally:
            await asyncio.gather(*(c.close() for c in conns))
    n = sessions * CONC_TURNS
    return {
        "turns_per_s": n / wall,
        "p50_ms": statistics.median(latencies),
        "p99_ms": percentile(latencies, 99),
        "server_cpu_ms_per_turn": (cpu1 - cpu0) * 1000.0 / n,
        "valkey_cpu_ms_per_turn": (vk1 - vk0) * 1000.0 / n,
        "client_cpu_ms_per_turn": (me1 - me0) * 1000.0 / n,
    }


def check(failures: Failures, system: System, what: str) -> None:
    if failures.count:
        examples = "\n  ".join(failures.examples)
        raise BenchError(
            f"{system.name} {what}: {failures.count} failed turn(s), e.g.:\n  {examples}\n"
            f"--- {system.name} log (tail) ---\n{log_tail(system.server.log)}"
        )


async def measure(systems: list[System], valkey: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    deadline: Deadline = args.deadline_obj
    for s in systems:
        await wait_ready(s.server, deadline)
    own = {s.name: s.valkey or valkey for s in systems}  # (port, pid) of each system's Valkey
    clients = {s.name: Redis(host=HOST, port=own[s.name][0]) for s in systems}
    results: dict[str, dict[str, Any]] = {s.name: {} for s in systems}
    try:
        for s in systems:
            failures = Failures()
            redis, pid = clients[s.name], own[s.name][1]
            results[s.name].update(await sequential(s, args.turns, redis, pid, deadline=deadline, failures=failures))
            check(failures, s, "sequential")
        rounds: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
        for _ in range(args.rounds):
            for s in systems:
                failures = Failures()
                rounds[s.name].append(await concurrent_round(s, args.sessions, own[s.name][1], deadline, failures))
                check(failures, s, f"concurrent ({args.sessions} sessions)")
    finally:
        for client in clients.values():
            await client.aclose()
    for s in systems:
        rs = rounds[s.name]
        r = results[s.name]
        r["turns_per_s"] = statistics.median(x["turns_per_s"] for x in rs)
        r["turns_per_s_rounds"] = [round(x["turns_per_s"], 1) for x in rs]
        for key in ("p50_ms", "p99_ms", "server_cpu_ms_per_turn", "valkey_cpu_ms_per_turn", "client_cpu_ms_per_turn"):
            r[f"conc_{key}"] = statistics.median(x[key] for x in rs)
    return results


# ---- report ------------------------------------------------------------------------------


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    keel, bare = results["keel"], results["bare"]
    ratios = {
        "seq_p50": keel["seq_p50_ms"] / bare["seq_p50_ms"],
        "seq_p99": keel["seq_p99_ms"] / bare["seq_p99_ms"],
        "turns_per_s": keel["turns_per_s"] / bare["turns_per_s"],
    }
    print(f"\nsequential: 1 session, {SEQ_WARMUP} warm-up + {args.turns} timed turns")
    print(f"concurrent: {args.sessions} sessions x {CONC_TURNS} turns at once, median of {args.rounds} round(s)")
    print("Valkey AOF everysec; HTTP/1.1 keep-alive on loopback, one connection per session\n")
    cols = (
        "system",
        "seq p50 ms",
        "seq p99 ms",
        "turns/s",
        "conc p99 ms",
        "Redis RTT/turn",
        "cmds/turn",
        "CPU ms/turn",
    )
    print("{:<6} {:>10} {:>10} {:>8} {:>11} {:>14} {:>9} {:>11}".format(*cols))
    for name, r in results.items():
        print(
            f"{name:<6} {r['seq_p50_ms']:>10.3f} {r['seq_p99_ms']:>10.3f} {r['turns_per_s']:>8,.0f}"
            f" {r['conc_p99_ms']:>11.1f} {r['redis_round_trips_per_turn']:>14.1f} {r['redis_cmds_per_turn']:>9.1f}"
            f" {r['conc_server_cpu_ms_per_turn']:>11.3f}"
        )
    print(
        "(Redis RTT/turn: Valkey socket reads per sequential turn; cmds/turn: Valkey commands per"
        " sequential turn, counting those inside Lua; CPU ms/turn: the server process under load)"
    )
    print(
        f"\nkeel/bare: seq p50 x{ratios['seq_p50']:.2f}, seq p99 x{ratios['seq_p99']:.2f},"
        f" turns/s x{ratios['turns_per_s']:.3f}"
    )
    traced = results.get("traced")
    if traced is not None:  # (--tracing: keel with its spans exported, beside keel without)
        ratios["traced_cpu"] = traced["conc_server_cpu_ms_per_turn"] / keel["conc_server_cpu_ms_per_turn"]
        ratios["traced_seq_cpu"] = traced["seq_server_cpu_ms_per_turn"] / keel["seq_server_cpu_ms_per_turn"]
        added = traced["conc_server_cpu_ms_per_turn"] - keel["conc_server_cpu_ms_per_turn"]
        print(
            f"traced/keel: server CPU per turn under load x{ratios['traced_cpu']:.2f} ({added:+.3f} ms),"
            f" sequential x{ratios['traced_seq_cpu']:.2f}; seq p50 x{traced['seq_p50_ms'] / keel['seq_p50_ms']:.2f};"
            f" {args.spans_received} spans received"
        )
    notes = []
    if ratios["seq_p50"] > 3:
        notes.append(f"keel seq p50 is {ratios['seq_p50']:.1f}x bare (target: at most 3x)")
    if keel["turns_per_s"] < 1000:
        notes.append(f"keel does {keel['turns_per_s']:,.0f} turns/s at {args.sessions} sessions (target: 1,000)")
    for note in notes:
        print(f"NOTE: {note}")
    out = {
        "config": {"turns": args.turns, "sessions": args.sessions, "rounds": args.rounds, "conc_turns": CONC_TURNS},
        "keel": keel,
        "bare": bare,
        **({"traced": traced, "spans_received": args.spans_received} if traced is not None else {}),
        "ratio_keel_over_bare": ratios,
    }
    print("RESULT " + json.dumps(out, default=float), flush=True)
    return out


# ---- the bare baseline (runs in its own process: --serve-bare) -----------------------------

BARE_LUA = """
redis.call('RPUSH', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XADD', KEYS[2], '*', 'type', 'turn', 'n', ARGV[3])
"""


def bare_app(redis_port: int) -> Starlette:
    """POST /turn/{sid}: LRANGE the last 20 items, then one EVALSHA (RPUSH user + assistant, XADD)."""
    redis = Redis.from_url(f"redis://{HOST}:{redis_port}", max_connections=512, health_check_interval=30)
    script = redis.register_script(BARE_LUA)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await redis.aclose()

    async def turn(request: Request) -> Response:
        sid = request.path_params["sid"]
        text = json.loads(await request.body())["text"]
        hist_key, events_key = f"bare:{sid}:hist", f"bare:{sid}:events"
        raw = await redis.lrange(hist_key, -20, -1)  # round trip 1
        history = [json.loads(x) for x in raw]
        # a zero-latency "model": the reply depends on the history, so the read is used
        user = {"role": "user", "content": text}
        reply = {"role": "assistant", "content": f"hi ({len(history)} items seen)"}
        event_id = await script(  # round trip 2 (EVALSHA)
            keys=[hist_key, events_key], args=[json.dumps(user), json.dumps(reply), len(history)]
        )
        return JSONResponse(
            {"session_id": sid, "status": "completed", "reply": reply["content"], "event": event_id.decode()}
        )

    async def readyz(request: Request) -> Response:
        await redis.ping()
        return JSONResponse({"ok": True})

    routes = [Route("/turn/{sid}", turn, methods=["POST"]), Route("/readyz", readyz, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


def serve_bare(port: int, redis_port: int, gc_threshold: int) -> None:
    heap.settle(gc_threshold)  # (as keel's process settles its own: 0, Python's own settings)
    uvicorn.run(bare_app(redis_port), host=HOST, port=port, log_level="warning")


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--turns", type=positive, default=300, help="timed sequential turns (default 300)")
    ap.add_argument("--sessions", type=positive, default=100, help="concurrent sessions (default 100)")
    ap.add_argument("--rounds", type=positive, default=3, help="concurrent rounds (default 3)")
    ap.add_argument("--deadline", type=float, default=600.0, help="global time budget in seconds (default 600)")
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="also keel with tracing on (OTLP/HTTP to a receiver in this process, its own Valkey): 'traced'",
    )
    ap.add_argument(
        "--bare-gc-threshold",
        type=int,
        default=heap.THRESHOLD,
        help="the bare endpoint's collector set as keel sets its own (app/heap.py) at this threshold "
        f"(default {heap.THRESHOLD}, keel's default; 0: Python's own settings)",
    )
    ap.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--redis-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.turns > 100_000 or args.sessions > 2_000 or args.rounds > 100:
        ap.error("keep --turns <= 100000, --sessions <= 2000 and --rounds <= 100")
    return args


def start_traced(
    tmp: Path, deadline: Deadline, keel_env: dict[str, str], servers: list[Server], valkeys: list[Any]
) -> tuple[System, Any]:
    """--tracing: keel as `keel` is, with its spans exported over OTLP/HTTP to a receiver in this
    process (tests/otlp_receiver.py), on a Valkey of its own (no turn of the other's there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the repository: its tests' receiver)
    from tests.otlp_receiver import Receiver

    receiver = Receiver()
    receiver.start()
    (tmp / "valkey2").mkdir()
    valkey, port = start_valkey(tmp / "valkey2", deadline)
    valkeys.append(valkey)
    traced = Server("traced", free_port(), tmp / "traced.log")
    servers.append(traced)
    env = keel_env | {"REDIS_URL": f"redis://{HOST}:{port}", "KEEL_PORT": str(traced.port)}
    traced.start([sys.executable, "-m", "app"], server_env(env | {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}))
    return System(
        traced, keel_session, lambda sid: f"/v1/sessions/{sid}/messages?wait=true", (port, valkey.pid)
    ), receiver


def run(args: argparse.Namespace) -> int:
    args.deadline_obj = deadline = Deadline(args.deadline)
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-"))
    valkey: subprocess.Popen[bytes] | None = None
    extra_valkeys: list[subprocess.Popen[bytes]] = []
    receiver: Any = None  # (--tracing: the OTLP receiver, tests/otlp_receiver.py)
    servers: list[Server] = []
    try:
        (tmp / "valkey").mkdir()
        valkey, valkey_port = start_valkey(tmp / "valkey", deadline)
        redis_url = f"redis://{HOST}:{valkey_port}"
        keel = Server("keel", free_port(), tmp / "keel.log")
        bare = Server("bare", free_port(), tmp / "bare.log")
        servers = [keel, bare]
        keel_env = {"REDIS_URL": redis_url, "KEEL_HOST": HOST, "KEEL_PORT": str(keel.port)}
        keel_env |= {"KEEL_LOG_LEVEL": "warning", "KEEL_AGENT": AGENT}
        keel.start([sys.executable, "-m", "app"], server_env(keel_env))
        bare_argv = [sys.executable, str(Path(__file__).resolve()), "--serve-bare", "--port", str(bare.port)]
        bare_argv += ["--redis-port", str(valkey_port), "--bare-gc-threshold", str(args.bare_gc_threshold)]
        bare.start(bare_argv, server_env({}))
        systems = [
            System(keel, keel_session, lambda sid: f"/v1/sessions/{sid}/messages?wait=true"),
            System(bare, bare_session, lambda sid: f"/turn/{sid}"),
        ]
        if args.tracing:
            traced, receiver = start_traced(tmp, deadline, keel_env, servers, extra_valkeys)
            systems.insert(1, traced)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            results = runner.run(measure(systems, (valkey_port, valkey.pid), args))
        for s in servers:
            s.check_alive()
        if receiver is not None:
            stop_process(servers[-1].proc)  # (its last spans exported as it stops)
            args.spans_received = len(receiver.spans)
            if not args.spans_received:
                raise BenchError("tracing was on, and no span came")
        report(results, args)
        return 0
    except BenchError as exc:
        print(f"bench_http: {exc}", file=sys.stderr)
        return 1
    finally:
        for s in servers:
            stop_process(s.proc)
        stop_process(valkey)
        for v in extra_valkeys:
            stop_process(v)
        if receiver is not None:
            receiver.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    args = parse_args()
    if args.serve_bare:
        if args.port is None or args.redis_port is None:
            print("--serve-bare needs --port and --redis-port", file=sys.stderr)
            return 2
        serve_bare(args.port, args.redis_port, args.bare_gc_threshold)
        return 0
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
