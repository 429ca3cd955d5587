"""A randomized crash soak: the deterministic crash test (test_failpoints.py) generalized.

Each trial draws, from a seeded random.Random, a crash (a failpoint armed to fire the N-th time it
is reached, or a plain SIGKILL after a short delay) and a little workload: 1 to 3 sessions, each
a few plain messages and "pay N" messages whose approval requests are answered approve or deny.
keel runs as a subprocess (`python -m app`, tests/crash_agent.py); a supervisor notices its death
and starts a replacement on the same port and Redis without failpoints; the client retries every
request it got no answer for, with the same message_id or the same answer (the documented client
contract). When every session is idle the trial checks the invariants (DESIGN.md I2-I5):

- every message sent is a user item in history exactly once, in send order, and its turn
  completed: the reply right after it, or after its tool pair;
- every tool call has exactly one result, right after it;
- an approved charge ran once per call id, or twice with the same call id only when the crash
  came between the run and the commit of its result; a denied one never ran;
- every request id the client saw (before or after the crash) is the one in history and was
  answered with the client's answer; input.requested appears once per gated call;
- usage.model_calls equals the usage.recorded events, and every model call in the agent's log has
  its usage.recorded (per turn and step); a model step ran twice only across the crash;
- the SSE client (EventTail) saw no event id twice, and saw exactly what the outbox replays.

The agent's log gets a {"crash": n} line from the supervisor when it notices a death, so "across
the crash" is read off the log: the first run is before the marker, the second after it. A crash
stops every task of the process wherever it is: a failpoint fixes where one task stops, not the
others, so any kind of crash may cut any session's step or tool run short. One loss no design can
avoid is tolerated and counted (a note, not a violation): a task stopped between the model's reply
and its usage write; the step that step.before_commit itself cut short must still be accounted.

Used by tests/crash/test_soak.py (a few trials in CI) and deploy/soak.py (many trials)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from harness.store.client import is_cluster_node
from harness.store.keys import SessionKeys
from tests.service import EventTail, Service

FAILPOINTS = (
    "step.before_commit",
    "step.after_commit",
    "outbox.after_publish",
    "response.after_accept",
    "tool.after_run",
)
SIGKILL = "sigkill"
KINDS = (*FAILPOINTS, SIGKILL)
TERMINAL = ("turn.completed", "turn.failed", "turn.cancelled")
DENIED = "error: a person denied this call"
NTH_CAP = 6  # a failpoint fires at most this far in (outbox.after_publish: anywhere in the workload)
KILL_AFTER_S = (0.005, 0.03, 0.012)  # SIGKILL after uniform(low, high + per_message * messages) seconds
MAX_RESTARTS = 3  # replacements have no failpoints: more deaths than this is a failure of its own
REQUEST_DEADLINE_S = 30.0
AGENT = "tests.crash_agent:agent"


# ---- plans ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Msg:
    mid: str
    text: str
    amount: int | None = None  # a "pay N" message
    decision: str | None = None  # the client's answer to its approval request
    settle: bool = False  # wait for its turn to end before sending the next message
    resend: bool = False  # send it (or its answer) twice: a retry the client did not need

    def expected(self) -> list[tuple[str, str]]:
        """(role, text) of the history items its turn leaves."""
        if self.amount is None:
            return [("user", self.text), ("assistant", f"re: {self.text}")]
        result = f"charged {self.amount}" if self.decision == "approve" else DENIED
        return [("user", self.text), ("assistant", ""), ("tool", result), ("assistant", f"done: {result}")]


@dataclass(frozen=True)
class Plan:
    seed: int
    trial: int
    kind: str  # a failpoint name or "sigkill"
    nth: int  # failpoint: fire the nth time it is reached
    kill_after: float  # sigkill: seconds after the workload starts
    sessions: tuple[tuple[Msg, ...], ...]

    @property
    def failpoints(self) -> str:
        return f"{self.kind}=exit@{self.nth}" if self.kind in FAILPOINTS else ""

    def describe(self) -> str:
        crash = self.failpoints or f"sigkill after {self.kill_after:.3f}s"
        counts = "+".join(str(len(s)) for s in self.sessions)
        return f"seed {self.seed} trial {self.trial}: {crash}; messages per session {counts}"


def kind_of(seed: int, trial: int) -> str:
    """Trials go through the kinds in seeded random order, each kind once per len(KINDS) trials."""
    cycle, pos = divmod(trial, len(KINDS))
    order = list(KINDS)
    random.Random(f"keel-soak:{seed}:cycle:{cycle}").shuffle(order)
    return order[pos]


def reach(kind: str, sessions: list[list[Msg]]) -> int:
    """How many times the workload is sure to reach failpoint `kind` (if nothing crashes first)."""
    msgs = [m for s in sessions for m in s]
    steps = sum(1 if m.amount is None else 2 for m in msgs)
    if kind in ("step.before_commit", "step.after_commit"):
        return steps
    if kind == "response.after_accept":
        return sum(1 for m in msgs if m.decision is not None)
    if kind == "tool.after_run":
        return sum(1 for m in msgs if m.decision == "approve")
    if kind == "outbox.after_publish":  # events the session's tail is sent, at the least
        return sum(1 + sum(events_of(m) for m in s) for s in sessions)
    raise ValueError(kind)


def events_of(m: Msg) -> int:
    """A message's events: received, started, usage, completed x2 (message, turn); a charge adds
    input.requested, input.resolved, tool.completed and the second step's usage, and, approved,
    tool.started (a denied call never starts)."""
    if m.amount is None:
        return 5
    return 10 if m.decision == "approve" else 9


def make_plan(seed: int, trial: int) -> Plan:
    rng = random.Random(f"keel-soak:{seed}:trial:{trial}")
    kind = kind_of(seed, trial)
    sessions: list[list[Msg]] = []
    for s in range(rng.randint(1, 3)):
        msgs: list[Msg] = []
        for j in range(rng.randint(1, 4)):
            mid = f"t{trial}.s{s}.m{j}"
            settle, resend = rng.random() < 0.5, rng.random() < 0.15
            if rng.random() < 0.5:
                amount = rng.randint(1, 99)
                decision = "approve" if rng.random() < 0.6 else "deny"
                msgs.append(Msg(mid, f"pay {amount}", amount, decision, settle, resend))
            else:
                msgs.append(Msg(mid, f"hello {s}.{j}", settle=settle, resend=resend))
        sessions.append(msgs)
    if kind in ("tool.after_run", "response.after_accept") and not any(
        m.decision == "approve" for s in sessions for m in s
    ):  # the point must be reached: make one message an approved charge
        s = rng.randrange(len(sessions))
        j = rng.randrange(len(sessions[s]))
        old, amount = sessions[s][j], rng.randint(1, 99)
        sessions[s][j] = Msg(old.mid, f"pay {amount}", amount, "approve", old.settle, old.resend)
    nth, kill_after = 0, 0.0
    if kind in FAILPOINTS:
        most = reach(kind, sessions)
        nth = rng.randint(1, most if kind == "outbox.after_publish" else min(NTH_CAP, most))
    else:
        low, high, per_message = KILL_AFTER_S
        kill_after = round(rng.uniform(low, high + per_message * sum(map(len, sessions))), 3)
    return Plan(seed, trial, kind, nth, kill_after, tuple(tuple(s) for s in sessions))


# ---- the service across crashes --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def append_line(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Crash:
    rc: int  # 137: a failpoint's os._exit; -9: SIGKILL
    at: float  # seconds into the trial
    wall_ms: int  # time.time() in ms when the death was noticed (Redis stream ids use the same clock)
    ready_s: float = 0.0  # death noticed -> replacement ready


class Supervisor:
    """Runs keel and, whenever it dies, starts a replacement on the same port (no failpoints),
    and writes a {"crash": n} marker into the agent's log between the two processes' lines."""

    def __init__(self, svc: Service, log: Path, failpoints: str) -> None:
        self.svc, self.log, self.failpoints = svc, log, failpoints
        self.gen = 0  # bumped when a replacement is ready
        self.down = False  # the process died and the replacement is not ready yet
        self.failed = False  # could not bring keel back
        self.crashes: list[Crash] = []
        self.errors: list[str] = []
        self.killed = False
        self._t0 = time.monotonic()
        self._bump = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None
        self._kill: asyncio.TimerHandle | None = None
        self._stopping = False

    async def start(self) -> None:
        env = {"KEEL_FAILPOINTS": self.failpoints} if self.failpoints else {}
        await asyncio.to_thread(lambda: self.svc.start(20.0, **env))
        self._watch = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            proc = self.svc.proc
            assert proc is not None
            rc = await asyncio.to_thread(proc.wait)
            if self._stopping:
                return
            self.down, died = True, time.monotonic()
            crash = Crash(rc, died - self._t0, int(time.time() * 1000))
            self.crashes.append(crash)
            append_line(self.log, {"crash": len(self.crashes), "rc": rc, "wall_ms": crash.wall_ms})
            if len(self.crashes) > MAX_RESTARTS:
                self.errors.append(f"keel died {len(self.crashes)} times; giving up")
                self.failed = True
                self._notify()
                return
            try:
                await asyncio.to_thread(self.svc.start)
            except Exception as exc:
                self.errors.append(f"the replacement did not start: {str(exc)[-2000:]}")
                self.failed = True
                self._notify()
                return
            crash.ready_s = time.monotonic() - died
            self.gen += 1
            self.down = False
            self._notify()

    def _notify(self) -> None:
        old, self._bump = self._bump, asyncio.Event()
        old.set()

    def arm_kill(self, delay: float) -> None:
        self._kill = asyncio.get_running_loop().call_later(delay, self._sigkill)

    def _sigkill(self) -> None:
        proc = self.svc.proc
        if self.gen == 0 and not self.down and proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            self.killed = True

    def disarm(self) -> None:
        if self._kill is not None:
            self._kill.cancel()

    async def wait_past(self, gen: int, timeout: float) -> None:
        """Until a replacement newer than `gen` is ready (or `timeout`, or keel cannot come back)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.gen <= gen and not self.failed:
                    await self._bump.wait()

    async def settle(self, timeout: float = 30.0) -> None:
        """Until no restart is in progress (nor a SIGKILL sent whose death is not noticed yet)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while (self.down or (self.killed and not self.crashes)) and not self.failed:
                    await self._bump.wait()

    async def stop(self) -> None:
        self.disarm()
        await self.settle()
        self._stopping = True
        await asyncio.to_thread(self.svc.stop)
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watch, 20)


class Tail(EventTail):
    """EventTail, plus a wait for any condition on the events seen."""

    async def until(self, done: Callable[[list[dict[str, Any]]], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not done(self.events):
                self._changed.clear()
                await self._changed.wait()

    def poke(self) -> None:
        self._changed.set()


# ---- one trial --------------------------------------------------------------------------------


@dataclass
class TrialResult:
    plan: Plan
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    crashes: list[Crash] = field(default_factory=list)
    finished: bool = False  # every turn settled
    turns: int = 0
    retries: int = 0  # requests the client sent again after a transport error
    tool_runs: int = 0
    tool_reruns: int = 0  # approved calls run twice (same call id) across the crash
    step_reruns: int = 0  # model steps run twice across the crash
    carried: int = 0  # approval requests seen before the crash, answered and run after it
    unaccounted: int = 0  # model calls logged but not in usage (the crash came between the two)
    seconds: float = 0.0
    workload_s: float = 0.0  # from the first request to every turn settled
    workdir: str = ""

    @property
    def fired(self) -> bool:
        return bool(self.crashes)


class Trial:
    def __init__(self, plan: Plan, redis_url: str, workdir: Path, deadline_s: float, *, strict_usage: bool) -> None:
        self.plan = plan
        self.strict_usage = strict_usage  # a model call lost between reply and usage write is a violation
        self.redis_url = redis_url
        self.workdir = workdir
        self.deadline_s = deadline_s
        self.log = workdir / "calls.jsonl"
        self.result = TrialResult(plan, workdir=str(workdir))
        self._end = 0.0
        self.http: httpx.AsyncClient
        self.redis: Redis
        self.sup: Supervisor

    def violation(self, text: str) -> None:
        self.result.violations.append(f"{self.plan.describe()}: {text}")

    def left(self) -> float:
        return max(self._end - time.monotonic(), 0.1)

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """One request, retried (the same one) until the service answers it."""
        end = time.monotonic() + REQUEST_DEADLINE_S
        quick = 0
        while True:
            gen = self.sup.gen
            try:
                return await self.http.request(method, path, json=body)
            except httpx.TransportError:
                self.result.retries += 1
                if time.monotonic() > end or self.sup.failed:
                    raise
                if self.sup.down or quick >= 3:  # dead: wait for the replacement
                    quick = 0
                    await self.sup.wait_past(gen, 2.0)
                else:  # perhaps a death not noticed yet, or a stale keep-alive connection
                    quick += 1

    async def run(self) -> TrialResult:
        started = time.monotonic()
        self._end = started + self.deadline_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = (
            RedisCluster.from_url(self.redis_url) if is_cluster_node(self.redis_url) else Redis.from_url(self.redis_url)
        )
        await self.redis.flushall()
        svc = Service(
            self.workdir,
            free_port(),
            REDIS_URL=self.redis_url,
            KEEL_AGENT=AGENT,
            KEEL_LEASE_MS="1000",
            KEEL_TEST_LOG=str(self.log),
        )
        self.sup = Supervisor(svc, self.log, self.plan.failpoints)
        runs: list[SessionRun] = []
        try:
            await self.sup.start()
            async with httpx.AsyncClient(base_url=svc.base, timeout=10) as self.http:
                runs = [SessionRun(self, i, msgs) for i, msgs in enumerate(self.plan.sessions)]
                try:
                    await self._workload(runs)
                    if self.result.finished:
                        log = read_lines(self.log)
                        for r in runs:
                            await r.check(log)
                        self._check_trial(runs, log, read_text(svc.log))
                finally:
                    for r in runs:
                        await r.close()
        except Exception as exc:  # a failure of the client itself: report it, go on with the next trial
            self.violation(f"client error: {type(exc).__name__}: {exc}")
        finally:
            await self.sup.stop()
            await self.redis.aclose()
            self.result.crashes = self.sup.crashes
            self.result.violations.extend(f"{self.plan.describe()}: {e}" for e in self.sup.errors)
            self.result.seconds = time.monotonic() - started
        return self.result

    async def _workload(self, runs: list[SessionRun]) -> None:
        if self.plan.kind == SIGKILL:
            self.sup.arm_kill(self.plan.kill_after)
        began = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s):
                outcomes = await asyncio.gather(*(r.run() for r in runs), return_exceptions=True)
        except TimeoutError:
            self.sup.disarm()
            await self.sup.settle()
            self.violation(f"not settled within {self.deadline_s:.0f}s: " + await self._diagnose(runs))
            return
        self.result.workload_s = time.monotonic() - began
        self.result.turns = sum(len(r.ended() & set(r.by_mid)) for r in runs)
        self.sup.disarm()
        await self.sup.settle()  # a SIGKILL that just landed: let its replacement come up
        if any(isinstance(o, TimeoutError) for o in outcomes):  # a wait on the tail ran out of time
            self.violation(f"not settled within {self.deadline_s:.0f}s: " + await self._diagnose(runs))
        for r, outcome in zip(runs, outcomes, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, TimeoutError):
                self.violation(f"session {r.index}: client error: {type(outcome).__name__}: {outcome}")
        self.result.finished = not any(isinstance(o, BaseException) for o in outcomes)

    async def _diagnose(self, runs: list[SessionRun]) -> str:
        out = []
        for r in runs:
            if r.sid and set(r.by_mid) <= r.ended():
                continue  # this one settled
            state: Any = "?"
            if r.sid:
                with contextlib.suppress(Exception):
                    state = (await asyncio.wait_for(self.http.get(f"/v1/sessions/{r.sid}"), 5)).json()
            ended = r.ended()
            missing = [m.mid for m in r.msgs if m.mid not in ended]
            types = [e["type"] for e in r.tail.events[-6:]] if r.tail else []
            answerer = r.answerer_error()
            out.append(
                f"[session {r.index} {r.sid}: unsettled {missing}, state {state}, last events {types}"
                + (f", answerer failed: {answerer}]" if answerer else "]")
            )
        return " ".join(out)

    def _check_trial(self, runs: list[SessionRun], log: list[dict[str, Any]], keel_log: str) -> None:
        res, kind = self.result, self.plan.kind
        crashes = self.sup.crashes
        expected_rc = -signal.SIGKILL if kind == SIGKILL else 137
        if crashes and crashes[0].rc != expected_rc:
            self.violation(f"keel exited with {crashes[0].rc}, not {expected_rc}: {keel_log[-1500:]}")
        if len(crashes) > 1:
            self.violation(f"a replacement without failpoints died: exit codes {[c.rc for c in crashes]}")
        if kind in FAILPOINTS:
            if crashes and f"keel: failpoint {kind}: exiting" not in keel_log:
                self.violation(f"keel died, but not at failpoint {kind}: {keel_log[-1500:]}")
            if not crashes:
                res.notes.append(f"{self.plan.describe()}: failpoint {kind}@{self.plan.nth} never fired")
        # every tool run belongs to a call in some session's history
        calls = {c for r in runs for c in r.calls}
        for x in log:
            if "tool" in x and x.get("call_id") not in calls:
                self.violation(f"a tool ran for call {x.get('call_id')}, which no history holds: {x}")
        res.tool_runs = sum(1 for x in log if "tool" in x)
        # step.before_commit stops its own task after the step's usage was written: that re-run
        # step at least is fully accounted (other tasks may have been cut anywhere)
        if kind == "step.before_commit" and crashes and res.unaccounted >= res.step_reruns:
            self.violation(
                f"the step cut short by step.before_commit was not accounted: {res.step_reruns} steps re-run, "
                f"{res.unaccounted} model calls missing from usage"
            )


class SessionRun:
    """One session's client: sends its messages in order, answers its approval requests, retries
    what got no answer, and afterwards checks what keel made of it."""

    def __init__(self, trial: Trial, index: int, msgs: tuple[Msg, ...]) -> None:
        self.trial = trial
        self.index = index
        self.msgs = msgs
        self.by_mid = {m.mid: m for m in msgs}
        self.sid = ""
        self.tail: Tail | None = None
        self.mid_of_turn: dict[str, str] = {}  # from message.received events
        self.seen: dict[str, int] = {}  # request id -> supervisor generation when the client saw it
        self.calls: dict[str, str] = {}  # call id (of a charge in history) -> message id
        self._answerer: asyncio.Task[None] | None = None
        self._stop = False

    def violation(self, text: str) -> None:
        self.trial.violation(f"session {self.index} ({self.sid}): {text}")

    def ended(self, events: list[dict[str, Any]] | None = None) -> set[str]:
        if events is None:
            events = self.tail.events if self.tail is not None else []
        return {e["data"].get("message_id", "") for e in events if e["type"] in TERMINAL}

    async def run(self) -> None:
        t = self.trial
        r = await t.call("POST", "/v1/sessions")
        if r.status_code != 201:
            raise AssertionError(f"create session: {r.status_code} {r.text}")
        self.sid = r.json()["session_id"]
        self.tail = Tail(t.sup.svc.base, self.sid)
        self.tail.start()
        self._answerer = asyncio.create_task(self._answer())
        path = f"/v1/sessions/{self.sid}/messages"
        for m in self.msgs:
            for _ in range(2 if m.resend else 1):
                r = await t.call("POST", path, {"text": m.text, "message_id": m.mid})
                if r.status_code != 202:
                    self.violation(f"message {m.mid}: {r.status_code} {r.text}")
            if m.settle:
                await self.tail.until(self._have_ended({m.mid}), t.left())
        await self.tail.until(self._have_ended(set(self.by_mid)), t.left())
        self._stop = True
        self.tail.poke()
        await self._answerer

    async def _answer(self) -> None:
        """Answer every approval request the tail shows, with the message's decision."""
        assert self.tail is not None
        idx = 0
        while True:
            while idx < len(self.tail.events):
                e = self.tail.events[idx]
                idx += 1
                if e["type"] == "message.received":
                    self.mid_of_turn[e["turn_id"]] = e["data"]["message_id"]
                elif e["type"] == "input.requested":
                    for req in e["data"]["requests"]:
                        await self._respond(e, req)
            if self._stop:
                return
            await self.tail.until(self._news(idx), self.trial.left())

    def _have_ended(self, mids: set[str]) -> Callable[[list[dict[str, Any]]], bool]:
        return lambda events: mids <= self.ended(events)

    def _news(self, seen: int) -> Callable[[list[dict[str, Any]]], bool]:
        return lambda events: len(events) > seen or self._stop

    async def _respond(self, event: dict[str, Any], req: dict[str, Any]) -> None:
        rid = req["request_id"]
        if rid in self.seen:
            return  # shown twice: the check reports it
        self.seen[rid] = self.trial.sup.gen
        msg = self.by_mid.get(self.mid_of_turn.get(event["turn_id"], ""))
        if msg is None or msg.decision is None:
            self.violation(f"request {rid} for turn {event['turn_id']}, which is no pay message of ours")
            return
        if req["tool"] != "charge" or req["arguments"] != {"amount": msg.amount}:
            self.violation(f"request {rid} of {msg.mid} ({msg.text}) asks for {req['tool']} {req['arguments']}")
        body = {"request_id": rid, "decision": msg.decision}
        for _ in range(2 if msg.resend else 1):
            r = await self.trial.call("POST", f"/v1/sessions/{self.sid}/responses", body)
            if r.status_code != 202 or r.json().get("decision") != msg.decision:
                self.violation(f"answering {rid} ({msg.decision}) of {msg.mid}: {r.status_code} {r.text}")

    def answerer_error(self) -> str:
        a = self._answerer
        if a is None or not a.done() or a.cancelled() or a.exception() is None:
            return ""
        return repr(a.exception())

    async def close(self) -> None:
        self._stop = True
        if self._answerer is not None and not self._answerer.done():
            self._answerer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._answerer
        if self.tail is not None:
            await self.tail.stop()

    # ---- the checks ---------------------------------------------------------------------------

    async def _replay(self, n: int) -> list[dict[str, Any]]:
        """The first `n` events of the outbox, as a new SSE connection replays them."""
        events: list[dict[str, Any]] = []
        async with (
            asyncio.timeout(10),
            self.trial.http.stream("GET", f"/v1/sessions/{self.sid}/events") as resp,
        ):
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) >= n:
                        break
        return events

    async def check(self, log: list[dict[str, Any]]) -> None:
        t, sid = self.trial, self.sid
        assert self.tail is not None
        info = (await t.call("GET", f"/v1/sessions/{sid}")).json()
        if info["status"] != "idle" or info["pending"] or info["queued"]:
            self.violation(f"not idle after every turn ended: {info}")
        items = (await t.call("GET", f"/v1/sessions/{sid}/history")).json()["items"]
        n = int(await t.redis.xlen(SessionKeys(sid).outbox))
        try:
            await self.tail.until(lambda ev: len(ev) >= n, 10)
        except TimeoutError:
            self.violation(f"the SSE client has {len(self.tail.events)} events, the outbox {n}")
        events = await self._replay(n)
        self._check_events(events)
        self._check_history(items, events)
        self._check_requests(events)
        self._check_tools(log, events)
        self._check_model_calls(log, events, info)

    def _check_events(self, replay: list[dict[str, Any]]) -> None:
        """The tail saw every event once, exactly as the outbox replays it (I2)."""
        assert self.tail is not None
        seen = self.tail.events
        ids = [e["id"] for e in seen]
        dups = [i for i, c in Counter(ids).items() if c > 1]
        if dups:
            self.violation(f"the SSE client got event ids more than once: {dups}")
        if ids != [e["id"] for e in replay]:
            self.violation(f"the SSE client's ids {ids} are not the outbox replay {[e['id'] for e in replay]}")
        elif seen != replay:
            diff = next(i for i, (a, b) in enumerate(zip(seen, replay, strict=True)) if a != b)
            self.violation(f"event {ids[diff]} differs on redelivery: {seen[diff]} vs {replay[diff]}")
        per_mid: dict[str, Counter[str]] = defaultdict(Counter)
        for e in replay:
            if e["type"] in ("message.received", "turn.started", *TERMINAL):
                per_mid[e["data"].get("message_id", "")][e["type"]] += 1
        for m in self.msgs:
            got = per_mid.get(m.mid, Counter())
            want = {"message.received": 1, "turn.started": 1, "turn.completed": 1}
            if dict(got) != want:
                self.violation(f"message {m.mid}: events {dict(got)}, expected one of each of {list(want)}")
            done = [e for e in replay if e["type"] == "turn.completed" and e["data"].get("message_id") == m.mid]
            if done and done[0]["data"].get("reply") != m.expected()[-1][1]:
                self.violation(f"message {m.mid} ({m.text}): reply {done[0]['data'].get('reply')!r}")

    def _check_history(self, items: list[dict[str, Any]], replay: list[dict[str, Any]]) -> None:
        """Each message once, in send order, its turn complete; tool calls and results paired."""
        users = [i.get("message_id") for i in items if i["role"] == "user"]
        if users != [m.mid for m in self.msgs]:
            self.violation(f"user items {users}, sent {[m.mid for m in self.msgs]}")
        got = [(i["role"], i["text"]) for i in items]
        want = [pair for m in self.msgs for pair in m.expected()]
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            self.violation(f"history differs from item {at}: got {got[at : at + 4]}, expected {want[at : at + 4]}")
        turn_mid = {e["turn_id"]: e["data"]["message_id"] for e in replay if e["type"] == "turn.started"}
        results = Counter(i.get("tool_call_id") for i in items if i["role"] == "tool")
        called: set[str] = set()
        for k, item in enumerate(items):
            calls = [c["id"] for c in item.get("tool_calls", ())]
            if not calls:
                continue
            called.update(calls)
            after = [x.get("tool_call_id") if x["role"] == "tool" else None for x in items[k + 1 : k + 1 + len(calls)]]
            if after != calls:
                self.violation(f"calls {calls} are not followed by their results: {after}")
            for c in item["tool_calls"]:
                self.calls[c["id"]] = turn_mid.get(item["turn_id"], "")
        for cid, count in results.items():
            if count != 1 or cid not in called:
                self.violation(f"tool result for call {cid}: {count} of them, call in history: {cid in called}")

    def _check_requests(self, replay: list[dict[str, Any]]) -> None:
        """Requests: one per gated call, never replaced, answered with the client's answers (I2, I3)."""
        requested = Counter(
            r["request_id"] for e in replay if e["type"] == "input.requested" for r in e["data"]["requests"]
        )
        resolved: dict[str, list[str]] = defaultdict(list)
        for e in replay:
            if e["type"] == "input.resolved":
                resolved[e["data"]["request_id"]].append(e["data"]["decision"])
        gated = {f"req_{cid}": mid for cid, mid in self.calls.items()}
        for rid, mid in gated.items():
            decision = self.by_mid[mid].decision if mid in self.by_mid else None
            if requested[rid] != 1:
                self.violation(f"input.requested for {rid} ({mid}) {requested[rid]} times")
            if resolved.get(rid) != [decision]:
                self.violation(f"{rid} ({mid}) resolved as {resolved.get(rid)}, the client answered {decision}")
        for rid, count in requested.items():
            if rid not in gated:
                self.violation(f"request {rid} was shown ({count}x) but its call is not in history: replaced")
        crash_gen = len(self.trial.sup.crashes)
        for rid, gen in self.seen.items():
            if rid not in gated:
                self.violation(f"the client saw request {rid} (generation {gen}), history has {sorted(gated)}")
            elif gen == 0 and crash_gen:
                self.trial.result.carried += 1

    def _crash_between(self, log: list[dict[str, Any]], a: int, b: int) -> dict[str, Any] | None:
        """The crash marker between log lines a and b, if any."""
        return next((x for x in log[a + 1 : b] if "crash" in x), None)

    def _check_tools(self, log: list[dict[str, Any]], replay: list[dict[str, Any]]) -> None:
        """An approved charge ran once, or twice with the same call id when the crash came between
        its run and the commit of its result (the result then committed after the crash); a denied
        one never ran. (A crash stops every task of the process wherever it is: the failpoint fixes
        where one task stops, not the others, so any kind of crash may cut any call short.)"""
        runs: dict[str, list[int]] = defaultdict(list)
        for k, x in enumerate(log):
            if "tool" in x:
                runs[x["call_id"]].append(k)
        completed = {e["data"]["call_id"]: e["id"] for e in replay if e["type"] == "tool.completed"}
        completions = Counter(e["data"]["call_id"] for e in replay if e["type"] == "tool.completed")
        kind = self.trial.plan.kind
        for cid, mid in self.calls.items():
            msg = self.by_mid.get(mid)
            ran = runs.get(cid, [])
            if msg is None:
                self.violation(f"call {cid} belongs to no message of ours ({mid})")
                continue
            if completions[cid] != 1:
                self.violation(f"call {cid} of {mid}: {completions[cid]} tool.completed events")
            amounts = {log[k].get("amount") for k in ran}
            if ran and amounts != {msg.amount}:
                self.violation(f"call {cid} of {mid} ({msg.text}) ran with amounts {amounts}")
            if msg.decision == "deny":
                if ran:
                    self.violation(f"denied call {cid} of {mid} ran {len(ran)} times")
            elif len(ran) == 2 and (crash := self._crash_between(log, ran[0], ran[1])) is not None:
                self.trial.result.tool_reruns += 1
                done_ms = int(completed.get(cid, "0-0").split("-")[0])
                if done_ms < crash["wall_ms"]:
                    self.violation(f"call {cid} of {mid} ran again after the crash, its result is from before it")
            elif len(ran) != 1:
                self.violation(
                    f"approved call {cid} of {mid} ran {len(ran)} times (crash {kind}, "
                    f"crash in between: {len(ran) == 2 and self._crash_between(log, ran[0], ran[1]) is not None})"
                )

    def _check_model_calls(self, log: list[dict[str, Any]], replay: list[dict[str, Any]], info: dict[str, Any]) -> None:
        """Each step called the model once, or twice across the crash (then it committed after the
        crash: no committed step runs again); usage has every attempt, per step (I3, I5)."""
        turn_mid = {e["turn_id"]: e["data"]["message_id"] for e in replay if e["type"] == "turn.started"}

        def committed_ms(turn: str, step: int) -> int:
            """When the step committed: its input.requested (a charge's first step) or turn.completed."""
            msg = self.by_mid.get(turn_mid[turn])
            etype = "input.requested" if msg is not None and msg.amount is not None and step == 0 else "turn.completed"
            e = next((e for e in replay if e["type"] == etype and e["turn_id"] == turn), {"id": "0-0"})
            return int(e["id"].split("-")[0])

        steps: dict[tuple[str, int], list[int]] = defaultdict(list)
        for k, x in enumerate(log):
            if "model" in x and x.get("turn") in turn_mid:
                steps[(x["turn"], x["model"])].append(k)
        usage = Counter((e["turn_id"], e["data"]["step"]) for e in replay if e["type"] == "usage.recorded")
        for turn, mid in turn_mid.items():
            msg = self.by_mid.get(mid)
            got = sorted(s for (t, s) in steps if t == turn)
            want = [0] if msg is None or msg.amount is None else [0, 1]
            if got != want:
                self.violation(f"turn {turn} ({mid}) called the model for steps {got}, expected {want}")
        res, kind = self.trial.result, self.trial.plan.kind
        for (turn, step), at in steps.items():
            crash = self._crash_between(log, at[0], at[1]) if len(at) == 2 else None
            what = f"model step {step} of turn {turn} ({turn_mid[turn]})"
            if len(at) > 1:
                if crash is None:
                    self.violation(f"{what} ran {len(at)} times (crash {kind})")
                    continue
                res.step_reruns += 1
                if committed_ms(turn, step) < crash["wall_ms"]:
                    self.violation(f"{what} ran again after the crash, though it committed before it")
            accounted = usage.pop((turn, step), 0)
            if accounted == len(at):
                continue
            if crash is not None and accounted == 1 and not self.trial.strict_usage:
                # A crash can stop a task between the model's reply and its usage write: that
                # attempt's tokens die with it (the attempt itself is counted before the call,
                # which the model_calls check below holds keel to).
                res.unaccounted += 1
                res.notes.append(
                    f"{self.trial.plan.describe()}: session {self.index}: {what}: 2 model calls, 1 usage.recorded "
                    f"(the crash came between a model reply and its token record)"
                )
            else:
                self.violation(f"{what}: {len(at)} model calls, {accounted} usage.recorded (crash {kind})")
        if usage:
            self.violation(f"usage.recorded for steps the model never ran: {dict(usage)}")
        # Every provider attempt is counted (I5), before it is made: a crash between the count and
        # the call can add one that never happened (at most one per crash), never lose one.
        calls = sum(len(at) for at in steps.values())
        crashes = sum(1 for x in log if "crash" in x)
        counted = info["usage"]["model_calls"]
        if not calls <= counted <= calls + crashes:
            self.violation(f"usage.model_calls {counted}, model calls made {calls}, crashes {crashes}")
        elif counted > calls:
            res.notes.append(
                f"{self.trial.plan.describe()}: session {self.index}: {counted - calls} attempt(s) counted that a "
                f"crash stopped before the model was called"
            )


