"""Where a sequential in-process turn's time goes, stage by stage, and inside its two scripts.

    python deploy/bench/turn_timeline.py [--turns 2000]

A diagnostic, as `lower_bound.py` is: not part of `make bench`. keel in-process, as
`bench_keel.py` runs it (`Sessions.submit_and_wait`, the zero-latency scripted model, a new
session every 300 turns), `--turns` timed turns after a warm-up, in three parts, each against a
fresh private Valkey (AOF everysec):

- unmarked: the turn's median, and Valkey's mean time an EVALSHA (`INFO commandstats`: keel's
  SUBMIT and COMMIT, and a CREATE every 300 turns), as the server times it.
- marked: each turn is marked, with `time.perf_counter_ns`, where it passes from one part of
  keel to the next: the store's submit and commit, each script on the wire (from the store's
  call to the wire, its arguments packed and written, until the reply is back in the calling
  task: whatever else the process runs meanwhile is inside), the turn loop, the model call and
  the waiter. For each pair of marks that follow each other in the turns' most common order,
  the median us between them; and turn by turn, medians of the whole turn, each script's round
  trip and the rest (keel's Python outside its trips). The waiter resumes while COMMIT is on
  the wire: that stage is inside its round trip. Then the floor's turn (`lower_bound.py`'s:
  LRANGE, then one script, on redis-py) on the same Valkey, timed the same way: its two round
  trips, each with redis-py's own work on the command and its reply, and its Python between.
- scripts: SUBMIT and COMMIT with every `redis.call` timed in Lua (`os.clock`: the server's CPU
  time): Valkey's time an EVALSHA timed (against the unmarked part's: what the timing costs),
  and each script's mean time from its first line to its reply, the part of it in
  `redis.call` (the command and its conversions to and from Lua, and some of the timing) with
  how many calls, and the rest (Lua's own work: its prelude, arguments, helpers, logic and
  reply, and the rest of the timing); and the part in `redis.call` by command (its time and
  its calls a script: which commands a storage redesign would save most by).

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
from lower_bound import FLOOR, FLOOR_SHA, SESSION_TURNS  # the sibling module: the floor's script  # noqa: E402
from support import Deadline, positive, start_valkey, stop_process  # the sibling module  # noqa: E402

from app import build_harness, heap  # noqa: E402
from app.settings import Settings  # noqa: E402
from harness import Agent  # noqa: E402
from harness.loop.modelcall import ModelCall  # noqa: E402
from harness.loop.turn import Turn  # noqa: E402
from harness.models import ScriptedModel  # noqa: E402
from harness.service import sessions as service  # noqa: E402
from harness.store import protocol  # noqa: E402
from harness.store.sessions import Store  # noqa: E402
from harness.store.wire import Wire  # noqa: E402

WARM_UP = 200

_marks: list[tuple[str, int]] = []


def _mark(name: str) -> None:
    _marks.append((name, time.perf_counter_ns()))


def _marked(owner: Any, attr: str, label: Callable[[tuple[Any, ...]], str]) -> None:
    """Mark entering and leaving the coroutine function `owner.attr` ("<label>" and "<label>
    done"; `label` names the call from its arguments)."""
    inner = getattr(owner, attr)

    @functools.wraps(inner)
    async def marked(*args: Any, **kwargs: Any) -> Any:
        name = label(args)
        _mark(name)
        try:
            return await inner(*args, **kwargs)
        finally:
            _mark(f"{name} done")

    setattr(owner, attr, marked)


def _script_name(args: tuple[Any, ...]) -> str:
    """`Wire.script_with(self, sha, ...)`'s script, by its SHA1."""
    names = {protocol.SUBMIT.sha: "SUBMIT", protocol.COMMIT.sha: "COMMIT"}
    return f"{names.get(args[1], 'another script')} on the wire"


def instrument_stages() -> None:
    _marked(Store, "submit", lambda _: "store.submit")
    _marked(Store, "commit", lambda _: "store.commit")
    _marked(Wire, "script_with", _script_name)
    _marked(Turn, "run", lambda _: "turn loop")
    _marked(ModelCall, "reply", lambda _: "model call")
    _marked(service, "collect_turn", lambda _: "waiter")  # (the name the service calls)


# Every redis.call timed (os.clock: the server's CPU seconds), and counted, in all and by command:
# a local `redis` that shadows the global one for the whole script (its helpers are local
# functions of the same chunk).
_TIMED = """local __redis, __clock = redis, os.clock
local __call = __redis.call
local __began, __in_calls, __calls, __by = __clock(), 0, 0, {}
local redis = setmetatable({call = function(name, ...)
  local t = __clock()
  local r = __call(name, ...)
  local dt = __clock() - t
  __in_calls, __calls = __in_calls + dt, __calls + 1
  local c = __by[name]
  if c then c[1], c[2] = c[1] + dt, c[2] + 1 else __by[name] = {dt, 1} end
  return r
end}, {__index = __redis})
"""
_REPLY = "local function reply(t)\n  mflush()\n  return cmsgpack.pack(t)\nend"


def _reply_timed(name: str) -> str:
    """The scripts' `reply` helper, which also pushes the script's figures onto `timeline:<name>`
    (a key of its own: not a session's, so unseen by keel)."""
    figures = "string.format('%.1f %.1f %d', (__clock() - __began) * 1e6, __in_calls * 1e6, __calls)"
    by_command = "for c, v in pairs(__by) do f[#f + 1] = string.format('%s:%.2f:%d', c, v[1] * 1e6, v[2]) end"
    return (
        "local function reply(t)\n  mflush()\n  local packed = cmsgpack.pack(t)\n"
        f"  local f = {{{figures}}}\n  {by_command}\n"
        f"  __call('RPUSH', 'timeline:{name}', table.concat(f, ' '))\n  return packed\nend"
    )


def instrument_scripts() -> None:
    """SUBMIT's and COMMIT's sources with their calls timed."""
    for name in ("SUBMIT", "COMMIT"):
        script = getattr(protocol, name)
        if _REPLY not in script.source:
            raise SystemExit("the scripts' reply helper changed: update turn_timeline.py")
        script.source = _TIMED + script.source.replace(_REPLY, _reply_timed(name), 1)
        script.sha = hashlib.sha1(script.source.encode()).hexdigest()


async def turns(port: int, n: int) -> tuple[list[list[tuple[str, int]]], float]:
    """Marks of `n` sequential turns (after the warm-up), and Valkey's mean us an EVALSHA over
    them (`INFO commandstats`: SUBMIT's and COMMIT's, and a CREATE every 300 turns)."""
    agent = Agent(instructions="t", tools=[add], model=ScriptedModel(plain, keep=0))
    harness = build_harness(Settings(), f"redis://127.0.0.1:{port}", agent)
    stats = Redis(port=port)
    marked: list[list[tuple[str, int]]] = []
    sid = ""
    try:
        await harness.start()
        heap.settle(heap.THRESHOLD)
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


def _between(turn: list[tuple[str, int]], first: str, last: str) -> float:
    at = dict(turn)  # (each mark once a turn: see `stages`)
    return (at[last] - at[first]) / 1000


def stages(marked: list[list[tuple[str, int]]]) -> dict[str, Any]:
    """Median us between consecutive marks, in the turns' most common order; and, turn by turn,
    each script's round trip and the rest of the turn (keel's Python outside its trips), medians."""
    orders = [tuple(name for name, _ in turn) for turn in marked]
    order, count = Counter(orders).most_common(1)[0]
    if len(set(order)) != len(order):
        raise SystemExit(f"a mark came twice in a turn: {order}")
    same = [turn for turn, o in zip(marked, orders, strict=True) if o == order]
    steps = []
    for j in range(1, len(order)):
        us = statistics.median(turn[j][1] - turn[j - 1][1] for turn in same) / 1000
        steps.append({"from": order[j - 1], "to": order[j], "us": round(us, 1)})
    spans: dict[str, list[float]] = {"turn": [], "SUBMIT's trip": [], "COMMIT's trip": [], "outside the trips": []}
    for turn in same:
        total = _between(turn, "caller", "caller done")
        trips = [_between(turn, f"{s} on the wire", f"{s} on the wire done") for s in ("SUBMIT", "COMMIT")]
        for name, value in zip(spans, (total, *trips, total - sum(trips)), strict=True):
            spans[name].append(value)
    medians = {name: round(statistics.median(values), 1) for name, values in spans.items()}
    return {"turns": len(marked), "in_order": count, "steps": steps, "spans": medians}


async def floor(port: int, n: int) -> dict[str, float]:
    """The floor's sequential turn as `lower_bound.py` makes it, timed the same way: its two round
    trips (each with redis-py's own work on the command and its reply) and its Python between
    them, median us."""
    redis = Redis(port=port)
    parts: list[tuple[int, int, int]] = []
    try:
        await redis.script_load(FLOOR)
        for i in range(WARM_UP + n):
            hist, events = f"floor:{i // SESSION_TURNS}:hist", f"floor:{i // SESSION_TURNS}:events"
            t0 = time.perf_counter_ns()
            raw = await redis.lrange(hist, -20, -1)
            t1 = time.perf_counter_ns()
            history = [json.loads(x) for x in raw]
            user = json.dumps({"role": "user", "content": "hello"})
            reply = json.dumps({"role": "assistant", "content": f"hi ({len(history)} items seen)"})
            t2 = time.perf_counter_ns()
            await redis.evalsha(FLOOR_SHA, 2, hist, events, user, reply, i)
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
    """The timed scripts' figures, means over the timed turns."""
    redis = Redis(port=port)
    try:
        out = {}
        for name in ("SUBMIT", "COMMIT"):
            listed = await redis.lrange(f"timeline:{name}", 0, -1)
            raws = [(raw.decode() if isinstance(raw, bytes) else raw).split() for raw in listed]
            rows = [tuple(float(x) for x in raw[:3]) for raw in raws]
            total, in_calls, calls = (statistics.mean(r[k] for r in rows) for k in range(3))
            by: dict[str, list[float]] = {}  # command -> [us, calls], summed over the scripts
            for raw in raws:
                for part in raw[3:]:
                    command, us, n = part.rsplit(":", 2)
                    sums = by.setdefault(command.upper(), [0.0, 0.0])
                    sums[0] += float(us)
                    sums[1] += int(n)
            out[name] = {
                "scripts": len(rows),
                "in_script_us": round(total, 1),
                "redis_call_us": round(in_calls, 1),
                "calls": round(calls, 1),
                "rest_of_lua_us": round(total - in_calls, 1),
                "by_command": {
                    command: {"us": round(us / len(rows), 2), "calls": round(n / len(rows), 2)}
                    for command, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])
                },
            }
        return out
    finally:
        await redis.aclose()


