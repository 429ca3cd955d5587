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


class _Link:
    """One opened session with a server: the task that holds the SDK's client (so a connection
    that dies takes down that task, not the calls' callers), from its opening to its end. A
    failure of one link touches no other: a call on an old link that fails late cannot close
    the link made after it."""

    def __init__(self) -> None:
        self.client: Any = None  # the SDK's Client, once open, until the link ends
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # opened (or why not)
        self.closing = asyncio.Event()  # set: the holder lets the client go
        self.holder: asyncio.Task[None] | None = None
        self.stale = False  # no new call goes over it; let go once its calls in flight are over
        self.inflight = 0
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read, if none waited)

    def usable(self) -> bool:
        """Open, not let go, and its connection not known to have ended (a stdio server that
        exited while idle: the SDK's dispatcher has seen the end of its output)."""
        if self.client is None or self.stale or self.closing.is_set():
            return False
        dispatcher = getattr(self.client.session, "_dispatcher", None)  # (the SDK has no public flag)
        return not getattr(dispatcher, "_closed", False)


class McpSession:
    """This process's session with one MCP server: its current link, made again for the next
    call after one died; the server's tools as it last listed them."""

    def __init__(self, server: McpServer, changed: Callable[[McpSession], None]) -> None:
        self.server = server
        self.tools: tuple[McpTool, ...] = ()
        self._changed = changed  # the catalogue changed (called once the new one is in place)
        self._link: _Link | None = None  # the newest link, opening or open
        self._links: set[_Link] = set()  # every link whose holder runs (ended at close)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # ---- the session -----------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether a call now would go over the session open now (else it opens another first)."""
        return self._link is not None and self._link.usable()

    async def open(self, wait: float = OPEN_S) -> _Link:
        """The open link, opening one if there is none (callers at the same time share one
        opening); McpUnavailable (naming the server) if it cannot be opened, or not within
        `wait` seconds for this caller (the opening goes on for the others)."""
        if self._closed:
            raise McpUnavailable(f"MCP server {self.server.name!r}: keel is stopping")
        link = self._link
        if link is None or (link.ready.done() and not link.usable()):
            if link is not None:
                self._lost(link)
            link = self._link = _Link()
            self._links.add(link)
            link.holder = asyncio.create_task(self._hold(link), name=f"keel-mcp-{self.server.name}")
        try:
            async with asyncio.timeout(min(wait, OPEN_S)):
                await asyncio.shield(link.ready)
        except TimeoutError:
            raise McpUnavailable(
                f"MCP server {self.server.name!r}: no session within {min(wait, OPEN_S):g} s"
            ) from None
        return link

    async def _hold(self, link: _Link) -> None:
        from mcp import Client  # (keel[mcp]: imported only where a server is configured)

        name = self.server.name
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with asyncio.timeout(OPEN_S):
                    client = await stack.enter_async_context(
                        Client(await self._target(stack), message_handler=self._message)
                    )
                    tools = await self._list(client)
                link.client = client
                self._catalogue(tools)
                link.ready.set_result(None)
                self._spawn(self._listen(link))
                await link.closing.wait()
        except asyncio.CancelledError:
            if not link.ready.done():
                link.ready.set_exception(McpUnavailable(f"MCP server {name!r}: closed while opening"))
            raise
        except BaseException as exc:
            if not link.ready.done():
                why = f"no session within {OPEN_S:g} s" if isinstance(exc, TimeoutError) else _why(exc)
                link.ready.set_exception(McpUnavailable(f"MCP server {name!r}: {self._failed()}: {why}"))
            elif not link.closing.is_set():
                log.warning("mcp: the session with %s ended: %s; the next call opens another", name, _why(exc))
        finally:
            link.client = None
            link.closing.set()
            if self._link is link:
                self._link = None
            self._links.discard(link)

    async def _target(self, stack: contextlib.AsyncExitStack) -> Any:
        """What the SDK's client connects to: the server's command (stdio), or its URL with the
        configured headers (streamable HTTP, over an HTTP client closed with the session)."""
        if self.server.transport == "http":
            import httpx2  # (the mcp SDK's HTTP client)
            from mcp.client.streamable_http import streamable_http_client

            # 30 s to connect or write (as the SDK's own); a held response stream is read for as
            # long as a call may take
            read = max(300.0, self.server.timeout_s + 30.0)
            http = httpx2.AsyncClient(headers=dict(self.server.headers), timeout=httpx2.Timeout(30.0, read=read))
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

    def _lost(self, link: _Link) -> None:
        """This link is no good any more: the next call opens another, and its holder lets it go
        once the calls in flight over it are over (closing it now would cut them short: a
        server that lost keel's session refuses each of them, and each then goes again)."""
        link.stale = True
        if self._link is link:
            self._link = None
        if not link.inflight:
            link.closing.set()

    async def close(self) -> None:
        """End the session: every link (a stdio server's process with it), for good."""
        self._closed = True
        await cancel_and_wait(self._tasks)
        links = list(self._links)
        for link in links:
            link.closing.set()  # an open link's holder lets its client go (a stdio server told to end)
            if link.holder is not None and not link.ready.done():
                link.holder.cancel()  # one still opening is stopped (once: the SDK then ends its process)
        holders = [link.holder for link in links if link.holder is not None and not link.holder.done()]
        if holders:
            _, late = await asyncio.wait(holders, timeout=STOP_S)
            for holder in late:
                holder.cancel()
            # (one cancel, waited for: cancelling again would cut short the SDK's shielded ending
            # of a stdio server, which then outlives keel)
            _, late = await asyncio.wait(late, timeout=STOP_S) if late else (set(), set())
            await cancel_and_wait(late)
        self._link = None

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

    async def _listen(self, link: _Link) -> None:
        """A 2026-07-28 server's change events (`subscriptions/listen`), where it has them."""
        try:
            async with link.client.listen(tools_list_changed=True) as changes:
                async for _ in changes:
                    await self._relist()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (not offered, or the stream ended: a session made again lists anew)
            log.debug("mcp: no change events from %s: %s", self.server.name, _why(exc))

    async def _relist(self) -> None:
        link = self._link
        if link is None or not link.usable():
            return
        try:
            self._catalogue(await self._list(link.client))
        except Exception as exc:
            log.warning("mcp: listing %s's tools again failed: %s", self.server.name, _why(exc))

    # ---- calls -------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any], call_id: str) -> str:
        """The call's result text; ToolError for an error result (the server's, or one of reaching
        it). A call that may have reached the server is never sent again here; one the server
        refused for a session it no longer has (HTTP 404 for the session id: it never ran) is
        sent once more, over a new session."""
        for attempt in (1, 2):
            link = self._link
            if link is None or not link.usable():
                try:
                    link = await self.open(self.server.timeout_s)
                except McpUnavailable as exc:
                    raise ToolError(exc.message) from None
            try:
                return await self._call_once(link, tool, arguments, call_id)
            except _SessionGone:
                self._lost(link)
                if attempt == 2:
                    gone = f"MCP server {self.server.name!r} lost the session twice; the call did not run"
                    raise ToolError(gone) from None
                log.info("mcp: %s no longer has keel's session; %s goes over a new one", self.server.name, tool)
        raise AssertionError("unreachable")

    async def _call_once(self, link: _Link, tool: str, arguments: dict[str, Any], call_id: str) -> str:
        name = self.server.name
        started = time.monotonic()
        call = asyncio.ensure_future(link.client.call_tool(tool, arguments, meta={"keel/call_id": call_id}))
        link.inflight += 1
        try:
            async with asyncio.timeout(self.server.timeout_s):
                result = await call
        except TimeoutError:
            raise ToolError(f"MCP server {name!r}: {tool} took longer than {self.server.timeout_s:g} s") from None
        except asyncio.CancelledError:
            if _cancelled_here():
                raise  # (the turn is cancelled: the SDK tells the server)
            self._lost(link)
            raise ToolError(f"MCP server {name!r}: {LOST}") from None
        except Exception as exc:
            if _session_gone(exc):
                raise _SessionGone from None
            if _connection_failed(exc):
                self._lost(link)
                raise ToolError(f"MCP server {name!r}: {LOST} ({_why(exc)})") from None
            raise ToolError(f"MCP server {name!r}: {_why(exc)}") from None
        finally:
            link.inflight -= 1
            if link.stale and not link.inflight:
                link.closing.set()
        log.debug("mcp: %s.%s took %.1f ms", name, tool, (time.monotonic() - started) * 1000)
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or f"{tool} failed")
        return text


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
    from mcp_types.jsonrpc import CONNECTION_CLOSED

    if isinstance(exc, MCPError):
        return exc.code == CONNECTION_CLOSED or "connection closed" in exc.message.lower()
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
