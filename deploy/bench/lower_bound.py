"""How near the floor a durable turn can get: the least keel must write, timed against the floor
and against keel, in one run.

    python deploy/bench/lower_bound.py [--turns 1500] [--rounds 6]

Six ways to make a sequential plain turn, in one process, against one private Valkey (AOF
everysec, as the peers' benchmarks), in alternating blocks of `--turns` turns:

- floor: the peers' bare limit (`floor/bench_bare.py`): LRANGE, then one Lua script (RPUSH of
  two items, one XADD), on redis-py;
- least, redis-py: what a durable turn cannot do without, in the same two round trips: the
  message recorded once (its id remembered), queued in the inbox, the session leased with a
  fencing token, its message.received and turn.started written, the recent history read (one
  script, with the job on the job stream in the same write); then the fence checked, the user and
  assistant items appended, usage.recorded, message.completed and turn.completed written, the
  inbox and lease given back, the meta updated (one script). Python does no more than build those
  strings;
- least, keel's wire: the same scripts through keel's own connection (`harness.store.wire`);
- keel's store alone: keel's own store layer and scripts, driven directly as a runner would
  for a plain reply (`Store.submit` beginning the turn, `Store.commit` ending it with the reply,
  its usage and events): what keel's storage costs without its service, runner, turn loop,
  model call, event hub and waiter (a harness of its own, not started, whose jobs go to job
  streams nobody reads);
- keel's store + turn loop: the same, with the turn loop (`Turn.run`: the prompt, the model
  call with its attempts, metrics and tracing hooks, the commit) in place of the hand-made
  commit: what the runner, the service and the waiter add is the rest;
- keel: `Sessions.submit_and_wait` with the zero-latency scripted model (as bench_keel.py).

Each way starts a new session every 300 turns, as the peers' sequential run does (keel's prompt
is the whole active history, which grows until compaction; the floor reads the last 20 items).

For each: the median of each block's sequential p50, its ratio to the floor's p50 in the same
round, Valkey's time a turn in the scripts (`INFO commandstats`, EVALSHA) and all of its
CPU a turn (`INFO cpu`), and the benchmark process's own CPU a turn, user and system
(`getrusage`: the ways' Python and its system calls; the split between the two is sampled at
the kernel's tick, their sum is not), with the times it slept a turn (voluntary context
switches). keel's distance from the least durable turn on its own wire splits into Valkey's
share (the scripts' extra time) and keel's Python (the rest).

`--busy-poll-us N` (a diagnostic, not a setting of keel): the benchmark process's event loop
polls its sockets without blocking for up to N us before it sleeps, so that neither way pays
this machine's wake-up from idle after each round trip (a virtual machine's sleeping core is
slow to wake): what the ratios are when only the work each way does counts.

One RESULT line (JSON) at the end: {"rounds", "turns", "busy_poll_us", "ways": {name: {...}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import resource
import selectors
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents import add, plain  # the sibling module  # noqa: E402
from support import Deadline, start_valkey, stop_process  # the sibling module  # noqa: E402

from app import build_harness  # noqa: E402
from app.settings import Settings  # noqa: E402
from harness import Agent  # noqa: E402
from harness.events import MessageCompletedData, TurnCompletedData, pending  # noqa: E402
from harness.ids import new_id  # noqa: E402
from harness.loop.outcomes import Final  # noqa: E402
from harness.loop.prompt import user_item  # noqa: E402
from harness.loop.turn import Turn  # noqa: E402
from harness.models import ScriptedModel  # noqa: E402
from harness.store.types import Begun, UsageRecord  # noqa: E402
from harness.store.wire import Wire  # noqa: E402
from harness.types import InboxMessage, Item, Usage  # noqa: E402

FLOOR = """
redis.call('RPUSH', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XADD', KEYS[2], '*', 'type', 'turn', 'n', ARGV[3])
"""

# KEYS: meta, mids, inbox, outbox, lease, history. ARGV: message id, turn id, inbox entry,
# message.received's body, turn.started's body.
SUBMIT = """
local m = redis.call('HMGET', KEYS[1], 'owner', 'seq', 'fence', 'status')
if not m[1] then return 'missing' end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 'dup' end
local seq = tonumber(m[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 10000, '*', 's', seq + 1, 't', 'message.received', 'b', ARGV[4])
redis.call('RPUSH', KEYS[3], ARGV[3])
local fence = tonumber(m[3]) + 1
redis.call('SET', KEYS[5], fence, 'PX', 5000)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 10000, '*', 's', seq + 2, 't', 'turn.started', 'b', ARGV[5])
local items = redis.call('LRANGE', KEYS[6], -20, -1)
redis.call('HSET', KEYS[1], 'seq', seq + 2, 'fence', fence, 'status', 'running', 'turn', ARGV[2])
table.insert(items, 1, tostring(fence))
return items
"""

# ARGV: fence, turn id, the user and assistant items, the bodies of usage.recorded,
# message.completed and turn.completed.
COMMIT = """
local m = redis.call('HMGET', KEYS[1], 'seq', 'turn', 'u_in', 'u_out')
if redis.call('GET', KEYS[5]) ~= ARGV[1] or m[2] ~= ARGV[2] then return 'stale' end
local seq = tonumber(m[1])
redis.call('RPUSH', KEYS[6], ARGV[3], ARGV[4])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 10000, '*', 's', seq + 1, 't', 'usage.recorded', 'b', ARGV[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 10000, '*', 's', seq + 2, 't', 'message.completed', 'b', ARGV[6])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', 10000, '*', 's', seq + 3, 't', 'turn.completed', 'b', ARGV[7])
redis.call('LPOP', KEYS[3])
redis.call('DEL', KEYS[5])
redis.call('HSET', KEYS[1], 'seq', seq + 3, 'status', 'idle', 'turn', '',
  'u_in', tonumber(m[3] or 0) + 600, 'u_out', tonumber(m[4] or 0) + 6)
return 'ok'
"""

SESSION_TURNS = 300  # turns a session (the peers' sequential run: 300 turns on one session)


def new_session(i: int, made: list[Any]) -> bool:
    """Whether turn `i` begins a new session (none made yet, or the last had its turns)."""
    return i % SESSION_TURNS == 0 or not made


Way = Callable[[int], Awaitable[None]]  # one turn (the `int`: its number in the run)
Call = Callable[[str, str, list[str], list[Any], bool], Awaitable[Any]]  # sha, source, keys, args, with the job


class Least:
    """The least durable turn, on either client (`call`)."""

    def __init__(self, call: Call, redis: Redis, tag: str) -> None:
        self.call = call
        self.redis = redis
        self.tag = tag
        self.keys: list[str] = []

    async def turn(self, i: int) -> None:
        if new_session(i, self.keys):
            tag = f"{self.tag}{i // SESSION_TURNS}"
            self.keys = [f"least:{{{tag}}}:{name}" for name in ("meta", "mids", "inbox", "outbox", "lease", "history")]
            await self.redis.hset(self.keys[0], mapping={"owner": "bench", "seq": 0, "fence": 0, "status": "idle"})
        mid, tid, at = f"msg_{self.tag}_{i:020d}", f"turn_{self.tag}_{i:020d}", f"{time.time():.6f}"
        head = f'"turn_id":"{tid}","at":{at},"data":'
        entry = json.dumps({"message_id": mid, "turn_id": tid, "text": "hello"})
        received = head + json.dumps({"message_id": mid, "text": "hello"}) + "}"
        started = head + json.dumps({"message_id": mid}) + "}"
        got = await self.call(SUBMIT_SHA, SUBMIT, self.keys, [mid, tid, entry, received, started], True)
        fence, items = got[0], [json.loads(x) for x in got[1:]]
        user = json.dumps({"id": f"it_{tid}_u", "role": "user", "text": "hello", "turn_id": tid})
        reply = json.dumps({"id": f"it_{tid}_a", "role": "assistant", "text": f"hi ({len(items)})", "turn_id": tid})
        usage = head + json.dumps({"input_tokens": 600, "output_tokens": 6}) + "}"
        done = head + json.dumps({"text": "hi there"}) + "}"
        ended = head + json.dumps({"status": "completed"}) + "}"
        answer = await self.call(COMMIT_SHA, COMMIT, self.keys, [fence, tid, user, reply, usage, done, ended], False)
        assert answer in (b"ok", "ok"), answer


def sha(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


FLOOR_SHA, SUBMIT_SHA, COMMIT_SHA = sha(FLOOR), sha(SUBMIT), sha(COMMIT)  # (once: not in the timed turns)


JOB = ("XADD", "least:{jobs}:stream", "MAXLEN", "~", "1000", "*", "s", "x")


class Keel:
    """keel's three ways: whole (a started harness), and its store alone and its store with the
    turn loop, each driven as a runner drives them for a plain reply (a harness of their own, not
    started, whose jobs go to job streams nobody reads)."""

    def __init__(self, port: int) -> None:
        self.agent = Agent(instructions="You are a test agent.", tools=[add], model=ScriptedModel(plain, keep=0))
        self.harness = build_harness(Settings(), f"redis://127.0.0.1:{port}", self.agent)
        # (two job streams: not the one the started harness's runner reads)
        self.alone = build_harness(Settings(job_shards=2), f"redis://127.0.0.1:{port}", self.agent)
        self.sids: list[str] = []
        self.alone_sids: list[str] = []

    @classmethod
    async def started(cls, port: int) -> Keel:
        keel = cls(port)
        await keel.harness.start()
        return keel

    async def stop(self) -> None:
        await self.harness.stop()
        await self.alone.stop()

    async def whole(self, i: int) -> None:
        if new_session(i, self.sids):
            self.sids.append(await self.harness.sessions.create("bench"))
        res = await self.harness.sessions.submit_and_wait(
            self.sids[-1], "bench", "hello", context=None, message_id=None, timeout=30
        )
        assert res.status == "completed", res

    async def _begin(self, i: int) -> tuple[str, InboxMessage, Begun]:
        """A message recorded and its turn begun, as a runner's reserved SUBMIT does."""
        if new_session(i, self.alone_sids):
            self.alone_sids.append(await self.alone.sessions.create("bench"))
        sid, message = self.alone_sids[-1], InboxMessage(message_id=new_id("msg"), turn_id=new_id("turn"), text="hello")
        began = (await self.alone.store.submit(sid, "bench", message, begin_lease_ms=30_000)).began
        assert began is not None
        return sid, message, began

    async def store_alone(self, i: int) -> None:
        sid, message, began = await self._begin(i)
        tid = message.turn_id
        reply = Item(id=new_id("it"), role="assistant", text="hi there", turn_id=tid)
        events = [
            pending(tid, MessageCompletedData(reply.id, reply.text)),
            pending(tid, TurnCompletedData(message.message_id, reply.text)),
        ]
        usage = UsageRecord(0, Usage(input_tokens=600, output_tokens=6), None)
        items = [user_item(message), reply]
        await self.alone.store.commit(sid, began.fence, tid, items, events, mode="final", usage=usage, guard=True)

    async def turn_loop(self, i: int) -> None:
        sid, _, began = await self._begin(i)
        runner = self.alone.runner
        assert runner is not None
        turn = Turn(
            self.alone.store, self.agent, sid, began, calls=runner.calls, stats=runner.stats, tools=runner.toolbox()
        )
        outcome = await turn.run()
        assert isinstance(outcome, Final), outcome


async def ways(redis: Redis, port: int) -> tuple[dict[str, Way], Callable[[], Awaitable[None]]]:
    """The six ways, ready to run, and what closes them."""
    for source in (FLOOR, SUBMIT, COMMIT):
        await redis.script_load(source)

    async def floor(i: int) -> None:
        hist, events = f"floor:{i // SESSION_TURNS}:hist", f"floor:{i // SESSION_TURNS}:events"
        history = [json.loads(x) for x in await redis.lrange(hist, -20, -1)]
        user = json.dumps({"role": "user", "content": "hello"})
        reply = json.dumps({"role": "assistant", "content": f"hi ({len(history)} items seen)"})
        await redis.evalsha(FLOOR_SHA, 2, hist, events, user, reply, i)

    async def on_redis_py(sha_: str, source: str, keys: list[str], args: list[Any], job: bool) -> Any:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.evalsha(sha_, len(keys), *keys, *args)
            if job:
                pipe.execute_command(*JOB)
            return (await pipe.execute())[0]

    wire = Wire(redis)

    async def on_wire(sha_: str, source: str, keys: list[str], args: list[Any], job: bool) -> Any:
        return (await wire.script_with(sha_, source, keys, args, [JOB] if job else []))[0]

    least_py, least_wire = Least(on_redis_py, redis, "py"), Least(on_wire, redis, "wire")

    keel = await Keel.started(port)

    async def close() -> None:
        await keel.stop()
        await wire.close()

    turns: dict[str, Way] = {
        "floor": floor,
        "least, redis-py": least_py.turn,
        "least, keel's wire": least_wire.turn,
        "keel's store alone": keel.store_alone,
        "keel's store + turn loop": keel.turn_loop,
        "keel": keel.whole,
    }
    return turns, close


async def valkey_usage(redis: Redis) -> tuple[float, float]:
    """(EVALSHA's microseconds, Valkey's CPU seconds) so far."""
    stats = await redis.info("commandstats")
    cpu = await redis.info("cpu")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0)), float(cpu["used_cpu_user"] + cpu["used_cpu_sys"])