def _on_valkey(tmp: Path, part: str, run: Callable[[int], Any]) -> Any:
    """`run(port)` against a fresh private Valkey of its own."""
    (tmp / part).mkdir()
    valkey, port = start_valkey(tmp / part, Deadline(600))
    try:
        return run(port)
    finally:
        stop_process(valkey)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=positive, default=2000, help="timed turns a part (default 2000)")
    args = parser.parse_args()
    n = args.turns
    with tempfile.TemporaryDirectory() as tmp:
        plain_turns, evalsha = _on_valkey(Path(tmp), "unmarked", lambda port: asyncio.run(turns(port, n)))
        unmarked = statistics.median(_between(turn, "caller", "caller done") for turn in plain_turns)
        instrument_stages()

        def marked_then_floor(port: int) -> tuple[dict[str, Any], dict[str, float]]:
            marked, _ = asyncio.run(turns(port, n))
            return stages(marked), asyncio.run(floor(port, n))

        found, bare = _on_valkey(Path(tmp), "marked", marked_then_floor)
        instrument_scripts()

        def timed(port: int) -> tuple[float, dict[str, Any]]:
            _, timed_evalsha = asyncio.run(turns(port, n))
            return timed_evalsha, asyncio.run(script_split(port))

        timed_evalsha, split = _on_valkey(Path(tmp), "scripts", timed)
    spans = found["spans"]
    print(f"unmarked: the turn {unmarked:.1f} us (median), Valkey's time an EVALSHA {evalsha:.1f} us (mean)")
    print(f"marked: median us between marks, {found['in_order']} of {found['turns']} turns in this order")
    for step in found["steps"]:
        print(f"  {step['from']:>26} -> {step['to']:<26} {step['us']:7.1f}")
    print("  turn by turn, medians: " + ", ".join(f"{name} {us:.1f}" for name, us in spans.items()))
    print(
        f"the floor, same Valkey: LRANGE's trip {bare['lrange_trip_us']:.1f}, its Python {bare['python_us']:.1f}, "
        f"its script's trip {bare['script_trip_us']:.1f}; the turn {bare['total_us']:.1f}"
    )
    print(f"scripts timed: Valkey's time an EVALSHA {timed_evalsha:.1f} us (mean); a script's means, Lua's clock:")
    for name, row in split.items():
        print(
            f"  {name:7} in the script {row['in_script_us']:6.1f}, in {row['calls']:4.1f} redis.call "
            f"{row['redis_call_us']:6.1f}, the rest of the Lua {row['rest_of_lua_us']:6.1f}"
        )
        print(
            "    by command, us (calls) a script: "
            + ", ".join(f"{c} {v['us']:.1f} ({v['calls']:.3g})" for c, v in row["by_command"].items())
        )
    result = {
        "turns": n,
        "unmarked": {"turn_us": round(unmarked, 1), "evalsha_us": round(evalsha, 1)},
        "marked": found,
        "floor": bare,
        "scripts": {"evalsha_us": round(timed_evalsha, 1), **split},
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
