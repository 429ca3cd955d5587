"""Crash keel right after it delivered an event webhook (the receiver has it, the cursor did
not move), start a replacement: every event reaches the subscriber at least once, in order, the
redelivered one with the same webhook-id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.channels.webhook_receiver import Receiver
from tests.conftest import ValkeyServer, free_port
from tests.service import Service


@pytest.mark.slow
async def test_a_crash_after_a_delivery_delivers_again_with_the_same_id(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, receiver: Receiver
) -> None:
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
        KEEL_LEASE_MS="1000",
        KEEL_API_KEYS="k1",
        KEEL_WEBHOOK_ALLOW_PRIVATE="1",
    )
    headers = {"Authorization": "Bearer k1"}
    try:
        svc.start(KEEL_FAILPOINTS="relay.after_send=exit@3")
        async with httpx.AsyncClient(base_url=svc.base, headers=headers, timeout=10) as c:
            made = (await c.post("/v1/webhooks", json={"url": receiver.url("hook"), "events": ["*"]})).json()
            receiver.expect("hook", made["secret"])
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            sent = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hello", "message_id": "m1"})
            assert sent.status_code == 202
        assert await asyncio.to_thread(svc.wait_exit) == 137
        got_before = len(receiver.delivered("hook"))
        assert got_before == 3
        svc.start()
        async with httpx.AsyncClient(base_url=svc.base, headers=headers, timeout=10) as c:
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hello", "message_id": "m1"})
            assert r.json()["status"] == "completed"
            events = [e["id"] for e in r.json()["events"]]
        # session.created, then the turn's events: each at least once, in order, stable ids
        want = len(events) + 1
        await receiver.until(lambda r: len(dict.fromkeys(d.webhook_id for d in r.delivered("hook"))) >= want, 30)
        ids = [d.webhook_id for d in receiver.delivered("hook")]
        first_seen = list(dict.fromkeys(ids))
        assert [i.split(":", 1)[1] for i in first_seen[1:]] == events
        assert all(i.startswith(f"{sid}:") for i in ids)
        assert ids.count(first_seen[2]) == 2  # the third delivery was made, then made again after the crash
        assert receiver.invalid == 0
    finally:
        svc.stop()
