"""One model step's attempts: counted, streamed, retried, interrupted.

One model step's attempts: each counted before it is made (I5), its reply's text streamed out
as live `message.delta` events, a failed attempt recorded, and one that may succeed (a rate
limit, an overloaded or unreachable provider, a cut or idle stream) tried again after an
exponential backoff with jitter, or after the provider's `retry-after`, up to
`Agent.model_retries` more times. The retries are keel's: provider clients are made with theirs
off, so every attempt is counted and shown. A cancel of the turn (`interrupt`) closes the
provider's stream or ends the backoff at once, and no further attempt is made (the call listens
for its turn's cancel on the store's hub, whichever process it was asked in). A drain of the
process (`Calls.hand_over`) does the same without ending the turn: `HandedOver`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Coroutine
from typing import TypeVar

import msgspec

from harness import failpoints
from harness.errors import ModelError
from harness.events import delta
from harness.loop.agent import Agent
from harness.models.base import ModelReply, ModelRequest, TextDelta, ToolSpec
from harness.retry import backoff
from harness.store import Store
from harness.telemetry import tracing
from harness.telemetry.metrics import HarnessStats
from harness.types import Usage

log = logging.getLogger("keel.model")
_enc = msgspec.json.Encoder()
T = TypeVar("T")
LIVE_YIELD_S = 0.002  # during a burst of deltas, readers get the floor at least this often


class Interrupted(Exception):
    """The turn was cancelled during the model call (its stream closed, or its backoff ended):
    the turn ends cancelled (a signal, not a failure)."""


class HandedOver(Exception):
    """This process is draining: the turn stops at its model call (the provider's stream
    closed, or no attempt made) without committing anything of the call, so that another process
    takes the turn over from its last commit (a signal, not a failure)."""


_tools_memo: list[tuple[object, int]] = [(None, 0)]  # the last tool list hashed (a turn's is one tuple)


def _tools_hash(tools: tuple[ToolSpec, ...]) -> int:
    seen, value = _tools_memo[0]
    if seen is not tools:
        value = hash(_enc.encode(tools))
        _tools_memo[0] = (tools, value)
    return value


def _usage_attributes(reply: ModelReply) -> dict[str, object]:
    usage = reply.usage
    if usage is None:
        return {}
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_tokens,
    }


class Calls:
    """The model calls in progress in this process, one per session at most: a drain stops
    every call, and every one that would start after it, with HandedOver (`hand_over`)."""

    def __init__(self) -> None:
        self.running: dict[str, ModelCall] = {}
        self.handing_over = False

    def hand_over(self) -> None:
        self.handing_over = True
        for call in list(self.running.values()):
            call.hand_over()


STOPS = (Interrupted, HandedOver)  # a call's ends that are no failure (its span says "stopped")


def as_model_error(exc: Exception) -> ModelError:
    if isinstance(exc, ModelError):
        return exc
    return ModelError(f"the model call failed: {type(exc).__name__}: {exc}")


class ModelCall:
    def __init__(
        self,
        store: Store,
        agent: Agent,
        sid: str,
        turn_id: str,
        *,
        running: Calls | None = None,
        stats: HarnessStats | None = None,
    ) -> None:
        self.store, self.agent, self.sid, self.turn_id = store, agent, sid, turn_id
        self.stats = stats or HarnessStats()
        self._hub = store.hub  # where its deltas go, and its turn's cancel comes from
        self._running = running if running is not None else Calls()  # the calls in progress here
        self._task: asyncio.Task[object] | None = None
        self._cuttable = False  # awaiting the provider or a backoff (the only awaits an interrupt may cut)
        self._asked = False  # a cancel of this turn was asked for
        self._leaving = False  # the process is draining: the turn goes to another process
        self._interrupted = False  # this task was cancelled for one of those two

    def interrupt(self) -> None:
        """A cancel of this turn was asked for: close the provider's stream (or end a backoff)
        now, or, between those, make no further attempt."""
        self._asked = True
        self._cut()

    def hand_over(self) -> None:
        """The process is draining: as `interrupt`, but the turn is not to end (HandedOver)."""
        self._leaving = True
        self._cut()

    def _cut(self) -> None:
        # (asked from within the call's own task, the model's code itself: it is not suspended
        # in what could be cut, so nothing is; the flags stop it at the next attempt, and the
        # step's commit finds the cancel)
        task = self._task
        if self._cuttable and task is not None and not self._interrupted and task is not asyncio.current_task():
            self._interrupted = True
            task.cancel()

    async def reply(self, request: ModelRequest, step: int, item_id: str, *, counted: bool) -> ModelReply:
        """The model's reply to `request`, whose text streams as deltas of `item_id` (a retry
        streams it again from offset 0). `counted`: the first attempt is counted already.
        Raises the last attempt's ModelError when no attempt succeeded, Interrupted when the turn
        was cancelled during the call, HandedOver when the process began to drain."""
        running = self._running.running
        running[self.sid] = self
        self._leaving = self._running.handing_over
        self._watch_prefix(request)
        try:
            with self._hub.cancellable(self.sid, self.turn_id, self.interrupt):
                return await self._attempts(request, step, item_id, counted=counted)
        finally:
            if running.get(self.sid) is self:
                del running[self.sid]

    async def _attempts(self, request: ModelRequest, step: int, item_id: str, *, counted: bool) -> ModelReply:
        self._task = asyncio.current_task()
        retry = 0
        while True:
            if self._asked or self._leaving:  # (asked between attempts: a counted first attempt stays counted)
                raise self._stopped()
            if not counted:
                await self.store.count_attempt(self.sid)  # before the call: a reply lost in a crash still counts
            counted = False
            began = time.perf_counter()
            attributes = functools.partial(self._attributes, request, retry)  # (made only if traced)
            with tracing.span(f"chat {self.model_name}", attributes, signals=STOPS) as span:
                try:
                    reply = await self._cut_short(self._stream(request, item_id))
                except (Interrupted, HandedOver) as exc:
                    outcome = "interrupted" if isinstance(exc, Interrupted) else "handed_over"
                    self.stats.attempt(outcome, time.perf_counter() - began)
                    await self._record_failed(step)
                    raise
                except Exception as exc:
                    error = as_model_error(exc)
                    self.stats.attempt(error.code, time.perf_counter() - began)
                    tracing.failed(span, error.code)
                else:
                    self.stats.attempt("ok", time.perf_counter() - began)
                    if reply.usage is not None:
                        usage = reply.usage
                        self.stats.cache_read(self.agent.name, self.model_name, usage.input_tokens, usage.cached_tokens)
                    if span is not None:
                        tracing.record(span, _usage_attributes(reply))
                        tracing.content(span, "gen_ai.output.messages", reply.text)
                    return reply
            log.warning("session %s turn %s: model attempt failed: %s", self.sid, self.turn_id, error.code)
            await self._record_failed(step)
            if not error.retryable or retry >= self.agent.model_retries:
                raise error
            retry += 1
            await self._cut_short(asyncio.sleep(backoff(retry, error.retry_after)))

    async def _cut_short(self, awaitable: Coroutine[object, object, T]) -> T:
        """Await what an interrupt may cut (the provider's stream, a backoff): Interrupted (or
        HandedOver) then, or at once if it was asked already."""
        if self._asked or self._leaving:
            awaitable.close()
            raise self._stopped()
        self._cuttable = True
        try:
            return await awaitable
        except asyncio.CancelledError:
            if not self._interrupted or not self._uncancel():
                raise
            raise self._stopped() from None
        finally:
            self._cuttable = False

    def _watch_prefix(self, request: ModelRequest) -> None:
        """Prompt-cache health: a request whose tools or system prompt differ from the session's
        previous one's writes its cache again (and so does every request after it, if the
        change is one that recurs: a clock or an id in the instructions). Counted and logged."""
        tools = _tools_hash(request.tools)
        changed = self.stats.prefix(self.agent.name, self.model_name, self.sid, tools, hash(request.system))
        if changed:
            log.warning(
                "session %s turn %s: the cached prefix changed since the session's last request (%s): "
                "the provider writes its prompt cache again",
                self.sid,
                self.turn_id,
                " and ".join(changed),
            )

    @property
    def model_name(self) -> str:
        return str(getattr(self.agent.model, "model", type(self.agent.model).__name__))

    def _attributes(self, request: ModelRequest, retry: int) -> dict[str, object]:
        return {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": str(getattr(self.agent.model, "PROVIDER", "unknown")),
            "gen_ai.request.model": self.model_name,
            "gen_ai.conversation.id": self.sid,
            "keel.turn.id": self.turn_id,
            "keel.attempt": retry + 1,
        }

    def _stopped(self) -> Interrupted | HandedOver:
        """Why the call stops: a cancel of the turn (it wins: the turn ends), else a drain."""
        return Interrupted() if self._asked else HandedOver()

    async def _record_failed(self, step: int) -> None:
        await self.store.record_usage(self.sid, self.turn_id, step, Usage(), failed=True)  # (it may be billed)

    def _uncancel(self) -> bool:
        """Take back the interrupt's cancellation; False if the task is being cancelled for
        another reason too (a shutdown), which must go on."""
        task = self._task
        return task is not None and task.uncancel() == 0

    async def _stream(self, request: ModelRequest, item_id: str) -> ModelReply:
        reply: ModelReply | None = None
        offset = 0
        loop = asyncio.get_running_loop()
        yielded = -LIVE_YIELD_S
        self._hub.streaming(self.sid)
        try:
            async with contextlib.aclosing(self.agent.model.stream(request)) as events:  # closed when cut
                async for event in events:
                    if isinstance(event, TextDelta):
                        if event.text:
                            self._hub.live(self.sid, delta(self.sid, self.turn_id, item_id, event.text, offset))
                            failpoints.reached("model.mid_stream")
                            # A burst the provider sent at once is read from a buffer without a pause:
                            # let the readers send what came so far, at the first delta and then at
                            # most every LIVE_YIELD_S, so a burst goes out in a few writes, not one.
                            now = loop.time()
                            if now - yielded >= LIVE_YIELD_S:
                                await asyncio.sleep(0)
                                yielded = loop.time()
                        offset += len(event.text)
                    else:
                        reply = event
        finally:
            self._cuttable = False  # (the flush below is not the provider's: it is not cut)
        if reply is None:
            raise ModelError("the model's stream ended without a reply", retryable=True)
        if offset:
            await self._hub.flush_live()  # readers elsewhere get the deltas before the commit
        return reply
