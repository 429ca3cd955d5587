"""Tools from MCP servers in keel as a user configures it: `KEEL_MCP_CONFIG` naming the reference
stdio server `mcp-server-time` and the tests' MCP server over streamable HTTP, an agent on a
local server speaking Anthropic's protocol. The calls, approvals, errors, a server killed
mid-call, the catalogue, and the tools block the provider sees."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from app.settings import Settings
from harness import Agent, tool
from harness.models.anthropic import AnthropicModel
from tests.conftest import free_port
from tests.mcp_server import McpTestServer
from tests.models.anthropic_server import AnthropicServer, Reply, text, tool_use
from tests.service import ROOT, Service

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def tests_server(tmp_path: Path) -> Iterator[McpTestServer]:
    server = McpTestServer(tmp_path).start()
    yield server
    server.kill()


@pytest.fixture
async def provider() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer() as s:
        yield s
        for client in s.clients:
            await client.close()


def config(tmp_path: Path, tests_server: McpTestServer, **test_keys: Any) -> Settings:
    """keel's settings from an environment whose KEEL_MCP_CONFIG names both servers."""
    path = tmp_path / "mcp.json"
    servers = {
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]},
        "test": {"url": tests_server.url, "headers": {"Authorization": "Bearer ${TEST_MCP_TOKEN}"}, **test_keys},
    }
    path.write_text(json.dumps({"mcpServers": servers}))
    return Settings.from_env({"KEEL_MCP_CONFIG": str(path), "TEST_MCP_TOKEN": "t0ken"})


def claude(provider: AnthropicServer) -> Agent:
    client = anthropic.AsyncAnthropic(api_key="test-key", base_url=provider.url)
    provider.clients.append(client)
    return Agent(instructions="Be brief.", tools=[add], model=AnthropicModel("claude-test", client=client))


def tool_result(body: dict[str, Any]) -> dict[str, Any]:
    """The tool result the request ends with: its text and whether it is an error."""
    [block] = [b for b in body["messages"][-1]["content"] if b["type"] == "tool_result"]
    content = block["content"]
    said = content if isinstance(content, str) else "".join(c["text"] for c in content if c["type"] == "text")
    return {"text": said, "is_error": bool(block.get("is_error"))}


def echo(prefix: str) -> Any:
    """A reply that says the tool result it was given."""
    return lambda body: Reply([text(prefix + tool_result(body)["text"])])


def calls(name: str, args: dict[str, Any]) -> Reply:
    return Reply([tool_use("toolu_1", name, args)], stop_reason="tool_use")


async def send(client: Any, sid: str, words: str) -> dict[str, Any]:
    r = await client.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=30", json={"text": words})
    assert r.status_code == 200, r.text
    turn: dict[str, Any] = r.json()
    return turn


