"""One turn of the agent loop: model step, commit, tools, commit, repeat until a final reply.

Every step's outcome is committed (with its events) before anything acts on it; a turn that
resumes after a crash starts from what was committed and never recomputes a committed step.
A step whose calls need approval commits them as requests and pauses the turn; the turn
resumes when every request is answered, and runs exactly the stored calls.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from harness import failpoints
from harness.errors import CallbackError, ModelError, StaleLease
from harness.events import (
    CompactionRequestedData,
    Data,
    ErrorInfo,
    InputRequestedData,
    MessageCompletedData,
    Pending,
    Requested,
    ToolCompletedData,
    ToolStartedData,
    TurnCancelledData,
    TurnCompletedData,
    TurnFailedData,
    pending,
)
from harness.ids import new_id, request_id
from harness.loop.agent import Agent
from harness.loop.compaction import Compactor, split
from harness.loop.modelcall import Calls, Interrupted, ModelCall
from harness.loop.outcomes import EndCancelled, Final, Outcome, Paused, RunTools, StepOutcome
from harness.loop.prompt import assemble, new_input, user_item
from harness.loop.runtime import changed, newest_snapshot, snapshot_item
from harness.models.base import ModelReply, ModelRequest
from harness.models.tokens import request_tokens
from harness.store import (
    AwaitingAnswers,
    Begun,
    CancelPending,
    Commit,
    CommitMode,
    Ended,
    Stepped,
    Store,
    UsageRecord,
    Withheld,
)
from harness.telemetry import tracing
from harness.telemetry.metrics import HarnessStats
from harness.tools import ToolContext
from harness.tools.calls import denial, needs_approval, result_item, run_call
from harness.tools.toolbox import Toolbox
from harness.types import Answer, ApprovalRequest, Item, ToolCall, Usage

log = logging.getLogger("keel.turn")
_enc = msgspec.json.Encoder()


class Turn:
    """Runs the turn a runner has begun. Holds nothing between turns."""

    def __init__(
        self,
        store: Store,
        agent: Agent,
        sid: str,
        begun: Begun,
        *,
        calls: Calls | None = None,
        stats: HarnessStats | None = None,
        tools: Toolbox | None = None,
    ) -> None:
        self.store = store
        # the tools this run of the turn has (the agent's, and its MCP servers' as they are now)
        self.toolbox = tools or agent.toolbox
        self._stopped: set[str] = set()  # calls a cancel stopped while they ran
        self.stats = stats or HarnessStats()
        self.agent = agent
        self.sid = sid
        self.begun = begun
        self.message = begun.message
        self.turn_id = begun.message.turn_id
        self.history = begun.history  # active history before this turn (a compaction replaces it)
        committed = begun.turn_items  # [snapshot][user item][outputs...] once the first step committed
        user_at = next((n for n, i in enumerate(committed) if i.kind == "message" and i.role == "user"), -1)
        self.user_committed = user_at >= 0
        # this turn's runtime snapshot: committed with the user item, or read when the turn starts
        self.snapshot = newest_snapshot(committed[:user_at]) if self.user_committed else None
        self.turn_items: list[Item] = committed[user_at + 1 :] if self.user_committed else []
        self.tail: list[Item] = []  # a snapshot re-read mid-run, shown but not stored
        self._reread = False  # a step ran tools: read the runtime context again before the next call
        self.last_in, self.last_est = begun.last_in, begun.last_est
        self._calls = calls  # the model calls in progress in this process (a cancel, a drain stop them)
        self._compacted_for_length = False  # a "prompt too long" was answered with a compaction
        # requests of this turn with no answer: those BEGIN found, and any this run commits
        self.open_requests = [rid for rid, answer in begun.answers.items() if answer is None]
        # the next model call is already counted (a fresh turn's BEGIN counts its first one)
        self.attempt_counted = bool(begun.started_id) and not begun.cancel

    async def run(self) -> Outcome:
        if self.begun.cancel:
            return await self.cancel()
        if not self.user_committed and self.agent.runtime:
            text = await self.agent.runtime.read()
            if changed(text, newest_snapshot(self.history)):
                self.snapshot = snapshot_item(self.turn_id, text or "", "rc")
        pending = self._unfinished_calls()
        outcome: StepOutcome = self._resumed(pending) if pending is not None else await self._model_step()
        while True:
            match outcome:
                case Final() | Paused():
                    return outcome
                case EndCancelled():
                    return await self.cancel()
                case RunTools(item=item, announced=announced):
                    stopped = await self._run_tools(item, announced)
                    outcome = stopped if stopped is not None else await self._model_step()

    def _unfinished_calls(self) -> Item | None:
        """On resume: the last committed assistant item, if some of its calls have no result."""
        done = {i.tool_call_id for i in self.turn_items if i.role == "tool"}
        for item in reversed(self.turn_items):
            if item.role == "assistant":
                return item if any(c.id not in done for c in item.tool_calls) else None
        return None

    def _resumed(self, item: Item) -> RunTools:
        """The calls left to run on resume. The first of them that runs was announced (by the
        step's commit or the last result's); if the step paused and none has a result yet, only
        if a runner resumed it and wrote that call's tool.started before it stopped."""
        done = {i.tool_call_id for i in self.turn_items if i.role == "tool"}
        paused = any(request_id(c.id or "") in self.begun.answers for c in item.tool_calls)
        first = next((c for c in item.tool_calls if c.id not in done and not denial(self.begun.answers, c)), None)
        if paused and not any(c.id in done for c in item.tool_calls):
            # (announced only if a runner got that far since the answers: BEGIN says which call)
            return RunTools(item, first.id if first is not None and first.id == self.begun.announced else None)
        return RunTools(item, first.id if first is not None else None)

    def _step(self) -> int:
        return sum(1 for i in self.turn_items if i.role == "assistant")

    # ---- model steps -------------------------------------------------------------------

    async def _model_step(self) -> StepOutcome:
        step = self._step()
        if step >= self.agent.max_steps:
            return await self.fail("max_steps", f"the turn used its {self.agent.max_steps} model steps")
        if self._reread:
            await self._refresh_tail()
        try:
            request = await self._request(step)
            if self.agent.context_window is not None:
                compacted = await self._maybe_compact(request, step)
                if isinstance(compacted, EndCancelled):
                    return compacted
                request = compacted
        except CallbackError as exc:
            return await self.fail(exc.code, exc.message)
        estimate = request_tokens(request) if self.agent.context_window is not None else None
        item_id = new_id("it")
        call = ModelCall(self.store, self.agent, self.sid, self.turn_id, running=self._calls, stats=self.stats)
        counted, self.attempt_counted = self.attempt_counted, False
        try:
            reply = await call.reply(request, step, item_id, counted=counted)
        except Interrupted:
            return EndCancelled()  # (cancelled during the call: the attempt counted, nothing of it stored)
        except ModelError as exc:
            if exc.code == "model_context_length" and not self._compacted_for_length:
                self._compacted_for_length = True  # once: compact, then this step again
                compacted = await self._maybe_compact(request, step, forced=True)
                if isinstance(compacted, EndCancelled):
                    return compacted
                if compacted is not request:
                    return await self._model_step()
            return await self.fail(exc.code, exc.message)
        # The attempt's tokens are written by the script that commits its step, first, so a
        # refused or retried step shows every attempt (I5). With step.before_commit armed, apart:
        # the crash tests stop the process between the two writes.
        usage = reply.usage or Usage()
        record: UsageRecord | None = UsageRecord(step, usage, estimate)
        if failpoints.armed("step.before_commit"):
            await self.store.record_usage(self.sid, self.turn_id, step, usage, estimate=estimate)
            record = None
        if estimate is not None:
            self.last_in, self.last_est = usage.input_tokens, estimate
        return await self._commit_reply(reply, record, item_id)

    async def _request(self, step: int) -> ModelRequest:
        return await assemble(
            system=self.agent.instructions,
            tools=self.toolbox.specs,
            callback=self.agent.input_callback,
            session_id=self.sid,
            turn_id=self.turn_id,
            step=step,
            history=self.history,
            fresh=new_input(self.message, self.begun.sticky, self.snapshot),
            outputs=self.turn_items,
            tail=self.tail,
        )

    async def _refresh_tail(self) -> None:
        """After a step that ran tools: read the runtime context once more; a change is shown at
        the request tail, not stored (the next user message persists it)."""
        self._reread = False
        text = await self.agent.runtime.read()
        if text is not None:
            newest = self.snapshot or newest_snapshot(self.history)
            self.tail = [snapshot_item(self.turn_id, text, f"rt{self._step()}")] if changed(text, newest) else []

    async def _maybe_compact(
        self, request: ModelRequest, step: int, *, forced: bool = False
    ) -> ModelRequest | EndCancelled:
        """Compact before this call if the prompt (the provider's last count plus an estimate of
        what changed since, plus the compaction envelope) passes the threshold (I8), or, `forced`,
        because the provider said the prompt is too long."""
        window, config = self.agent.context_window or 0, self.agent.compaction
        estimate = request_tokens(request)
        tokens = self.last_in + estimate - self.last_est if self.last_in else estimate
        reason = "context_length" if forced else "threshold"
        if not (forced or config.due(tokens, window)) or not split(self.history, config.keep_turns).older:
            return request  # under the threshold, or nothing older than the kept turns
        compactor = Compactor(self.store, self.agent.model, config, self.sid, self.turn_id)
        events = [self._event(CompactionRequestedData(reason, tokens, window))]
        done = compactor.trimmed(self.history, tokens, window)
        if done is None:
            if _cancelled(await self._commit([], events)):  # announced before the summarizer runs
                return EndCancelled()
            events = []
            done = await compactor.summarized(self.history, step)
        events.append(self._event(done.event(reason, tokens)))
        if done.history is None:
            return EndCancelled() if _cancelled(await self._commit([], events)) else request
        current = [*self._head(), user_item(self.message), *self.turn_items] if self.user_committed else []
        failpoints.reached("compaction.before_commit")
        committed = await self._commit([*done.history, *current], events, rebase=len(done.history))
        self.history = done.history
        self.last_in = self.last_est = 0
        return EndCancelled() if _cancelled(committed) else await self._request(step)

    def _head(self) -> list[Item]:
        """The turn's durable input before its user item: the runtime snapshot, if any."""
        return [self.snapshot] if self.snapshot is not None else []

    async def _commit_reply(self, reply: ModelReply, usage: UsageRecord | None, item_id: str) -> StepOutcome:
        # keel's own call ids, always: a provider's may repeat (call_0 in every response), and the
        # id is the request id's root and the tools' idempotency key.
        calls = tuple(ToolCall(c.name, c.arguments, new_id("call")) for c in reply.tool_calls)
        item = Item(
            id=item_id,
            role="assistant",
            text=reply.text,
            turn_id=self.turn_id,
            tool_calls=calls,
            provider=reply.provider,
        )
        items = [] if self.user_committed else [*self._head(), user_item(self.message)]
        items.append(item)
        events: list[Pending] = []
        if reply.text:
            events.append(self._event(MessageCompletedData(item.id, reply.text)))
        gated = [c for c in calls if needs_approval(self.toolbox.tools, c)]
        requests = [
            ApprovalRequest(request_id(c.id or ""), c.id or "", c.name, c.arguments, self.turn_id) for c in gated
        ]
        mode: CommitMode
        if requests:
            shown = [Requested(r.request_id, r.tool, r.arguments) for r in requests]
            # (the author: who may be asked, for a channel that lets only them answer)
            events.append(self._event(InputRequestedData(shown, self.message.author)))
            mode = "pause"
        elif calls:
            events.extend(self._tool_started(calls[:1]))  # each next one with the result before it
            mode = "step"
        else:
            events.append(self._event(TurnCompletedData(self.message.message_id, reply.text)))
            mode = "final"
        failpoints.reached("step.before_commit")
        committed = await self._commit(
            items, events, mode=mode, requests=requests, after="step.after_commit", usage=usage, guard=True
        )
        if isinstance(committed, Withheld):  # a cancel came first: nothing of the step is stored (as if interrupted)
            return EndCancelled()
        self.open_requests += [r.request_id for r in requests]
        self.user_committed = True
        self.turn_items.append(item)
        match committed:
            case Ended(more=more):
                return Final(more=more)
            case CancelPending():
                return EndCancelled()
            case AwaitingAnswers():
                return Paused()
        return RunTools(item, calls[0].id)

    # ---- tools -------------------------------------------------------------------------

    async def _run_tools(self, item: Item, announced: str | None) -> Final | Paused | EndCancelled | None:
        """Run the calls that have no committed result yet, committing each result as it comes:
        after a crash only the call that was running runs again (with the same call id). Calls
        of a step that paused for approval run (or are refused) by their answers. A call's
        tool.started is written only while no cancel is pending (`announced`: already written,
        by the step's commit or the result before), so it never announces a call that does not run."""
        done = {i.tool_call_id for i in self.turn_items if i.role == "tool"}
        todo = [c for c in item.tool_calls if c.id not in done]
        if any(self.begun.answers.get(request_id(c.id or ""), False) is None for c in todo):
            return Paused()  # cannot happen (BEGIN waits for every answer); never run unanswered
        for n, call in enumerate(todo):
            refused = denial(self.begun.answers, call)
            if refused is not None:
                why = f": {refused.reason}" if refused.reason else ""
                text, is_error = f"error: a person denied this call{why}", True
            else:
                if call.id != announced and _cancelled(
                    await self._commit([], self._tool_started([call]), guard=True, announced=call.id or "")
                ):
                    return EndCancelled()
                began = time.perf_counter()
                ran = await self._traced_call(call)
                self.stats.tool(
                    call.name if call.name in self.toolbox.tools else "unknown", time.perf_counter() - began
                )
                if ran is None:  # a cancel stopped it (an MCP server's call): the turn ends now
                    self._stopped.add(call.id or "")
                    return EndCancelled()
                text, is_error = ran
                failpoints.reached("tool.after_run")
            result = result_item(self.turn_id, call, text, is_error=is_error)
            following = next((c for c in todo[n + 1 :] if not denial(self.begun.answers, c)), None)
            announced = following.id if following is not None else None
            # the last result of the step counts the model call that follows it (if one does)
            model_next = call is todo[-1] and self._step() < self.agent.max_steps
            committed = await self._commit(
                [result],
                [self._event(ToolCompletedData(call.id or "", call.name, text, is_error))],
                attempt=model_next,
                announce=self._tool_started([following]) if following is not None else [],
            )
            self.turn_items.append(result)
            if _cancelled(committed):
                return EndCancelled()
            if isinstance(committed, Stepped) and committed.steered:  # (messages steered in: the model sees them next)
                self.turn_items.extend(committed.steered)
                failpoints.reached("steer.after_join")
            self.attempt_counted = model_next
        self._reread = bool(self.agent.runtime)
        return None

    async def _traced_call(self, call: ToolCall) -> tuple[str, bool] | None:
        """`_run_call` in its `execute_tool` span."""
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.name,
            "gen_ai.tool.call.id": call.id or "",
            "gen_ai.conversation.id": self.sid,
            "keel.turn.id": self.turn_id,
        }
        with tracing.span(f"execute_tool {call.name}", attributes) as span:
            tracing.content(span, "gen_ai.tool.call.arguments", _enc.encode(call.arguments).decode())
            ran = await self._run_call(call)
            if ran is None:
                tracing.record(span, {"keel.stopped": "cancelled"})
            else:
                if ran[1]:
                    tracing.failed(span, "tool_error")
                tracing.content(span, "gen_ai.tool.call.result", ran[0])
            return ran

    async def _run_call(self, call: ToolCall) -> tuple[str, bool] | None:
        """Run one call: its result text and whether it is an error; None when the tool is one a
        cancel stops (`interruptible`) and a cancel of the turn did, during the call."""
        context = ToolContext(self.sid, self.turn_id, call.id or "")
        tool = self.toolbox.tools.get(call.name)
        if tool is None or not tool.interruptible:
            return await run_call(self.toolbox.tools, call, context)  # (a running Python tool finishes first)
        running = asyncio.ensure_future(run_call(self.toolbox.tools, call, context))

        def stop() -> None:
            running.cancel()

        with self.store.hub.cancellable(self.sid, self.turn_id, stop):
            try:
                return await running
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # (this task is stopped: a shutdown, not the turn's cancel)
                return None

    def _tool_started(self, calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[Pending]:
        return [self._event(ToolStartedData(c.id or "", c.name, c.arguments)) for c in calls]

    # ---- endings -----------------------------------------------------------------------

    async def fail(self, code: str, message: str) -> Final:
        event = self._event(TurnFailedData(self.message.message_id, ErrorInfo(code, message)))
        items = [] if self.user_committed else [*self._head(), user_item(self.message)]
        committed = await self._commit(items, [event], mode="final", guard=True)
        if not isinstance(committed, Ended):  # a cancel was accepted first: it is what ends the turn
            return await self.cancel()
        return Final(more=committed.more)

    async def cancel(self) -> Final:
        """End the turn as cancelled: open requests withdrawn, every call without a result
        answered with an error result (a tool call is never left without its result)."""
        items: list[Item] = [] if self.user_committed else [*self._head(), user_item(self.message)]
        # (each emits input.resolved if, and only if, it is not already answered)
        withdrawn = [(rid, Answer("withdrawn", "the turn was cancelled")) for rid in self.open_requests]
        pending = self._unfinished_calls()
        if pending is not None:
            done = {i.tool_call_id for i in self.turn_items if i.role == "tool"}
            for call in pending.tool_calls:
                if call.id not in done:
                    said = "stopped when the turn was cancelled" if call.id in self._stopped else "not run"
                    items.append(
                        result_item(self.turn_id, call, f"error: the turn was cancelled; {said}", is_error=True)
                    )
        events = [self._event(TurnCancelledData(self.message.message_id))]
        committed = await self._commit(items, events, mode="final", answers=withdrawn)
        return Final(more=isinstance(committed, Ended) and committed.more)

    async def _commit(
        self,
        items: list[Item],
        events: list[Pending],
        *,
        mode: CommitMode = "step",
        requests: list[ApprovalRequest] | None = None,
        answers: list[tuple[str, Answer]] | None = None,
        after: str | None = None,
        attempt: bool = False,
        rebase: int | None = None,
        usage: UsageRecord | None = None,
        guard: bool = False,
        announce: list[Pending] | None = None,
        announced: str = "",
    ) -> Commit:
        try:
            committed = await self.store.commit(
                self.sid,
                self.begun.fence,
                self.turn_id,
                items,
                events,
                mode=mode,
                requests=requests or (),
                answers=answers or (),
                attempt=attempt,
                rebase=rebase,
                usage=usage,
                guard=guard,
                announce=announce or (),
                announced=announced,
                failpoint=after,
            )
        except StaleLease:
            log.warning("session %s turn %s: lease lost (or session deleted), stopping", self.sid, self.turn_id)
            raise
        return committed

    def _event(self, data: Data) -> Pending:
        return pending(self.turn_id, data)


def _cancelled(committed: Commit) -> bool:
    """A cancel is pending for the turn (the commit was made, or withheld because of it)."""
    return isinstance(committed, CancelPending | Withheld)
