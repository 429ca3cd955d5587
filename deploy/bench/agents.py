"""The benchmark agent: a zero-latency scripted model that answers "hi" and keeps no requests,
so a turn costs only keel itself (HTTP, harness, Redis)."""

from __future__ import annotations

from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel


def _hi(request: ModelRequest) -> ModelReply:
    return ModelReply(text="hi")


agent = Agent(instructions="You are a benchmark agent.", model=ScriptedModel(_hi, keep=0), name="bench")
