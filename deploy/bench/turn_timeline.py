"""Where a sequential in-process turn's time goes, stage by stage, and inside its two scripts.

    python deploy/bench/turn_timeline.py [--turns 2000]

A diagnostic, as `lower_bound.py` is: not part of `make bench`. keel in-process, as
`bench_keel.py` runs it (`Sessions.submit_and_wait`, the zero-latency scripted model, a new
session every 300 turns), against a private Valkey (AOF everysec). Three parts, in one run:

- stages: each turn is marked where it passes from one part of keel to the next (the store's
  SUBMIT and COMMIT, each script's round trip on the wire, the turn loop, the model call, the
  waiter), with `time.perf_counter_ns` (the marks and the wrappers that make them cost less
  than the spread between runs, against unmarked turns). For each pair of marks that follow
  each other in the turns' most common order: the median microseconds between them. The
  waiter resumes while COMMIT is on the wire: its stage overlaps that round trip and is not on
  the turn's path. With them, Valkey's own time an EVALSHA (`INFO commandstats`, unmarked).
- the floor (`lower_bound.py`'s: LRANGE, then one script, on redis-py) on the same Valkey, timed
  the same way: its two round trips and its Python between them.
- scripts: as many turns again, on a fresh Valkey, with every `redis.call` of SUBMIT and
  COMMIT timed in Lua (`os.clock`: the server's CPU time): each script's mean time from its
  first line to its reply, the part of it spent in `redis.call` (the command and its
  conversions to and from Lua, the timing around each call included) and how many calls, the
  rest being Lua's own work (its prelude, arguments, helpers, logic and reply).

Prints the three and one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents import add, plain  # the sibling module  # noqa: E402
from lower_bound import FLOOR, SESSION_TURNS  # the sibling module: the floor's script  # noqa: E402
from support import Deadline, start_valkey, stop_process  # the sibling module  # noqa: E402

from app import build_harness, heap  # noqa: E402
from app.settings import Settings  # noqa: E402
from harness import Agent  # noqa: E402
from harness.loop.modelcall import ModelCall  # noqa: E402
from harness.loop.turn import Turn  # noqa: E402
from harness.models import ScriptedModel  # noqa: E402
from harness.service import sessions as service  # noqa: E402
from harness.service import waiting  # noqa: E402
from harness.store import protocol  # noqa: E402
from harness.store.sessions import Store  # noqa: E402
from harness.store.wire import Wire  # noqa: E402

WARM_UP = 200

_marks: list[tuple[str, int]] = []
_phase: list[str] = []  # the store call in progress: its script's round trip is named after it


def _mark(name: str) -> None:
    _marks.append((name, time.perf_counter_ns()))


def _marked(cls: Any, attr: str, label: str | Callable[[], str], *, phase: str = "") -> None:
    """Mark entering and leaving the coroutine method `cls.attr` ("<label>" and "<label> done");
    with `phase`, the script it sends meanwhile is named so."""
    inner = getattr(cls, attr)

    @functools.wraps(inner)
    async def marked(*args: Any, **kwargs: Any) -> Any:
        name = label if isinstance(label, str) else label()
        if phase:
            _phase.append(phase)
        _mark(name)
        try:
            return await inner(*args, **kwargs)
        finally:
            if phase:
                _phase.pop()
            _mark(f"{name} done")

    setattr(cls, attr, marked)


def instrument_stages() -> None:
    _marked(Store, "submit", "store.submit", phase="SUBMIT")
    _marked(Store, "commit", "store.commit", phase="COMMIT")
    _marked(Wire, "script_with", lambda: f"{_phase[-1] if _phase else 'a script'} on the wire")
    _marked(Turn, "run", "turn loop")
    _marked(ModelCall, "reply", "model call")
    collect = waiting.collect_turn

    async def waiter(*args: Any, **kwargs: Any) -> Any:
        _mark("waiter")
        try:
            return await collect(*args, **kwargs)
        finally:
            _mark("waiter done")

    setattr(service, "collect_turn", waiter)  # noqa: B010 (the name the service calls, replaced: mypy refuses it)


# Every redis.call timed (os.clock: the server's CPU seconds), and counted: a local `redis` that
# shadows the global one for the whole script (its helpers are local functions of the same chunk).
_TIMED = """local __redis, __clock = redis, os.clock
local __call = __redis.call
local __began, __in_calls, __calls = __clock(), 0, 0
local redis = setmetatable({call = function(...)
  local t = __clock()
  local r = __call(...)
  __in_calls, __calls = __in_calls + (__clock() - t), __calls + 1
  return r
end}, {__index = __redis})
"""
_REPLY = "local function reply(t)\n  mflush()\n  return cmsgpack.pack(t)\nend"
_REPLY_TIMED = (
    "local function reply(t)\n  mflush()\n  local packed = cmsgpack.pack(t)\n"
    "  __call('RPUSH', 'timeline:{0}', string.format('%.1f %.1f %d', (__clock() - __began) * 1e6, __in_calls * 1e6,"
    " __calls))\n  return packed\nend"
)


def instrument_scripts() -> None:
    """SUBMIT's and COMMIT's sources with their calls timed; each reply pushes its figures onto
    `timeline:<NAME>` (a key of its own: not a session's, so unseen by keel)."""
    for name in ("SUBMIT", "COMMIT"):
        script = getattr(protocol, name)
        assert _REPLY in script.source, "the scripts' reply helper changed: update turn_timeline.py"
        script.source = _TIMED + script.source.replace(_REPLY, _REPLY_TIMED.replace("{0}", name), 1)
        script.sha = hashlib.sha1(script.source.encode()).hexdigest()


async def turns(port: int, n: int) -> tuple[list[list[tuple[str, int]]], float]:
    """Marks of `n` sequential turns (after the warm-up), and Valkey's mean us an EVALSHA
    (`INFO commandstats`: SUBMIT's and COMMIT's, as the server times them)."""
    stats = Redis(port=port)
    harness = build_harness(
        Settings(),
        f"redis://127.0.0.1:{port}",
        Agent(instructions="t", tools=[add], model=ScriptedModel(plain, keep=0)),
    )
    await harness.start()
    heap.settle(heap.THRESHOLD)
    marked: list[list[tuple[str, int]]] = []
    sid = ""
    try:
        for i in range(WARM_UP + n):
            if i % SESSION_TURNS == 0:
                sid = await harness.sessions.create("bench")
            _marks.clear()
            _mark("caller")
            res = await harness.sessions.submit_and_wait(
                sid, "bench", "hello", context=None, message_id=None, timeout=30
            )
            _mark("caller done")
            assert res.status == "completed", res
            if i >= WARM_UP:
                marked.append(list(_marks))
            elif i == WARM_UP - 1:
                await stats.config_resetstat()
                await stats.delete("timeline:SUBMIT", "timeline:COMMIT")  # (the timed scripts' figures, if timed)
        evalsha = float((await stats.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"])
    finally:
        await harness.stop()
        await stats.aclose()
    return marked, evalsha


def stages(marked: list[list[tuple[str, int]]]) -> dict[str, Any]:
    """Median microseconds between consecutive marks, in the turns' most common order."""
    orders = Counter(tuple(name for name, _ in turn) for turn in marked)
    order, count = orders.most_common(1)[0]
    same = [turn for turn in marked if tuple(name for name, _ in turn) == order]
    steps = []
    for j in range(1, len(order)):
        us = statistics.median(turn[j][1] - turn[j - 1][1] for turn in same) / 1000
        steps.append({"from": order[j - 1], "to": order[j], "us": round(us, 1)})
    total = statistics.median(turn[-1][1] - turn[0][1] for turn in same) / 1000
    return {"turns": len(marked), "in_order": count, "total_us": round(total, 1), "steps": steps}


async def floor(port: int, n: int) -> dict[str, float]:
    """The floor's sequential turn, timed the same way: its two round trips (each with redis-py's
    own work on the command and its reply) and its Python between them, median us."""
    redis = Redis(port=port)
    script = redis.register_script(FLOOR)
    parts: list[tuple[int, int, int]] = []
    try:
        for i in range(WARM_UP + n):
            hist, events = f"floor:{i // SESSION_TURNS}:hist", f"floor:{i // SESSION_TURNS}:events"
            t0 = time.perf_counter_ns()
            raw = await redis.lrange(hist, -20, -1)
            t1 = time.perf_counter_ns()
            history = [json.loads(x) for x in raw]
            user, reply = {"role": "user", "content": "hello"}, {"role": "assistant", "content": f"hi ({len(history)})"}
            args: list[str | int] = [json.dumps(user), json.dumps(reply), i]
            t2 = time.perf_counter_ns()
            await script(keys=[hist, events], args=args)
            t3 = time.perf_counter_ns()
            if i >= WARM_UP:
                parts.append((t1 - t0, t2 - t1, t3 - t2))
    finally:
        await redis.aclose()
    lrange, between, evalsha = (statistics.median(p[k] for p in parts) / 1000 for k in range(3))
    total = statistics.median(sum(p) for p in parts) / 1000
    return {
        "lrange_trip_us": round(lrange, 1),
        "python_us": round(between, 1),
        "script_trip_us": round(evalsha, 1),
        "total_us": round(total, 1),
    }


async def script_split(port: int) -> dict[str, Any]:
    redis = Redis(port=port)
    try:
        out = {}
        for name in ("SUBMIT", "COMMIT"):
            rows = [tuple(float(x) for x in raw.split()) for raw in await redis.lrange(f"timeline:{name}", 0, -1)]
            total, in_calls, calls = (statistics.mean(r[k] for r in rows) for k in range(3))
            out[name] = {
                "scripts": len(rows),
                "in_script_us": round(total, 1),
                "redis_call_us": round(in_calls, 1),
                "calls": round(calls, 1),
                "rest_of_lua_us": round(total - in_calls, 1),
            }
        return out
    finally:
        await redis.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=2000, help="timed turns (default 2000)")
    args = parser.parse_args()
    instrument_stages()
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("stages", "scripts"):
            (Path(tmp) / part).mkdir()
        valkey, port = start_valkey(Path(tmp) / "stages", Deadline(600))
        try:
            marked, evalsha = asyncio.run(turns(port, args.turns))
            found = stages(marked) | {"evalsha_us": round(evalsha, 1)}
            bare = asyncio.run(floor(port, args.turns))
        finally:
            stop_process(valkey)
        instrument_scripts()
        valkey, port = start_valkey(Path(tmp) / "scripts", Deadline(600))
        try:
            asyncio.run(turns(port, args.turns))
            split = asyncio.run(script_split(port))
        finally:
            stop_process(valkey)
    print(f"stages: median us between marks, {found['in_order']} of {found['turns']} turns in this order")
    for step in found["steps"]:
        print(f"  {step['from']:>26} -> {step['to']:<26} {step['us']:7.1f}")
    print(f"  {'the turn':>26}    {'':<26} {found['total_us']:7.1f}")
    print(f"  (Valkey's time an EVALSHA, SUBMIT's and COMMIT's, unmarked: {found['evalsha_us']:.1f} us)")
    print(
        f"the floor, same Valkey: LRANGE's trip {bare['lrange_trip_us']:.1f}, its Python {bare['python_us']:.1f}, "
        f"its script's trip {bare['script_trip_us']:.1f}; the turn {bare['total_us']:.1f}"
    )
    print("scripts: mean us a script, Lua's own CPU clock")
    for name, row in split.items():
        print(
            f"  {name:7} in the script {row['in_script_us']:6.1f}, in {row['calls']:4.1f} redis.call "
            f"{row['redis_call_us']:6.1f}, the rest of the Lua {row['rest_of_lua_us']:6.1f}"
        )
    print("RESULT " + json.dumps({"turns": args.turns, "stages": found, "floor": bare, "scripts": split}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
