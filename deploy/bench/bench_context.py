"""Prompt-cache reuse and compaction over long sessions, measured with the caching test double
(CachingScriptedModel: cached tokens = the longest prefix of the request that an earlier
request of the session began with, in estimated tokens).

    .venv/bin/python deploy/bench/bench_context.py

1. The 50-turn workload of tests/harness/test_runtime_cache.py (page context on every turn, a
   git branch that changes every 10 turns, a tool call every third turn) through keel, beside a
   baseline in the same run: the same conversation assembled the way seed 003's harness did,
   with the branch in the system prompt.
2. A long session with automatic compaction (context_window 6,000): how many compactions, the
   largest prompt, cache reuse, and the turn p50 of the first and last 100 turns, beside the
   same session on an agent without runtime context or compaction.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support import Deadline, start_valkey, stop_process  # the sibling module: this file runs as a script

from app import build_harness
from app.settings import Settings
from harness import Agent, Compaction, tool
from harness.events import CompactionCompleted, UsageRecorded
from harness.models import CachingScriptedModel, Item, ModelReply, ModelRequest, ToolCall
from harness.models.tokens import estimate_tokens
from harness.types import PageContext

INSTRUCTIONS = "You are a careful product assistant for an online shop. Answer briefly. " * 12


@tool
def lookup(q: str) -> str:
    """Look something up in the shop's catalogue."""
    return f"3 products match {q}: " + ", ".join(f"item-{q}-{n}" for n in range(8))


def script(r: ModelRequest) -> ModelReply:
    if r.purpose == "compaction":
        return ModelReply(text="The user browsed products and asked questions; all were answered.")
    last = r.messages[-1]
    if last.role == "user" and last.text.endswith("look"):
        return ModelReply(tool_calls=[ToolCall("lookup", {"q": "lamp"})])
    return ModelReply(text=f"Here is the answer to step {r.step}, with a sentence of detail.")


def branch_at(n: int) -> str:
    return f"feature-{n // 10}"


async def keel_session(url: str, turns: int, *, features: bool, window: int | None = None) -> dict[str, Any]:
    state = {"n": 0}

    def git_branch() -> str:
        return branch_at(state["n"])

    model = CachingScriptedModel(script, keep=0)
    agent = Agent(
        instructions=INSTRUCTIONS,
        tools=[lookup],
        model=model,
        runtime_context=[git_branch] if features else [],
        context_window=window,
        compaction=Compaction(keep_turns=4),
    )
    h = build_harness(Settings(), url, agent)
    await h.start()
    try:
        sid = await h.sessions.create("bench")
        times: list[float] = []
        usage: list[list[dict[str, Any]]] = []
        compactions = 0
        for n in range(turns):
            state["n"] = n
            text = f"question {n}" + (" look" if n % 3 == 0 else "")
            context: PageContext = {"page": f"/products/{n} selection={n * 7}"} if features else None
            t0 = time.perf_counter()
            turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "bench", text, context), 30)
            times.append(time.perf_counter() - t0)
            if turn.status != "completed":
                raise RuntimeError(f"turn {n}: {turn.status}")
            usage.append([msgspec.to_builtins(u.data) for e in turn.events if (u := e.of(UsageRecorded)) is not None])
            compactions += sum(1 for e in turn.events if e.type == CompactionCompleted.TYPE)
    finally:
        await h.stop()
    calls = [u for t in usage[1:] for u in t if u.get("purpose", "turn") == "turn"]
    return {
        "cached": sum(u["cached_tokens"] for u in calls) / max(sum(u["input_tokens"] for u in calls), 1),
        "prefixes": len(set(model.prefixes)),
        "max_prompt": max(u["input_tokens"] for t in usage for u in t),
        "compactions": compactions,
        "p50_first": statistics.median(times[:100]) * 1000,
        "p50_last": statistics.median(times[-100:]) * 1000,
    }


async def naive_ratio(turns: int) -> float:
    """The same conversation as seed 003's harness built it: the branch in the system prompt."""
    model = CachingScriptedModel(script, keep=0)
    history: list[Item] = []
    cached = total = 0
    for n in range(turns):
        system = f"{INSTRUCTIONS}\nGit branch: {branch_at(n)}"
        user = Item(id=f"u{n}", role="user", text=f"question {n}" + (" look" if n % 3 == 0 else ""))
        ctx = Item(id=f"c{n}", role="user", text=f"[page context]\n/products/{n} selection={n * 7}", kind="context")
        outputs: list[Item] = []
        for step in range(3):
            request = ModelRequest(system, (lookup.spec,), [*history, ctx, user, *outputs], "naive", f"t{n}", step)
            reply = await model.complete(request)
            assert reply.usage is not None
            if n > 0:
                cached, total = cached + reply.usage.cached_tokens, total + reply.usage.input_tokens
            out = Item(id=f"a{n}{step}", role="assistant", text=reply.text, tool_calls=tuple(reply.tool_calls))
            outputs.append(out)
            if not reply.tool_calls:
                break
            outputs.append(Item(id=f"r{n}", role="tool", text=lookup("lamp"), kind="tool_result"))
        history += [user, *outputs]
    return cached / total


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=600, help="turns of the compaction session")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-ctx-") as tmp:
        proc, port = start_valkey(Path(tmp), Deadline(60))
        url = f"redis://127.0.0.1:{port}"
        try:
            keel = await keel_session(url, 50, features=True)
            naive = await naive_ratio(50)
            print("50-turn session, page context every turn, branch changes every 10 turns, tool every 3rd:")
            print(
                f"  keel:     {keel['cached']:.1%} of input tokens after the first turn cached; "
                f"{keel['prefixes']} distinct tools+system prefix(es)"
            )
            print(f"  baseline (branch in the system prompt, seed 003): {naive:.1%} cached")
            window = 6_000
            long = await keel_session(url, args.long, features=True, window=window)
            bare = await keel_session(url, args.long, features=False)
            print(f"{args.long}-turn session, context_window {window:,}, compaction keep_turns=4:")
            print(
                f"  compactions {long['compactions']}, largest prompt {long['max_prompt']:,} tokens "
                f"(without compaction: {bare['max_prompt']:,}), cached {long['cached']:.1%}"
            )
            print(
                f"  turn p50 first/last 100: {long['p50_first']:.2f} / {long['p50_last']:.2f} ms "
                f"(ratio {long['p50_last'] / long['p50_first']:.2f}); without compaction "
                f"{bare['p50_first']:.2f} / {bare['p50_last']:.2f} ms (the caching double's work grows with the prompt)"
            )
            print(f"  (estimate of the instructions alone: {estimate_tokens(INSTRUCTIONS)} tokens)")
        finally:
            stop_process(proc)


if __name__ == "__main__":
    asyncio.run(main())
