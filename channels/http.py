"""The HTTP channel: REST for commands and reads (SSE lives in `channels.sse`, the route table
in `channels.routes`).

Handlers decode and validate at the edge, call the Harness, and encode its values. Nothing is
written unless the whole request was valid (I10)."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from channels.answers import (
    Health,
    HistoryPage,
    MessageAccepted,
    NewSession,
    ResponseAccepted,
    SessionToken,
    SettledTurn,
    TurnQueued,
    history_item,
    settled,
)
from channels.errors import ChannelError, error_response
from channels.spec import Param, Returns, operation
from channels.types import (
    CancelTurn,
    CreateSession,
    Empty,
    ForkSession,
    Respond,
    SendMessage,
    UpdateSession,
    cancel_decoder,
    create_session_decoder,
    empty_decoder,
    fork_session_decoder,
    respond_decoder,
    send_message_decoder,
    update_session_decoder,
)
from harness import Harness
from harness.errors import Unavailable
from harness.types import SESSIONS_PAGE_MAX, SessionInfo, SessionPage

_enc = msgspec.json.Encoder()
MAX_WAIT_S = 300.0
SECONDS = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?", re.ASCII)
HISTORY_PAGE, HISTORY_PAGE_MAX = 500, 1000
SESSIONS_PAGE = 20
META_FILTER = "metadata."


def json_response(value: Any, status: int = 200) -> Response:
    return Response(_enc.encode(value), status_code=status, media_type="application/json")


def harness_of(request: Request) -> Harness:
    h: Harness = request.app.state.harness
    return h


def owner_of(request: Request) -> str:
    owner: str = request.scope["state"]["owner"]  # (what `request.state` wraps, set by `ApiKeyAuth`)
    return owner


async def read_body(request: Request) -> bytes:
    """The request body, refusing more than the configured limit without reading it all. Read
    from the ASGI messages as they come (Starlette's `request.stream()`, an async generator,
    cost a third of a plain request's handling here); a body that stalls mid-way holds nothing
    for long: a timer cancels the read (`asyncio.timeout` did the same for four times the cost,
    about 3 us a request)."""
    state = request.app.state
    limit: int = state.max_body
    declared = next((v for k, v in request.scope["headers"] if k == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ChannelError(413, "too_large", f"the body is larger than {limit} bytes")
    receive = request.receive
    chunks: list[bytes] = []
    size = 0
    timeout: float = getattr(state, "body_timeout", 30.0)
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("read_body runs in a task")
    cancelling = task.cancelling()  # (as asyncio.timeout does: cancels asked before this one go on)
    stalled: list[bool] = []  # the timer fired (and asked for a cancel, to be taken back)
    timer = asyncio.get_running_loop().call_later(timeout, _stall, task, stalled)
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":  # (http.disconnect: the client went away mid-body)
                raise ChannelError(400, "incomplete_body", "the client disconnected before the body ended")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ChannelError(413, "too_large", f"the body is larger than {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if stalled:
            stalled.clear()
            if task.uncancel() <= cancelling:  # (the timer's cancel alone: a shutdown's goes on)
                raise ChannelError(408, "body_timeout", f"the body did not arrive within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        if stalled:  # (fired, and its cancel came out as something else: taken back all the same)
            task.uncancel()
    return b"".join(chunks)


def _stall(task: asyncio.Task[Any], stalled: list[bool]) -> None:
    stalled.append(True)
    task.cancel()


def decode(decoder: msgspec.json.Decoder[Any], body: bytes, *, empty_ok: bool = False) -> Any:
    if not body.strip():
        if empty_ok:
            body = b"{}"
        else:
            raise ChannelError(400, "invalid_request", "the body must be a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ChannelError(400, "invalid_request", str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ChannelError(400, "invalid_json", f"the body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ChannelError(400, "invalid_json", "the body is nested too deeply") from None


def query(request: Request, name: str) -> str | None:
    """The query parameter `name` (its last value), as `request.query_params.get(name)` gives
    it. A query with nothing escaped in it (no `%`, no `+`) is split here: Starlette's parse of
    every parameter cost more than the rest of a plain `?wait=true` request's routing."""
    raw: bytes = request.scope.get("query_string", b"")
    if not raw:
        return None
    if b"%" in raw or b"+" in raw:
        return request.query_params.get(name)
    key, found = name.encode("latin-1", "replace"), None
    for part in raw.split(b"&"):
        k, _, v = part.partition(b"=")
        if k == key:
            found = v
    return found.decode("latin-1") if found is not None else None


def flag(request: Request, name: str) -> bool:
    raw = query(request, name)
    if raw is None or raw in ("false", "0", ""):
        return False
    if raw in ("true", "1"):
        return True
    raise ChannelError(400, "invalid_query", f"?{name}= takes true or false")


NOT_FOUND = {404: "`session_not_found`: no such session, or another key's"}
RATED = {429: "`rate_limited`: past `KEEL_RATE_LIMIT` for this key (Retry-After)"}
QUEUED = {429: "`rate_limited` (past `KEEL_RATE_LIMIT`), `queue_full` (past `KEEL_MAX_QUEUED`); Retry-After"}


@operation(
    "Create a session",
    Returns(201, NewSession, "The new session", provides={"sid": "$response.body#/session_id"}),
    body=CreateSession,
    body_optional=True,
    errors=RATED,
)
async def create_session(request: Request) -> Response:
    body = decode(create_session_decoder, await read_body(request), empty_ok=True)
    harness = harness_of(request)
    await harness.quotas.admit(owner_of(request))
    sid = await harness.sessions.create(owner_of(request), body.metadata)
    return json_response(NewSession(sid), 201)


@operation(
    "Send a message",
    Returns(202, MessageAccepted, "Accepted (without `wait`): `handled` says how"),
    Returns(200, SettledTurn, "With `?wait=true`: the turn settled, or `pending` past the timeout"),
    body=SendMessage,
    errors={
        **NOT_FOUND,
        **QUEUED,
        400: "`invalid_request`, `invalid_json`, `invalid_message_id`, `invalid_query`",
        409: "`busy`: `policy: reject`, and a turn runs or waits (nothing written); `turn_events_gone`: with "
        "`wait`, a message sent again whose turn ended longer ago than its events are kept",
    },
    params=(
        Param("wait", {"type": "boolean"}, "Answer when the turn settles (200) instead of at once (202)"),
        Param(
            "timeout",
            {"type": "string", "pattern": r"^[0-9]{1,6}(\.[0-9]{1,6})?$"},
            "With `wait`: seconds, ASCII digits (at most 300)",
        ),
    ),
)
async def send_message(request: Request) -> Response:
    sid = request.path_params["sid"]
    wait = flag(request, "wait")
    timeout = request.app.state.wait_timeout
    raw = query(request, "timeout")
    if raw is not None:
        if not SECONDS.fullmatch(raw):  # (ASCII digits only, as every number in a query)
            raise ChannelError(400, "invalid_query", "?timeout= takes seconds, like 30 or 2.5")
        timeout = min(float(raw), MAX_WAIT_S)
        if not timeout > 0:
            raise ChannelError(400, "invalid_query", "?timeout= must be positive")
    body = decode(send_message_decoder, await read_body(request))
    harness, owner = harness_of(request), owner_of(request)
    await harness.sessions.admissible(sid, owner, body.message_id)  # (bad input spends no token)
    await harness.quotas.admit(owner)
    if wait:
        turn = await harness.sessions.submit_and_wait(
            sid,
            owner,
            body.text,
            context=body.context,
            message_id=body.message_id,
            timeout=timeout,
            policy=body.policy,
        )
        return json_response(settled(turn), 200)
    result = await harness.sessions.submit(sid, owner, body.text, body.context, body.message_id, policy=body.policy)
    return json_response(MessageAccepted(sid, result.message_id, result.handled), 202)


@operation(
    "Answer an approval request",
    Returns(202, ResponseAccepted, "Recorded (the same answer again is accepted too)"),
    body=Respond,
    errors={
        404: "`session_not_found`, `request_not_found`",
        409: "`already_answered` (with the recorded `decision`)",
        400: "`invalid_request`, `invalid_json`, `invalid_decision`",
    },
)
async def respond(request: Request) -> Response:
    sid = request.path_params["sid"]
    body = decode(respond_decoder, await read_body(request))
    res = await harness_of(request).sessions.respond(
        sid, owner_of(request), body.request_id, body.decision, body.reason
    )
    return json_response(ResponseAccepted(sid, body.request_id, res.answer.decision), 202)


@operation(
    "Cancel the turn in progress (or only `turn_id`)",
    Returns(202, TurnQueued, "The turn that will end with turn.cancelled"),
    body=CancelTurn,
    body_optional=True,
    errors={**NOT_FOUND, 409: "`nothing_to_cancel`", 400: "`invalid_request`, `invalid_json`, `invalid_turn_id`"},
)
async def cancel(request: Request) -> Response:
    sid = request.path_params["sid"]
    body = decode(cancel_decoder, await read_body(request), empty_ok=True)
    turn_id = await harness_of(request).sessions.cancel(sid, owner_of(request), body.turn_id)
    return json_response(TurnQueued(sid, turn_id), 202)


@operation(
    "Queue a compaction",
    Returns(202, TurnQueued, "Queued behind the session's turns"),
    body=Empty,
    body_optional=True,
    errors={**NOT_FOUND, **QUEUED},
)
async def compact(request: Request) -> Response:
    """Queue a compaction behind the session's turns: 202, then compaction.requested,
    compaction.completed and session.waiting on the event stream."""
    return await _operation(request, "compact")


@operation(
    "Queue a clear of the model's history",
    Returns(202, TurnQueued, "Queued behind the session's turns"),
    body=Empty,
    body_optional=True,
    errors={**NOT_FOUND, 429: "`queue_full`: past `KEEL_MAX_QUEUED` (Retry-After)"},
)
async def clear(request: Request) -> Response:
    """Queue a clear of the model's history behind the session's turns: 202, then
    context.cleared and session.waiting on the event stream."""
    return await _operation(request, "clear")


async def _operation(request: Request, kind: Literal["compact", "clear"]) -> Response:
    sid = request.path_params["sid"]
    decode(empty_decoder, await read_body(request), empty_ok=True)
    harness = harness_of(request)
    if kind == "compact":  # (a compaction calls the model: it counts like a message)
        await harness.sessions.admissible(sid, owner_of(request))
        await harness.quotas.admit(owner_of(request))
    op = harness.sessions.compact if kind == "compact" else harness.sessions.clear
    op_id = await op(sid, owner_of(request))
    return json_response(TurnQueued(sid, op_id), 202)


@operation(
    "Mint a websocket token for a browser",
    Returns(201, SessionToken, "A short-lived token for `?token=` on this session's websocket"),
    body=Empty,
    body_optional=True,
    errors={
        **NOT_FOUND,
        429: "`rate_limited`: past `KEEL_RATE_LIMIT` for this key or `KEEL_TOKEN_RATE_LIMIT` for this session",
    },
)
async def mint_token(request: Request) -> Response:
    """A short-lived token for a browser to open this session's websocket with (`?token=`)."""
    sid = request.path_params["sid"]
    decode(empty_decoder, await read_body(request), empty_ok=True)
    owner = owner_of(request)
    harness = harness_of(request)
    await harness.sessions.check_owner(sid, owner)
    await harness.quotas.admit(owner)
    await harness.quotas.admit_token(sid)
    token, expires_at = request.app.state.tokens.mint(sid, owner)
    return json_response(SessionToken(token, expires_at), 201)


@operation(
    "A session's status, open requests, queue, usage", Returns(200, SessionInfo, "The session"), errors=NOT_FOUND
)
async def get_session(request: Request) -> Response:
    info = await harness_of(request).sessions.info(request.path_params["sid"], owner_of(request))
    return json_response(info)


@operation(
    "The key's sessions, most recent activity first",
    Returns(200, SessionPage, "A page of sessions, and the cursor of the next page (null after the last)"),
    errors={400: "`invalid_query`, `invalid_cursor`"},
    params=(
        Param("limit", {"type": "integer", "minimum": 1, "maximum": SESSIONS_PAGE_MAX}, "Sessions (20 by default)"),
        Param(
            "cursor",
            {"type": "string", "pattern": r"^[0-9]{1,16}\.ses_[0-9a-z]{26}$"},
            "The page before's `next_cursor`",
        ),
        Param("status", {"type": "string", "enum": ["idle", "running", "waiting"]}, "Only sessions in this state"),
    ),
)
async def list_sessions(request: Request) -> Response:
    """The key's sessions, most recent activity first (`updated_at`: its last message, or a
    turn's end): `?limit=` (20 by default, at most 100), `?cursor=` (the page before's
    `next_cursor`), `?status=`, and `?metadata.<key>=<value>` (up to 8: sessions whose metadata
    has that value: a string as it is, any other value as its JSON). A filtered page may hold
    fewer sessions than `limit` (each page looks through at most 1,000) and still have a next."""
    query = request.query_params
    metadata: dict[str, str] = {}
    for name, value in query.multi_items():
        if name.startswith(META_FILTER) and len(name) > len(META_FILTER):
            if name[len(META_FILTER) :] in metadata:
                raise ChannelError(400, "invalid_query", f"?{name}= is given twice")
            metadata[name[len(META_FILTER) :]] = value
    page = await harness_of(request).sessions.listing(
        owner_of(request),
        limit=int_query(request, "limit", SESSIONS_PAGE, 1, SESSIONS_PAGE_MAX),
        cursor=query.get("cursor"),
        status=query.get("status"),
        metadata=metadata,
    )
    return json_response(page)


@operation(
    "Fork a session: a new one with its history, or the part before a message",
    Returns(201, NewSession, "The new session", provides={"sid": "$response.body#/session_id"}),
    body=ForkSession,
    body_optional=True,
    errors={
        **NOT_FOUND,
        **RATED,
        400: "`invalid_request`, `invalid_json`, `invalid_message_id`",
        409: "`message_not_in_history`: the message's turn left nothing in the active history (compacted away "
        "or cleared)",
    },
)
async def fork_session(request: Request) -> Response:
    """A new session of the same key with the same metadata, whose history is the source's: all
    of it (`{}`; a turn in progress is left out), or what came before the turn of the message
    `before_message_id`. It has no pending requests, no queue and no page context; the source is
    not changed. Editing a message is a fork before it and the new text sent there;
    regenerating a reply, a fork before its message and the same text sent again."""
    body: ForkSession = decode(fork_session_decoder, await read_body(request), empty_ok=True)
    harness = harness_of(request)
    sid, owner = request.path_params["sid"], owner_of(request)
    await harness.sessions.admissible(sid, owner, body.before_message_id)  # (bad input spends no token)
    await harness.quotas.admit(owner)
    new_sid = await harness.sessions.fork(sid, owner, body.before_message_id)
    return json_response(NewSession(new_sid), 201)


@operation(
    "Rename a session, change its metadata",
    Returns(200, SessionInfo, "The session as it is now"),
    body=UpdateSession,
    errors={**NOT_FOUND, 400: "`invalid_request`, `invalid_json`, `invalid_title`, `invalid_metadata`"},
)
async def update_session(request: Request) -> Response:
    """`title` (1 to 200 characters) replaces the session's title; `metadata`'s keys are merged
    into the session's (a null value removes its key), within the limits a new session's
    metadata has (64 keys, keys of 1 to 128 characters, 16 KiB as JSON)."""
    body: UpdateSession = decode(update_session_decoder, await read_body(request))
    info = await harness_of(request).sessions.update(
        request.path_params["sid"],
        owner_of(request),
        title=body.title if isinstance(body.title, str) else None,
        metadata=body.metadata if isinstance(body.metadata, dict) else None,
    )
    return json_response(info)


@operation(
    "Delete a session: all of it, at once",
    Returns(204, None, "Deleted: a turn in progress was stopped; readers got `session.deleted`"),
    errors=NOT_FOUND,
)
async def delete_session(request: Request) -> Response:
    """Remove the session and everything of it (history, events, queued messages, requests,
    delivery state) in one step. A turn in progress is stopped; SSE streams and websockets of the
    session get `session.deleted` and end. Afterwards the id is unknown (404)."""
    await harness_of(request).sessions.delete(request.path_params["sid"], owner_of(request))
    return Response(status_code=204)


def int_query(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = query(request, name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 12) or not low <= int(raw) <= high:  # (ASCII digits only)
        raise ChannelError(400, "invalid_query", f"?{name}= takes a whole number from {low} to {high}")
    return int(raw)


@operation(
    "A page of the active history, oldest first",
    Returns(200, HistoryPage, "Items, and where the next page starts"),
    errors={
        **NOT_FOUND,
        400: "`invalid_query`, `invalid_cursor`",
        409: "`history_replaced`: a compaction or clear replaced the history since the page the cursor came from",
    },
    params=(
        Param("cursor", {"type": "string", "pattern": r"^[0-9]{1,12}$"}, "The page before's `next_cursor`"),
        Param("offset", {"type": "integer", "minimum": 0, "maximum": 10**9}, "Where the page starts"),
        Param("limit", {"type": "integer", "minimum": 1, "maximum": HISTORY_PAGE_MAX}, "Items (500 by default)"),
    ),
)
async def get_history(request: Request) -> Response:
    """A page of the active history, oldest first: `?limit=` (default 500, at most 1000) items
    from `?cursor=` (the page before's `next_cursor`: 409 `history_replaced` once a compaction
    or clear replaced the history, so that pages read across one never pass for one history) or
    from `?offset=` (default 0) in it; `next_offset` and `next_cursor` say where the next page
    starts, null after the last one."""
    query = request.query_params
    if "cursor" in query and "offset" in query:
        raise ChannelError(400, "invalid_query", "?cursor= and ?offset= each say where the page starts: give one")
    offset = int_query(request, "offset", 0, 0, 10**9)
    limit = int_query(request, "limit", HISTORY_PAGE, 1, HISTORY_PAGE_MAX)
    sid = request.path_params["sid"]
    page, next_offset, next_cursor = await harness_of(request).sessions.history_page(
        sid, owner_of(request), cursor=query.get("cursor"), offset=offset, limit=limit
    )
    return json_response(HistoryPage([history_item(i) for i in page], next_offset, next_cursor))


@operation("The process is up", Returns(200, Health, "Always"), storage=False, tag="operations")
async def healthz(request: Request) -> Response:
    return json_response(Health(ok=True))


@operation(
    "Redis is reachable",
    Returns(200, Health, "Ready"),
    errors={503: "`redis_unavailable`"},
    storage=False,
    tag="operations",
)
async def readyz(request: Request) -> Response:
    try:
        await harness_of(request).ping()
    except Unavailable as exc:
        cause = type(exc.__cause__ or exc).__name__
        return error_response(503, "redis_unavailable", f"Redis is not reachable: {cause}")
    return json_response(Health(ok=True))
