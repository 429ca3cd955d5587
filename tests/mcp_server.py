"""An MCP server for the tests, built with the official SDK and served over streamable HTTP:
`python -m tests.mcp_server <port> <log> [legacy]` (a subprocess, so a test can kill it mid-call;
`legacy`: as a 2025-11-25 server, with a session id), or over stdio: `python -m tests.mcp_server
stdio <log>`.

Its tools: `lookup` (read-only), `delete_file` (unannotated, so destructive), `slow` (sleeps;
says whether it was cancelled), `boom` (a ToolError), `crash` (an unexpected exception),
`picture` (an image), `report` (structured content only), `die` (the process ends mid-call),
`hold` (the first call of each `keel/call_id` never answers, a later one answers at once: a
server deduplicating by the key), and `grow` (adds the tool `extra`, says the list changed).
Every call is a JSON line in the
log: {"tool", "call_id", "args"}, then {"tool", "call_id", "end": "done" | "cancelled"}.
`GET /requests` is how many HTTP requests reached `/mcp`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, ImageContent, ToolAnnotations
from starlette.types import Receive, Scope, Send

ROOT = Path(__file__).resolve().parents[1]

READ_ONLY = ToolAnnotations(read_only_hint=True)
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def make(log_path: str) -> tuple[MCPServer, dict[str, int]]:  # noqa: PLR0915 (one tool after another)
    mcp = MCPServer("tests")
    counts = {"requests": 0}
    seen: set[str] = set()

    def log(record: dict[str, Any]) -> None:
        with open(log_path, "a") as f:  # one write of one line: whole or nothing
            f.write(json.dumps(record) + "\n")

    def began(ctx: Context, tool: str, **args: Any) -> str:
        meta = ctx.request_context.meta or {}
        call_id = str(meta.get("keel/call_id", ""))
        log({"tool": tool, "call_id": call_id, "args": args})
        return call_id

    @mcp.tool(annotations=READ_ONLY)
    def lookup(key: str, ctx: Context) -> str:
        """Look a key up."""
        began(ctx, "lookup", key=key)
        return f"value of {key}"

    @mcp.tool()
    def delete_file(path: str, ctx: Context) -> str:
        """Delete a file."""
        began(ctx, "delete_file", path=path)
        return f"deleted {path}"

    @mcp.tool(annotations=READ_ONLY)
    async def slow(seconds: float, ctx: Context) -> str:
        """Sleep for a while."""
        call_id = began(ctx, "slow", seconds=seconds)
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            log({"tool": "slow", "call_id": call_id, "end": "cancelled"})
            raise
        log({"tool": "slow", "call_id": call_id, "end": "done"})
        return f"slept {seconds}"

    @mcp.tool(annotations=READ_ONLY)
    def boom(ctx: Context) -> str:
        """Fail, saying why."""
        began(ctx, "boom")
        raise ToolError("the disk is full")

    @mcp.tool(annotations=READ_ONLY)
    def crash(ctx: Context) -> str:
        """Fail unexpectedly."""
        began(ctx, "crash")
        raise RuntimeError("secret internals")

    @mcp.tool(annotations=READ_ONLY)
    def picture(ctx: Context) -> CallToolResult:
        """Draw a picture."""
        began(ctx, "picture")
        return CallToolResult(content=[ImageContent(data=PNG, mime_type="image/png")])

    @mcp.tool(annotations=READ_ONLY, structured_output=True)
    def report(ctx: Context) -> CallToolResult:
        """A structured report."""
        began(ctx, "report")
        return CallToolResult(content=[], structured_content={"rows": 2, "ok": True})

    @mcp.tool(annotations=READ_ONLY)
    async def hold(ctx: Context) -> str:
        """Answer a call id's second call only (the first waits for ever)."""
        call_id = began(ctx, "hold")
        if call_id not in seen:
            seen.add(call_id)
            await asyncio.sleep(3600)
        return f"held {call_id}"

    @mcp.tool(annotations=READ_ONLY)
    def die(ctx: Context) -> str:
        """End the server's process mid-call."""
        began(ctx, "die")
        os._exit(3)

    @mcp.tool(annotations=READ_ONLY)
    async def grow(ctx: Context) -> str:
        """Add the tool `extra`."""
        began(ctx, "grow")

        def extra() -> str:
            """A tool that came later."""
            return "extra"

        mcp.add_tool(extra, annotations=READ_ONLY)
        if ctx.protocol_version in ("2025-11-25", "2025-06-18", "2025-03-26"):  # (a session: a notification)
            await ctx.session.send_tool_list_changed()
        else:  # (2026-07-28: an event to `subscriptions/listen` streams)
            await ctx.notify_tools_changed()
        return "grown"

    return mcp, counts


def app(log_path: str, *, legacy: bool = False) -> Any:
    """The server's ASGI app. `legacy`: it answers `server/discover` with 404, as a server of the
    2025-11-25 protocol does, so a client falls back to `initialize` and a session id."""
    mcp, counts = make(log_path)
    inner = mcp.streamable_http_app()

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/requests":
            body = json.dumps(counts).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http" and scope["path"] == "/mcp":
            counts["requests"] += 1
            if legacy and scope["method"] == "POST":
                receive = await _unless_discover(receive, send)
                if receive is None:
                    return
        await inner(scope, receive, send)

    return serve


async def _unless_discover(receive: Receive, send: Send) -> Receive | None:
    """The request's body, read whole and handed on; None (404 sent) for a `server/discover`."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    if b'"server/discover"' in body:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return None
    sent = False

    async def again() -> Any:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return again


class McpTestServer:
    """This server as a subprocess on a free port, for a test: started, killed, started again
    on the same port; its log read back."""

    def __init__(self, workdir: Path, *, legacy: bool = False) -> None:
        self.legacy = legacy
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = workdir / f"mcp-{self.port}.jsonl"
        self.log.touch()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> McpTestServer:
        args = [sys.executable, "-m", "tests.mcp_server", str(self.port), str(self.log), *(["legacy"] * self.legacy)]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                self.requests()
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise TimeoutError("the MCP test server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def records(self, tool: str | None = None) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [r for r in lines if tool is None or r["tool"] == tool]

    def requests(self) -> int:
        n: int = httpx.get(f"http://127.0.0.1:{self.port}/requests", timeout=5).json()["requests"]
        return n

    async def began(self, tool: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Once `n` calls of `tool` reached the server: their records."""
        async with asyncio.timeout(timeout):
            while len(calls := [r for r in self.records(tool) if "args" in r]) < n:  # noqa: ASYNC110 (a file)
                await asyncio.sleep(0.02)
        return calls


if __name__ == "__main__":
    where, log_path = sys.argv[1], sys.argv[2]
    if where == "stdio":
        with open(log_path, "a") as f:
            f.write(json.dumps({"tool": "", "pid": os.getpid()}) + "\n")  # (so a test can see it end)
        make(log_path)[0].run("stdio")
    else:
        legacy = sys.argv[3:] == ["legacy"]
        uvicorn.run(app(log_path, legacy=legacy), host="127.0.0.1", port=int(where), log_level="warning", lifespan="on")