def own_cpu() -> tuple[float, float, float]:
    """This process's user and system CPU seconds so far, and how many times it slept."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime, used.ru_stime, float(used.ru_nvcsw)


def busy_poll(us: int) -> None:
    """The event loop's selector polls for up to `us` microseconds before it blocks
    (`--busy-poll-us`): never past the wait it was asked for, which it then blocks out."""
    blocking = selectors.EpollSelector.select
    budget = us / 1e6

    def select(self: Any, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return blocking(self, timeout)
        start = time.perf_counter()
        end = start + (budget if timeout is None else min(budget, timeout))
        while True:
            ready = blocking(self, 0)
            now = time.perf_counter()
            if ready or now >= end:
                break
        if ready or (timeout is not None and now - start >= timeout):
            return ready
        return blocking(self, None if timeout is None else timeout - (now - start))

    setattr(selectors.EpollSelector, "select", select)  # noqa: B010 (a method replaced: mypy would refuse the assignment)


async def run(port: int, turns: int, rounds: int) -> dict[str, Any]:
    redis = Redis(port=port)
    await redis.flushall()
    run_turn, close = await ways(redis, port)
    names = list(run_turn)
    p50: dict[str, list[float]] = {n: [] for n in names}
    script_us: dict[str, list[float]] = {n: [] for n in names}
    cpu_us: dict[str, list[float]] = {n: [] for n in names}
    own_us: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    n = 0
    try:
        for name in names:  # warm-up: each way's first 200 turns
            for _ in range(200):
                n += 1
                await run_turn[name](n)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                await redis.config_resetstat()
                before = await valkey_usage(redis)
                own = own_cpu()
                took = []
                for _ in range(turns):
                    n += 1
                    t0 = time.perf_counter()
                    await run_turn[name](n)
                    took.append(time.perf_counter() - t0)
                own_after = own_cpu()
                after = await valkey_usage(redis)
                user, system, sleeps = ((b - a) / turns for a, b in zip(own, own_after, strict=True))
                own_us[name].append((user * 1e6, system * 1e6, sleeps))
                p50[name].append(statistics.median(took) * 1e3)
                script_us[name].append((after[0] - before[0]) / turns)
                cpu_us[name].append((after[1] - before[1]) / turns * 1e6)
    finally:
        await close()
        await redis.aclose()
    out: dict[str, Any] = {}
    for name in names:
        ratios = [a / b for a, b in zip(p50[name], p50["floor"], strict=True)]
        out[name] = {
            "seq_p50_ms": round(statistics.median(p50[name]), 4),
            "ratio_to_floor": round(statistics.median(ratios), 3),
            "ratios": [round(x, 2) for x in ratios],
            "scripts_us_per_turn": round(statistics.median(script_us[name]), 1),
            "valkey_cpu_us_per_turn": round(statistics.median(cpu_us[name]), 1),
            "own_user_us_per_turn": round(statistics.median(u for u, _, _ in own_us[name]), 1),
            "own_system_us_per_turn": round(statistics.median(s for _, s, _ in own_us[name]), 1),
            "own_sleeps_per_turn": round(statistics.median(z for _, _, z in own_us[name]), 2),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1500, help="turns a block (default 1500)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the six blocks (default 6)")
    parser.add_argument("--busy-poll-us", type=int, default=0, help="a diagnostic: poll before sleeping (0: off)")
    args = parser.parse_args()
    if args.busy_poll_us > 0:
        busy_poll(args.busy_poll_us)
    with tempfile.TemporaryDirectory() as tmp:
        valkey, port = start_valkey(Path(tmp), Deadline(600))
        try:
            found = asyncio.run(run(port, args.turns, args.rounds))
        finally:
            stop_process(valkey)
    print(
        f"{'way':26} {'seq p50 ms':>10} {'/ floor':>8} {'scripts us':>11} {'Valkey CPU us':>14} {'own user us':>12}"
        f" {'own sys us':>11} {'sleeps':>7}   ratios by round"
    )
    for name, row in found.items():
        print(
            f"{name:26} {row['seq_p50_ms']:10.3f} {row['ratio_to_floor']:8.2f} {row['scripts_us_per_turn']:11.1f} "
            f"{row['valkey_cpu_us_per_turn']:14.1f} {row['own_user_us_per_turn']:12.1f}"
            f" {row['own_system_us_per_turn']:11.1f} {row['own_sleeps_per_turn']:7.2f}   {row['ratios']}"
        )
    result = {"rounds": args.rounds, "turns": args.turns, "busy_poll_us": args.busy_poll_us, "ways": found}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
