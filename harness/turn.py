"""One turn of the agent loop: model step, commit, tools, commit, repeat until a final reply.

Every step's outcome is committed (with its events) before anything acts on it; a turn that
resumes after a crash starts from what was committed and never recomputes a committed step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from harness.agent import Agent
from harness.errors import StaleLease
from harness.ids import new_id
from harness.models.base import ModelReply
from harness.prompt import assemble, user_item
from harness.store import Begun, Committed, Store, event_body
from harness.tools import ToolContext
from harness.types import Item, ToolCall, Usage

log = logging.getLogger("keel.turn")
# Called after each commit: (session id, newest event id, whether the commit settled the turn).
Publish = Callable[[str, str, bool], None]
_enc = msgspec.json.Encoder()


@dataclass(frozen=True)
class Final:
    """The turn ended; `more` says whether another message is already waiting."""

    more: bool


@dataclass(frozen=True)
class RunTools:
    item: Item  # the committed assistant item whose calls must now run


StepOutcome = Final | RunTools


class TurnRunner:
    """Runs the turn a runner has begun. Holds nothing between turns."""

    def __init__(self, store: Store, agent: Agent, sid: str, begun: Begun, publish: Publish) -> None:
        self.store = store
        self.agent = agent
        self.sid = sid
        self.begun = begun
        self.message = begun.message
        self.turn_id = begun.message.turn_id
        self.turn_items: list[Item] = [i for i in begun.turn_items if i.kind != "message" or i.role != "user"]
        self.user_committed = len(begun.turn_items) > 0
        self._publish = publish

    async def run(self) -> Final:
        pending = self._unfinished_calls()
        if pending is not None:
            outcome: StepOutcome = RunTools(pending)
        else:
            outcome = await self._model_step()
        while True:
            match outcome:
                case Final():
                    return outcome
                case RunTools(item=item):
                    await self._run_tools(item)
                    outcome = await self._model_step()

    def _unfinished_calls(self) -> Item | None:
        """On resume: the last committed assistant item, if some of its calls have no result."""
        for item in reversed(self.turn_items):
            if item.role == "assistant":
                return item if item.tool_calls else None
        return None

    def _step(self) -> int:
        return sum(1 for i in self.turn_items if i.role == "assistant")

    async def _model_step(self) -> StepOutcome:
        step = self._step()
        if step >= self.agent.max_steps:
            return await self.fail("max_steps", f"the turn used its {self.agent.max_steps} model steps")
        request = assemble(
            self.agent,
            session_id=self.sid,
            message=self.message,
            history=self.begun.history,
            sticky=self.begun.sticky,
            turn_items=self.turn_items,
            step=step,
        )
        try:
            reply = await self.agent.model.complete(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("session %s turn %s: model failed: %s", self.sid, self.turn_id, type(exc).__name__)
            return await self.fail("model_error", f"the model call failed: {type(exc).__name__}: {exc}")
        return await self._commit_reply(reply, step)

    async def _commit_reply(self, reply: ModelReply, step: int) -> StepOutcome:
        calls = tuple(c if c.id else ToolCall(c.name, c.arguments, new_id("call")) for c in reply.tool_calls)
        item = Item(id=new_id("it"), role="assistant", text=reply.text, turn_id=self.turn_id, tool_calls=calls)
        usage = reply.usage or Usage()
        items = [] if self.user_committed else [user_item(self.message)]
        items.append(item)
        events: list[tuple[str, bytes]] = [
            self._event(
                "usage.recorded",
                {
                    "step": step,
                    "input_tokens": usage.input_tokens,
                    "output_tokens": usage.output_tokens,
                    "cached_tokens": usage.cached_tokens,
                },
            ),
        ]
        if reply.text:
            events.append(self._event("message.completed", {"item_id": item.id, "text": reply.text}))
        for call in calls:
            events.append(
                self._event("tool.started", {"call_id": call.id, "tool": call.name, "arguments": call.arguments})
            )
        final = not calls
        if final:
            events.append(self._event("turn.completed", {"message_id": self.message.message_id, "reply": reply.text}))
        committed = await self._commit(
            items, events, final=final, usage=(usage.input_tokens, usage.output_tokens, usage.cached_tokens, 1)
        )
        self.user_committed = True
        self.turn_items.append(item)
        if final:
            return Final(more=committed.more)
        return RunTools(item)

    async def _run_tools(self, item: Item) -> None:
        """Run the calls that have no committed result yet, committing each result as it comes:
        after a crash only the call that was running runs again (with the same call id)."""
        done = {i.tool_call_id for i in self.turn_items if i.role == "tool"}
        for call in item.tool_calls:
            if call.id in done:
                continue
            text, is_error = await self._invoke(call)
            result = Item(
                id=f"it_{call.id}_r",
                role="tool",
                text=text,
                kind="tool_result",
                turn_id=self.turn_id,
                tool_call_id=call.id,
                tool_name=call.name,
                is_error=is_error,
            )
            data = {"call_id": call.id, "tool": call.name, "result": text, "is_error": is_error}
            await self._commit([result], [self._event("tool.completed", data)])
            self.turn_items.append(result)

    async def _invoke(self, call: ToolCall) -> tuple[str, bool]:
        tool = self.agent.tools.get(call.name)
        if tool is None:
            return f"error: there is no tool named {call.name!r}", True
        assert call.id is not None
        try:
            if tool.needs_approval(call.arguments):
                # Until keel can ask a person (the approvals capability), a gated call is never run.
                return f"error: {call.name} needs human approval, which this service cannot ask for; not run", True
            value = await tool.invoke(call.arguments, ToolContext(self.sid, self.turn_id, call.id))
        except asyncio.CancelledError:
            raise
        except msgspec.ValidationError as exc:
            return f"error: invalid arguments for {call.name}: {exc}", True
        except Exception as exc:
            return f"error: {type(exc).__name__}: {exc}", True
        return _result_text(value), False

    async def fail(self, code: str, message: str) -> Final:
        event = self._event(
            "turn.failed", {"message_id": self.message.message_id, "error": {"code": code, "message": message}}
        )
        committed = await self._commit([] if self.user_committed else [user_item(self.message)], [event], final=True)
        return Final(more=committed.more)

    async def _commit(
        self,
        items: list[Item],
        events: list[tuple[str, bytes]],
        *,
        final: bool = False,
        usage: tuple[int, int, int, int] = (0, 0, 0, 0),
    ) -> Committed:
        try:
            committed = await self.store.commit(
                self.sid, self.begun.fence, self.turn_id, items, events, usage=usage, final=final
            )
        except StaleLease:
            log.warning("session %s turn %s: lease lost, stopping", self.sid, self.turn_id)
            raise
        if committed.event_ids:
            self._publish(self.sid, committed.event_ids[-1], final)
        return committed

    def _event(self, etype: str, data: dict[str, Any]) -> tuple[str, bytes]:
        return etype, event_body(self.turn_id, data)


def _result_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return _enc.encode(value).decode()
    except TypeError:
        return str(value)
