"""Tools from MCP servers: one session per server in this process, its catalogue, its calls.

`McpTools` opens a session with each of an agent's MCP servers when the process starts (the
official `mcp` SDK, `keel[mcp]`: stdio or streamable HTTP), lists their tools and offers them as
`<server>__<tool>` (characters outside `[A-Za-z0-9_-]` made `_`, at most 64) with the server's
description and input schema, sorted by name after the agent's own tools, in one `Toolbox`
kept while nothing changes. A changed catalogue (the server says its list changed, or a session
made again lists other tools) makes a new Toolbox, which the next turn takes when it begins: a
running turn keeps its tools. The change is logged and counted (it costs the prompt cache).

One session serves every turn and session of the process, calls in parallel over it. A call
carries keel's call id in `_meta` as `keel/call_id` (a server deduplicates with it: after a
crash the call is made again with the same id). Its result: the text content; the structured
content's JSON where there is no text; a short note for an image, audio or a resource;
`isError` an error result the model sees. A protocol error, a server that is down or a call past
`timeout_s` is an error result too, and the turn goes on; a session that died is opened again
for the next call, never to send a call again that may have reached the server. A cancel of
the turn stops the call (the SDK tells the server) at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from harness.aio import cancel_and_wait
from harness.errors import KeelError, ToolError
from harness.models.base import ToolSpec
from harness.tools import ToolContext
from harness.tools.mcpconfig import McpServer
from harness.tools.toolbox import Toolbox, ToolPort

log = logging.getLogger("keel.mcp")
NAME_MAX = 64
OPEN_S = 30.0  # a session's opening, at most (a stdio server's start included)
STOP_S = 5.0  # a session's closing, at most
LOST = "the connection was lost during the call; it may or may not have run, and was not sent again"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class McpUnavailable(KeelError):
    """An MCP server could not be started or reached; the message names it."""

    code = "mcp_unavailable"


def keel_name(server: str, tool: str) -> str:
    """The name the model knows an MCP server's tool by."""
    return _UNSAFE.sub("_", f"{server}__{tool}")[:NAME_MAX]


