"""MCP tool calls: keel's client beside the SDK's own, on the same server, in the same run.

    .venv/bin/python deploy/bench/bench_mcp.py [--calls 100] [--rounds 5] [--cancels 20]

Starts an MCP server (the SDK's MCPServer over streamable HTTP, a read-only `echo` tool and a
`slow` one, counting the HTTP requests that reach `/mcp`) and a private Valkey, each a
subprocess. Then, in rounds, the two alternating:

- direct: the SDK's `Client`, connected once, calls `echo` --calls times one after another;
- keel: a Harness on the Valkey, its agent's scripted (zero-latency) model calling
  `bench__echo` once per turn, --calls turns one after another; its MCP session is opened when
  the harness starts, and the requests the server received are counted from before that
  opening to after the first --calls turns: HTTP requests per tool call, amortized. The same
  harness's turns calling a local tool (the same echo) instead, in the same rounds, give what
  an MCP call costs in a turn (MCP turn p50 - local-tool turn p50); keel's added latency per
  call is that less the direct call's p50. keel's MCP layer alone (`McpTool.invoke`, no turn)
  is timed beside the direct call too.
- cancel: --cancels turns whose tool call is `slow` (60 s), each cancelled once the call began:
  the time from the cancel to the turn's turn.cancelled (its p50 and worst).

Prints a table and one `RESULT {json}` line. Every process started here is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # keel's packages, when run from anywhere

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from support import (  # the sibling module: this file runs as a script
    HOST,
    BenchError,
    Deadline,
    free_port,
    log_tail,
    percentile,
    positive,
    start_process,
    start_valkey,
    stop_process,
)

from app import build_harness
from app.settings import Settings
from harness import Agent, Harness, McpServer, tool
from harness.events import StoredEvent
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage
from harness.tools import ToolContext

USAGE = Usage(input_tokens=100, output_tokens=1)


def serve(port: int) -> None:
    """The MCP server (run as `bench_mcp.py --serve PORT`)."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations
    from starlette.types import Receive, Scope, Send

    mcp = MCPServer("bench")
    counts = {"requests": 0}

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    def echo(text: str) -> str:
        """Say the text back."""
        return text

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def slow(seconds: float) -> str:
        """Take a while."""
        await asyncio.sleep(seconds)
        return "slept"

    inner = mcp.streamable_http_app()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/requests":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": json.dumps(counts).encode()})
            return
        if scope["type"] == "http" and scope["path"] == "/mcp":
            counts["requests"] += 1
        await inner(scope, receive, send)

    uvicorn.run(app, host=HOST, port=port, log_level="warning", lifespan="on")


@tool
def echo(text: str) -> str:
    """Say the text back."""
    return text


def reply(request: ModelRequest) -> ModelReply:
    """One tool call per turn: the MCP server's echo ("mcp"), the local one ("local"), or the
    MCP server's slow tool ("cancel me"); then the reply."""
    last = request.messages[-1]
    if last.role == "tool":
        return ModelReply(text=f"said {last.text}", usage=USAGE)
    if last.text == "cancel me":
        return ModelReply(tool_calls=[ToolCall("bench__slow", {"seconds": 60})], usage=USAGE)
    name = "bench__echo" if last.text == "mcp" else "echo"
    return ModelReply(tool_calls=[ToolCall(name, {"text": "hi"})], usage=USAGE)


async def requests(http: httpx2.AsyncClient, port: int) -> int:
    n: int = (await http.get(f"http://{HOST}:{port}/requests")).json()["requests"]
    return n


async def timed(n: int, one: Callable[[int], Awaitable[Any]]) -> list[float]:
    out: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        await one(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def direct_round(url: str, calls: int, warm: int) -> list[float]:
    async with httpx2.AsyncClient() as http, Client(streamable_http_client(url, http_client=http)) as client:
        for _ in range(warm):
            await client.call_tool("echo", {"text": "hi"})
        return await timed(calls, lambda i: client.call_tool("echo", {"text": "hi"}))


async def turns(harness: Harness, sid: str, calls: int, which: str) -> list[float]:
    async def one(i: int) -> None:
        res = await harness.sessions.submit_and_wait(sid, "bench", which, context=None, message_id=None, timeout=30)
        if res.reply != "said hi":
            raise BenchError(f"a turn came out {res.status}: {res.reply!r}")

    return await timed(calls, one)


async def cancel_once(harness: Harness, sid: str) -> float:
    """ms from the cancel of a turn whose MCP call runs to its turn.cancelled."""
    submitted = await harness.sessions.submit(sid, "bench", "cancel me", None, None)
    after = submitted.received_id
    cancelled_at = 0.0
    async with asyncio.timeout(30):
        async for event in harness.sessions.tail(sid, after, heartbeat=5):
            if not isinstance(event, StoredEvent):
                continue
            if event.type == "tool.started":
                cancelled_at = time.perf_counter()
                await harness.sessions.cancel(sid, "bench")
            elif event.type == "turn.cancelled":
                return (time.perf_counter() - cancelled_at) * 1000
            elif event.type in ("turn.completed", "turn.failed"):
                raise BenchError(f"the turn was not cancelled: {event.type}")
    raise BenchError("no turn.cancelled")


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(xs), 3), "p99": round(percentile(xs, 99), 3)}


