"""SIGTERM drains a process (issue 15, item 5): it stops taking turns and hands its running one
over at once (the lease released, not left to lapse), /readyz and new requests answer 503
`draining` with Retry-After, websockets close with 1012 and SSE streams end cleanly; clients
that reconnect to another process get every event exactly once; the process exits 0. Real
processes (`python -m app`, `python -m app.worker`) on one real Valkey."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import ValkeyServer, free_port
from tests.service import EventTail, Service, Worker

LEASE_MS = 20_000  # a takeover that waited for the lease to lapse would take 20 s
TAKEOVER_S = 5.0  # ... one at once takes well under this
pytestmark = pytest.mark.slow


@pytest.fixture
def processes(valkey: ValkeyServer, redis: Redis, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`processes(name, worker=False, **env)`: a keel web process (or a worker) with the slow
    agent on the test's Valkey, not started; stopped after the test."""
    made: list[Service | Worker] = []

    def make(name: str, *, worker: bool = False, **env: str) -> Service | Worker:
        (tmp_path / name).mkdir()
        common = {
            "KEEL_AGENT": "tests.crash_agent:slow",
            "KEEL_LEASE_MS": str(LEASE_MS),
            "KEEL_TEST_LOG": str(tmp_path / "calls.jsonl"),
            **env,
        }
        proc = (
            Worker(tmp_path / name, valkey.url, **common)
            if worker
            else Service(tmp_path / name, free_port(), REDIS_URL=valkey.url, **common)
        )
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.stop()


async def logged(path: Path, match: Callable[[dict[str, Any]], bool], timeout: float = 10) -> dict[str, Any]:
    """The first record of the agent's log that matches, once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((r for r in records(path) if match(r)), None)
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"nothing like that in {path}")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def outbox(redis: Redis, sid: str) -> list[tuple[str, str]]:
    """(id, type) of every event in the session's outbox."""
    return [(i.decode(), f[b"t"].decode()) for i, f in await redis.xrange(f"keel:{{{sid}}}:outbox")]


async def frames_until_closed(ws: ClientConnection, timeout: float = 10) -> tuple[list[dict[str, Any]], int | None]:
    frames: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout):
            async for raw in ws:
                frames.append(json.loads(raw))
    except ConnectionClosed:
        pass
    return [f for f in frames if "id" in f], ws.close_code


async def frames_until(ws: ClientConnection, etype: str, timeout: float = 10) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        while not frames or frames[-1]["type"] != etype:
            frame = json.loads(await ws.recv())
            if "id" in frame:
                frames.append(frame)
    return frames


async def test_sigterm_hands_a_blocked_turn_over_and_clients_follow_elsewhere(
    processes: Any, redis: Redis, tmp_path: Path
) -> None:
    a, b = processes("a", KEEL_TEST_BLOCK="1"), processes("b")
    a.start()
    b.start()
    async with httpx.AsyncClient(base_url=a.base, timeout=10) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        tail = EventTail(a.base, sid)
        tail.start()
        try:
            async with connect(f"ws://127.0.0.1:{a.port}/v1/sessions/{sid}/ws") as ws:
                await tail.wait_for("session.created")
                r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "slow 1", "message_id": "m1"})
                assert r.status_code == 202
                await logged(tmp_path / "calls.jsonl", lambda r: "blocked" in r)
                tail.base = b.base  # where it reconnects (a load balancer's choice)
                a.proc.send_signal(signal.SIGTERM)
                began = time.monotonic()
                before, code = await frames_until_closed(ws)
            assert code == 1012
            after = before[-1]["id"]
            async with connect(f"ws://127.0.0.1:{b.port}/v1/sessions/{sid}/ws?after={after}") as ws:
                rest = await frames_until(ws, "turn.completed", timeout=TAKEOVER_S)
            taken_over_in = time.monotonic() - began
            await tail.wait_for("turn.completed", timeout=TAKEOVER_S)
        finally:
            await tail.stop()
    assert taken_over_in < TAKEOVER_S  # not the lease's 20 s
    assert a.wait_exit(10) == 0
    assert tail.endings[0] == "end" and tail.connections == 2  # ended cleanly; resumed on b

    stored = await outbox(redis, sid)
    upto = [e for e in stored[: [t for _, t in stored].index("turn.completed") + 1]]
    assert [(f["id"], f["type"]) for f in before + rest] == upto  # every event, exactly once, in order
    assert [(e["id"], e["type"]) for e in tail.events][: len(upto)] == upto
    types = [t for _, t in upto]
    assert types.count("turn.started") == 1 and types.count("message.completed") == 1
    assert "turn.cancelled" not in types and "turn.failed" not in types
    assert tail.events[[e["type"] for e in tail.events].index("turn.completed")]["data"]["reply"] == "re: slow 1"
    calls = [r for r in records(tmp_path / "calls.jsonl") if "model" in r]
    assert [r["pid"] for r in calls] == [a.proc.pid, b.proc.pid]  # cut in a, made once more in b


