"""A rolling restart under load (issue 15, item 5): two web processes and a worker on one Valkey,
clients running turns without pause against both web ports, and every process restarted in turn
(SIGTERM, wait for its exit, start it again), each once the load has moved on since the last.

Clients do what the README asks of them. HTTP clients POST messages (with their own message_id,
so a retry is safe) and follow their session's SSE stream; websocket clients send their
messages as frames. A 503 is retried after its Retry-After, on the other port (as a load
balancer would); an SSE stream that ends, or a websocket closed with 1012, is opened again on
the other port after the last event id; a websocket client sends its message again after a
reconnect (same message_id). Anything else is an error. At the end every client's events are
compared with its session's outbox: none lost, none twice, each message's turn completed once.

Used by tests/app/test_rolling_restart.py and deploy/rolling_restart.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tests.conftest import free_port
from tests.service import Service, Worker

TURN_TIMEOUT_S = 15.0  # a turn left to a lapsed lease (20 s here) would take longer
CAUGHT_UP_TIMEOUT_S = 15.0
LEASE_MS = 20_000
TEXTS = ("think 0.2", "hold 0.15", "hello")  # a slow model call, a slow tool, a quick turn
DRAINED = re.compile(r"drained: (\d+) turns handed over")


@dataclass
class Tally:
    turns: int = 0  # turns the clients saw complete
    events: int = 0  # committed events the clients received, checked against the outboxes
    lost: int = 0  # outbox events a client never received
    duplicated: int = 0  # events a client received more than once
    retried_503: int = 0  # 503s (with Retry-After) retried
    reopened_1012: int = 0  # websockets closed with 1012 and opened again elsewhere
    sse_ended: int = 0  # SSE streams the server ended cleanly, resumed elsewhere
    refused: int = 0  # connections refused (no process on the port)
    handed_over: int = 0  # turns the draining processes handed over (their logs)
    errors: list[str] = field(default_factory=list)  # anything else a client saw
    drains: list[tuple[str, float, int]] = field(default_factory=list)  # (process, s from SIGTERM to exit, status)

    def lines(self) -> list[str]:
        drains = ", ".join(f"{name} {s:.1f}s exit {code}" for name, s, code in self.drains)
        return [
            f"turns {self.turns}, events {self.events}: lost {self.lost}, duplicated {self.duplicated}",
            f"503 retried {self.retried_503}, websockets reopened after 1012 {self.reopened_1012}, "
            f"SSE streams ended and resumed {self.sse_ended}, connections refused {self.refused}",
            f"turns handed over {self.handed_over}; drains: {drains}",
            f"errors {len(self.errors)}" + "".join(f"\n  {e}" for e in self.errors[:20]),
        ]


class Client:
    """One session, its messages and the events it received (committed ones: they have ids)."""

    def __init__(self, name: str, ports: tuple[int, int], tally: Tally, rng: random.Random) -> None:
        self.name, self.ports, self.tally, self.rng = name, ports, tally, rng
        self.port = ports[int(name[-1]) % 2]
        self.sid = ""
        self.events: list[dict[str, Any]] = []
        self.sent: list[str] = []  # message ids, in order
        self.completed = 0
        self.changed = asyncio.Event()

    def avoid(self, port: int) -> None:
        """That port refused or is going away: use the other one from now on."""
        if self.port == port:
            self.port = self.ports[1] if port == self.ports[0] else self.ports[0]

    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def next_message(self) -> tuple[str, str]:
        mid = f"{self.name}-{len(self.sent)}"
        self.sent.append(mid)
        return mid, self.rng.choice(TEXTS)

    def received(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.changed.set()

    def done_with(self, mid: str) -> bool:
        return any(e["type"] == "turn.completed" and e["data"].get("message_id") == mid for e in self.events)

    async def request(self, http: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
        """The answer, after retrying 503s (Retry-After) and refused connections elsewhere."""
        while True:
            port = self.port
            try:
                r = await http.request(method, f"{self.base()}{path}", **kw)
            except httpx.ConnectError:
                self.tally.refused += 1
                self.avoid(port)
                await asyncio.sleep(0.05)
                continue
            except httpx.HTTPError as exc:  # (the same message_id again is safe)
                self.tally.errors.append(f"{self.name} {method} {path} on {port}: {exc!r}")
                self.avoid(port)
                continue
            if r.status_code == 503 and "retry-after" in r.headers:
                self.tally.retried_503 += 1
                self.avoid(port)
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            if r.status_code >= 400:
                self.tally.errors.append(f"{self.name} {method} {path} on {port}: {r.status_code} {r.text}")
            return r

    async def create(self, http: httpx.AsyncClient) -> None:
        self.sid = (await self.request(http, "POST", "/v1/sessions")).json()["session_id"]

    async def wait_done(self, mid: str) -> None:
        try:
            async with asyncio.timeout(TURN_TIMEOUT_S):
                while not self.done_with(mid):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            self.tally.errors.append(f"{self.name}: the turn of {mid} did not complete in {TURN_TIMEOUT_S:.0f}s")


class HttpClient(Client):
    """POSTs its messages one after the other and follows the session's SSE stream."""

    async def run(self, stop: asyncio.Event, http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            mid, text = self.next_message()
            body = {"text": text, "message_id": mid}
            await self.request(http, "POST", f"/v1/sessions/{self.sid}/messages", json=body)
            await self.wait_done(mid)
            self.completed += 1

    async def follow(self, http: httpx.AsyncClient) -> None:
        while True:
            port = self.port
            headers = {"Last-Event-ID": self.events[-1]["id"]} if self.events else {}
            try:
                async with http.stream("GET", f"{self.base()}/v1/sessions/{self.sid}/events", headers=headers) as r:
                    if r.status_code == 503 and "retry-after" in r.headers:
                        self.tally.retried_503 += 1
                        self.avoid(port)
                        await asyncio.sleep(float(r.headers["retry-after"]))
                        continue
                    if r.status_code != 200:
                        self.tally.errors.append(f"{self.name} SSE on {port}: {r.status_code}")
                        self.avoid(port)
                        continue
                    committed, data = False, None
                    async for line in r.aiter_lines():
                        if line.startswith("id: "):  # (live events have none)
                            committed = True
                        elif line.startswith("data: "):
                            data = line[6:]
                        elif line == "":
                            if committed and data is not None:
                                self.received(json.loads(data))
                            committed, data = False, None
                self.tally.sse_ended += 1
            except httpx.ConnectError:
                self.tally.refused += 1
                await asyncio.sleep(0.05)
            except httpx.HTTPError as exc:
                self.tally.errors.append(f"{self.name} SSE on {port}: {exc!r}")
            self.avoid(port)


class WsClient(Client):
    """Sends its messages as websocket frames, one after the other, on the socket it reads."""

    async def run(self, stop: asyncio.Event, idle: asyncio.Event) -> None:
        mid, text = self.next_message()
        while True:
            port = self.port
            after = f"?after={self.events[-1]['id']}" if self.events else ""
            try:
                async with connect(f"ws://127.0.0.1:{port}/v1/sessions/{self.sid}/ws{after}", open_timeout=5) as ws:
                    if not self.done_with(mid):  # (again after a reconnect: the same message_id is one message)
                        await ws.send(json.dumps({"type": "message", "text": text, "message_id": mid}))
                    async for raw in ws:
                        frame = json.loads(raw)
                        if frame["type"] == "error":
                            self.tally.errors.append(f"{self.name} ws on {port}: {frame['error']}")
                        if "id" not in frame:
                            continue
                        self.received(frame)
                        if not idle.is_set() and self.done_with(mid):
                            self.completed += 1
                            if stop.is_set():
                                idle.set()  # (reads on, until the test has checked it caught up)
                                continue
                            mid, text = self.next_message()
                            await ws.send(json.dumps({"type": "message", "text": text, "message_id": mid}))
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                if code == 1012:
                    self.tally.reopened_1012 += 1
                else:
                    self.tally.errors.append(f"{self.name} ws on {port} closed: {code}")
            except OSError:  # refused
                self.tally.refused += 1
                await asyncio.sleep(0.05)
            except (InvalidHandshake, TimeoutError) as exc:
                self.tally.errors.append(f"{self.name} ws on {port}: {exc!r}")
            self.avoid(port)


@dataclass
class Fleet:
    """Two web processes and a worker, on one Valkey."""

    web: list[Service]
    worker: Worker

    @classmethod
    def make(cls, redis_url: str, workdir: Path, **env: str) -> Fleet:
        common = {
            "KEEL_AGENT": "tests.crash_agent:slow",
            "KEEL_LEASE_MS": str(LEASE_MS),
            "KEEL_TEST_LOG": str(workdir / "calls.jsonl"),
            "KEEL_LOG_LEVEL": "info",  # (the "drained:" line)
            **env,
        }
        for name in ("web1", "web2", "worker"):
            (workdir / name).mkdir(parents=True, exist_ok=True)
        web = [Service(workdir / n, free_port(), REDIS_URL=redis_url, **common) for n in ("web1", "web2")]
        return cls(web, Worker(workdir / "worker", redis_url, **common))

    def named(self) -> list[tuple[str, Service | Worker]]:
        return [("web1", self.web[0]), ("web2", self.web[1]), ("worker", self.worker)]

    async def start(self) -> None:
        for _, proc in self.named():
            await asyncio.to_thread(proc.start)

    async def restart(self, name: str, proc: Service | Worker, tally: Tally) -> None:
        assert proc.proc is not None
        began = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait_exit, 30)
        tally.drains.append((name, time.monotonic() - began, code))
        await asyncio.to_thread(proc.start)

    def stop(self) -> None:
        for _, proc in self.named():
            proc.stop()

    def handed_over(self) -> int:
        logs = [p.log for _, p in self.named()]
        return sum(int(n) for log in logs if log.exists() for n in DRAINED.findall(log.read_text()))


