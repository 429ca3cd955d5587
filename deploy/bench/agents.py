"""The benchmarks' agents: a zero-latency scripted model that answers "hi" and keeps no requests,
so a turn costs only keel itself (HTTP, harness, Redis); and the in-process benchmarks' model
functions (a plain reply, or one tool call first)."""

from __future__ import annotations

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage

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
