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
the crash" is read off the log: the first run is before the marker, the second after it.

On a cluster (`ClusterFaults`, deploy/soak.py --cluster), keel runs with KEEL_DURABILITY=replica,
a 503 is sent again too (the API's word: not done, safe to repeat), and a `failover` trial kills
the primary holding its sessions mid-workload (keel stays up) and promotes its replica. The
invariants are the same; the failover is a window, not an instant (from the replica cut off to
the cluster whole again, a write's outcome may be unknown to keel): the log gets {"crash":
"failover"} when it begins and {"failover_end": ...} when it is over, and a run is "across the
crash" when the first is before the end and the second after the beginning. A crash
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
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from harness.store.client import is_cluster_node
from harness.store.keys import SessionKeys
from tests.cluster import ValkeyCluster, _command
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
# On a Valkey Cluster (`ClusterFaults`): also the primary holding the trial's sessions killed and
# its replica promoted mid-workload. It comes twice per cycle, so that 200 trials have 50 of them.
FAILOVER = "failover"
CLUSTER_KINDS = (*KINDS, FAILOVER, FAILOVER)
TERMINAL = ("turn.completed", "turn.failed", "turn.cancelled")
DENIED = "error: a person denied this call"
NTH_CAP = 6  # a failpoint fires at most this far in (outbox.after_publish: anywhere in the workload)
KILL_AFTER_S = (0.005, 0.03, 0.012)  # SIGKILL after uniform(low, high + per_message * messages) seconds
MAX_RESTARTS = 3  # replacements have no failpoints: more deaths than this is a failure of its own
# failover: how long the primary's replica is cut off before the primary is killed (none, or a
# uniform draw: past WAIT's 1 s the writes of the moment are refused, before it they wait)
HOLD_NONE_P, HOLD_S = 0.3, (0.1, 1.6)
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
    kind: str  # a failpoint name, "sigkill" or "failover"
    nth: int  # failpoint: fire the nth time it is reached; failover: once keel wrote nth events
    kill_after: float  # sigkill: seconds after the workload starts
    sessions: tuple[tuple[Msg, ...], ...]
    hold: float = 0.0  # failover: seconds the replica is cut off before its primary is killed
    cluster: bool = False  # drawn for a cluster (CLUSTER_KINDS)

    @property
    def failpoints(self) -> str:
        return f"{self.kind}=exit@{self.nth}" if self.kind in FAILPOINTS else ""

    @property
    def crash(self) -> str:
        """The crash, short (the trial lines' column)."""
        if self.kind == FAILOVER:
            return f"failover@{self.nth} hold {self.hold:.2f}s"
        return self.failpoints or f"sigkill@{self.kill_after:.2f}s"

    def describe(self) -> str:
        if self.kind == FAILOVER:
            crash = f"failover once {self.nth} events are written, the replica cut off {self.hold:.3f}s first"
        else:
            crash = self.failpoints or f"sigkill after {self.kill_after:.3f}s"
        counts = "+".join(str(len(s)) for s in self.sessions)
        where = " (cluster)" if self.cluster else ""
        return f"seed {self.seed} trial {self.trial}{where}: {crash}; messages per session {counts}"


def kind_of(seed: int, trial: int, kinds: tuple[str, ...] = KINDS) -> str:
    """Trials go through the kinds in seeded random order, each kind once per len(kinds) trials
    (as often as it is in `kinds`)."""
    cycle, pos = divmod(trial, len(kinds))
    order = list(kinds)
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


def make_plan(seed: int, trial: int, *, cluster: bool = False) -> Plan:
    """Trial `trial`'s plan; `cluster`: drawn from CLUSTER_KINDS (on one server, the plans are
    what they always were)."""
    rng = random.Random(f"keel-soak:{seed}:trial:{trial}")
    kind = kind_of(seed, trial, CLUSTER_KINDS if cluster else KINDS)
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
    nth, kill_after, hold = 0, 0.0, 0.0
    if kind in FAILPOINTS:
        most = reach(kind, sessions)
        nth = rng.randint(1, most if kind == "outbox.after_publish" else min(NTH_CAP, most))
    elif kind == FAILOVER:  # after any event but the last: the workload is sure to be under way
        nth = rng.randint(1, reach("outbox.after_publish", sessions) - 1)
        hold = 0.0 if rng.random() < HOLD_NONE_P else round(rng.uniform(*HOLD_S), 3)
    else:
        low, high, per_message = KILL_AFTER_S
        kill_after = round(rng.uniform(low, high + per_message * sum(map(len, sessions))), 3)
    return Plan(seed, trial, kind, nth, kill_after, tuple(tuple(s) for s in sessions), hold, cluster)


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


# ---- a cluster's primary killed and failed over -------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One line of CLUSTER NODES."""

    id: str
    port: int
    primary: bool
    primary_id: str  # a replica's primary ("-" for a primary)
    failed: bool  # flagged fail or fail? by the node that answered
    slots: tuple[tuple[int, int], ...]


@dataclass
class Failover:
    victim: int  # the port of the primary killed
    replica: int  # the port of its replica, promoted
    sessions: int  # how many of the trial's sessions the primary held
    hold: float  # seconds the replica was cut off before the kill
    at: float  # seconds into the trial when the fault began
    wall_ms: int  # time.time() in ms then (as Crash.wall_ms)
    late: bool = False  # keel had written every event of the workload by then
    promoted_s: float = 0.0  # kill -> the replica says it is a primary
    restored_s: float = 0.0  # kill -> the old primary back as the new one's replica, in sync, every node ok


class ClusterFaults:
    """Failovers on a running tests.cluster.ValkeyCluster, as tests/crash/test_cluster_failover.py
    does one: the primary's replica cut off for `hold` seconds if any (SIGSTOP, CLIENT KILL TYPE
    replica), the primary kill -9'd, the replica promoted (CLUSTER FAILOVER TAKEOVER). Then, so
    that writes can be replicated again (`KEEL_DURABILITY=replica` needs a replica), the killed
    node is started again with its old command line and data: it learns that its slots have a
    newer owner and becomes that one's replica. Roles change as this goes on, so they are read
    from CLUSTER NODES, never from the cluster's lists of primaries and replicas at start."""

    def __init__(self, cluster: ValkeyCluster) -> None:
        self.cluster = cluster

    @property
    def url(self) -> str:
        return self.cluster.url

    def nodes(self) -> list[Node]:
        """CLUSTER NODES, as the first node that answers it sees them."""
        for port in self.cluster.ports:
            try:
                return self._nodes(port)
            except (OSError, RuntimeError):
                continue
        raise RuntimeError("no node of the cluster answers")

    def _nodes(self, port: int) -> list[Node]:
        out = []
        for line in _command(port, "CLUSTER", "NODES", timeout=2.0).decode().splitlines():
            fields = line.split()
            if len(fields) < 8:  # (the reply's length line)
                continue
            flags = fields[2].split(",")
            slots = []
            for part in fields[8:]:
                if not part.startswith("["):  # (a slot being migrated or imported)
                    low, _, high = part.partition("-")
                    slots.append((int(low), int(high or low)))
            out.append(
                Node(
                    id=fields[0],
                    port=int(fields[1].split(":")[1].split("@")[0]),
                    primary="master" in flags,
                    primary_id=fields[3],
                    failed="fail" in flags or "fail?" in flags,
                    slots=tuple(slots),
                )
            )
        return out

    def owner(self, sid: str) -> int:
        """The port of the primary that holds session `sid`."""
        slot = key_slot(SessionKeys(sid).meta.encode())
        for n in self.nodes():
            if n.primary and not n.failed and any(low <= slot <= high for low, high in n.slots):
                return n.port
        raise LookupError(f"no primary holds slot {slot}")

    def replica_of(self, primary: int) -> int:
        nodes = self.nodes()
        pid = next(n.id for n in nodes if n.port == primary)
        return next(n.port for n in nodes if n.primary_id == pid and not n.failed)

    def fail_over(self, victim: int, hold: float) -> tuple[int, float]:
        """Cut the replica of the primary on `victim` off for `hold` seconds (if any), kill the
        primary, promote the replica: its port, and the seconds from the kill to its promotion."""
        c = self.cluster
        replica = self.replica_of(victim)
        try:
            if hold:
                c.signal(replica, signal.SIGSTOP)  # (stopped, it cannot connect again ...)
                c.cut_replicas(victim)  # (... once the primary dropped it)
                time.sleep(hold)  # (the replica falls behind for this long)
            c.kill9(victim)
        finally:
            if hold:
                c.signal(replica, signal.SIGCONT)
        killed = time.monotonic()
        c.take_over(replica)
        return replica, time.monotonic() - killed

    def restore(self, victim: int, timeout: float = 30.0) -> None:
        """Start the node on `victim` again (it was killed) and wait until it is a replica in
        sync and the cluster is whole (`healthy`)."""
        c = self.cluster
        k = c.ports.index(victim)
        c.procs[k] = subprocess.Popen(c.procs[k].args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_healthy(timeout)

    def healthy(self) -> str:
        """What is wrong with the cluster ("" when nothing): every node answers, says the cluster
        is ok and sees 3 primaries with slots and a replica of each, none flagged failing; every
        primary has its replica connected and every replica its link up."""
        views = []
        for port in self.cluster.ports:
            try:
                if b"cluster_state:ok" not in _command(port, "CLUSTER", "INFO", timeout=2.0):
                    return f"node {port}: cluster_state is not ok"
                views.append((port, self._nodes(port)))
            except (OSError, RuntimeError) as exc:
                return f"node {port}: {exc or type(exc).__name__}"
        want = len(self.cluster.primaries)
        for port, nodes in views:
            primaries = [n for n in nodes if n.primary and n.slots and not n.failed]
            replicas = {n.primary_id for n in nodes if not n.primary and not n.failed}
            if len(primaries) != want or replicas != {n.id for n in primaries} or any(n.failed for n in nodes):
                return f"node {port} sees {[(n.port, n.primary, n.failed) for n in nodes]}"
        for n in views[0][1]:
            info = _command(n.port, "INFO", "replication", timeout=2.0)
            up = b"connected_slaves:1" if n.primary else b"master_link_status:up"
            if up not in info:
                return f"node {n.port}: replication not up"
        return ""

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while why := self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster is not whole after {timeout:.0f}s: {why}")
            time.sleep(0.05)


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
    refused: int = 0  # 503 answers (cluster: no replica acknowledged in time), sent again
    failover: Failover | None = None
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
        return bool(self.crashes) or self.failover is not None


class Trial:
    def __init__(
        self,
        plan: Plan,
        redis_url: str,
        workdir: Path,
        deadline_s: float,
        *,
        strict_usage: bool,
        faults: ClusterFaults | None = None,
    ) -> None:
        self.plan = plan
        self.strict_usage = strict_usage  # a model call lost between reply and usage write is a violation
        # on a cluster: keel with KEEL_DURABILITY=replica; a 503 is sent again (as the API allows)
        self.faults = faults
        self.redis_url = redis_url
        self.workdir = workdir
        self.deadline_s = deadline_s
        self.log = workdir / "calls.jsonl"
        self.result = TrialResult(plan, workdir=str(workdir))
        self._end = self._started = 0.0
        self.http: httpx.AsyncClient
        self.redis: Redis | RedisCluster
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
                r = await self.http.request(method, path, json=body)
                if r.status_code != 503 or self.faults is None or time.monotonic() > end:
                    return r
                self.result.refused += 1  # not done: the same request again (Retry-After, shortened)
                await asyncio.sleep(0.1)
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
        started = self._started = time.monotonic()
        self._end = started + self.deadline_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.faults is not None:  # (a failover before: the cluster whole again)
            await asyncio.to_thread(self.faults.wait_healthy)
        self.redis = self._client()
        await self.redis.flushall()
        env = {"KEEL_DURABILITY": "replica"} if self.faults is not None else {}
        svc = Service(
            self.workdir,
            free_port(),
            REDIS_URL=self.redis_url,
            KEEL_AGENT=AGENT,
            KEEL_LEASE_MS="1000",
            KEEL_TEST_LOG=str(self.log),
            **env,
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

    def _client(self) -> Redis | RedisCluster:
        if is_cluster_node(self.redis_url):
            return RedisCluster.from_url(self.redis_url)
        return Redis.from_url(self.redis_url)

    async def _workload(self, runs: list[SessionRun]) -> None:
        if self.plan.kind == SIGKILL:
            self.sup.arm_kill(self.plan.kill_after)
        failing = asyncio.create_task(self._fail_over(runs)) if self.plan.kind == FAILOVER else None
        began = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s):
                outcomes = await asyncio.gather(*(r.run() for r in runs), return_exceptions=True)
        except TimeoutError:
            self.sup.disarm()
            await self.sup.settle()
            await self._failed_over(failing)
            self.violation(f"not settled within {self.deadline_s:.0f}s: " + await self._diagnose(runs))
            return
        self.result.workload_s = time.monotonic() - began
        if not await self._failed_over(failing):
            return
        self.result.turns = sum(len(r.ended() & set(r.by_mid)) for r in runs)
        self.sup.disarm()
        await self.sup.settle()  # a SIGKILL that just landed: let its replacement come up
        if any(isinstance(o, TimeoutError) for o in outcomes):  # a wait on the tail ran out of time
            self.violation(f"not settled within {self.deadline_s:.0f}s: " + await self._diagnose(runs))
        for r, outcome in zip(runs, outcomes, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, TimeoutError):
                self.violation(f"session {r.index}: client error: {type(outcome).__name__}: {outcome}")
        self.result.finished = not any(isinstance(o, BaseException) for o in outcomes)

    async def _fail_over(self, runs: list[SessionRun]) -> None:
        """Once keel has written the plan's nth event of the trial's sessions (their outboxes,
        polled: the fault lands while keel still has events to write, not only to deliver):
        fail over the primary that holds the most of the sessions with events still to come
        (then the most sessions), and bring its node back as the new primary's replica. The
        agent's log gets a {"crash": "failover"} marker when the fault begins (with the replica
        cut off, writes from then on may be lost)."""
        faults, plan = self.faults, self.plan
        assert faults is not None
        total = reach("outbox.after_publish", [list(s) for s in plan.sessions])  # (every event, no crash)
        written: dict[int, int] = {}
        while sum(written.values()) < plan.nth:
            for r in runs:
                if r.sid:
                    written[r.index] = int(await self.redis.xlen(SessionKeys(r.sid).outbox))
            await asyncio.sleep(0.001)
        ranked: dict[int, tuple[int, int]] = {}
        for r in runs:
            if r.sid:
                port = await asyncio.to_thread(faults.owner, r.sid)
                to_come, held = ranked.get(port, (0, 0))
                more = written.get(r.index, 0) < 1 + sum(events_of(m) for m in r.msgs)
                ranked[port] = (to_come + more, held + 1)
        victim = max(ranked, key=lambda port: ranked[port])
        late = sum(written.values()) >= total
        wall_ms = int(time.time() * 1000)
        at = time.monotonic() - self._started
        append_line(self.log, {"crash": "failover", "victim": victim, "hold": plan.hold, "wall_ms": wall_ms})
        fo = Failover(victim, 0, ranked[victim][1], plan.hold, at, wall_ms, late)
        self.result.failover = fo
        fo.replica, fo.promoted_s = await asyncio.to_thread(faults.fail_over, victim, plan.hold)
        killed = time.monotonic() - fo.promoted_s
        await asyncio.to_thread(faults.restore, victim)
        fo.restored_s = time.monotonic() - killed
        append_line(self.log, {"failover_end": victim, "wall_ms": int(time.time() * 1000)})
        old, self.redis = self.redis, self._client()  # (its connections to the killed node are gone)
        with contextlib.suppress(Exception):
            await old.aclose()

    async def _failed_over(self, failing: asyncio.Task[None] | None) -> bool:
        """Wait for the failover (if any) to be done; False (a violation) if it could not be."""
        if failing is None:
            return True
        try:
            with contextlib.suppress(TimeoutError):  # (it may begin as the workload ends)
                async with asyncio.timeout(2):
                    while self.result.failover is None and not failing.done():  # noqa: ASYNC110 (a flag)
                        await asyncio.sleep(0.01)
            if self.result.failover is None and not failing.done():  # the workload failed before its nth event
                failing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await failing
                self.violation(f"the failover never began: not {self.plan.nth} events written")
                return False
            await asyncio.wait_for(failing, 60)
        except Exception as exc:
            self.violation(f"the failover did not complete: {type(exc).__name__}: {exc}")
            return False
        return True

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
        if kind == FAILOVER:
            if crashes:  # keel itself was not to die: the store failed over under it
                self.violation(f"keel died during a failover: exit codes {[c.rc for c in crashes]}: {keel_log[-1500:]}")
        elif crashes and crashes[0].rc != expected_rc:
            self.violation(f"keel exited with {crashes[0].rc}, not {expected_rc}: {keel_log[-1500:]}")
        if len(crashes) > 1 and kind != FAILOVER:
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
        """The crash marker between log lines a and b, if any; or a failover's, when its window
        (from its marker to its end marker) overlaps them: the first run before the cluster was
        whole again, the second after the fault began."""
        for k, x in enumerate(log):
            if "crash" not in x:
                continue
            end = k
            if x["crash"] == FAILOVER:
                end = next((j for j in range(k + 1, len(log)) if "failover_end" in log[j]), len(log))
            if k < b and end > a:
                return x
        return None

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
    faults: ClusterFaults | None = None,
) -> list[TrialResult]:
    """Run the trials one after the other; with a `budget` (seconds), start none after it is spent.
    With `faults` (a cluster at `redis_url`): the cluster's plans (CLUSTER_KINDS), keel with
    `KEEL_DURABILITY=replica`."""
    end = None if budget is None else time.monotonic() + budget
    results = []
    for trial in trials:
        if end is not None and time.monotonic() > end:
            break
        plan = make_plan(seed, trial, cluster=faults is not None)
        trial_dir = workdir / f"trial-{trial:04d}"
        result = await Trial(plan, redis_url, trial_dir, trial_deadline, strict_usage=strict_usage, faults=faults).run()
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def trial_line(r: TrialResult) -> str:
    fo = r.failover
    if fo is not None:
        crash = f"failover of :{fo.victim} ({fo.sessions} sessions) at {fo.at:.2f}s" + (" (late)" if fo.late else "")
    else:
        crash = f"crash rc={r.crashes[0].rc} at {r.crashes[0].at:.2f}s" if r.crashes else "no crash"
    return (
        f"trial {r.plan.trial:4d} {r.plan.crash:32s} "
        f"{len(r.plan.sessions)} sessions {r.turns:2d} turns, {crash}, workload {r.workload_s:4.1f}s, "
        f"total {r.seconds:4.1f}s, "
        f"{len(r.violations)} violations"
    )


def summary(results: list[TrialResult], wall_s: float) -> list[str]:
    lines = [f"{'kind':24s} {'trials':>6s} {'crashed':>7s} {'turns':>6s} {'violations':>10s}"]
    for kind in (*KINDS, FAILOVER) if any(r.plan.cluster for r in results) else KINDS:
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
    fos = [r.failover for r in results if r.failover is not None]
    if fos:
        held = [f.hold for f in fos if f.hold]
        promoted, restored = [f.promoted_s for f in fos], [f.restored_s for f in fos if f.restored_s]
        lines.append(
            f"failovers {len(fos)} ({sum(f.late for f in fos)} after the last event was written; the replica cut off "
            f"first in {len(held)}, {min(held, default=0):.2f}-{max(held, default=0):.2f}s), kill -> replica "
            f"promoted: median {statistics.median(promoted):.2f}s, max {max(promoted):.2f}s; -> old primary back "
            f"as its replica, in sync: median {statistics.median(restored or [0]):.2f}s, "
            f"max {max(restored or [0]):.2f}s"
        )
    if any(r.plan.cluster for r in results):
        lines.append(f"503 answers sent again {sum(r.refused for r in results)}")
    if secs:
        lines.append(f"trial time: median {statistics.median(secs):.1f}s, max {max(secs):.1f}s")
    lines.append(f"violations {sum(len(r.violations) for r in results)}, wall time {wall_s:.1f}s")
    return lines