async def progress(clients: list[Client], turns: int = 1) -> None:
    """Until every client has completed `turns` more turns (looked at every 0.1 s)."""
    marks = [c.completed + turns for c in clients]
    async with asyncio.timeout(2 * TURN_TIMEOUT_S):
        while any(c.completed < m for c, m in zip(clients, marks, strict=True)):  # noqa: ASYNC110
            await asyncio.sleep(0.1)


async def rolling_restart(
    redis_url: str, workdir: Path, *, clients: int = 4, rounds: int = 1, seed: int = 1, say: Callable[[str], None]
) -> Tally:
    """Run the load, restart every process `rounds` times over, and check every client's events."""
    tally, rng = Tally(), random.Random(seed)
    fleet = Fleet.make(redis_url, workdir)
    await fleet.start()
    ports = (fleet.web[0].port, fleet.web[1].port)
    https = [HttpClient(f"h{n}", ports, tally, random.Random(rng.random())) for n in range(clients)]
    sockets = [WsClient(f"w{n}", ports, tally, random.Random(rng.random())) for n in range(clients)]
    stop = asyncio.Event()
    idle = {c.name: asyncio.Event() for c in sockets}
    everyone: list[Client] = [*https, *sockets]
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as http:
            for c in everyone:
                await c.create(http)
            senders = [asyncio.create_task(c.run(stop, http)) for c in https]
            tasks = [
                *senders,
                *(asyncio.create_task(c.follow(http)) for c in https),
                *(asyncio.create_task(c.run(stop, idle[c.name])) for c in sockets),
            ]
            try:
                await progress(everyone)
                for n in range(rounds):
                    for name, proc in fleet.named():
                        await fleet.restart(name, proc, tally)
                        say(f"round {n + 1}: {name} restarted ({tally.drains[-1][1]:.1f}s from SIGTERM to exit)")
                        await progress(everyone)
                stop.set()
                async with asyncio.timeout(2 * TURN_TIMEOUT_S):
                    await asyncio.gather(*senders)
                    await asyncio.gather(*(e.wait() for e in idle.values()))
                redis = Redis.from_url(redis_url)
                try:
                    for c in everyone:
                        await check(c, redis, tally)
                finally:
                    await redis.aclose()
            finally:  # (before the client closes its connections under them)
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(BaseException):
                        await task
    finally:
        fleet.stop()
    tally.handed_over = fleet.handed_over()
    return tally