async def test_mcp_tools_run_are_approved_fail_and_reconnect_with_one_stable_tools_block(
    serve: Any, tmp_path: Path, tests_server: McpTestServer, provider: AnthropicServer
) -> None:
    settings = config(tmp_path, tests_server, block=["grow", "hold"])
    live = await serve(claude(provider), mcp_servers=settings.mcp_servers)
    harness = live.app.state.harness
    provider.replies = [
        calls("time__get_current_time", {"timezone": "UTC"}),
        echo("It is now: "),
        calls("test__delete_file", {"path": "/tmp/a"}),
        echo("done: "),
        calls("test__delete_file", {"path": "/tmp/b"}),
        echo("not done: "),
    ]
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        first = await send(c, sid, "what time is it in UTC?")
        assert first["status"] == "completed"
        result = tool_result(provider.requests[1])
        now = json.loads(result["text"])
        assert now["timezone"] == "UTC" and now["datetime"][:4] == time.strftime("%Y", time.gmtime())
        assert first["reply"] == "It is now: " + result["text"]
        items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        [stored] = [i for i in items if i["role"] == "tool"]
        assert (stored["tool_name"], stored["text"], stored["is_error"]) == (
            "time__get_current_time",
            result["text"],
            False,
        )

        asked = await send(c, sid, "delete /tmp/a")  # destructive (unannotated): asks first
        assert asked["status"] == "waiting" and tests_server.records("delete_file") == []
        [request] = (await c.get(f"/v1/sessions/{sid}")).json()["pending"]
        assert (request["tool"], request["arguments"]) == ("test__delete_file", {"path": "/tmp/a"})
        done = await harness.sessions.respond_and_wait(sid, "anon", request["request_id"], "approve", timeout=30)
        assert (done.status, done.reply) == ("completed", "done: deleted /tmp/a")
        again = await c.post(
            f"/v1/sessions/{sid}/responses", json={"request_id": request["request_id"], "decision": "approve"}
        )
        assert again.status_code == 202  # the same answer again: accepted, the tool not run again

        asked = await send(c, sid, "delete /tmp/b")
        [request] = (await c.get(f"/v1/sessions/{sid}")).json()["pending"]
        denied = await harness.sessions.respond_and_wait(sid, "anon", request["request_id"], "deny", timeout=30)
        assert denied.status == "completed" and denied.reply.startswith("not done: ")
    deleted = tests_server.records("delete_file")
    assert [r["args"]["path"] for r in deleted] == ["/tmp/a"]  # once after approve, never after deny
    assert deleted[0]["call_id"] == call_id_of(await history(live, sid), {"path": "/tmp/a"})  # keel's call id

    blocks = [body["tools"] for body in provider.requests]
    assert len(blocks) == 6 and all(b == blocks[0] for b in blocks)  # byte for byte the same, every request
    names = [t["name"] for t in blocks[0]]
    assert names[0] == "add" and names[1:] == sorted(names[1:])  # the agent's own, then MCP's by name
    assert "test__grow" not in names  # (blocked)
    assert {"time__get_current_time", "time__convert_time", "test__lookup", "test__delete_file"} <= set(names)
    lookup = next(t for t in blocks[0] if t["name"] == "test__lookup")
    assert lookup["description"] == "Look a key up."
    assert lookup["input_schema"]["properties"]["key"]["type"] == "string"


async def history(live: Any, sid: str) -> list[dict[str, Any]]:
    async with live.client() as c:
        items: list[dict[str, Any]] = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        return items


def call_id_of(items: list[dict[str, Any]], arguments: dict[str, Any]) -> str:
    """keel's id of the call with these arguments, from the session's history."""
    for item in items:
        for call in item.get("tool_calls") or []:
            if call["arguments"] == arguments:
                call_id: str = call["id"]
                return call_id
    raise AssertionError(f"no call with {arguments}")


async def test_a_server_killed_mid_call_is_an_error_result_and_the_next_call_opens_it_again(
    serve: Any, tmp_path: Path, tests_server: McpTestServer, provider: AnthropicServer
) -> None:
    settings = config(tmp_path, tests_server, approval="never")
    live = await serve(claude(provider), mcp_servers=settings.mcp_servers)
    provider.replies = [
        calls("test__slow", {"seconds": 60}),
        echo("after the crash: "),
        calls("test__lookup", {"key": "k"}),
        echo("looked up: "),
    ]
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        turn = asyncio.create_task(send(c, sid, "take your time"))
        await tests_server.began("slow")
        tests_server.kill()
        first = await asyncio.wait_for(turn, 30)
        assert first["status"] == "completed"
        lost = tool_result(provider.requests[1])
        assert lost["is_error"] and lost["text"].startswith("error: MCP server 'test': the connection was lost"), lost
        tests_server.start()  # the same server back, on the same port
        second = await send(c, sid, "look k up")
        assert (second["status"], second["reply"]) == ("completed", "looked up: value of k")
    assert len(tests_server.records("slow")) == 1  # the call that may have reached it was not sent again


