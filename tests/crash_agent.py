"""The agent crash tests run inside `python -m app` (KEEL_AGENT=tests.crash_agent:agent). It
writes every model call and every tool run as a JSON line to $KEEL_TEST_LOG, so a test can count
them across processes that die."""

from __future__ import annotations

import asyncio
import json
import os

from harness import Agent, Compaction, ToolContext, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage


def log(record: dict[str, object]) -> None:
    with open(os.environ["KEEL_TEST_LOG"], "a") as f:  # one write of one line: whole or nothing
        f.write(json.dumps(record) + "\n")


@tool(approval=True)
def charge(amount: int, ctx: ToolContext) -> str:
    """Charge the card (an outside effect, deduplicated by ctx.call_id)."""
    log({"tool": "charge", "call_id": ctx.call_id, "amount": amount})
    return f"charged {amount}"


def script(request: ModelRequest) -> ModelReply:
    log({"model": request.step, "turn": request.turn_id, "purpose": request.purpose})
    if request.purpose == "compaction":
        return ModelReply(text="SUMMARY", usage=Usage(input_tokens=50, output_tokens=5))
    last = request.messages[-1]
    usage = Usage(input_tokens=10, output_tokens=1)
    if last.role == "user" and last.text.startswith("pay "):
        return ModelReply(tool_calls=[ToolCall("charge", {"amount": int(last.text[4:])})], usage=usage)
    if last.role == "user" and last.text.startswith("long "):  # a reply Slack gets in several posts
        n = int(last.text[5:])
        return ModelReply(text="".join(chr(97 + i // 3900 % 26) for i in range(n)), usage=usage)
    if last.role == "user" and last.text.startswith("mcp "):  # a tool of the MCP server KEEL_MCP_CONFIG names
        return ModelReply(tool_calls=[ToolCall(last.text[4:], {})], usage=usage)
    if last.role == "tool":
        return ModelReply(text=f"done: {last.text}", usage=usage)
    return ModelReply(text=f"re: {last.text}", usage=usage)


agent = Agent(instructions="You charge cards when asked.", tools=[charge], model=ScriptedModel(script, keep=0))


def estimated(reply: ModelReply) -> ModelReply:
    """The reply without its fixed usage: ScriptedModel estimates it, so the prompt is seen to grow."""
    return ModelReply(text=reply.text, tool_calls=reply.tool_calls)


# The same model with a small window: every few turns it compacts (tests/crash/test_compaction_crash.py).
compacting = Agent(
    instructions="You charge cards when asked.",
    tools=[charge],
    model=ScriptedModel(lambda r: estimated(script(r)), keep=0),
    context_window=400,
    compaction=Compaction(keep_turns=1),
)


@tool
async def hold(seconds: float, ctx: ToolContext) -> str:
    """Take `seconds` (a slow tool; logged when it begins and when it ends)."""
    log({"tool": "hold", "call_id": ctx.call_id, "pid": os.getpid()})
    await asyncio.sleep(seconds)
    log({"tool": "held", "call_id": ctx.call_id, "pid": os.getpid()})
    return f"held {seconds:g}"


async def blocking(request: ModelRequest) -> ModelReply:
    """As `script`, but with $KEEL_TEST_BLOCK set a model call for a message that starts with
    "slow " never returns (logged first, as {"blocked": turn id}): the turn is running in this
    process for as long as the test likes. A process without it answers at once. "think N"
    takes N seconds to answer; "hold N" calls the slow tool."""
    users = [i.text for i in request.messages if i.role == "user" and i.kind == "message"]
    log({"model": request.step, "turn": request.turn_id, "pid": os.getpid(), "users": users})
    last = request.messages[-1]
    if os.environ.get("KEEL_TEST_BLOCK") and last.role == "user" and last.text.startswith("slow "):
        log({"blocked": request.turn_id, "pid": os.getpid()})
        await asyncio.Event().wait()
    if last.role == "user" and last.text.startswith("think "):  # a model call that takes its time
        await asyncio.sleep(float(last.text[6:]))
        return ModelReply(text=f"thought {last.text[6:]}")
    if last.role == "user" and last.text.startswith("hold "):
        return ModelReply(tool_calls=[ToolCall("hold", {"seconds": float(last.text[5:])})])
    if last.role == "tool":
        return ModelReply(text=f"done: {last.text}")
    return ModelReply(text=f"re: {last.text}")


# Turns that block in the model or take their time in a tool (tests/app/test_lifecycle.py).
slow = Agent(instructions="You take your time.", tools=[hold], model=ScriptedModel(blocking, keep=0))