async def check(c: Client, redis: Redis, tally: Tally) -> None:
    """The client's events against the session's outbox, once it has caught up with it."""
    raw: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(f"keel:{{{c.sid}}}:outbox")  # type: ignore[assignment]
    stored = [(i.decode(), f[b"t"].decode(), json.loads(b"{" + f[b"b"])) for i, f in raw]
    last = stored[-1][0]
    try:
        async with asyncio.timeout(CAUGHT_UP_TIMEOUT_S):
            while not any(e["id"] == last for e in c.events):
                c.changed.clear()
                await c.changed.wait()
    except TimeoutError:
        tally.errors.append(f"{c.name}: never received the outbox's last event {last}")
    got = [e["id"] for e in c.events]
    ids = [i for i, _, _ in stored]
    tally.events += len(got)
    tally.duplicated += len(got) - len(set(got))
    tally.lost += len(set(ids) - set(got))
    if [i for i in dict.fromkeys(got) if i in set(ids)] != ids:
        tally.errors.append(f"{c.name}: events out of order")
    if extra := set(got) - set(ids):
        tally.errors.append(f"{c.name}: {len(extra)} events not in the outbox")
    for mid in c.sent:
        ends = [t for _, t, env in stored if t.startswith("turn.") and env["data"].get("message_id") == mid]
        received = [t for _, t, env in stored if t == "message.received" and env["data"].get("message_id") == mid]
        if ends != ["turn.started", "turn.completed"] or len(received) != 1:
            tally.errors.append(f"{c.name}: message {mid}: {len(received)} received, turn events {ends}")
    tally.turns += c.completed