async def test_results_errors_and_a_timeout_are_what_the_model_reads(
    serve: Any, tmp_path: Path, tests_server: McpTestServer, provider: AnthropicServer
) -> None:
    settings = config(tmp_path, tests_server, approval="never", timeout_s=0.5)
    live = await serve(claude(provider), mcp_servers=settings.mcp_servers)
    cases = [
        ("test__boom", {}, True, "the disk is full"),
        ("test__picture", {}, False, "[an image (image/png) was returned]"),
        ("test__report", {}, False, '{"rows":2,"ok":true}'),
        ("test__slow", {"seconds": 5}, True, "0.5 s"),
    ]
    for name, args, _, _ in cases:
        provider.replies += [calls(name, args), Reply([text("ok")])]
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for n, (name, _, is_error, says) in enumerate(cases):
            assert (await send(c, sid, f"call {name}"))["status"] == "completed", name
            result = tool_result(provider.requests[2 * n + 1])
            assert result["is_error"] is is_error and says in result["text"], (name, result)
        provider.replies += [calls("test__crash", {}), Reply([text("ok")])]
        assert (await send(c, sid, "crash it"))["status"] == "completed"
        crashed = tool_result(provider.requests[-1])
        assert crashed["is_error"] and "secret internals" not in crashed["text"]  # the SDK's generic error
    [ended] = [r for r in tests_server.records("slow") if "end" in r]
    assert ended["end"] == "cancelled"  # past timeout_s the call was stopped at the server too


async def test_a_changed_catalogue_takes_effect_at_the_next_turn_and_is_counted(
    serve: Any, tmp_path: Path, tests_server: McpTestServer, provider: AnthropicServer
) -> None:
    settings = config(tmp_path, tests_server, approval="never")
    live = await serve(claude(provider), mcp_servers=settings.mcp_servers)
    provider.replies = [calls("test__grow", {}), Reply([text("grown")]), Reply([text("next")])]
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        assert (await send(c, sid, "grow"))["reply"] == "grown"
        names = [[t["name"] for t in body["tools"]] for body in provider.requests]
        assert names[0] == names[1] and "test__extra" not in names[1]  # never within a turn
        async with asyncio.timeout(10):  # the server's notice comes on its own stream
            while live.app.state.harness.stats.mcp_catalogue_changes.get("test", 0) < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        assert (await send(c, sid, "again"))["reply"] == "next"
        assert "test__extra" in [t["name"] for t in provider.requests[2]["tools"]]
        metrics = (await c.get("/metrics")).text
        assert 'keel_mcp_catalogue_changes_total{server="test"} 1.0' in metrics


async def test_a_cancel_during_an_mcp_call_stops_it_at_the_server(
    serve: Any, tmp_path: Path, tests_server: McpTestServer, provider: AnthropicServer
) -> None:
    settings = config(tmp_path, tests_server, approval="never")
    live = await serve(claude(provider), mcp_servers=settings.mcp_servers)
    provider.replies = [calls("test__slow", {"seconds": 60})]
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        turn = asyncio.create_task(send(c, sid, "take your time"))
        await tests_server.began("slow")
        asked = time.monotonic()
        assert (await c.post(f"/v1/sessions/{sid}/cancel")).status_code == 202
        ended = await asyncio.wait_for(turn, 10)
        assert ended["status"] == "cancelled" and time.monotonic() - asked < 5  # not the tool's 60 s
        async with asyncio.timeout(10):
            while not [r for r in tests_server.records("slow") if "end" in r]:  # noqa: ASYNC110 (a file)
                await asyncio.sleep(0.02)
    assert [r["end"] for r in tests_server.records("slow") if "end" in r] == ["cancelled"]
    items = await history(live, sid)
    [result] = [i for i in items if i["role"] == "tool"]
    assert result["is_error"] and result["text"] == "error: the turn was cancelled; stopped when the turn was cancelled"


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"command": "x", "cwd": "/"}, "keel: MCP server 'bad': unknown key 'cwd'"),
        ({"url": "http://127.0.0.1:9/mcp?key=s3cret"}, "keel: MCP server 'bad': cannot reach http://127.0.0.1:9/mcp: "),
        ({"command": "/no/such/program"}, "keel: MCP server 'bad': cannot start /no/such/program: "),
        ({"command": "x", "env": {"TOKEN": "${NOT_SET_ANYWHERE}"}}, "keel: MCP server 'bad': env names"),
    ],
)
def test_a_bad_config_or_an_unreachable_server_is_one_line_at_start(
    tmp_path: Path, server: dict[str, Any], message: str
) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"bad": server}}))
    svc = Service(tmp_path, free_port(), KEEL_MCP_CONFIG=str(path))
    r = subprocess.run(
        [sys.executable, "-m", "app"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60, env=svc.env
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(("WARNING", "INFO")) and " WARNING " not in ln]
    assert len(lines) == 1 and lines[0].startswith(message) and "s3cret" not in r.stderr, r.stderr
