"""AG-UI (CopilotKit's protocol) on keel's durable turns: `POST /v1/agui` takes `RunAgentInput`
and streams AG-UI events over SSE, encoded by the `ag-ui-protocol` package.

`threadId` is a keel session of the caller's key. A run without `resume` takes the thread's last
message, a user message (its `id` the `message_id`: the thread is posted whole on every run, so
an old message is never a new turn), with the `context` entries as the turn's page context;
the history the client posts is never read. A run whose `resume` entries answer interrupts
(keel's approval requests: `resolved` with payload `{"approved": true|false, "reason"?}`, or
`cancelled`, a denial) records those answers as `POST .../responses` does and streams the rest
of the paused turn. `state`, `tools` and `forwardedProps` are accepted and not used: keel runs
its own tools, never the frontend's."""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from ag_ui.core import (
    BaseEvent,
    Interrupt,
    RunErrorEvent,
    RunFinishedCancelledOutcome,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    RunFinishedSuccessOutcome,
    RunStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallResultEvent,
    ToolCallStartEvent,
)
from ag_ui.encoder import EventEncoder
from starlette.requests import Request
from starlette.responses import Response

from channels.errors import ChannelError
from channels.http import NOT_FOUND, QUEUED, decode, read_body
from channels.spec import Returns, operation
from channels.turnstream import Action, Answer, Followed, TextItems, TurnReader
from harness.events import (
    Event,
    InputRequested,
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

_enc = msgspec.json.Encoder()
_sse = EventEncoder()
MAX_MESSAGES = 10_000


# ---- RunAgentInput: what keel reads of it -----------------------------------------------------


class AguiMessage(msgspec.Struct):
    id: str
    role: str
    content: str | list[dict[str, Any]] | None = None


class ContextEntry(msgspec.Struct):
    description: str
    value: str


class ResumeEntry(msgspec.Struct):
    interruptId: str  # (the protocol's names)
    status: Literal["resolved", "cancelled"]
    payload: Any = None


class RunAgentInput(msgspec.Struct):
    """AG-UI's run input (`state`, `tools`, `forwardedProps` and the rest are accepted)."""

    threadId: str
    runId: str
    messages: list[AguiMessage] = msgspec.field(default_factory=list)
    context: list[ContextEntry] = msgspec.field(default_factory=list)
    resume: list[ResumeEntry] | None = None


run_input_decoder = msgspec.json.Decoder(RunAgentInput)


def _text_of(message: AguiMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = message.content or []
    return "".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")


def _answer(entry: ResumeEntry) -> tuple[str, str]:
    """(decision, reason) of a resume entry: `cancelled` denies."""
    payload = entry.payload if isinstance(entry.payload, dict) else {}
    reason = payload.get("reason")
    reason = reason if isinstance(reason, str) else ""
    if entry.status == "cancelled":
        return "deny", reason
    approved = payload.get("approved")
    if not isinstance(approved, bool):
        raise ChannelError(400, "invalid_decision", 'a resolved interrupt\'s payload is {"approved": true|false}')
    return ("approve" if approved else "deny"), reason


# ---- keel's events as AG-UI events --------------------------------------------------------------


class AguiRun:
    """The AG-UI events of one run of a turn. A text item is one text message; an attempt
    whose text is not what keel kept (a retried model call) ends, and the kept text follows as
    a message of its own (AG-UI takes nothing back)."""

    def __init__(self, thread_id: str, run_id: str) -> None:
        self.thread_id, self.run_id = thread_id, run_id
        self.texts = TextItems()
        self.message: dict[str, str] = {}  # text item -> its current message id
        self.open: set[str] = set()  # message ids started, not ended
        self.calls: set[str] = set()

    def opening(self) -> bytes:
        return _bytes([RunStartedEvent(thread_id=self.thread_id, run_id=self.run_id, protocol_version="1.0")])

    def feed(self, event: Followed) -> bytes:
        out: list[BaseEvent] = []
        match event:
            case MessageDelta(data=d):
                self._text(out, d.item_id, *self.texts.delta(d.item_id, d.delta, d.offset))
            case MessageCompleted(data=d):
                self._text(out, d.item_id, *self.texts.completed(d.item_id, d.text))
                self._end(out, self.message.get(d.item_id, ""))
            case ToolStarted(data=d):
                self._call(out, d.call_id, d.tool, d.arguments)
            case ToolCompleted(data=d):
                self._call(out, d.call_id, d.tool, None)
                out.append(
                    ToolCallResultEvent(
                        message_id=f"{d.call_id}.result", tool_call_id=d.call_id, content=d.result, role="tool"
                    )
                )
            case InputRequested(data=d):
                for r in d.requests:
                    self._call(out, call_of(r.request_id), r.tool, r.arguments)
        return _bytes(out)

    def closing(self, last: Event | SessionDeleted) -> bytes:
        out: list[BaseEvent] = []
        self._end_texts(out)
        match last:
            case TurnCompleted():
                out.append(self._finished(RunFinishedSuccessOutcome()))
            case InputRequested(data=d):
                asked = [
                    Interrupt(
                        id=r.request_id,
                        reason="tool_approval",
                        tool_call_id=call_of(r.request_id),
                        message=f"{r.tool} asks for approval",
                    )
                    for r in d.requests
                ]
                out.append(self._finished(RunFinishedInterruptOutcome(interrupts=asked)))
            case TurnCancelled():
                out.append(self._finished(RunFinishedCancelledOutcome()))
            case TurnFailed(data=d):
                out.append(RunErrorEvent(message=d.error.message, code=d.error.code))
            case SessionDeleted():
                out.append(RunErrorEvent(message="the session is gone", code="session_deleted"))
        return _bytes(out)

    def _finished(self, outcome: Any) -> RunFinishedEvent:
        return RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id, outcome=outcome)

    def _text(self, out: list[BaseEvent], item_id: str, action: Action, text: str, first: bool) -> None:
        if action == "skip":
            return
        if first:
            for cut in self.texts.abandoned(item_id):  # (a cut attempt: its message ends as it is)
                self._end(out, self.message.get(cut, ""))
        if action == "restart":
            self._end(out, self.message.get(item_id, ""))
            n = sum(1 for m in self.message.values() if m.startswith(item_id))
            self.message[item_id] = f"{item_id}.{n + 1}"
            first = True
        if first and not text:
            return
        message_id = self.message.setdefault(item_id, item_id)
        if first:
            self._end_texts(out)
            out.append(TextMessageStartEvent(message_id=message_id, role="assistant"))
            self.open.add(message_id)
        if text:
            out.append(TextMessageContentEvent(message_id=message_id, delta=text))

    def _end(self, out: list[BaseEvent], message_id: str) -> None:
        if message_id in self.open:
            self.open.discard(message_id)
            out.append(TextMessageEndEvent(message_id=message_id))

    def _end_texts(self, out: list[BaseEvent]) -> None:
        for message_id in sorted(self.open):
            self._end(out, message_id)

    def _call(self, out: list[BaseEvent], call: str, tool: str, arguments: dict[str, Any] | None) -> None:
        if call in self.calls:
            return
        self.calls.add(call)
        self._end_texts(out)
        out.append(ToolCallStartEvent(tool_call_id=call, tool_call_name=tool))
        out.append(ToolCallArgsEvent(tool_call_id=call, delta=_enc.encode(arguments or {}).decode()))
        out.append(ToolCallEndEvent(tool_call_id=call))


def _bytes(events: list[BaseEvent]) -> bytes:
    now = int(time.time() * 1000)
    for e in events:
        e.timestamp = now
    return "".join(_sse.encode(e) for e in events).encode()


# ---- the route ---------------------------------------------------------------------------------


@operation(
    "Run the agent as an AG-UI client asks (CopilotKit's HttpAgent)",
    Returns(
        200,
        str,
        "AG-UI events over SSE: `RUN_STARTED`, `TEXT_MESSAGE_*`, `TOOL_CALL_*`, then `RUN_FINISHED` "
        "(outcome `success`, `interrupt` with keel's approval requests, or `cancelled`) or `RUN_ERROR`",
        media="text/event-stream",
    ),
    body=RunAgentInput,
    errors={
        **NOT_FOUND,
        **QUEUED,
        400: "`invalid_request`, `invalid_json`, `invalid_message_id`, `invalid_decision`",
        409: "`already_answered` (with the recorded `decision`), `awaiting_approval` (a new message while a turn "
        "waits for answers), `message_edited` (a sent message id with other text)",
    },
    tag="frontends",
)
async def run(request: Request) -> Response:
    """A run with a new user message starts its turn (an old one, posted again, replays it); a
    run that resumes interrupts answers them and streams the rest of the turn. Disconnecting
    does not stop the turn (`POST /v1/sessions/{id}/cancel` does)."""
    body: RunAgentInput = decode(run_input_decoder, await read_body(request))
    sid = body.threadId
    reader = TurnReader.of(request, sid)
    translator = AguiRun(sid, body.runId)
    if body.resume:
        answers = [Answer(e.interruptId, *_answer(e)) for e in body.resume]  # (all read before any is recorded)
        return reader.response(await reader.answer(answers, translator), {})
    last = body.messages[-1] if body.messages else None
    if last is None or last.role != "user":
        raise ChannelError(400, "invalid_request", "a run takes a new user message last (or resume entries)")
    text = _text_of(last)
    if not text.strip():
        raise ChannelError(400, "invalid_request", "the user message has no text")
    context = [f"{c.description}: {c.value}" for c in body.context] or None
    return await reader.submitted(text, context, last.id, lambda _: translator, {})
