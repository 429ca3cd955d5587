"""keel as an MCP server: `POST /mcp`, driven by the official SDK's client as Claude Desktop or
Cursor would drive it: four tools, a turn waited for, an approval answered, the API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall

KEY = "key-mcp"
ORDERS: list[str] = []


def agent(gate: asyncio.Event | None = None, started: asyncio.Event | None = None) -> Agent:
    @tool(approval=True)
    def place_order(item: str) -> str:
        """Order an item."""
        ORDERS.append(item)
        return f"ordered {item}"

    @tool
    async def wait_a_while() -> str:
        """Wait until the test lets it go."""
        assert gate is not None and started is not None
        started.set()
        await gate.wait()
        return "waited"

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "tool":
            return ModelReply(text=f"done: {last.text}")
        if last.text.startswith("order "):
            return ModelReply(tool_calls=[ToolCall("place_order", {"item": last.text[6:]})])
        if last.text == "wait":
            return ModelReply(tool_calls=[ToolCall("wait_a_while", {})])
        return ModelReply(text=f"you said {last.text}")

    return Agent(instructions="t", tools=[place_order, wait_a_while], model=ScriptedModel(script))


@contextlib.asynccontextmanager
async def mcp_client(base: str, key: str | None = KEY, statuses: list[int] | None = None) -> AsyncIterator[Client]:
    """The SDK's client for keel's /mcp with `key`; the HTTP statuses it got into `statuses`."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def seen(response: httpx2.Response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    hooks = {"response": [seen]}
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0), event_hooks=hooks)
    async with http, Client(streamable_http_client(f"{base}/mcp", http_client=http)) as client:
        yield client


def answer(result: Any) -> dict[str, Any]:
    """A tool result's JSON: its text, which is its structured content too."""
    data: dict[str, Any] = json.loads(result.content[0].text)
    assert result.structured_content == data
    return data


async def test_the_sdk_client_lists_four_tools_and_a_message_gets_its_reply(serve: Any) -> None:
    live = await serve(agent(), api_keys=(KEY, "key-other"))
    async with mcp_client(live.base) as client:
        listed = await client.list_tools()
        assert sorted(t.name for t in listed.tools) == ["cancel", "get_session", "respond", "send_message"]
        send = next(t for t in listed.tools if t.name == "send_message")
        assert send.input_schema["required"] == ["text"]
        assert set(send.input_schema["properties"]) == {"text", "session_id", "context"}
        first = await client.call_tool("send_message", {"text": "hello"})
        assert not first.is_error
        turn = answer(first)
        assert (turn["status"], turn["reply"], turn["pending"]) == ("completed", "you said hello", [])
        sid = turn["session_id"]
        again = answer(await client.call_tool("send_message", {"text": "more", "session_id": sid}))
        assert (again["session_id"], again["reply"]) == (sid, "you said more")
        info = answer(await client.call_tool("get_session", {"session_id": sid}))
        assert (info["status"], info["usage"]["model_calls"]) == ("idle", 2)
    async with live.client(KEY) as http:  # the same session over the HTTP API, with the same key
        items = (await http.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in items] == ["hello", "you said hello", "more", "you said more"]
    async with mcp_client(live.base, "key-other") as other:  # another key's client cannot see it
        result = await other.call_tool("get_session", {"session_id": sid})
        assert result.is_error and answer(result)["error"]["code"] == "session_not_found"
        result = await other.call_tool("send_message", {"text": "intrude", "session_id": sid})
        assert result.is_error and answer(result)["error"]["code"] == "session_not_found"


async def test_an_approval_is_answered_through_respond_and_the_tool_runs_once(serve: Any) -> None:
    ORDERS.clear()
    live = await serve(agent(), api_keys=(KEY,))
    async with mcp_client(live.base) as client:
        asked = answer(await client.call_tool("send_message", {"text": "order a lamp"}))
        assert asked["status"] == "waiting" and asked["reply"] is None
        [request] = asked["pending"]
        assert (request["tool"], request["arguments"]) == ("place_order", {"item": "a lamp"})
        args = {"session_id": asked["session_id"], "request_id": request["request_id"], "decision": "approve"}
        resumed = answer(await client.call_tool("respond", args))
        assert (resumed["status"], resumed["reply"], resumed["pending"]) == ("completed", "done: ordered a lamp", [])
        assert ORDERS == ["a lamp"]
        repeated = answer(await client.call_tool("respond", args))  # the same answer again: accepted, no second run
        assert repeated["status"] == "pending" and ORDERS == ["a lamp"]
        changed = await client.call_tool("respond", {**args, "decision": "deny"})
        assert changed.is_error
        assert answer(changed)["error"] == {
            "code": "already_answered",
            "message": f"request {request['request_id']} was already answered: approve",
            "decision": "approve",
        }

        asked = answer(await client.call_tool("send_message", {"text": "order a desk"}))
        [request] = asked["pending"]
        args = {"session_id": asked["session_id"], "request_id": request["request_id"], "decision": "deny"}
        denied = answer(await client.call_tool("respond", {**args, "reason": "too dear"}))
        assert denied["status"] == "completed" and "too dear" in denied["reply"]
        assert ORDERS == ["a lamp"]  # denied: never ran


