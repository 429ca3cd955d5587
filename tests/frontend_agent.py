"""The agent the frontend-protocol tests (Python and the real JavaScript clients) talk to.

Its model streams its text 4 characters a delta, a few milliseconds apart (as a provider's
tokens come), and answers by the user's text:
    "weather <city>"  -> calls `weather` (no approval), then says what it returned
    "pay <n>"         -> says it will pay, calls `pay` (approval always), then reports the result
    "pay <n> <m>"     -> two `pay` calls in one step (two approval requests)
    "fail"            -> the model fails (not retryable): the turn fails
    "slow"            -> waits on `Gates.slow` before its reply (a turn to join mid-way)
    anything else     -> "Echo: <text>"
`runs` counts every tool run, by call id (a tool that ran twice shows there)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any

from harness import Agent, ToolContext, tool
from harness.errors import ModelError
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from harness.models.base import ModelEvent, TextDelta

PACE_S = 0.003


class PacedModel(ScriptedModel):
    """ScriptedModel whose deltas come `PACE_S` apart, as a provider's do."""

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        async for event in super().stream(request):
            if isinstance(event, TextDelta):
                await asyncio.sleep(PACE_S)
            yield event


class Gates:
    def __init__(self) -> None:
        self.slow = asyncio.Event()
        self.slow_began = asyncio.Event()


def frontend_agent() -> tuple[Agent, Counter[str], Gates]:
    runs: Counter[str] = Counter()
    gates = Gates()

    @tool
    def weather(city: str, ctx: ToolContext) -> str:
        """The weather in a city."""
        runs[ctx.call_id] += 1
        return f"sunny in {city}"

    @tool(approval=True)
    def pay(amount: int, ctx: ToolContext) -> str:
        """Pay an amount."""
        runs[ctx.call_id] += 1
        return f"paid {amount}"

    async def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "tool":
            results = [m.text for m in r.messages if m.role == "tool" and m.turn_id == r.turn_id]
            return ModelReply(text="Done: " + "; ".join(results))
        text = last.text
        if text.startswith("weather "):
            return ModelReply(text="Looking it up.", tool_calls=[ToolCall("weather", {"city": text[8:]})])
        if text.startswith("pay "):
            calls = [ToolCall("pay", {"amount": int(n)}) for n in text[4:].split()]
            return ModelReply(text="I will pay.", tool_calls=calls)
        if text == "fail":
            raise ModelError("the model is down", retryable=False)
        if text == "slow":
            gates.slow_began.set()
            await gates.slow.wait()
            return ModelReply(text="That took a while, but here it is: the slow reply.")
        return ModelReply(text=f"Echo: {text}")

    agent = Agent(instructions="You test frontends.", tools=[weather, pay], model=PacedModel(script, chunk=4))
    return agent, runs, gates


def text_of(chunks: list[dict[str, Any]]) -> str:
    """The text a UI message stream's text-delta chunks make."""
    return "".join(c["delta"] for c in chunks if c["type"] == "text-delta")
