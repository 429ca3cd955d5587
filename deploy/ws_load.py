"""Websocket load: N browser-like clients, each on its own session over keel's websocket channel.

    .venv/bin/python deploy/ws_load.py --clients 1000 --turns 5

Starts a private Valkey and keel (`python -m app`, the zero-latency benchmark agent), creates
N sessions, opens N sockets at once and holds them, measures the server's RSS per idle
connection, then has every client run its turns at the same time (send a message frame, wait
for its turn.completed). Finally each client's events are checked against the session's outbox
in Redis: every event once, in order, none missing. Prints turns/s, turn latency p50/p99, RSS
per idle connection, CPU per turn; exits 1 if any event was lost, duplicated or out of order.
KEEL_LOAD_PROFILE=out.txt records a py-spy profile (raw, folded stacks) of the server's turns.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

import httpx
from redis.asyncio import Redis
from support import (  # deploy/bench/support.py
    HOST,
    BenchError,
    Deadline,
    cpu_seconds,
    free_port,
    log_tail,
    percentile,
    server_env,
    start_process,
    start_valkey,
    stop_process,
)
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from harness.events import SessionCreated, TurnCompleted

AGENT = "deploy.bench.agents:agent"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchError(f"no VmRSS for {pid}")


class Client:
    """One browser tab: a socket on one session, the events it saw, its turns' latencies."""

    def __init__(self, sid: str, base: str) -> None:
        self.sid, self.url = sid, f"{base}/v1/sessions/{sid}/ws"
        self.events: list[dict[str, Any]] = []
        self.latencies: list[float] = []
        self.ready = asyncio.Event()
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.ws: ClientConnection | None = None
        self.dropped: str | None = None

    async def hold(self, release: asyncio.Event) -> None:
        async with connect(self.url, max_size=None, open_timeout=60) as ws:
            self.ws = ws
            reader = asyncio.create_task(self._read(ws))
            await release.wait()
            reader.cancel()

    async def _read(self, ws: ClientConnection) -> None:
        try:
            await self._frames(ws)
        except ConnectionClosed as exc:
            self.dropped = f"closed by the server: {exc}"
            for waiter in self.waiting.values():
                if not waiter.done():
                    waiter.set_exception(BenchError(f"{self.sid}: {self.dropped}"))

    async def _frames(self, ws: ClientConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            if "id" not in frame:
                continue  # heartbeat, pong, error
            self.events.append(frame)
            if frame["type"] == SessionCreated.TYPE:
                self.ready.set()
            elif frame["type"] == TurnCompleted.TYPE:
                waiter = self.waiting.pop(frame["data"]["message_id"], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def turns(self, n: int) -> None:
        assert self.ws is not None
        loop = asyncio.get_running_loop()
        for k in range(n):
            mid = f"{self.sid[-8:]}-{k}"
            done = self.waiting[mid] = loop.create_future()
            t0 = time.perf_counter()
            await self.ws.send(json.dumps({"type": "message", "text": f"turn {k}", "message_id": mid}))
            await asyncio.wait_for(done, 60)
            self.latencies.append(time.perf_counter() - t0)


async def check(redis: Redis, client: Client) -> str | None:
    """None if the client saw exactly its session's outbox, in order; else what is wrong."""
    raw: Any = await redis.xrange(f"keel:{{{client.sid}}}:outbox")
    outbox = [eid.decode() for eid, _ in raw]
    seen = [e["id"] for e in client.events]
    if seen == outbox:
        return None
    if len(set(seen)) != len(seen):
        return f"{client.sid}: {len(seen) - len(set(seen))} duplicate events"
    missing = [e for e in outbox if e not in set(seen)]
    return f"{client.sid}: {len(missing)} events missing" if missing else f"{client.sid}: out of order"


class Measured:
    """What a run saw, for the report."""

    def __init__(self) -> None:
        self.opened_s = self.elapsed = self.cpu_server = self.cpu_client = 0.0
        self.rss_before = self.rss_held = self.rss_after = 0


async def wait_ready(http: httpx.AsyncClient, keel: subprocess.Popen[bytes], log: Path) -> None:
    for _ in range(300):
        try:
            if (await http.get("/readyz")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if keel.poll() is not None:
            raise BenchError(f"keel exited:\n{log_tail(log)}")
        await asyncio.sleep(0.1)
    raise BenchError("keel did not become ready")


async def make_sessions(http: httpx.AsyncClient, n: int) -> list[str]:
    limit = asyncio.Semaphore(32)

    async def create() -> str:
        async with limit:
            sid: str = (await http.post("/v1/sessions")).json()["session_id"]
            return sid

    return list(await asyncio.gather(*(create() for _ in range(n))))


async def open_all(tabs: list[Client], release: asyncio.Event) -> list[asyncio.Task[None]]:
    holds = [asyncio.create_task(c.hold(release)) for c in tabs]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.ready.wait() for c in tabs)), 120)
    except TimeoutError:
        dropped = [c.dropped for c in tabs if c.dropped]
        raise BenchError(f"{len(dropped)} sockets were dropped while opening: {dropped[:3]}") from None
    return holds