async def test_cancel_ends_the_turn_in_progress(serve: Any) -> None:
    gate, started = asyncio.Event(), asyncio.Event()
    live = await serve(agent(gate, started), api_keys=(KEY,))
    async with mcp_client(live.base) as client, live.client(KEY) as http:
        sid = (await http.post("/v1/sessions")).json()["session_id"]
        waiting = asyncio.create_task(client.call_tool("send_message", {"text": "wait", "session_id": sid}))
        await asyncio.wait_for(started.wait(), 10)
        cancelled = answer(await client.call_tool("cancel", {"session_id": sid}))
        assert cancelled["session_id"] == sid and cancelled["turn_id"].startswith("turn_")
        gate.set()  # (a local tool runs to its end; the turn ends cancelled after it)
        turn = answer(await asyncio.wait_for(waiting, 10))
        assert (turn["status"], turn["reply"]) == ("cancelled", None)
        nothing = await client.call_tool("cancel", {"session_id": sid})
        assert nothing.is_error and answer(nothing)["error"]["code"] == "nothing_to_cancel"


async def test_bad_arguments_change_nothing_and_say_why(serve: Any) -> None:
    live = await serve(agent(), api_keys=(KEY,))
    async with mcp_client(live.base) as client, live.client(KEY) as http:
        for args in ({}, {"text": "  "}, {"text": "hi", "extra": 1}, {"text": 5}):
            result = await client.call_tool("send_message", args)
            assert result.is_error and answer(result)["error"]["code"] == "invalid_request", args
        sid = (await http.post("/v1/sessions")).json()["session_id"]
        bad = {"session_id": sid, "request_id": "req_nope", "decision": "maybe"}
        assert answer(await client.call_tool("respond", bad))["error"]["code"] == "invalid_request"
        missing = await client.call_tool("respond", {**bad, "decision": "approve"})
        assert answer(missing)["error"]["code"] == "request_not_found"
        assert (await http.get(f"/v1/sessions/{sid}/history")).json()["items"] == []
        with pytest.raises(MCPError, match="no tool 'delete_everything'"):
            await client.call_tool("delete_everything", {})


async def test_no_key_or_a_wrong_key_gets_401(serve: Any) -> None:
    live = await serve(agent(), api_keys=(KEY,))
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=live.base, headers=headers) as raw:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = await raw.post("/mcp", json=call, headers=auth)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", auth
        r = await raw.post("/mcp", json={**call, "method": "nothing/here"}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["error"]["code"] == -32601  # JSON-RPC's, not HTTP's
    statuses: list[int] = []
    with pytest.raises(Exception, match="TaskGroup"):  # the SDK's client is refused too (its error says less)
        async with mcp_client(live.base, "wrong", statuses) as client:
            await client.list_tools()
    assert statuses and set(statuses) == {401}


async def test_without_keys_only_loopback_hosts_reach_it(serve: Any) -> None:
    live = await serve(agent())  # no API keys: loopback only, and no DNS rebinding either
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=live.base, headers=headers) as raw:
        assert (await raw.post("/mcp", json=call, headers={"Host": "evil.example"})).status_code in (400, 421)
        page = {"Origin": "http://evil.example"}
        assert (await raw.post("/mcp", json=call, headers=page)).status_code in (400, 403)
    async with mcp_client(live.base, None) as client:
        assert len((await client.list_tools()).tools) == 4


async def test_without_the_mcp_extra_mcp_says_so(serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from channels.mcp import McpChannel

    def missing(self: McpChannel) -> None:
        raise ModuleNotFoundError("No module named 'mcp'", name="mcp")

    monkeypatch.setattr(McpChannel, "_build", missing)
    live = await serve(agent(), api_keys=(KEY,))
    async with live.client(KEY) as c:
        r = await c.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 501 and r.json()["error"]["code"] == "mcp_not_installed"
        assert (await c.post("/v1/sessions")).status_code == 201  # the rest of keel serves on
