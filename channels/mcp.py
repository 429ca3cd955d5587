"""keel as an MCP server: `POST /mcp` (streamable HTTP), so Claude Desktop, Cursor or any MCP
client can talk to a keel agent.

Four tools, each one harness command of the HTTP API: `send_message` (a new session when no
`session_id` is given; waits for the turn like `?wait=true`), `respond` (answers an approval
request and waits for the turn it resumes), `get_session` and `cancel`. Their answers are JSON,
as text and as structured content; an error is an `isError` result carrying keel's
`{"error": {"code", "message"}}`, which changes nothing (I10). A tool keel does not have, or a
method it does not serve, is a JSON-RPC error (the SDK's).

The route sits behind the API key like `/v1`, and every session is its key's (the owner that
`ApiKeyAuth` put on the request). The transport is stateless, with JSON answers: any web process
answers any request, and no MCP session is kept between them. Without API keys (loopback only),
the Host and Origin headers must be loopback ones, so a web page cannot reach it by DNS
rebinding.

The SDK is loaded, and its session manager started, at the first request to `/mcp` (importing
it costs about half a second that a process not asked for it need not pay); without the
`keel[mcp]` extra, `/mcp` answers 501 `mcp_not_installed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from channels.errors import error_response
from channels.types import ContextValue, Text
from harness import Harness
from harness.aio import cancel_and_wait
from harness.errors import KeelError, Limited
from harness.events import Requested, TurnStatus
from harness.types import TurnOutcome

if TYPE_CHECKING:
    import mcp_types as types
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

log = logging.getLogger("keel")
PATH = "/mcp"
STOP_S = 5.0  # the session manager's ending, at most (its requests in flight are then cut)
LOOPBACK_HOSTS = ["127.0.0.1", "127.0.0.1:*", "localhost", "localhost:*", "[::1]", "[::1]:*"]
LOOPBACK_ORIGINS = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]

A = TypeVar("A", bound=msgspec.Struct)
SessionId = Annotated[str, msgspec.Meta(description="The session, as send_message named it")]


class SendArgs(msgspec.Struct, forbid_unknown_fields=True):
    text: Annotated[Text, msgspec.Meta(description="The user's message")]
    session_id: Annotated[
        str | None, msgspec.Meta(description="The session to continue; a new session when left out")
    ] = None
    context: Annotated[ContextValue, msgspec.Meta(description="Page context for the agent, as on the HTTP API")] = None


class RespondArgs(msgspec.Struct, forbid_unknown_fields=True):
    session_id: SessionId
    request_id: Annotated[str, msgspec.Meta(description="The approval request, from `pending`")]
    decision: Literal["approve", "deny"]
    reason: Annotated[str, msgspec.Meta(description="Why (the agent sees it with a denial)")] = ""


class SessionArgs(msgspec.Struct, forbid_unknown_fields=True):
    session_id: SessionId


class TurnAnswer(msgspec.Struct):
    """How a turn came out: `completed`, `failed`, `cancelled`, `waiting` (for the approvals in
    `pending`), or `pending` (still running when the wait ended: ask `get_session` later)."""

    session_id: str
    status: TurnStatus | Literal["pending"]
    reply: str | None
    pending: list[Requested]


class Cancelled(msgspec.Struct):
    session_id: str
    turn_id: str  # the turn that ends with turn.cancelled


class ErrorBody(msgspec.Struct):
    error: dict[str, Any]


def _schema(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """A struct's JSON schema, inline (an MCP input schema is one object)."""
    _, components = msgspec.json.schema_components((struct,))
    schema: dict[str, Any] = components[struct.__name__]
    schema.pop("title", None)
    return schema


def _tools() -> list[types.Tool]:
    import mcp_types as types

    return [
        types.Tool(
            name="send_message",
            description=(
                "Send a message to the keel agent and wait for its turn: a new session when no session_id is "
                "given. Answers the session id, how the turn came out (status), the agent's reply, and the "
                "approval requests it waits for (pending: answer them with respond)."
            ),
            input_schema=_schema(SendArgs),
        ),
        types.Tool(
            name="respond",
            description=(
                "Approve or deny a tool call the agent asked to make (a request in pending), then wait for the "
                "turn it resumes: answers like send_message."
            ),
            input_schema=_schema(RespondArgs),
        ),
        types.Tool(
            name="get_session",
            description="A session's status, open approval requests, queued messages and token usage.",
            input_schema=_schema(SessionArgs),
            annotations=types.ToolAnnotations(read_only_hint=True),
        ),
        types.Tool(
            name="cancel",
            description="Stop the session's turn in progress.",
            input_schema=_schema(SessionArgs),
            annotations=types.ToolAnnotations(destructive_hint=True, idempotent_hint=True),
        ),
    ]


_enc = msgspec.json.Encoder()


def _args(arguments: dict[str, Any], kind: type[A]) -> A:
    """A tool's arguments, validated as the HTTP API validates a body."""
    return msgspec.convert(arguments, kind)


def _result(value: msgspec.Struct, *, error: bool = False) -> types.CallToolResult:
    import mcp_types as types

    text = _enc.encode(value).decode()
    return types.CallToolResult(
        content=[types.TextContent(text=text)], structured_content=msgspec.to_builtins(value), is_error=error
    )


def _error(exc: KeelError | msgspec.ValidationError) -> types.CallToolResult:
    """keel's wire error, as an `isError` result."""
    if isinstance(exc, msgspec.ValidationError):
        return _result(ErrorBody({"code": "invalid_request", "message": str(exc)}), error=True)
    detail: dict[str, Any] = {"code": exc.code, "message": exc.message, **exc.details}
    if isinstance(exc, Limited):
        detail["retry_after"] = exc.retry_after
    return _result(ErrorBody(detail), error=True)


