"""A keel process killed during an MCP tool call: the session's next runner makes the call again
with the same `keel/call_id` (at least once, with a key), and the turn completes with the result
the server gave the second time (the tests' server answers a call id's second call only)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.conftest import ValkeyServer, free_port
from tests.mcp_server import McpTestServer
from tests.service import Service


async def test_a_crash_mid_call_makes_the_call_again_with_the_same_call_id(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    server = McpTestServer(tmp_path).start()
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"test": {"url": server.url, "approval": "never"}}}))
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:agent",
        KEEL_LEASE_MS="1000",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
        KEEL_MCP_CONFIG=str(config),
    )
    try:
        svc.start()
        async with httpx.AsyncClient(base_url=svc.base, timeout=30) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
            message = {"text": "mcp test__hold", "message_id": "m1"}
            assert (await c.post(f"/v1/sessions/{sid}/messages", json=message)).status_code == 202
            [first] = await server.began("hold")
            svc.kill9()  # in the middle of the call: the server has it, keel never got an answer
            svc.start()
            turn = (await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=30", json=message)).json()
            first_again, second = await server.began("hold", 2)
            assert first_again == first and second["call_id"] == first["call_id"]  # the same key, twice
            assert (turn["status"], turn["reply"]) == ("completed", f"done: held {first['call_id']}")
            items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
            [call] = [i for i in items if i.get("tool_calls")]
            [result] = [i for i in items if i["role"] == "tool"]  # one call, one result in history
            assert call["tool_calls"][0]["id"] == result["tool_call_id"] == first["call_id"]
    finally:
        svc.stop()
        server.kill()
