"""keel's harness in-process on the peers' turn workload (../shared/bench/peers/common.py).

    python3 ../shared/bench/peers/run.py --with deploy/bench/bench_keel.py --python .venv/bin/python
    KEEL_BENCH_VARIANT=tool ...   (or: .venv/bin/python deploy/bench/bench_keel.py --variant tool --port P)

One turn is what a channel does for `POST .../messages?wait=true`, without HTTP: the message is
recorded with its event and the job queued, the turn begun (lease, fencing token, turn.started)
in the same script, the zero-latency model answers, its usage and the reply with its events are
committed in one round trip, and the waiter gets the committed events (as it would read them
from the outbox; it reads the stream when anything came from elsewhere). Two round trips on the
turn's path; the job coming back off the stream and its batched acknowledgement are off it.
Variants: plain; tool (one tool call per turn); long (a 1,000-turn session: compare the first
and last 100 turns' p50). `make bench` runs it, and the floor, through `settled.py` (the
garbage collector set as keel's processes set theirs); run.py runs it with Python's settings.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # keel's packages, when run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the benchmarks' agents beside it)

import common  # type: ignore[import-not-found]  # the peers' harness (run.py puts its folder on PYTHONPATH)
from agents import add, plain, with_tool  # the sibling module

from app import build_harness
from app.settings import Settings
from harness import Agent
from harness.models import ScriptedModel


async def setup(args: Any) -> Any:
    variant = os.environ.get("KEEL_BENCH_VARIANT") or args.variant
    if variant == "long":
        common.SEQ_TURNS = 1_000
    ctx = types.SimpleNamespace()
    fn = with_tool if variant == "tool" else plain
    agent = Agent(instructions="You are a test agent.", tools=[add], model=ScriptedModel(fn, keep=0))
    ctx.harness = build_harness(Settings(), f"redis://127.0.0.1:{args.port}", agent)
    ctx.redis = ctx.harness.redis
    await ctx.redis.flushall()
    await ctx.harness.start()
    return ctx


async def make_session(ctx: Any, sid: str) -> str:
    session: str = await ctx.harness.sessions.create("bench")
    return session


async def turn(ctx: Any, s: str, i: int) -> None:
    res = await ctx.harness.sessions.submit_and_wait(s, "bench", "hello", context=None, message_id=None, timeout=30)
    assert res.status == "completed" and res.reply == "hi there", res


async def verify(ctx: Any, s: str, sessions: list[str]) -> dict[str, Any]:
    redis: Redis = ctx.redis
    return {
        "check_seq_items": len(await ctx.harness.sessions.history(s, "bench")),
        "check_conc_items": len(await ctx.harness.sessions.history(sessions[0], "bench")),
        "check_jobs_left": await redis.xlen("keel:{jobs}:stream"),
    }


async def teardown(ctx: Any) -> None:
    await ctx.harness.stop()


if __name__ == "__main__":
    variant = os.environ.get("KEEL_BENCH_VARIANT")
    names = {
        "plain": ("keel (in-process: submit+begin, usage+commit, events)", "Valkey 9 AOF everysec"),
        "tool": ("keel + 1 function tool/turn", "Valkey 9 AOF everysec"),
        "long": ("keel, 1,000-turn session", "Valkey 9 AOF everysec"),
    }
    if variant:  # run.py passes no --variant to an extra module: take it from the environment
        names = {variant: names[variant], **names}
    common.main(sys.modules[__name__], names)
