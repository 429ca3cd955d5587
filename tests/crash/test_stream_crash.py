"""Crash keel in the middle of a model's stream (a real SDK client streaming from a local server
that speaks Anthropic's protocol), restart it on the same Redis: the step runs again once, one
`message.completed` with the whole reply, nothing of the cut attempt stored, both attempts
counted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import ValkeyServer, free_port
from tests.models.anthropic_server import AnthropicServer, Reply, text
from tests.service import Service


@pytest.fixture
async def provider() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer() as s:
        yield s


@pytest.mark.slow
async def test_a_crash_mid_stream_reruns_the_step_once(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path, provider: AnthropicServer
) -> None:
    provider.replies = [Reply([text("the first attempt, cut short")], chunks=6), Reply([text("the whole reply")])]
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_MODEL="anthropic:claude-test",
        ANTHROPIC_API_KEY="test-key",
        ANTHROPIC_BASE_URL=provider.url,
        KEEL_LEASE_MS="1000",
    )
    try:
        svc.start(KEEL_FAILPOINTS="model.mid_stream=exit")
        async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            sent = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hello", "message_id": "m1"})
            assert sent.status_code == 202
        # (waited for in a thread: the provider this process serves must keep streaming meanwhile)
        assert await asyncio.to_thread(svc.wait_exit) == 137  # died with the stream half read
        svc.start()
        async with httpx.AsyncClient(base_url=svc.base, timeout=20) as c:
            again = {"text": "hello", "message_id": "m1"}  # the client's retry of the same message
            turn = (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json=again)).json()
            history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
            info = (await c.get(f"/v1/sessions/{sid}")).json()
    finally:
        svc.stop()
    assert turn["status"] == "completed" and turn["reply"] == "the whole reply"
    outbox = await redis.xrange(f"keel:{{{sid}}}:outbox")
    types = [fields[b"t"].decode() for _, fields in outbox]
    assert types.count("message.completed") == 1 and "message.delta" not in types
    completed = next(
        json.loads(fields[b"b"].join([b"{", b""])) for _, fields in outbox if fields[b"t"] == b"message.completed"
    )
    assert completed["data"]["text"] == "the whole reply"
    assert [(i["role"], i["text"]) for i in history if i["kind"] == "message"] == [
        ("user", "hello"),
        ("assistant", "the whole reply"),
    ]
    assert info["usage"]["model_calls"] == 2 and len(provider.requests) == 2
