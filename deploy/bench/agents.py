"""The benchmark agent: a zero-latency scripted model that answers "hi" and keeps no requests,
so a turn costs only keel itself (HTTP, harness, Redis)."""

from __future__ import annotations

from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel, Usage


def _hi(request: ModelRequest) -> ModelReply:
    # Usage as a provider reports it (ScriptedModel would otherwise estimate it by walking the
    # whole prompt: a cost of the test double, not of keel).
    return ModelReply(text="hi", usage=Usage(input_tokens=100, output_tokens=1))


agent = Agent(instructions="You are a benchmark agent.", model=ScriptedModel(_hi, keep=0), name="bench")
