"""The AI SDK's UI message stream (`useChat`, `DefaultChatTransport`) on keel's durable turns.

`POST /v1/chat` takes what the transport posts, `{id, messages, trigger, ...body}`: `id` is a
keel session of the caller's key; only the last message is read (the client's copy of history
is never trusted). A user message is the turn's message (its `id` the `message_id`, so a resend
is one message; `body.context` the page context); an assistant message whose tool parts are in
`approval-responded` answers those approval requests (as `POST .../responses` does) and the rest
of its turn streams. `GET /v1/chat/{id}/stream` streams the turn in progress from its first
event, then live (204 when none is). The answer is SSE of JSON chunks ending `data: [DONE]`.

The assistant message's id is the turn's id: a continuation and a resume address the same
message. Text comes from keel's deltas while they continue what was sent, and from the
committed `message.completed` (the rest of it, or all of it when the stream joined mid-item);
a model attempt retried after some of its text was sent starts its step over (`reset-step`).
A turn that pauses for approval finishes with `finishReason: "tool-calls"`, so the client's
`sendAutomaticallyWhen` sends the answers."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from channels.errors import ChannelError
from channels.http import NOT_FOUND, QUEUED, decode, read_body
from channels.spec import Returns, operation
from channels.turnstream import Action, Answer, Followed, TextItems, TurnReader
from channels.types import ContextValue
from harness.events import (
    Event,
    InputRequested,
    InputResolved,
    MessageCompleted,
    MessageDelta,
    SessionDeleted,
    ToolCompleted,
    ToolStarted,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from harness.ids import call_of

HEADERS = {"x-vercel-ai-ui-message-stream": "v1"}
DONE = b"data: [DONE]\n\n"
MAX_MESSAGES = 10_000
_enc = msgspec.json.Encoder()


# ---- what the transport posts -----------------------------------------------------------------


class Approval(msgspec.Struct):
    id: str
    approved: bool | None = None
    reason: str | None = None


class UiPart(msgspec.Struct):
    """A part of a UI message: only what keel reads of it (other fields are let be)."""

    type: str
    text: str | None = None
    state: str | None = None
    toolCallId: str | None = None  # (the protocol's names)
    approval: Approval | None = None


class UiMessage(msgspec.Struct):
    id: str
    role: str
    parts: list[UiPart] = []


class ChatRequest(msgspec.Struct):
    """What `DefaultChatTransport` posts (with `body`'s keys beside: `context` is read)."""

    id: str
    messages: Annotated[list[UiMessage], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
    trigger: str = "submit-message"
    messageId: str | None = None
    context: ContextValue = None


chat_decoder = msgspec.json.Decoder(ChatRequest)


# ---- keel's events as UI message chunks -------------------------------------------------------


def _chunk(value: dict[str, Any]) -> bytes:
    return b"data: " + _enc.encode(value) + b"\n\n"


class UiStream:
    """The UI message stream of one turn (its message id is the turn's id)."""

    def __init__(self, message_id: str, metadata: dict[str, Any] | None = None) -> None:
        self.message_id = message_id
        self.metadata = metadata  # the assistant message's `metadata` (the start chunk's)
        self.texts = TextItems()
        self.calls: set[str] = set()  # tool calls the client was shown
        self.ended: set[str] = set()  # ... and those it has an outcome of
        self.step_open = False
        self.step_item = ""  # the step's text item
        self.step_tools = False

    def opening(self) -> bytes:
        start: dict[str, Any] = {"type": "start", "messageId": self.message_id}
        if self.metadata is not None:
            start["messageMetadata"] = self.metadata
        return _chunk(start)

    def feed(self, event: Followed) -> bytes:
        out: list[dict[str, Any]] = []
        match event:
            case MessageDelta(data=d):
                self._text(out, d.item_id, *self.texts.delta(d.item_id, d.delta, d.offset))
            case MessageCompleted(data=d):
                self._text(out, d.item_id, *self.texts.completed(d.item_id, d.text))
                if self.texts.sent(d.item_id):
                    out.append({"type": "text-end", "id": d.item_id})
            case ToolStarted(data=d):
                self._step(out, tools=True)
                self._shown(out, d.call_id, d.tool, d.arguments)
            case InputRequested(data=d):
                self._step(out, tools=True)
                for r in d.requests:
                    call = call_of(r.request_id)
                    self._shown(out, call, r.tool, r.arguments)
                    out.append({"type": "tool-approval-request", "approvalId": r.request_id, "toolCallId": call})
            case InputResolved(data=d) if d.decision != "approve":
                call = call_of(d.request_id)
                if call in self.calls and call not in self.ended:
                    self.ended.add(call)
                    out.append({"type": "tool-output-denied", "toolCallId": call})
            case ToolCompleted(data=d) if d.call_id not in self.ended:
                self._step(out, tools=True)
                self._shown(out, d.call_id, d.tool, {})
                self.ended.add(d.call_id)
                if d.is_error:
                    out.append({"type": "tool-output-error", "toolCallId": d.call_id, "errorText": d.result})
                else:
                    out.append({"type": "tool-output-available", "toolCallId": d.call_id, "output": d.result})
        return b"".join(_chunk(c) for c in out)

    def closing(self, last: Event | SessionDeleted) -> bytes:
        out: list[dict[str, Any]] = [{"type": "text-end", "id": i} for i in self.texts.unfinished()]
        if not isinstance(last, InputRequested):  # (a call left without an outcome gets one)
            for call in sorted(self.calls - self.ended):
                out.append({"type": "tool-output-error", "toolCallId": call, "errorText": "the turn ended first"})
        if self.step_open:
            out.append({"type": "finish-step"})
            self.step_open = False
        match last:
            case TurnCompleted():
                out.append({"type": "finish", "finishReason": "stop"})
            case InputRequested():  # (not "interrupted": that would stop sendAutomaticallyWhen)
                out.append({"type": "finish", "finishReason": "tool-calls"})
            case TurnFailed(data=d):
                out.append({"type": "error", "errorText": f"{d.error.code}: {d.error.message}"})
                out.append({"type": "finish", "finishReason": "error"})
            case TurnCancelled():  # ("interrupted": nothing is sent again automatically)
                out.append({"type": "finish", "finishReason": "interrupted"})
            case SessionDeleted():
                out.append({"type": "error", "errorText": "session_deleted: the session is gone"})
                out.append({"type": "finish", "finishReason": "error"})
        return b"".join(_chunk(c) for c in out) + DONE

    # ---- parts --------------------------------------------------------------------------------

    def _step(self, out: list[dict[str, Any]], item: str = "", *, tools: bool = False) -> None:
        """Open a step for what comes (a new text item after a step's tools begins the next)."""
        if self.step_open and item and item != self.step_item and (self.step_item or self.step_tools):
            out.append({"type": "finish-step"})
            self.step_open = False
        if not self.step_open:
            out.append({"type": "start-step"})
            self.step_open, self.step_item, self.step_tools = True, "", False
        if item:
            self.step_item = item
        self.step_tools = self.step_tools or tools

    def _restart_step(self, out: list[dict[str, Any]], item_id: str) -> None:
        """What the client was sent of this step is not what keel kept: it is taken back."""
        out += [{"type": "reset-step"}, {"type": "start-step"}]
        self.step_open, self.step_item, self.step_tools = True, item_id, False

    def _text(self, out: list[dict[str, Any]], item_id: str, action: Action, text: str, first: bool) -> None:
        if action == "skip":
            return
        if action == "restart":  # (a retried attempt; or the kept text is not what streamed)
            self._restart_step(out, item_id)
            first = True
        elif first and self.texts.abandoned(item_id):  # (a cut attempt, its step run again as a new item)
            self._restart_step(out, item_id)
        if not text and first:
            return
        self._step(out, item_id)
        if first:
            out.append({"type": "text-start", "id": item_id})
        if text:
            out.append({"type": "text-delta", "id": item_id, "delta": text})

    def _shown(self, out: list[dict[str, Any]], call: str, tool: str, arguments: dict[str, Any]) -> None:
        if call not in self.calls:
            self.calls.add(call)
            out.append({"type": "tool-input-available", "toolCallId": call, "toolName": tool, "input": arguments})


# ---- the routes --------------------------------------------------------------------------------


STREAM = Returns(
    200,
    str,
    "The AI SDK UI message stream: SSE `data:` lines of JSON chunks (`start`, `start-step`, `text-*`, "
    "`tool-*`, `reset-step`, `finish-step`, `finish`, `error`), then `data: [DONE]`",
    media="text/event-stream",
)


@operation(
    "Chat as the AI SDK's useChat does (its UI message stream)",
    STREAM,
    body=ChatRequest,
    errors={
        **NOT_FOUND,
        **QUEUED,
        400: "`invalid_request`, `invalid_json`, `invalid_message_id`, `nothing_to_answer`, `invalid_decision`",
        409: "`already_answered` (with the recorded `decision`), `awaiting_approval` (a new message while a turn "
        "waits for answers), `message_not_in_history` (regenerating or editing a message whose turn was compacted "
        "away)",
    },
    tag="frontends",
)
async def chat(request: Request) -> Response:
    """A user message starts (or, resent, replays) its turn; an assistant message with answered
    approvals answers them and streams the rest of the turn. Disconnecting does not stop the
    turn (`POST /v1/sessions/{id}/cancel` does)."""
    body: ChatRequest = decode(chat_decoder, await read_body(request))
    if body.trigger == "regenerate-message":
        return await _regenerate(request, body)
    if body.trigger != "submit-message":
        raise ChannelError(400, "invalid_request", f"unknown trigger {body.trigger[:40]!r}")
    sid = body.id
    named = [m for m in body.messages if body.messageId is not None and m.id == body.messageId]
    last = named[-1] if named else body.messages[-1]  # (the transport names the message it answers)
    if last.role == "user":
        text = "".join(p.text or "" for p in last.parts if p.type == "text")
        if not text.strip():
            raise ChannelError(400, "invalid_request", "the last message has no text")
        reader = TurnReader.of(request, sid)
        try:
            return await reader.submitted(text, body.context, last.id, UiStream, HEADERS)
        except ChannelError as exc:  # a sent message with other text: useChat's edit
            if exc.code != "message_edited":
                raise
        return await _forked(request, reader, last.id, text, body.context)
    if last.role == "assistant":
        return await _continue(request, sid, last)
    raise ChannelError(400, "invalid_request", "the last message must be the user's, or the assistant's with answers")


async def _regenerate(request: Request, body: ChatRequest) -> Response:
    """`regenerate()`: the messages up to the user message whose reply is made again."""
    last = body.messages[-1]
    text = "".join(p.text or "" for p in last.parts if p.type == "text")
    if last.role != "user" or not text.strip():
        raise ChannelError(400, "invalid_request", "regenerating: the last message must be the user's, with text")
    return await _forked(request, TurnReader.of(request, body.id), last.id, text, body.context)


async def _forked(request: Request, source: TurnReader, message_id: str, text: str, context: Any) -> Response:
    """A regenerated reply, or an edited message: keel's history is never rewritten, so the
    session is forked before message `message_id` and `text` sent in the fork, whose turn
    streams back. The fork's id is the assistant message's `metadata.keel.session_id` (and the
    `x-keel-session-id` header): the chat goes on there. A browser with a session token gets
    one for the fork too (`metadata.keel.token`)."""
    harness, owner = source.harness, source.owner
    await harness.sessions.admissible(source.sid, owner, message_id)  # (bad input spends no token)
    new_sid = await harness.sessions.fork(source.sid, owner, before_message_id=message_id)
    keel: dict[str, Any] = {"session_id": new_sid}
    headers = {**HEADERS, "x-keel-session-id": new_sid}
    if getattr(request.state, "owner", None) is None:  # (a browser's session token: one for the fork)
        token, expires_at = request.app.state.tokens.mint(new_sid, owner)
        keel |= {"token": token, "token_expires_at": expires_at}
    fork = TurnReader(request, harness, new_sid, owner)
    return await fork.submitted(
        text, context, message_id, functools.partial(UiStream, metadata={"keel": keel}), headers
    )


async def _continue(request: Request, sid: str, message: UiMessage) -> Response:
    answered = [p.approval for p in message.parts if p.state == "approval-responded" and p.approval is not None]
    if not answered or any(a.approved is None for a in answered):
        raise ChannelError(400, "nothing_to_answer", "the assistant message has no answered approval")
    answers = [Answer(a.id, "approve" if a.approved else "deny", a.reason or "") for a in answered]
    reader = TurnReader.of(request, sid)
    return reader.response(await reader.answer(answers, UiStream(message.id)), HEADERS)


@operation(
    "Resume the turn in progress as a UI message stream (useChat's `resume`)",
    STREAM,
    Returns(204, None, "No turn is in progress"),
    errors=NOT_FOUND,
    tag="frontends",
)
async def chat_stream(request: Request) -> Response:
    """The turn running, waiting for approval, or queued next, from its first chunk, then
    live. An item that was streaming comes whole when it completes (deltas are not stored)."""
    reader = TurnReader.of(request, request.path_params["sid"])
    at = await reader.harness.sessions.turn_in_progress(reader.sid, reader.owner)
    if at is None:
        return Response(status_code=204)
    upto = await reader.harness.sessions.newest_event(reader.sid)  # (it may wait on requests no longer kept)
    reader.take_place()
    return reader.response(reader.frames(at.turn_id, at.after, UiStream(at.turn_id), upto=upto), HEADERS)