async def drive(tabs: list[Client], turns: int, pid: int, m: Measured) -> None:
    if profile := os.environ.get("KEEL_LOAD_PROFILE"):  # a py-spy profile of the server's turns
        argv = ["py-spy", "record", "-o", profile, "-f", "raw", "-p", str(pid), "-d", "12"]
        await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0, cpu_server, cpu_client = time.perf_counter(), cpu_seconds(pid), time.process_time()
    await asyncio.gather(*(c.turns(turns) for c in tabs))
    m.elapsed = time.perf_counter() - t0
    m.cpu_server, m.cpu_client = cpu_seconds(pid) - cpu_server, time.process_time() - cpu_client


def report(tabs: list[Client], turns: int, m: Measured, problems: list[str]) -> None:
    lat = [x * 1000 for c in tabs for x in c.latencies]
    n, clients = len(lat), len(tabs)
    print(f"clients {clients}, turns per client {turns}, sockets opened and confirmed in {m.opened_s:.1f} s")
    print(f"server RSS: {m.rss_before / 1024:.1f} MiB before, {m.rss_held / 1024:.1f} MiB with {clients} idle sockets")
    print(
        f"  -> {(m.rss_held - m.rss_before) / clients:.1f} KiB per idle connection; {m.rss_after / 1024:.1f} MiB after"
    )
    print(f"turns: {n} in {m.elapsed:.2f} s = {n / m.elapsed:,.0f} turns/s, all clients at once")
    print(
        f"turn latency (send -> turn.completed): p50 {statistics.median(lat):.1f} ms, p99 {percentile(lat, 99):.1f} ms"
    )
    print(f"CPU per turn: server {m.cpu_server * 1000 / n:.2f} ms, this client {m.cpu_client * 1000 / n:.2f} ms")
    events = sum(len(c.events) for c in tabs)
    print(f"events checked against the outbox: {events:,}; lost, duplicated or out of order: {len(problems)}")
    for p in problems[:10]:
        print("  " + p)


async def run(clients: int, turns: int, tmp: Path) -> int:
    valkey, vport = start_valkey(tmp, Deadline(600))
    port = free_port()
    env = {"REDIS_URL": f"redis://{HOST}:{vport}", "KEEL_PORT": str(port), "KEEL_AGENT": AGENT}
    env |= {"KEEL_LOG_LEVEL": "warning", "KEEL_DATA_DIR": str(tmp / "keel"), "KEEL_DEMO_PAGE": "0"}
    log = tmp / "keel.log"
    keel = start_process([sys.executable, "-m", "app"], server_env(env), log)
    redis = Redis(host=HOST, port=vport)
    m, release = Measured(), asyncio.Event()
    try:
        async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=30) as http:
            await wait_ready(http, keel, log)
            sids = await make_sessions(http, clients + 50)
        base = f"ws://{HOST}:{port}"
        warm = await open_all([Client(sid, base) for sid in sids[clients:]], release)  # once-only allocations
        m.rss_before = rss_kib(keel.pid)
        tabs = [Client(sid, base) for sid in sids[:clients]]
        t0 = time.perf_counter()
        holds = await open_all(tabs, release)
        m.opened_s = time.perf_counter() - t0
        gc.collect()
        m.rss_held = rss_kib(keel.pid)
        await drive(tabs, turns, keel.pid, m)
        m.rss_after = rss_kib(keel.pid)
        problems = [p for c in tabs if (p := await check(redis, c))]
        release.set()
        await asyncio.gather(*holds, *warm, return_exceptions=True)
        report(tabs, turns, m, problems)
        return 1 if problems else 0
    finally:
        await redis.aclose()
        if sys.exc_info()[0] is not None or keel.poll() is not None:
            print(f"keel's log:\n{log_tail(log)}", file=sys.stderr)
        stop_process(keel)
        stop_process(valkey)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=5, help="turns per client, all clients at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-ws-load-") as tmp:
        try:
            return asyncio.run(run(args.clients, args.turns, Path(tmp)))
        except BenchError as exc:
            print(f"ws_load: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
