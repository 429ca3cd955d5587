"""Crash keel while it delivers a Linear agent session's activities (a post made, the cursor not
moved), start a replacement: every activity exactly once (the activity id is the idempotency
key Linear honours), in order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.channels.linear_server import API_KEY, SECRET, FakeLinear, created, prompted, signed
from tests.conftest import ValkeyServer, free_port
from tests.service import Service


async def hook(svc: Service, body: bytes) -> None:
    async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
        assert (await c.post("/v1/linear/webhook", content=body, headers=signed(body))).status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "nth"), [("created", 1), ("created", 2), ("approved", 1), ("approved", 3)])
async def test_a_crash_after_an_activity_is_sent_repeats_nothing(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, linear: FakeLinear, phase: str, nth: int
) -> None:
    """`created`: thought, elicitation; `approved`: the tool's two actions, the response."""
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
        KEEL_LEASE_MS="1000",
        LINEAR_WEBHOOK_SECRET=SECRET,
        LINEAR_API_KEY=API_KEY,
        KEEL_LINEAR_API_URL=linear.url,
    )
    crash = f"relay.after_send=exit@{nth}"
    try:
        svc.start(**({"KEEL_FAILPOINTS": crash} if phase == "created" else {}))
        await hook(svc, created("as-c", comment="pay 7"))
        if phase == "created":
            assert await asyncio.to_thread(svc.wait_exit) == 137
            svc.start()
        await linear.until(lambda s: "elicitation" in s.kinds("as-c"))
        if phase == "approved":
            svc.stop()
            svc.start(KEEL_FAILPOINTS=crash)
        await hook(svc, prompted("as-c", "act-1", "approve"))
        if phase == "approved":
            assert await asyncio.to_thread(svc.wait_exit) == 137
            svc.start()
        await linear.until(lambda s: "response" in s.kinds("as-c"), timeout=30)
        kinds = linear.kinds("as-c")
        assert kinds == ["thought", "elicitation", "action", "action", "response"], kinds
        assert linear.of("as-c")[-1].content["body"] == "done: charged 7"
        assert len({a.id for a in linear.of("as-c")}) == len(kinds)
    finally:
        svc.stop()
