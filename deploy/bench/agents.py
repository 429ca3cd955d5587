"""The benchmarks' agents: a zero-latency scripted model that answers "hi" and keeps no requests,
so a turn costs only keel itself (HTTP, harness, Redis); the in-process benchmarks' model
functions (a plain reply, or one tool call first); and a model that streams time-stamped deltas
(`bench_crossproc.py --deltas`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator

from harness import Agent, tool
from harness.models import ModelEvent, ModelReply, ModelRequest, ScriptedModel, TextDelta, ToolCall, Usage

USAGE = Usage(input_tokens=100, output_tokens=1)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def plain(request: ModelRequest) -> ModelReply:
    return ModelReply(text="hi there", usage=USAGE)


def with_tool(request: ModelRequest) -> ModelReply:
    if request.messages[-1].role == "tool":
        return ModelReply(text="hi there", usage=USAGE)
    return ModelReply(tool_calls=[ToolCall("add", {"a": 1, "b": 2})], usage=USAGE)


def _hi(request: ModelRequest) -> ModelReply:
    # Usage as a provider reports it (ScriptedModel would otherwise estimate it by walking the
    # whole prompt: a cost of the test double, not of keel).
    return ModelReply(text="hi", usage=Usage(input_tokens=100, output_tokens=1))


agent = Agent(instructions="You are a benchmark agent.", model=ScriptedModel(_hi, keep=0), name="bench")


class Stamped:
    """A model that streams its reply as `deltas` text deltas, `pace_s` apart (a model streaming
    at its pace), each beginning with the time it was sent (`time.time_ns()`, 19 digits) and its
    index (3 digits): a reader's receipt time minus that stamp is the delta's latency."""

    PROVIDER = "keel.bench"
    model = "stamped"

    def __init__(self, deltas: int, pace_s: float) -> None:
        self.deltas = deltas
        self.pace_s = pace_s

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        parts = []
        for n in range(self.deltas):
            if n and self.pace_s:
                await asyncio.sleep(self.pace_s)
            part = f"{time.time_ns():019d}{n:03d} "
            parts.append(part)
            yield TextDelta(part)
        yield ModelReply(text="".join(parts), usage=USAGE)


# `bench_crossproc.py --deltas`: its deltas a turn and their pace from the environment it sets
stamped = Agent(
    instructions="You are a benchmark agent.",
    model=Stamped(
        int(os.environ.get("KEEL_BENCH_DELTAS", "20")), float(os.environ.get("KEEL_BENCH_PACE_MS", "5")) / 1000
    ),
    name="bench",
)
