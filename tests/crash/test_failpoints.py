"""Crash keel at each failpoint, start a replacement on the same Redis, answer the ORIGINAL
request: the request stays the same, the tool runs once (a re-run after tool.after_run gets the
same idempotency key), no committed model step runs again, usage lists every provider attempt,
and an SSE client that follows the restart sees every event once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import ValkeyServer, free_port
from tests.service import EventTail, Service

# failpoint -> (KEEL_FAILPOINTS value, is the request shown before the crash, is it answered before)
SCENARIOS = {
    "step.before_commit": ("step.before_commit=exit", False, False),
    "step.after_commit": ("step.after_commit=exit", False, False),  # committed, never published
    # the 5th event written to the SSE client is input.requested (created, received, started, usage)
    "outbox.after_publish": ("outbox.after_publish=exit@5", True, False),
    "response.after_accept": ("response.after_accept=exit", True, True),
    "tool.after_run": ("tool.after_run=exit", True, True),
}


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
async def crashable(valkey: ValkeyServer, redis: Redis, tmp_path: Path) -> AsyncIterator[Service]:
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_LEASE_MS="1000",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
    )
    yield svc
    svc.stop()


async def crash(svc: Service, c: httpx.AsyncClient, tail: EventTail, failpoint: str) -> dict[str, Any] | None:
    """Drive the session until the armed failpoint kills the service; the request shown, if any."""
    _, shown_first, answer_first = SCENARIOS[failpoint]
    await c.post(f"/v1/sessions/{tail.sid}/messages", json={"text": "pay 7", "message_id": "m1"})
    shown = (await tail.wait_for("input.requested"))["data"]["requests"][0] if shown_first else None
    if answer_first:
        assert shown is not None
        body = {"request_id": shown["request_id"], "decision": "approve"}
        if failpoint == "response.after_accept":
            with pytest.raises(httpx.HTTPError):  # accepted, and the process dies before it answers
                await c.post(f"/v1/sessions/{tail.sid}/responses", json=body)
        else:  # answered at once; the resume then runs the tool and dies before committing its result
            assert (await c.post(f"/v1/sessions/{tail.sid}/responses", json=body)).status_code == 202
    assert svc.wait_exit() == 137, svc.log.read_text()
    return shown


async def recover(c: httpx.AsyncClient, tail: EventTail, shown: dict[str, Any] | None, failpoint: str) -> None:
    """After the restart: the pending request is the one shown; answer it; the turn completes."""
    _, _, answer_first = SCENARIOS[failpoint]
    requested = (await tail.wait_for("input.requested"))["data"]["requests"][0]
    if shown is not None:
        assert requested == shown
    if not answer_first:
        pending = (await c.get(f"/v1/sessions/{tail.sid}")).json()["pending"]
        assert pending == [requested]  # same id, same arguments
    body = {"request_id": requested["request_id"], "decision": "approve"}
    r = await c.post(f"/v1/sessions/{tail.sid}/responses", json=body)
    assert r.status_code == 202, r.text
    done = await tail.wait_for("turn.completed")
    assert done["data"]["reply"] == "done: charged 7"


async def check(c: httpx.AsyncClient, tail: EventTail, calls: Path, failpoint: str) -> None:
    log = read_log(calls)
    runs = [x for x in log if "tool" in x]
    if failpoint == "tool.after_run":
        assert len(runs) == 2 and runs[0]["call_id"] == runs[1]["call_id"]  # same idempotency key
    else:
        assert len(runs) == 1
    requested = next(e for e in tail.events if e["type"] == "input.requested")
    assert requested["data"]["requests"][0]["request_id"] == f"req_{runs[0]['call_id']}"
    model_steps = [x["model"] for x in log if "model" in x]
    assert model_steps == ([0, 0, 1] if failpoint == "step.before_commit" else [0, 1])  # none recomputed
    info = (await c.get(f"/v1/sessions/{tail.sid}")).json()
    assert info["usage"]["model_calls"] == len(model_steps)  # every attempt, the one lost in the crash too
    assert info["status"] == "idle" and info["pending"] == []
    # every event once, by id, in order, exactly what the outbox holds
    ids = [e["id"] for e in tail.events]
    assert len(ids) == len(set(ids))
    replay: list[str] = []
    async with c.stream("GET", f"/v1/sessions/{tail.sid}/events") as resp:
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                replay.append(line[4:])
            if len(replay) == len(ids):
                break
    assert ids == replay
    types = [e["type"] for e in tail.events]
    assert types.count("input.requested") == 1 and types.count("turn.completed") == 1
    # the call is announced once, also when it ran again after a crash (a takeover of the turn
    # that its answer resumed: the announcement was committed before the call ran)
    assert types.count("tool.started") == 1 and types.count("tool.completed") == 1, types
    history = (await c.get(f"/v1/sessions/{tail.sid}/history")).json()["items"]
    assert [(i["role"], i["text"]) for i in history] == [
        ("user", "pay 7"),
        ("assistant", ""),
        ("tool", "charged 7"),
        ("assistant", "done: charged 7"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("failpoint", list(SCENARIOS))
async def test_a_crash_at_each_failpoint_keeps_the_request_and_runs_the_tool_once(
    crashable: Service, tmp_path: Path, failpoint: str
) -> None:
    crashable.start(KEEL_FAILPOINTS=SCENARIOS[failpoint][0])
    async with httpx.AsyncClient(base_url=crashable.base, timeout=10) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        tail = EventTail(crashable.base, sid)
        tail.start()
        try:
            await tail.wait_for("session.created")
            shown = await crash(crashable, c, tail, failpoint)
            crashable.start()  # the replacement: same Redis, same port, no failpoint
            await recover(c, tail, shown, failpoint)
            await check(c, tail, tmp_path / "calls.jsonl", failpoint)
            assert tail.connections >= 2  # it did follow the restart
        finally:
            await tail.stop()
