"""A message steered into a running turn is seen by the model exactly once, also when keel dies
between the steer and the model call that takes it: killed when the turn's tool returned (the
steer recorded, not yet joined: tool.after_run) or just after it joined the turn (steer.after_join:
committed with the tool's result, the model call not made). A replacement resumes the turn; the
message is in the turn's history once, in every model call after it once, and never a turn of
its own."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import ValkeyServer, free_port
from tests.crash.test_failpoints import read_log
from tests.service import EventTail, Service

STEERED = "and check the logs too"


@pytest.mark.parametrize("failpoint", ["tool.after_run", "steer.after_join"])
async def test_a_steered_message_is_seen_once_across_a_crash(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, failpoint: str
) -> None:
    calls = tmp_path / "calls.jsonl"
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:slow",
        KEEL_LEASE_MS="1000",
        KEEL_TEST_LOG=str(calls),
    )
    svc.start(KEEL_FAILPOINTS=f"{failpoint}=exit")
    tail: EventTail | None = None
    try:
        async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            tail = EventTail(svc.base, sid)
            tail.start()
            r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hold 1.5", "message_id": "m1"})
            assert r.status_code == 202
            await tail.wait_for("tool.started")  # the tool runs for 1.5 s: the steer comes first
            body = {"text": STEERED, "message_id": "m2", "policy": "steer"}
            r = await c.post(f"/v1/sessions/{sid}/messages", json=body)
            assert r.status_code == 202 and r.json()["handled"] == "steered"
            assert svc.wait_exit() == 137  # the failpoint
            svc.start()  # the replacement, no failpoint: it takes the turn over when the lease lapses
            done = await tail.wait_for("turn.completed")
            items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        users = [i["text"] for i in items if i["role"] == "user"]
        assert users == ["hold 1.5", STEERED]  # in the turn's history once
        assert done["data"]["reply"] == f"re: {STEERED}"  # the last model call answered it
        steered_turn = {i["turn_id"] for i in items}
        assert len(steered_turn) == 1  # one turn: the steered message joined it
        events = tail.events
        assert [e["data"]["message_id"] for e in events if e["type"] == "message.received"] == ["m1"]
        assert len([e for e in events if e["type"] == "message.steered"]) == 1
        model_calls = [x for x in read_log(calls) if "model" in x]
        after = [x for x in model_calls if STEERED in x["users"]]
        assert after, "no model call saw the steered message"
        assert all(x["users"].count(STEERED) == 1 for x in after)
        assert model_calls[-1]["users"] == ["hold 1.5", STEERED]
    finally:
        if tail is not None:
            await tail.stop()
        svc.stop()