# ---- many trials -------------------------------------------------------------------------------


async def run_soak(
    redis_url: str,
    workdir: Path,
    *,
    seed: int,
    trials: Iterable[int],
    trial_deadline: float = 40.0,
    strict_usage: bool = False,
    budget: float | None = None,
    on_result: Callable[[TrialResult], None] | None = None,
) -> list[TrialResult]:
    """Run the trials one after the other; with a `budget` (seconds), start none after it is spent."""
    end = None if budget is None else time.monotonic() + budget
    results = []
    for trial in trials:
        if end is not None and time.monotonic() > end:
            break
        plan = make_plan(seed, trial)
        trial_dir = workdir / f"trial-{trial:04d}"
        result = await Trial(plan, redis_url, trial_dir, trial_deadline, strict_usage=strict_usage).run()
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def trial_line(r: TrialResult) -> str:
    crash = f"crash rc={r.crashes[0].rc} at {r.crashes[0].at:.2f}s" if r.crashes else "no crash"
    return (
        f"trial {r.plan.trial:4d} {r.plan.failpoints or f'sigkill@{r.plan.kill_after:.2f}s':32s} "
        f"{len(r.plan.sessions)} sessions {r.turns:2d} turns, {crash}, workload {r.workload_s:4.1f}s, "
        f"total {r.seconds:4.1f}s, "
        f"{len(r.violations)} violations"
    )