async def run(args: argparse.Namespace, deadline: Deadline, work: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://{HOST}:{port}/mcp"
    server = start_process([sys.executable, __file__, "--serve", str(port)], dict(os.environ), work / "mcp.log")
    valkey, valkey_port = start_valkey(work, deadline)
    try:
        async with httpx2.AsyncClient() as http:
            for _ in range(200):
                try:
                    await requests(http, port)
                    break
                except httpx2.TransportError:
                    await asyncio.sleep(0.05)
            else:
                raise BenchError(f"the MCP server did not start:\n{log_tail(work / 'mcp.log')}")
            agent = Agent(instructions="bench", tools=[echo], model=ScriptedModel(reply, keep=0))
            settings = Settings(mcp_servers=(McpServer.http("bench", url),))
            before = await requests(http, port)
            harness = build_harness(settings, f"redis://{HOST}:{valkey_port}", agent, run_turns=True)
            await harness.start()
            try:
                mcp_sid = await harness.sessions.create("bench")
                local_sid = await harness.sessions.create("bench")
                first = await turns(harness, mcp_sid, args.calls, "mcp")  # (the opening and these calls: counted)
                counted = await requests(http, port) - before
                direct: list[float] = []
                mcp_turn: list[float] = []
                local_turn: list[float] = []
                layer: list[float] = []
                assert harness.mcp is not None
                tool = harness.mcp.current().tools["bench__echo"]
                ctx = ToolContext("ses_bench", "turn_bench", "call_bench")
                for _ in range(args.rounds):
                    deadline.left()
                    direct += await direct_round(url, args.calls, warm=5)
                    mcp_turn += await turns(harness, mcp_sid, args.calls, "mcp")
                    local_turn += await turns(harness, local_sid, args.calls, "local")
                    layer += await timed(args.calls, lambda i: tool.invoke({"text": "hi"}, ctx))
                cancel_sid = await harness.sessions.create("bench")
                cancels = [await cancel_once(harness, cancel_sid) for _ in range(args.cancels)]
            finally:
                await harness.stop()
    finally:
        stop_process(server)
        stop_process(valkey)
    d, m, lo, la = summary(direct), summary(mcp_turn), summary(local_turn), summary(layer)
    in_turn = m["p50"] - lo["p50"]
    return {
        "calls": args.calls,
        "rounds": args.rounds,
        "requests_per_call": round(counted / args.calls, 3),
        "requests_counted": counted,
        "first_calls_turn_ms": summary(first),
        "direct_call_ms": d,
        "keel_mcp_layer_ms": la,
        "turn_with_mcp_tool_ms": m,
        "turn_with_local_tool_ms": lo,
        "mcp_call_in_a_turn_ms_p50": round(in_turn, 3),
        "keel_added_per_call_ms_p50": round(in_turn - d["p50"], 3),
        "layer_added_ms_p50": round(la["p50"] - d["p50"], 3),
        "cancel_to_turn_cancelled_ms": {"p50": round(statistics.median(cancels), 1), "max": round(max(cancels), 1)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive, default=100)
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument("--cancels", type=positive, default=20)
    parser.add_argument("--deadline", type=positive, default=600)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    with tempfile.TemporaryDirectory(prefix="keel-bench-mcp-") as tmp:
        try:
            result = asyncio.run(run(args, Deadline(args.deadline), Path(tmp)))
        except BenchError as exc:
            print(f"bench_mcp: {exc}", file=sys.stderr)
            return 1
    print(f"HTTP requests at the MCP server per tool call (amortized over {args.calls}): {result['requests_per_call']}")
    print(f"{'per call, ms':40} {'p50':>8} {'p99':>8}")
    for name, key in (
        ("SDK client, direct", "direct_call_ms"),
        ("keel's MCP layer (McpTool.invoke)", "keel_mcp_layer_ms"),
        ("keel turn with 1 MCP tool call", "turn_with_mcp_tool_ms"),
        ("keel turn with 1 local tool call", "turn_with_local_tool_ms"),
    ):
        print(f"{name:40} {result[key]['p50']:8.3f} {result[key]['p99']:8.3f}")
    print(f"an MCP call in a turn (turn p50 - local-tool turn p50): {result['mcp_call_in_a_turn_ms_p50']} ms")
    print(
        f"keel's added latency per MCP call (that - the direct call's p50): {result['keel_added_per_call_ms_p50']} ms"
    )
    c = result["cancel_to_turn_cancelled_ms"]
    print(f"cancel during an MCP call -> turn.cancelled: p50 {c['p50']} ms, max {c['max']} ms")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
