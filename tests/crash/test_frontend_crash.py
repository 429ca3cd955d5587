"""keel killed (-9) in the middle of a reply that a useChat client (the AI SDK's own
DefaultChatTransport in a chat built on AbstractChat) is reading: the client's stream breaks,
keel restarts on the same Redis and re-runs the step, and the client, resuming as a reloaded
page does (`GET /v1/chat/{id}/stream`), ends with exactly the committed reply, once. The same
for an AG-UI run: the thread posted again brings the turn, its reply once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ValkeyServer, free_port
from tests.jsclient import NodeScript, skip_without_node
from tests.models.anthropic_server import AnthropicServer, Reply, text
from tests.service import Service

pytestmark = skip_without_node()
CUT = "the first attempt, which keel does not live to finish"
WHOLE = "the whole reply, streamed again after the crash"


@pytest.fixture
async def provider() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer() as s:
        yield s


def keel_on(provider: AnthropicServer, valkey: ValkeyServer, tmp_path: Path) -> Service:
    """keel as a subprocess on the local Anthropic-protocol provider, a lease of 1 s."""
    return Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_MODEL="anthropic:claude-test",
        ANTHROPIC_API_KEY="test-key",
        ANTHROPIC_BASE_URL=provider.url,
        KEEL_LEASE_MS="1000",
    )


@pytest.mark.slow
async def test_a_use_chat_client_resumes_a_reply_cut_by_a_crash(
    valkey: ValkeyServer, tmp_path: Path, provider: AnthropicServer
) -> None:
    rerun = asyncio.Event()
    provider.replies = [Reply([text(CUT)], chunks=10, pace=0.02), Reply([text(WHOLE)], chunks=10, hold=rerun)]
    svc = keel_on(provider, valkey, tmp_path)
    run: NodeScript | None = None
    try:
        svc.start(KEEL_FAILPOINTS="model.mid_stream=exit@5")  # dies at the 5th delta of the first attempt
        async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
        run = await NodeScript.start("chat.mjs", "crash-resume", svc.base, sid)
        partial = await run.until("partial")
        assert CUT.startswith(partial["text"])  # the client had part of the cut attempt
        assert await asyncio.to_thread(svc.wait_exit) == 137
        dropped = await run.until("dropped")
        assert dropped["status"] == "error"
        svc.start()
        run.say()
        await run.until("resumed")
        rerun.set()
        run.say()
        done = await run.until("done", timeout=60)
        async with httpx.AsyncClient(base_url=svc.base, timeout=10) as c:
            history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    finally:
        if run is not None:
            await run.close()
        svc.stop()
    assert done["status"] == "ready" and done["error"] is None, done
    (message,) = done["messages"]
    assert message["role"] == "assistant" and message["text"] == WHOLE  # the committed reply, once
    assert [(i["role"], i["text"]) for i in history if i["kind"] == "message"] == [
        ("user", "hello"),
        ("assistant", WHOLE),
    ]
    assert len(provider.requests) == 2


@pytest.mark.slow
async def test_an_agui_run_cut_by_a_crash_is_run_again_with_the_rest_once(
    valkey: ValkeyServer, tmp_path: Path, provider: AnthropicServer
) -> None:
    provider.replies = [Reply([text(CUT)], chunks=10, pace=0.02), Reply([text(WHOLE)], chunks=10, pace=0.01)]
    svc = keel_on(provider, valkey, tmp_path)

    async def run(c: httpx.AsyncClient, sid: str, run_id: str) -> list[dict[str, Any]]:
        body = {"threadId": sid, "runId": run_id, "messages": [{"id": "u1", "role": "user", "content": "hello"}]}
        events: list[dict[str, Any]] = []
        try:
            async with c.stream("POST", "/v1/agui", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
        except httpx.HTTPError:  # (keel died under the stream)
            pass
        return events

    try:
        svc.start(KEEL_FAILPOINTS="model.mid_stream=exit@5")
        async with httpx.AsyncClient(base_url=svc.base, timeout=20) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            cut = await run(c, sid, "r1")
        assert await asyncio.to_thread(svc.wait_exit) == 137
        svc.start()
        async with httpx.AsyncClient(base_url=svc.base, timeout=20) as c:
            again = await run(c, sid, "r2")  # the page posts the same thread again
    finally:
        svc.stop()
    assert cut[0]["type"] == "RUN_STARTED" and not any(e["type"] == "RUN_FINISHED" for e in cut)
    assert any(e["type"] == "TEXT_MESSAGE_CONTENT" for e in cut)  # it died mid-reply
    assert again[0]["type"] == "RUN_STARTED" and again[-1]["type"] == "RUN_FINISHED"
    assert again[-1]["outcome"] == {"type": "success"}
    texts = [e for e in again if e["type"] == "TEXT_MESSAGE_CONTENT"]
    assert "".join(e["delta"] for e in texts) == WHOLE  # the committed reply, once
    assert len({e["messageId"] for e in texts}) == 1
