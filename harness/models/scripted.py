"""ScriptedModel: the model port's test double, its replies from a Python function.

ScriptedModel: a model whose replies come from a Python function. The test double of the
model port, shipped in the package so apps and tests use the same one."""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable

from harness.models.base import ModelEvent, ModelReply, ModelRequest, TextDelta, complete
from harness.models.tokens import estimate_tokens, request_tokens
from harness.types import Usage

ScriptFn = Callable[[ModelRequest], ModelReply | Awaitable[ModelReply]]


class ScriptedModel:
    """`fn(request) -> ModelReply`, sync or async. Requests are kept in `.requests` (the last
    `keep` of them; all when None) so a test can assert what the model was shown. A reply
    without usage gets an estimate. With `chunk=n` the reply's text is streamed first, `n`
    characters a delta (by default it comes whole, as one reply with no deltas)."""

    PROVIDER = "keel.scripted"  # (gen_ai.provider.name)
    model = "scripted"

    def __init__(self, fn: ScriptFn, *, keep: int | None = None, chunk: int | None = None) -> None:
        self._fn = fn
        self._keep = keep
        self._chunk = chunk
        self.requests: list[ModelRequest] = []

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        reply = await self.reply(request)
        if self._chunk:
            for start in range(0, len(reply.text), self._chunk):
                yield TextDelta(reply.text[start : start + self._chunk])
        yield reply

    async def complete(self, request: ModelRequest) -> ModelReply:
        """The reply, drained from `stream`."""
        return await complete(self, request)

    async def reply(self, request: ModelRequest) -> ModelReply:
        self.requests.append(request)
        if self._keep is not None and len(self.requests) > self._keep:
            del self.requests[: len(self.requests) - self._keep]
        reply = self._fn(request)
        if inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, ModelReply):
            raise TypeError(f"scripted model function returned {type(reply).__name__}, not ModelReply")
        if reply.usage is None:
            out = estimate_tokens(reply.text) + 8 * len(reply.tool_calls)
            usage = Usage(input_tokens=request_tokens(request), output_tokens=out)
            reply = ModelReply(text=reply.text, tool_calls=reply.tool_calls, usage=usage)
        return reply
