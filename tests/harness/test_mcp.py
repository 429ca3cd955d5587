"""MCP servers as the harness takes them: the configuration file, the names and approval rules of
their tools, and sessions that die and open again (the tests' server over stdio, a subprocess
of keel as any stdio server is)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harness import McpConfigError, McpServer, load_mcp_config, tool
from harness.errors import ToolError
from harness.tools import ToolContext
from harness.tools.mcp import LOST, McpTools, McpUnavailable, keel_name
from harness.tools.toolbox import Toolbox
from tests.mcp_server import McpTestServer


@tool
def zeta() -> str:
    """A local tool, named to sort after every MCP one."""
    return "z"


def stdio(log: Path, **keys: Any) -> McpServer:
    return McpServer.stdio("local", sys.executable, ["-m", "tests.mcp_server", "stdio", str(log)], **keys)


@pytest.fixture
async def tools(tmp_path: Path) -> AsyncIterator[McpTools]:
    made = McpTools(Toolbox.of([zeta]), [stdio(tmp_path / "calls.jsonl", block=("hold",))])
    await made.start()
    yield made
    await made.stop()


def write(tmp_path: Path, servers: Any) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def test_the_file_mcp_clients_use_is_read_with_secrets_from_the_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "files": {
                "command": "npx",
                "args": ["-y", "server-files", "--root=${ROOT}"],
                "env": {"TOKEN": "${FILES_TOKEN}"},
            },
            "linear": {
                "type": "http",
                "url": "https://mcp.example/mcp",
                "headers": {"Authorization": "Bearer ${LINEAR_KEY}"},
                "allow": ["list_issues", "create_issue"],
                "approval": {"list_issues": "never", "*": "always"},
                "timeout_s": 5,
            },
        },
    )
    files, linear = load_mcp_config(path, {"FILES_TOKEN": "f1", "LINEAR_KEY": "l1", "ROOT": "/srv"})
    assert (files.transport, files.command, files.args, dict(files.env)) == (
        "stdio",
        "npx",
        ("-y", "server-files", "--root=/srv"),
        {"TOKEN": "f1"},
    )
    assert (files.approval, files.timeout_s) == ("destructive", 60.0)
    assert (linear.transport, linear.url, dict(linear.headers)) == (
        "http",
        "https://mcp.example/mcp",
        {"Authorization": "Bearer l1"},
    )
    assert linear.offers("list_issues") and not linear.offers("delete_issue")
    assert (linear.approval_of("list_issues"), linear.approval_of("create_issue")) == ("never", "always")


@pytest.mark.parametrize(
    ("servers", "says"),
    [
        ({"a": {"command": "x", "cwd": "/"}}, "MCP server 'a': unknown key 'cwd'"),
        ({"a": {"command": "x", "url": "http://h/mcp"}}, "MCP server 'a': give either a command"),
        ({"a": {}}, "MCP server 'a': give either a command"),
        ({"a": {"url": "ftp://h"}}, "MCP server 'a': url must be http"),
        ({"a": {"command": "x", "approval": "sometimes"}}, "MCP server 'a': Invalid enum value 'sometimes'"),
        ({"a": {"command": "x", "timeout_s": 0}}, "MCP server 'a': timeout_s"),
        ({"a": {"command": "x", "args": "not a list"}}, "MCP server 'a': Expected `array`"),
        ({"a": {"command": "x", "env": {"K": "${NOT_SET}"}}}, "MCP server 'a': env names ${NOT_SET}"),
        ({"a b": {"command": "x"}}, "MCP server 'a b': a name is 1 to 32"),
        ({"a": {"command": "x", "type": "sse"}}, "MCP server 'a': type is stdio or http"),
        ({"a": {"command": "x", "type": "http"}}, "MCP server 'a': type 'http' does not fit an entry with no url"),
        ({"a": {"url": "http://h/mcp", "env": {"K": "v"}}}, "MCP server 'a': 'env' is for stdio servers"),
        ({"a": {"command": "x", "headers": {"K": "v"}}}, "MCP server 'a': 'headers' is for HTTP servers"),
        ({"a": {"command": "x", "args": ["${NOT_SET}"]}}, "MCP server 'a': args names ${NOT_SET}"),
    ],
)
def test_a_bad_server_entry_is_an_error_naming_the_server(tmp_path: Path, servers: Any, says: str) -> None:
    with pytest.raises(McpConfigError) as err:
        load_mcp_config(write(tmp_path, servers), {})
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_a_file_that_is_not_the_format_says_so(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    for content, says in (("{nope", "is not JSON"), ('{"servers": {}}', '{"mcpServers": {"<name>"')):
        path.write_text(content)
        with pytest.raises(McpConfigError, match="KEEL_MCP_CONFIG: .*" + says.replace("{", r"\{")):
            load_mcp_config(path, {})
    with pytest.raises(McpConfigError, match="cannot read"):
        load_mcp_config(tmp_path / "missing.json", {})


def test_the_model_knows_a_tool_by_its_server_and_name_in_safe_characters() -> None:
    assert keel_name("time", "get_current_time") == "time__get_current_time"
    assert keel_name("my-files", "read file.v2/all") == "my-files__read_file_v2_all"
    assert len(keel_name("s" * 32, "t" * 60)) == 64


async def test_tools_are_offered_sorted_after_the_agents_own_allowed_and_gated(tools: McpTools) -> None:
    box = tools.current()
    names = [spec.name for spec in box.specs]
    assert names[0] == "zeta" and names[1:] == sorted(names[1:])
    assert "local__hold" not in names and "local__lookup" in names  # (blocked)
    assert box.tools["local__lookup"].needs_approval({}) is False  # readOnlyHint: true
    assert box.tools["local__delete_file"].needs_approval({}) is True  # unannotated: destructive
    assert box.tools["local__lookup"].spec.description == "Look a key up."
    assert box is tools.current()  # the same box, the same bytes, while nothing changes


@pytest.mark.parametrize(
    ("approval", "lookup", "delete"),
    [("always", True, True), ("never", False, False), ({"delete_file": "never", "*": "always"}, True, False)],
)
async def test_approval_is_per_server_and_per_tool(tmp_path: Path, approval: Any, lookup: bool, delete: bool) -> None:
    made = McpTools(Toolbox(), [stdio(tmp_path / "calls.jsonl", approval=approval)])
    await made.start()
    try:
        box = made.current()
        assert box.tools["local__lookup"].needs_approval({}) is lookup
        assert box.tools["local__delete_file"].needs_approval({}) is delete
    finally:
        await made.stop()


async def test_a_stdio_server_that_dies_mid_call_is_an_error_and_started_again_for_the_next(
    tools: McpTools, tmp_path: Path
) -> None:
    box = tools.current()
    ctx = ToolContext("ses_1", "turn_1", "call_1")
    with pytest.raises(ToolError) as err:
        await box.tools["local__die"].invoke({}, ctx)
    assert err.value.message.startswith(f"MCP server 'local': {LOST}")
    again = await box.tools["local__lookup"].invoke({"key": "k"}, ToolContext("ses_1", "turn_1", "call_2"))
    assert again == "value of k"
    records = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [(r["tool"], r["call_id"]) for r in records if r["tool"]] == [("die", "call_1"), ("lookup", "call_2")]
    assert len([r for r in records if "pid" in r]) == 2  # a second process, for the second call


async def test_stopping_ends_a_stdio_servers_process(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    made = McpTools(Toolbox(), [stdio(log)])
    await made.start()
    [pid] = [json.loads(line)["pid"] for line in log.read_text().splitlines() if "pid" in line]
    os.kill(pid, 0)  # running
    await made.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_server_that_cannot_be_started_or_reached_is_named(tmp_path: Path) -> None:
    for server, says in (
        (McpServer.stdio("nothing", str(tmp_path / "no-such-program")), "MCP server 'nothing'"),
        (McpServer.http("down", "http://127.0.0.1:9/mcp"), "MCP server 'down'"),
    ):
        made = McpTools(Toolbox(), [server])
        with pytest.raises(McpUnavailable) as err:
            await made.start()
        assert err.value.message.startswith(says) and "\n" not in err.value.message


async def test_a_session_the_server_lost_is_opened_again_and_the_refused_call_sent_over_it(tmp_path: Path) -> None:
    server = McpTestServer(tmp_path, legacy=True).start()  # a 2025-11-25 server: a session id, kept
    made = McpTools(Toolbox(), [McpServer.http("old", server.url)])
    try:
        await made.start()
        lookup = made.current().tools["old__lookup"]
        assert await lookup.invoke({"key": "a"}, ToolContext("ses_1", "turn_1", "call_1")) == "value of a"
        server.kill()
        server.start()  # the same port, no memory of keel's session: 404 for its id
        assert await lookup.invoke({"key": "b"}, ToolContext("ses_1", "turn_1", "call_2")) == "value of b"
        assert [r["call_id"] for r in server.records("lookup")] == ["call_1", "call_2"]  # each ran once
    finally:
        await made.stop()
        server.kill()


async def test_a_stdio_server_that_died_while_idle_is_started_again_before_the_next_call(tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    made = McpTools(Toolbox(), [stdio(log)])
    await made.start()
    try:
        [pid] = [json.loads(line)["pid"] for line in log.read_text().splitlines() if "pid" in line]
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(10):  # keel sees its output end
            while made.sessions[0].connected:  # noqa: ASYNC110 (another process's end: no event of ours)
                await asyncio.sleep(0.01)
        lookup = made.current().tools["local__lookup"]
        assert await lookup.invoke({"key": "k"}, ToolContext("ses_1", "turn_1", "call_1")) == "value of k"
        assert len([line for line in log.read_text().splitlines() if "pid" in line]) == 2
    finally:
        await made.stop()


async def test_calls_in_parallel_refused_for_a_lost_session_each_go_again_once(tmp_path: Path) -> None:
    server = McpTestServer(tmp_path, legacy=True).start()
    made = McpTools(Toolbox(), [McpServer.http("old", server.url)])
    try:
        await made.start()
        lookup = made.current().tools["old__lookup"]
        server.kill()
        server.start()  # every call below carries the session id the server no longer has
        calls = [lookup.invoke({"key": f"k{n}"}, ToolContext("ses_1", "turn_1", f"call_{n}")) for n in range(4)]
        assert await asyncio.gather(*calls) == [f"value of k{n}" for n in range(4)]
        assert sorted(r["call_id"] for r in server.records("lookup")) == [f"call_{n}" for n in range(4)]
    finally:
        await made.stop()
        server.kill()


async def test_a_handshake_era_servers_list_changed_notice_changes_the_next_toolbox(tmp_path: Path) -> None:
    server = McpTestServer(tmp_path, legacy=True).start()
    changed: list[str] = []
    made = McpTools(Toolbox(), [McpServer.http("old", server.url)], changed=changed.append)
    try:
        await made.start()
        before = made.current()
        await before.tools["old__grow"].invoke({}, ToolContext("ses_1", "turn_1", "call_1"))
        async with asyncio.timeout(10):
            while not changed:  # noqa: ASYNC110 (the notice comes on the server's stream)
                await asyncio.sleep(0.01)
        assert changed == ["old"] and "old__extra" in made.current().tools and "old__extra" not in before.tools
    finally:
        await made.stop()
        server.kill()


async def test_calls_during_an_outage_share_one_opening_and_are_bounded_by_timeout_s() -> None:
    # a "server" that never answers its opening: every call waits for the same attempt, at most timeout_s
    hangs = McpServer.stdio("hangs", sys.executable, ["-c", "import time; time.sleep(60)"], timeout_s=1)
    made = McpTools(Toolbox(), [hangs])
    session = made.sessions[0]
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def one(n: int) -> tuple[float, str]:
        with pytest.raises(ToolError) as err:
            await session.call("anything", {}, f"call_{n}")
        return loop.time() - started, err.value.message

    try:
        ended = await asyncio.gather(*(one(n) for n in range(3)))
    finally:
        await made.stop()
    assert all(message == "MCP server 'hangs': no session within 1 s" for _, message in ended)
    assert max(at for at, _ in ended) < 5  # together, not one after another (3 x 1 s and more)
