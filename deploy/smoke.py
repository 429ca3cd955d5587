"""One real turn per provider whose key is set: `make smoke` (never part of `make test`).

    ANTHROPIC_API_KEY=... OPENAI_API_KEY=... make smoke

For each of Anthropic (`KEEL_SMOKE_ANTHROPIC`, default anthropic:claude-sonnet-4-5), OpenAI's
Responses API (`KEEL_SMOKE_OPENAI`, default openai:gpt-5-mini) and, when `KEEL_SMOKE_OPENAI_CHAT`
is set, an OpenAI-compatible Chat Completions server: a private Valkey, one session, one message
that needs the `add` tool, streamed. Checks the turn completed through the tool-use protocol and
that deltas streamed; prints usage. A provider without its key is skipped, saying so. Exit 1 if
any turn that ran failed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from support import Deadline, start_valkey, stop_process  # the benchmarks' helpers

from harness import Agent, Harness, tool
from harness.events import OUTCOMES, LiveEvent, StoredEvent, ToolCompleted, TurnFailed
from harness.models.spec import KEYS


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def specs() -> list[str]:
    out = [os.environ.get("KEEL_SMOKE_ANTHROPIC", "anthropic:claude-sonnet-4-5")]
    out.append(os.environ.get("KEEL_SMOKE_OPENAI", "openai:gpt-5-mini"))
    if os.environ.get("KEEL_SMOKE_OPENAI_CHAT"):
        out.append(os.environ["KEEL_SMOKE_OPENAI_CHAT"])
    return out


async def one_turn(spec: str, url: str) -> bool:
    agent = Agent(instructions="Use the add tool for arithmetic. Answer in one sentence.", tools=[add], model=spec)
    h = Harness.connect(url, agent)
    await h.start()
    try:
        sid = await h.sessions.create("smoke")
        deltas = 0

        async def read() -> None:
            nonlocal deltas
            async for event in h.sessions.tail(sid, "0-0", heartbeat=30):
                deltas += isinstance(event, LiveEvent)
                if isinstance(event, StoredEvent) and OUTCOMES.get(event.type) in ("completed", "failed"):
                    return

        reader = asyncio.create_task(read())
        result = await h.sessions.wait_turn(await h.sessions.submit(sid, "smoke", "What is 1234 + 4321?"), 120)
        await asyncio.wait_for(reader, 10)
        tools = [done.data.result for e in result.events if (done := e.of(ToolCompleted)) is not None]
        info = await h.sessions.info(sid, "smoke")
        ok = result.status == "completed" and tools == ["5555"]
        print(f"{spec}: {result.status}; tool results {tools}; {deltas} deltas; reply {result.reply!r}")
        print(f"  usage {info.usage}")
        if result.status == "failed":
            failed = result.events[-1].of(TurnFailed)
            print(f"  error {failed.data.error if failed is not None else None}")
        return ok
    finally:
        await h.stop()


async def main() -> int:
    failed = 0
    with tempfile.TemporaryDirectory(prefix="keel-smoke-") as tmp:
        proc, port = start_valkey(Path(tmp), Deadline(60))
        try:
            for spec in specs():
                key = KEYS.get(spec.partition(":")[0], "")
                if not os.environ.get(key):
                    print(f"{spec}: skipped ({key} is not set)")
                    continue
                failed += not await one_turn(spec, f"redis://127.0.0.1:{port}")
        finally:
            stop_process(proc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
