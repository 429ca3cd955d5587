"""The demo agent: a scripted model (no API key, no network) with three harmless tools (`add`,
`utc_time`, and `place_order`, a pretend order that asks a person first), so a newcomer can see
a whole turn, a streamed reply, a tool call, an approval and page context at work."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator
from datetime import UTC, datetime

from harness import Agent, tool
from harness.models import ModelEvent, ModelReply, ModelRequest, ScriptedModel, TextDelta, ToolCall

_ADD = re.compile(r"(-?\d+)\s*(?:\+|plus|and)\s*(-?\d+)")
CHUNK = 4  # characters a delta
PACE_S = 0.03  # between deltas: about 130 characters a second, quick but readable
LONGEST_S = 1.2  # a long reply comes faster, so that none takes longer than this


class TypingModel(ScriptedModel):
    """ScriptedModel that streams its replies as a provider does: `CHUNK` characters a delta,
    `PACE_S` apart (closer for a long reply, which takes at most `LONGEST_S`). A summary for
    compaction comes whole: nobody watches it arrive."""

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        reply = await self.reply(request)
        starts = range(0, len(reply.text), CHUNK)
        if request.purpose != "compaction" and starts:
            pause = min(PACE_S, LONGEST_S / len(starts))
            for start in starts:
                if start:
                    await asyncio.sleep(pause)
                yield TextDelta(reply.text[start : start + CHUNK])
        yield reply


@tool
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@tool(approval=True)
def place_order(item: str) -> str:
    """Order an item (a pretend order: nothing is bought). Needs a person's approval."""
    return f"ordered the {item} (pretend)"


@tool
def utc_time() -> str:
    """The current time in UTC, ISO 8601."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def today() -> str:
    """Runtime context: today's date travels as a snapshot in history (written when it changes),
    never in the system prompt, so the prompt prefix stays cached across midnight."""
    return datetime.now(UTC).date().isoformat()


def _reply(request: ModelRequest) -> ModelReply:
    if request.purpose == "compaction":  # summarize: the demo keeps what the user said
        said = [line[6:] for line in request.messages[-1].text.splitlines() if line.startswith("user: ")]
        return ModelReply(text="Earlier the user said: " + "; ".join(said))
    last = next(m for m in reversed(request.messages) if m.kind != "runtime")
    if last.role == "tool":
        return ModelReply(text=f"The {last.tool_name} tool says: {last.text}")
    text = last.text
    if m := _ADD.search(text):
        return ModelReply(tool_calls=[ToolCall("add", {"a": int(m[1]), "b": int(m[2])})])
    if "time" in text.lower():
        return ModelReply(tool_calls=[ToolCall("utc_time", {})])
    page = {i.context_key: i.text.split("\n", 1)[1] for i in request.messages if i.kind == "sticky" and i.context_key}
    if "looking at" in text.lower():  # answered from the page as it is now (keyed context)
        if page.get("selection", "nothing") == "nothing":
            return ModelReply(text="Nothing is selected. Pick a lamp on the left.")
        return ModelReply(text=f"You are looking at the {page['selection']} ({page.get('route', '?')}).")
    if text.lower().startswith("order"):
        item = page.get("selection", "nothing")
        named = re.sub(
            r"^(a|an|the)\s+", "", text[5:].strip(" .!?"), flags=re.I
        )  # "order a desk lamp": Slack has no page
        if item == "nothing" and named.lower() not in ("", "it", "this", "that"):
            item = named
        if item == "nothing":
            return ModelReply(text="Select a lamp first, then ask me to order it.")
        return ModelReply(tool_calls=[ToolCall("place_order", {"item": item})])
    # Name what it sees, not its content: a reply is durable history; page context is not (I1).
    keys = [i.context_key or "(this turn)" for i in request.messages if i.kind in ("context", "sticky")]
    noun = "entry" if len(keys) == 1 else "entries"
    seen = f" I can see {len(keys)} page context {noun}: {', '.join(keys)}." if keys else ""
    return ModelReply(text=f"You said: {text!r}.{seen} (Try 'what time is it' or 'add 2 and 3'.)")


agent = Agent(
    name="demo",
    instructions="You are keel's demo agent. Answer briefly.",
    tools=[add, utc_time, place_order],
    model=TypingModel(_reply, keep=0),
    runtime_context=[today],
    context_window=32_000,  # compacts automatically near 90% of this (and on POST .../compact)
)