class McpTool:
    """One tool of an MCP server, as the loop calls it (a `ToolPort`)."""

    interruptible = True

    def __init__(self, session: McpSession, remote: Any) -> None:
        self.session = session
        self.remote_name: str = remote.name
        self.name = keel_name(session.server.name, remote.name)
        self.spec = ToolSpec(name=self.name, description=remote.description or "", parameters=remote.input_schema)
        annotations = remote.annotations
        self.read_only = annotations is not None and annotations.read_only_hint is True

    def needs_approval(self, arguments: dict[str, Any]) -> bool:
        mode = self.session.server.approval_of(self.remote_name)
        return mode == "always" or (mode == "destructive" and not self.read_only)

    async def invoke(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return await self.session.call(self.remote_name, arguments, context.call_id)

    def same(self, other: McpTool) -> bool:
        return self.spec == other.spec and self.read_only == other.read_only


class McpSession:
    """This process's session with one MCP server: opened by a task of its own that holds the
    SDK's client (so a connection that dies takes down that task, not the calls' callers), made
    again for the next call after it died."""

    def __init__(self, server: McpServer, changed: Callable[[McpSession], None]) -> None:
        self.server = server
        self.tools: tuple[McpTool, ...] = ()
        self._changed = changed  # the catalogue changed (called once the new one is in place)
        self._client: Any = None
        self._holder: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._opening: asyncio.Lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- the session -----------------------------------------------------------------------

    async def open(self) -> None:
        """Open the session and list the tools; McpUnavailable (naming the server) if it cannot."""
        async with self._opening:
            if self._client is not None:
                return
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._holder = asyncio.create_task(self._hold(ready), name=f"keel-mcp-{self.server.name}")
            try:
                async with asyncio.timeout(OPEN_S):
                    await asyncio.shield(ready)
            except TimeoutError:
                await self._stop_holder()
                raise McpUnavailable(f"MCP server {self.server.name!r}: no session within {OPEN_S:g} s") from None
            except McpUnavailable:
                await self._stop_holder()
                raise

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        from mcp import Client  # (keel[mcp]: imported only where a server is configured)

        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    Client(await self._target(stack), message_handler=self._message)
                )
                tools = await self._list(client)
                self._client = client
                self._catalogue(tools)
                ready.set_result(None)
                self._spawn(self._listen(client))
                await self._closing.wait()
        except asyncio.CancelledError:
            if not ready.done():
                ready.set_exception(McpUnavailable(f"MCP server {self.server.name!r}: closed while opening"))
            raise
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(McpUnavailable(f"MCP server {self.server.name!r}: {self._failed()}: {_why(exc)}"))
            elif not self._closing.is_set():
                log.warning(
                    "mcp: the session with %s ended: %s; the next call opens it again", self.server.name, _why(exc)
                )
        finally:
            self._client = None

    async def _target(self, stack: contextlib.AsyncExitStack) -> Any:
        """What the SDK's client connects to: the server's command (stdio), or its URL with the
        configured headers (streamable HTTP, over an HTTP client closed with the session)."""
        if self.server.transport == "http":
            import httpx2  # (the mcp SDK's HTTP client)
            from mcp.client.streamable_http import streamable_http_client

            # (as the SDK's own: 30 s to connect or write, 5 min to read a held response stream)
            http = httpx2.AsyncClient(headers=dict(self.server.headers), timeout=httpx2.Timeout(30.0, read=300.0))
            await stack.enter_async_context(http)
            return streamable_http_client(self.server.url, http_client=http)
        from mcp.client.stdio import StdioServerParameters

        return StdioServerParameters(
            command=self.server.command, args=list(self.server.args), env=dict(self.server.env)
        )

    def _failed(self) -> str:
        """What could not be done, naming the program or the URL (without its query: it may hold
        a key)."""
        if self.server.transport == "http":
            return f"cannot reach {self.server.url.split('?', 1)[0]}"
        return f"cannot start {self.server.command}"

    async def close(self) -> None:
        """End the session (a stdio server's process with it)."""
        await cancel_and_wait(self._tasks)
        await self._stop_holder()

    async def _stop_holder(self) -> None:
        self._closing.set()
        holder, self._holder = self._holder, None
        if holder is not None and not holder.done():
            with contextlib.suppress(TimeoutError, Exception):
                async with asyncio.timeout(STOP_S):
                    await asyncio.shield(holder)
            if not holder.done():
                await cancel_and_wait([holder])

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the catalogue -----------------------------------------------------------------------

    async def _list(self, client: Any) -> list[Any]:
        tools: list[Any] = []
        cursor: str | None = None
        for _ in range(100):  # (a server that pages forever stops here)
            page = await client.list_tools(cursor=cursor, cache_mode="refresh")
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    def _catalogue(self, listed: Sequence[Any]) -> None:
        """Take a listing: the offered tools sorted by name, one of each name; a change told."""
        tools: dict[str, McpTool] = {}
        for remote in sorted(listed, key=lambda t: t.name):
            if not self.server.offers(remote.name):
                continue
            made = McpTool(self, remote)
            if made.name in tools:
                log.warning("mcp: %s lists two tools named %s for the model; the second is left out",
                            self.server.name, made.name)  # fmt: skip
                continue
            tools[made.name] = made
        fresh = tuple(tools.values())
        old = self.tools
        if len(old) == len(fresh) and all(a.same(b) for a, b in zip(old, fresh, strict=True)):
            return
        self.tools = fresh
        if old:
            log.info(
                "mcp: %s's tools changed (%d -> %d): the next turn takes them", self.server.name, len(old), len(fresh)
            )
        self._changed(self)

    async def _message(self, message: Any) -> None:
        """A handshake-era server's notification (its tool list changed), or a transport fault."""
        from mcp_types import ToolListChangedNotification

        if isinstance(message, ToolListChangedNotification):
            self._spawn(self._relist())
        elif isinstance(message, Exception):
            log.debug("mcp: %s: %s", self.server.name, _why(message))

    async def _listen(self, client: Any) -> None:
        """A 2026-07-28 server's change events (`subscriptions/listen`), where it has them."""
        try:
            async with client.listen(tools_list_changed=True) as changes:
                async for _ in changes:
                    await self._relist()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (not offered, or the stream ended: a session made again lists anew)
            log.debug("mcp: no change events from %s: %s", self.server.name, _why(exc))

    async def _relist(self) -> None:
        client = self._client
        if client is None:
            return
        try:
            self._catalogue(await self._list(client))
        except Exception as exc:
            log.warning("mcp: listing %s's tools again failed: %s", self.server.name, _why(exc))

    # ---- calls -------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any], call_id: str) -> str:
        """The call's result text; ToolError for an error result (the server's, or one of reaching
        it). A call that may have reached the server is never sent again here; one the server
        refused for a session it no longer has (HTTP 404 for the session id: it never ran) is
        sent once more, over a new session."""
        for attempt in (1, 2):
            client = await self._client_for_call()
            try:
                return await self._call_once(client, tool, arguments, call_id)
            except _SessionGone:
                self._lost()
                if attempt == 2:
                    gone = f"MCP server {self.server.name!r} lost the session twice; the call did not run"
                    raise ToolError(gone) from None
                log.info("mcp: %s no longer has keel's session; %s goes over a new one", self.server.name, tool)
        raise AssertionError("unreachable")

    async def _client_for_call(self) -> Any:
        if self._client is None:
            try:
                await self.open()
            except McpUnavailable as exc:
                raise ToolError(exc.message) from None
        if self._client is None:
            raise ToolError(f"MCP server {self.server.name!r} is unreachable")
        return self._client

    async def _call_once(self, client: Any, tool: str, arguments: dict[str, Any], call_id: str) -> str:
        name = self.server.name
        started = time.monotonic()
        call = asyncio.ensure_future(client.call_tool(tool, arguments, meta={"keel/call_id": call_id}))
        try:
            async with asyncio.timeout(self.server.timeout_s):
                result = await call
        except TimeoutError:
            raise ToolError(f"MCP server {name!r}: {tool} took longer than {self.server.timeout_s:g} s") from None
        except asyncio.CancelledError:
            if _cancelled_here():
                raise  # (the turn is cancelled: the SDK tells the server)
            self._lost()
            raise ToolError(f"MCP server {name!r}: {LOST}") from None
        except Exception as exc:
            if _session_gone(exc):
                raise _SessionGone from None
            if _connection_failed(exc):
                self._lost()
                raise ToolError(f"MCP server {name!r}: {LOST} ({_why(exc)})") from None
            raise ToolError(f"MCP server {name!r}: {_why(exc)}") from None
        log.debug("mcp: %s.%s took %.1f ms", name, tool, (time.monotonic() - started) * 1000)
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or f"{tool} failed")
        return text

    def _lost(self) -> None:
        """The session is no good any more: let it go (the next call opens another)."""
        self._client = None
        self._closing.set()