class McpChannel:
    """The `/mcp` endpoint (an ASGI app). Its SDK session manager runs in a task of its own from
    the first request until `stop`."""

    def __init__(self, *, open_to_all_hosts: bool, host: str, max_body: int, wait_timeout: float) -> None:
        self.open_to_all_hosts = open_to_all_hosts
        named = f"[{host}]" if ":" in host else host  # (the address keel listens on, if another loopback one)
        self.hosts = [*LOOPBACK_HOSTS, named, f"{named}:*"]
        self.origins = [*LOOPBACK_ORIGINS, f"http://{named}:*"]
        self.max_body = max_body
        self.wait_timeout = wait_timeout
        self._manager: asyncio.Future[StreamableHTTPSessionManager | None] | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._stopping.is_set():
            await error_response(503, "stopping", "keel is stopping")(scope, receive, send)
            return
        manager = await self._started()
        if manager is None:
            message = "this keel has no MCP support: install the keel[mcp] extra"
            await error_response(501, "mcp_not_installed", message)(scope, receive, send)
            return
        await manager.handle_request(scope, receive, send)

    async def stop(self) -> None:
        self._stopping.set()
        if self._holder is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._holder), STOP_S)
            await cancel_and_wait([self._holder])

    async def _started(self) -> StreamableHTTPSessionManager | None:
        if self._manager is None:
            self._manager = asyncio.get_running_loop().create_future()
            self._holder = asyncio.create_task(self._hold(self._manager), name="keel-mcp-server")
        return await asyncio.shield(self._manager)

    async def _hold(self, ready: asyncio.Future[StreamableHTTPSessionManager | None]) -> None:
        """Load the SDK (in a thread: the event loop goes on meanwhile), then run the session
        manager until `stop`."""
        try:
            manager = await asyncio.to_thread(self._build)
            async with manager.run():
                ready.set_result(manager)
                await self._stopping.wait()
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(("mcp", "httpx2")):
                log.exception("keel's MCP server could not be loaded")
                raise
            ready.set_result(None)  # (the extra is not installed: 501, saying so)
        except Exception:
            log.exception("keel's MCP server stopped")
            raise
        finally:
            if not ready.done():  # (it failed to start: every request says so, none waits)
                ready.set_exception(RuntimeError("keel's MCP server did not start"))

    def _build(self) -> StreamableHTTPSessionManager:
        from mcp.server.lowlevel import Server
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.server.transport_security import TransportSecuritySettings

        server: Server[Any] = Server("keel", version="1", on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        security = (
            TransportSecuritySettings(enable_dns_rebinding_protection=False)
            if self.open_to_all_hosts
            else TransportSecuritySettings(
                enable_dns_rebinding_protection=True, allowed_hosts=self.hosts, allowed_origins=self.origins
            )
        )
        self._tools = _tools()
        return StreamableHTTPSessionManager(
            server, json_response=True, stateless=True, security_settings=security, max_request_body_size=self.max_body
        )

    async def _list_tools(self, ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        import mcp_types as types

        return types.ListToolsResult(tools=self._tools)

    async def _call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        from mcp.shared.exceptions import MCPError
        from mcp_types.jsonrpc import INVALID_PARAMS

        request = ctx.request
        if not isinstance(request, Request):  # (the HTTP transport always gives its request)
            raise MCPError(INVALID_PARAMS, "keel's tools are served over HTTP only")
        harness: Harness = request.app.state.harness
        owner: str = request.scope["state"]["owner"]
        arguments = params.arguments or {}
        try:
            match params.name:
                case "send_message":
                    return _result(await self._send_message(harness, owner, _args(arguments, SendArgs)))
                case "respond":
                    return _result(await self._respond(harness, owner, _args(arguments, RespondArgs)))
                case "get_session":
                    args = _args(arguments, SessionArgs)
                    return _result(await harness.sessions.info(args.session_id, owner))
                case "cancel":
                    args = _args(arguments, SessionArgs)
                    return _result(Cancelled(args.session_id, await harness.sessions.cancel(args.session_id, owner)))
                case name:
                    raise MCPError(INVALID_PARAMS, f"keel has no tool {name[:64]!r}")
        except (msgspec.ValidationError, KeelError) as exc:
            return _error(exc)

    async def _send_message(self, harness: Harness, owner: str, args: SendArgs) -> TurnAnswer:
        if args.session_id is not None:  # (bad input spends no token)
            await harness.sessions.admissible(args.session_id, owner)
        await harness.quotas.admit(owner)
        sid = args.session_id if args.session_id is not None else await harness.sessions.create(owner)
        turn = await harness.sessions.submit_and_wait(
            sid, owner, args.text, context=args.context, message_id=None, timeout=self.wait_timeout
        )
        return await self._answer(harness, owner, sid, TurnOutcome(turn.status, turn.reply, turn.events))

    async def _respond(self, harness: Harness, owner: str, args: RespondArgs) -> TurnAnswer:
        outcome = await harness.sessions.respond_and_wait(
            args.session_id, owner, args.request_id, args.decision, args.reason, timeout=self.wait_timeout
        )
        return await self._answer(harness, owner, args.session_id, outcome)

    @staticmethod
    async def _answer(harness: Harness, owner: str, sid: str, outcome: TurnOutcome) -> TurnAnswer:
        pending: list[Requested] = []
        if outcome.status in ("waiting", "pending"):
            pending = (await harness.sessions.info(sid, owner)).pending
        return TurnAnswer(sid, outcome.status, outcome.reply, pending)
