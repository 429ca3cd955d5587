"""One model step's attempts: each counted before it is made (I5), its reply's text streamed out
as live `message.delta` events, a failed attempt recorded, and one that may succeed (a rate
limit, an overloaded or unreachable provider, a cut or idle stream) tried again after an
exponential backoff with jitter, or after the provider's `retry-after`, up to
`Agent.model_retries` more times. The retries are keel's: provider clients are made with theirs
off, so every attempt is counted and shown."""

from __future__ import annotations

import asyncio
import logging
import random

from harness.agent import Agent
from harness.errors import ModelError
from harness.events import delta
from harness.models.base import ModelReply, ModelRequest, TextDelta
from harness.outcomes import Live, Publish
from harness.store import Store
from harness.types import Usage

log = logging.getLogger("keel.model")
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 120.0


def backoff(retry: int, retry_after: float | None) -> float:
    """Seconds before retry number `retry` (1, 2, ...): the provider's `retry-after` when it
    gave one, else exponential with full jitter."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), RETRY_AFTER_MAX_S)
    return random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (retry - 1)))


def as_model_error(exc: Exception) -> ModelError:
    if isinstance(exc, ModelError):
        return exc
    return ModelError(f"the model call failed: {type(exc).__name__}: {exc}")


class ModelCall:
    def __init__(
        self, store: Store, agent: Agent, sid: str, turn_id: str, *, publish: Publish, live: Live | None
    ) -> None:
        self.store, self.agent, self.sid, self.turn_id = store, agent, sid, turn_id
        self._publish = publish
        self._live = live

    async def reply(self, request: ModelRequest, step: int, item_id: str, *, counted: bool) -> ModelReply:
        """The model's reply to `request`, whose text streams as deltas of `item_id` (a retry
        streams it again from offset 0). `counted`: the first attempt is counted already.
        Raises the last attempt's ModelError when no attempt succeeded."""
        retry = 0
        while True:
            if not counted:
                await self.store.count_attempt(self.sid)  # before the call: a reply lost in a crash still counts
            counted = False
            try:
                return await self._stream(request, item_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = as_model_error(exc)
            log.warning("session %s turn %s: model attempt failed: %s", self.sid, self.turn_id, error.code)
            failed = await self.store.record_usage(self.sid, self.turn_id, step, Usage(), failed=True)  # may be billed
            self._publish(self.sid, [failed], False)
            if not error.retryable or retry >= self.agent.model_retries:
                raise error
            retry += 1
            await asyncio.sleep(backoff(retry, error.retry_after))

    async def _stream(self, request: ModelRequest, item_id: str) -> ModelReply:
        reply: ModelReply | None = None
        offset = 0
        async for event in self.agent.model.stream(request):
            if isinstance(event, TextDelta):
                if event.text and self._live is not None:
                    self._live.live(self.sid, delta(self.sid, self.turn_id, item_id, event.text, offset))
                offset += len(event.text)
            else:
                reply = event
        if reply is None:
            raise ModelError("the model's stream ended without a reply", retryable=True)
        if offset and self._live is not None:
            await self._live.flush_live()  # readers elsewhere get the deltas before the commit
        return reply