async def test_a_draining_process_answers_503_and_finishes_its_tool_first(
    processes: Any, redis: Redis, tmp_path: Path
) -> None:
    a = processes("a")
    a.start()
    async with httpx.AsyncClient(base_url=a.base, timeout=10) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hold 1.5", "message_id": "m1"})
        assert r.status_code == 202
        await logged(tmp_path / "calls.jsonl", lambda r: r.get("tool") == "hold")
        a.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(5):  # /readyz goes not-ready first
            while (ready := await c.get("/readyz")).status_code == 200:
                pass
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        assert ready.json()["error"]["code"] == "draining"
        refused = await c.post("/v1/sessions")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert set(refused.json()["error"]) == {"code", "message"} and refused.json()["error"]["code"] == "draining"
        assert (await c.get("/healthz")).status_code == 200  # alive all the same
    assert a.wait_exit(10) == 0
    assert await redis.exists(f"keel:{{{sid}}}:lease") == 0  # released (it would have lived 20 s)
    assert [r["tool"] for r in records(tmp_path / "calls.jsonl") if "tool" in r] == ["hold", "held"]

    b = processes("b")
    b.start()
    async with httpx.AsyncClient(base_url=b.base, timeout=10) as c:
        tail = EventTail(b.base, sid)
        tail.start()
        try:
            done = await tail.wait_for("turn.completed", timeout=TAKEOVER_S)
        finally:
            await tail.stop()
        assert done["data"]["reply"] == "done: held 1.5"
    types = [t for _, t in await outbox(redis, sid)]
    assert types.count("tool.started") == 1 and types.count("tool.completed") == 1
    assert types.count("turn.completed") == 1 and types.count("session.created") == 1
    assert [r["tool"] for r in records(tmp_path / "calls.jsonl") if "tool" in r] == ["hold", "held"]  # not again


async def test_sigterm_to_a_worker_hands_its_turn_over_at_once(processes: Any, redis: Redis, tmp_path: Path) -> None:
    web = processes("web", KEEL_RUN_TURNS="0")
    one = processes("one", worker=True, KEEL_TEST_BLOCK="1")
    two = processes("two", worker=True)
    web.start()
    one.start()
    async with httpx.AsyncClient(base_url=web.base, timeout=10) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "slow 1", "message_id": "m1"})
        assert r.status_code == 202
        await logged(tmp_path / "calls.jsonl", lambda r: "blocked" in r)
        two.start()
        tail = EventTail(web.base, sid)
        tail.start()
        try:
            one.proc.send_signal(signal.SIGTERM)
            done = await tail.wait_for("turn.completed", timeout=TAKEOVER_S)
        finally:
            await tail.stop()
    assert done["data"]["reply"] == "re: slow 1"
    assert one.wait_exit(10) == 0
    types = [t for _, t in await outbox(redis, sid)]
    assert types.count("turn.started") == 1 and types.count("message.completed") == 1
    assert types.count("turn.completed") == 1 and "turn.cancelled" not in types