def _cancelled_here() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _SessionGone(Exception):
    """The server answered 404 for keel's session id: it did not take the call."""


_GONE = frozenset({"session terminated", "session not found"})  # the SDK client's words for a 404, a server's


def _session_gone(exc: BaseException) -> bool:
    """Whether the server refused the request for a session id it does not have (HTTP 404):
    the SDK's client says so, or passes on the server's JSON-RPC error (the Python and
    TypeScript SDKs' servers: "Session not found")."""
    from mcp.shared.exceptions import MCPError

    return isinstance(exc, MCPError) and exc.message.strip().lower() in _GONE


def _connection_failed(exc: BaseException) -> bool:
    from mcp.shared.exceptions import MCPError

    if isinstance(exc, MCPError):
        return "connection closed" in exc.message.lower()
    return isinstance(exc, OSError | ConnectionError | EOFError) or "connect" in type(exc).__name__.lower()


def _why(exc: BaseException) -> str:
    """A one-line reason (an ExceptionGroup's first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def result_text(result: Any) -> str:
    """A call result as the model reads it."""
    parts: list[str] = []
    texts = 0
    for block in result.content:
        kind = block.type
        if kind == "text":
            parts.append(block.text)
            texts += 1
        elif kind in ("image", "audio"):
            parts.append(f"[{'an image' if kind == 'image' else 'audio'} ({block.mime_type}) was returned]")
        elif kind == "resource":
            parts.append(f"[a resource was returned: {block.resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[a link to a resource was returned: {block.uri}]")
    if not texts and result.structured_content is not None:
        parts.insert(0, json.dumps(result.structured_content, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(parts)


class McpTools:
    """An agent's MCP servers in this process: their sessions, and the Toolbox they make with the
    agent's own tools (`current`: a new one only when a catalogue changed)."""

    def __init__(
        self, local: Toolbox, servers: Sequence[McpServer], *, changed: Callable[[str], None] = lambda name: None
    ) -> None:
        self.local = local
        self.sessions = [McpSession(s, self._changed) for s in servers]
        self._counted = changed  # (a metric: the server whose catalogue changed)
        self._box = local
        self._started = False

    async def start(self) -> None:
        """Open every server's session, at once; McpUnavailable for the first that cannot be."""
        results = await asyncio.gather(*(s.open() for s in self.sessions), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                await self.stop()
                raise result
        self._started = True
        self._box = self._toolbox()

    async def stop(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sessions), return_exceptions=True)

    def current(self) -> Toolbox:
        """The tools a turn that begins now has."""
        return self._box

    def _changed(self, session: McpSession) -> None:
        if not self._started:
            return  # (the first listing: no change, nothing to count)
        self._counted(session.server.name)
        self._box = self._toolbox()

    def _toolbox(self) -> Toolbox:
        mcp: list[ToolPort] = sorted((t for s in self.sessions for t in s.tools), key=lambda t: t.name)
        taken = set(self.local.tools)
        kept = []
        for t in mcp:
            if t.name in taken:
                log.warning("mcp: %s is the name of a tool the agent has already; the MCP one is left out", t.name)
                continue
            taken.add(t.name)
            kept.append(t)
        return Toolbox.of([*self.local.tools.values(), *kept])