def summary(results: list[TrialResult], wall_s: float) -> list[str]:
    lines = [f"{'kind':24s} {'trials':>6s} {'crashed':>7s} {'turns':>6s} {'violations':>10s}"]
    for kind in KINDS:
        rs = [r for r in results if r.plan.kind == kind]
        lines.append(
            f"{kind:24s} {len(rs):6d} {sum(r.fired for r in rs):7d} {sum(r.turns for r in rs):6d} "
            f"{sum(len(r.violations) for r in rs):10d}"
        )
    crashes = [c for r in results for c in r.crashes]
    recoveries = sum(len(r.crashes) for r in results if r.finished)
    ready = [c.ready_s for c in crashes if c.ready_s]
    secs = [r.seconds for r in results]
    lines += [
        f"trials {len(results)}, sessions {sum(len(r.plan.sessions) for r in results)}, "
        f"turns {sum(r.turns for r in results)}, crashes {len(crashes)}, recoveries {recoveries}",
        f"client retries {sum(r.retries for r in results)}, requests carried across a crash "
        f"{sum(r.carried for r in results)}, tool runs {sum(r.tool_runs for r in results)} "
        f"(re-run across a crash {sum(r.tool_reruns for r in results)}), model steps re-run across a crash "
        f"{sum(r.step_reruns for r in results)}, model calls lost between reply and usage write "
        f"{sum(r.unaccounted for r in results)}",
    ]
    if ready:
        lines.append(f"crash -> replacement ready: median {statistics.median(ready):.2f}s, max {max(ready):.2f}s")
    if secs:
        lines.append(f"trial time: median {statistics.median(secs):.1f}s, max {max(secs):.1f}s")
    lines.append(f"violations {sum(len(r.violations) for r in results)}, wall time {wall_s:.1f}s")
    return lines
