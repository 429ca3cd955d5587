"""Kill Valkey itself (SIGKILL, `appendfsync always`) while keel is mid-turn under a steady stream
of messages from a few concurrent clients. Nothing keel acknowledged is lost or duplicated, keel
reconnects by itself (no restart), re-sending what was not acknowledged (same message_ids)
completes it exactly once, and every session settles with its replies.

Evidence stays under the test's tmp dir: requests.jsonl (every request and its outcome),
summary.json, keel.log, valkey/valkey.log and valkey/'s AOF. KEEL_CRASH_SEED=<n> replays a run's
random choices (the timing of the kill is still up to the scheduler). The stream's own requests are
never retried: what failed is re-sent once the service is back, as the issue asks. After the
recovery nothing may fail (ATTEMPTS = 1): connections pooled before the kill must be noticed as
dead before use (redis-py 8.1 skipped that check with its default maintenance-notifications
setting, and each old connection failed one request with a 5xx)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from harness.store.keys import SessionKeys
from tests.conftest import ValkeyServer, free_port
from tests.service import Service

CLIENTS = 4
WAIT_S = 5  # ?wait=true&timeout= during the stream
RESEND_WAIT_S = 15
READY_DEADLINE_S = 10.0  # Valkey back -> keel's /readyz 200
WRITES_DEADLINE_S = 10.0  # ... -> writes acknowledged again
SETTLE_DEADLINE_S = 15.0
ATTEMPTS = 1  # tries of each request of the checks after the recovery: any 5xx then fails the test
ADD = re.compile(r"add (\d+) and (\d+)")


@dataclass
class Sent:
    """One request of the stream and what came of it."""

    n: int
    client: int
    kind: str  # "session" or "message"
    sid: str | None = None
    message_id: str | None = None
    text: str | None = None
    wait: bool = False
    sent_in: str = ""  # the phase when it was sent: before (the kill), outage, restarted, ready
    answered_in: str = ""
    status: int | None = None  # HTTP status; None: no answer (connection error, timeout)
    body: Any = None
    error: str | None = None
    at: list[float] = field(default_factory=list)  # sent, answered (monotonic)

    @property
    def acked(self) -> bool:
        """keel acknowledged it: 201 for a session, 202 for a message, 200 for ?wait=true."""
        return self.status == (201 if self.kind == "session" else 200 if self.wait else 202)

    @property
    def completed(self) -> bool:
        """A ?wait=true answer that reports the turn completed."""
        return self.acked and self.wait and isinstance(self.body, dict) and self.body.get("status") == "completed"


def expected(text: str) -> tuple[list[str], str]:
    """The demo agent's turn for `text`: the roles it leaves in history, and what its reply holds."""
    if m := ADD.fullmatch(text):
        return ["user", "assistant", "tool", "assistant"], str(int(m[1]) + int(m[2]))
    return ["user", "assistant"], text


class Stream:
    """Concurrent clients sending messages (and now and then creating a session) until stopped;
    every request is logged with the phase it was sent and answered in."""

    def __init__(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        self.http = http
        self.rng = rng
        self.phase = "before"
        self.log: list[Sent] = []
        self.sessions: list[str] = []  # acknowledged sessions, shared by all clients
        self.stop = asyncio.Event()
        self.retried: list[str] = []  # the checks' requests that failed once and were sent again
        self._progress = asyncio.Event()

    def count(self, pred: Callable[[Sent], bool]) -> int:
        return sum(1 for r in self.log if pred(r))

    async def until(self, what: str, cond: Callable[[], bool], timeout: float) -> None:
        """Wait (woken by each answered request) until `cond` holds."""
        try:
            async with asyncio.timeout(timeout):
                while not cond():
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout}s") from None

    async def send(self, rec: Sent, url: str, body: dict[str, Any]) -> Sent:
        rec.sent_in = self.phase
        rec.at.append(time.monotonic())
        self.log.append(rec)
        try:
            r = await self.http.post(url, json=body)
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        else:
            rec.status = r.status_code
            try:
                rec.body = r.json()
            except ValueError:
                rec.body = r.text[:300]
        rec.answered_in = self.phase
        rec.at.append(time.monotonic())
        self._progress.set()
        return rec

    async def call(self, method: str, url: str, *, timeout: float = 10.0, **kw: Any) -> httpx.Response:
        """A request of the checks: sent again (up to ATTEMPTS times) on a 5xx or a transport
        error, each retry logged; anything else is returned as it is."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                r = await self.http.request(method, url, timeout=timeout, **kw)
            except httpx.HTTPError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code < 500:
                    return r
                failure = f"{r.status_code} {r.text[:100]}"
            self.retried.append(f"{method} {url} {kw.get('json') or ''}: {failure}")
            if attempt == ATTEMPTS:
                raise AssertionError(f"{method} {url}: still failing after {ATTEMPTS} attempts: {failure}")
        raise AssertionError("unreachable")

    async def create_session(self, client: int) -> Sent:
        rec = await self.send(Sent(len(self.log), client, "session"), "/v1/sessions", {"metadata": {"c": client}})
        if rec.acked:
            rec.sid = rec.body["session_id"]
            self.sessions.append(rec.body["session_id"])
        return rec

    async def client(self, k: int, seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while not self.stop.is_set():
            n += 1
            if rng.random() < 0.06:
                rec = await self.create_session(k)
            else:
                mid = f"c{k}m{n}"
                text = f"add {rng.randrange(1000)} and {rng.randrange(1000)}" if rng.random() < 0.7 else f"note {mid}"
                rec = Sent(len(self.log), k, "message", rng.choice(self.sessions), mid, text, rng.random() < 0.4)
                url = f"/v1/sessions/{rec.sid}/messages" + (f"?wait=true&timeout={WAIT_S}" if rec.wait else "")
                await self.send(rec, url, {"text": text, "message_id": mid})
            if not rec.acked:
                await asyncio.sleep(0.02)  # a client's back-off after an error (pacing, not synchronisation)


@pytest.fixture
def valkey_always(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A Valkey of this test's own with `appendfsync always`, its data and log under tmp_path."""
    server = ValkeyServer(fsync="always")
    os.rmdir(server.dir)  # mkdtemp's empty dir: keep the AOF and log with the test's other evidence
    server.dir = str(tmp_path / "valkey")
    os.mkdir(server.dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def keel(valkey_always: ValkeyServer, tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port(), REDIS_URL=valkey_always.url, KEEL_AGENT="app.demo:agent", KEEL_LEASE_MS="1000")
    svc.start()
    yield svc
    svc.stop()


async def wait_ready(http: httpx.AsyncClient, deadline: float) -> tuple[float, list[str]]:
    """Poll /readyz until 200 (nothing else tells when keel has reconnected). Returns the time it
    took and what the polls saw before."""
    seen: list[str] = []
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(deadline):
            while True:
                try:
                    r = await http.get("/readyz", timeout=1.0)
                    if r.status_code == 200:
                        return time.monotonic() - t0, seen
                    seen.append(str(r.status_code))
                except httpx.HTTPError as exc:
                    seen.append(type(exc).__name__)
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"keel did not reconnect: /readyz not 200 within {deadline}s: {Counter(seen)}") from None


async def check_snapshot(stream: Stream, redis: Redis) -> dict[str, int]:
    """Right after recovery, with the clients still sending: every acknowledged session exists and
    every acknowledged message is present exactly once, as a user item in history or queued in the
    inbox (a message whose turn is running is in both). Exact, from one MULTI on Valkey; and through
    the API: acknowledged messages missing from history are at most the session's `queued` (and
    the turn in progress)."""
    acked = [r for r in stream.log if r.acked]  # read before the snapshot: all of these must be in it
    sids = sorted({r.sid for r in acked if r.sid})
    async with redis.pipeline(transaction=True) as pipe:
        for sid in sids:
            k = SessionKeys(sid)
            pipe.hget(k.meta, "turn")
            pipe.lrange(k.inbox, 0, -1)
            pipe.lrange(k.history, 0, -1)
        replies = await pipe.execute()
    durable: set[tuple[str, str]] = set()
    in_turn = 0
    for i, sid in enumerate(sids):
        turn, inbox, history = replies[3 * i : 3 * i + 3]
        assert turn is not None, f"acknowledged session {sid} is gone"
        in_turn += bool(turn)
        queued = Counter(json.loads(x)["message_id"] for x in inbox)
        users = Counter(json.loads(x).get("message_id") for x in history if json.loads(x)["role"] == "user")
        assert max([*queued.values(), 0]) <= 1, f"{sid}: a message queued twice: {queued}"
        assert max([*users.values(), 0]) <= 1, f"{sid}: a message twice in history: {users}"
        durable |= {(sid, m) for m in (*queued, *users)}
    lost = [asdict(r) for r in acked if r.kind == "message" and (r.sid, r.message_id) not in durable]
    assert not lost, f"acknowledged messages lost: {lost}"
    for sid in sids:
        mids = {r.message_id for r in acked if r.kind == "message" and r.sid == sid}
        info = await stream.call("GET", f"/v1/sessions/{sid}")
        assert info.status_code == 200, f"acknowledged session {sid}: {info.status_code} {info.text}"
        items = (await stream.call("GET", f"/v1/sessions/{sid}/history")).json()["items"]
        missing = mids - {i.get("message_id") for i in items if i["role"] == "user"}
        # `queued` counts the messages behind the turn in progress; that turn's own message may
        # not be in history yet (its user item is written with the turn's first step)
        behind = info.json()["queued"] + (1 if info.json()["status"] != "idle" else 0)
        assert len(missing) <= behind, f"{sid}: {missing} neither in history nor queued"
    unacked = {(r.sid, r.message_id) for r in stream.log if r.kind == "message" and not r.acked}
    return {"acked_then": len(acked), "unacked_but_durable": len(unacked & durable), "turns_in_progress": in_turn}


async def resend(stream: Stream, unacked: list[Sent]) -> dict[str, Any]:
    """Send every unacknowledged message again, same message_id, waiting for its turn (in order
    within a session, sessions at once). Each must complete."""
    by_sid: dict[str, list[Sent]] = {}
    for r in unacked:
        by_sid.setdefault(r.sid or "", []).append(r)
    answers: dict[str, Any] = {}

    async def one_session(recs: list[Sent]) -> None:
        for r in recs:
            resp = await stream.call(
                "POST",
                f"/v1/sessions/{r.sid}/messages?wait=true&timeout={RESEND_WAIT_S}",
                json={"text": r.text, "message_id": r.message_id},
                timeout=RESEND_WAIT_S + 5,
            )
            assert resp.status_code == 200, f"re-sending {asdict(r)}: {resp.status_code} {resp.text}"
            body = resp.json()
            assert body["status"] == "completed", f"re-sending {asdict(r)}: {body}"
            answers[r.message_id or ""] = body

    await asyncio.gather(*(one_session(recs) for recs in by_sid.values()))
    return answers


async def settle(stream: Stream, sids: list[str], deadline: float) -> None:
    """Poll each session until it is idle with nothing queued (no event says 'all settled')."""
    left = set(sids)
    last: dict[str, Any] = {}
    try:
        async with asyncio.timeout(deadline):
            while left:
                for sid in sorted(left):
                    info = (await stream.call("GET", f"/v1/sessions/{sid}")).json()
                    last[sid] = info
                    if info["status"] == "idle" and info["queued"] == 0 and not info["pending"]:
                        left.discard(sid)
                if left:
                    await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"sessions did not settle in {deadline}s: {[last[s] for s in left]}") from None


async def check_final(stream: Stream, redis: Redis, sids: list[str], resent: dict[str, Any]) -> int:
    """Every message ever sent (acknowledged, or re-sent after the recovery) is one whole turn in
    history, exactly once, with the demo agent's reply; what ?wait=true reported is what history
    holds; the outbox has each message, turn start and turn end once, seq without gaps."""
    turns_total = 0
    for sid in sids:
        sent = {r.message_id: r for r in stream.log if r.kind == "message" and r.sid == sid}
        items = (await stream.call("GET", f"/v1/sessions/{sid}/history")).json()["items"]
        items = [i for i in items if i["kind"] != "runtime"]  # the demo's date snapshot (once per session here)
        order = list(dict.fromkeys(i["turn_id"] for i in items))
        turns = {t: [i for i in items if i["turn_id"] == t] for t in order}
        assert [i["turn_id"] for i in items] == [t for t in order for _ in turns[t]], f"{sid}: turns interleave"
        by_mid: dict[str, tuple[str, str]] = {}
        for tid, t in turns.items():
            mid = t[0].get("message_id")
            assert t[0]["role"] == "user" and mid in sent, f"{sid}: a turn not from a sent message: {t}"
            assert mid not in by_mid, f"{sid}: message {mid} ran twice: {turns[by_mid[mid][0]]} and {t}"
            roles, holds = expected(sent[mid].text or "")
            assert [i["role"] for i in t] == roles and t[0]["text"] == sent[mid].text, f"{sid}: turn {t}"
            if len(roles) == 4:
                assert [c["name"] for c in t[1]["tool_calls"]] == ["add"], f"{sid}: turn {t}"
                assert t[2]["text"] == holds and not t[2]["is_error"], f"{sid}: turn {t}"
            assert holds in t[-1]["text"], f"{sid}: reply {t[-1]['text']!r} for {sent[mid].text!r}"
            by_mid[mid] = (tid, t[-1]["text"])
        missing = [asdict(r) for m, r in sent.items() if m not in by_mid]
        assert not missing, f"{sid}: sent (acknowledged or re-sent) but not in history: {missing}"
        for mid, r in sent.items():
            body = r.body if r.completed else resent.get(mid or "")
            if body is not None:
                said = (body["events"][0]["turn_id"], body["reply"])
                assert by_mid[mid or ""] == said, f"{sid}: {mid} answered {said}, history {by_mid[mid or '']}"
        turns_total += len(turns)
        check_outbox(sid, await redis.xrange(SessionKeys(sid).outbox), set(turns), set(by_mid))
    return turns_total


def check_outbox(sid: str, entries: list[Any], turns: set[str], mids: set[str]) -> None:
    seqs = [int(f[b"s"]) for _, f in entries]
    assert seqs == list(range(1, len(seqs) + 1)), f"{sid}: outbox seq {seqs}"
    kinds: Counter[tuple[str, str]] = Counter()
    for _, f in entries:
        etype, env = f[b"t"].decode(), json.loads(b"{" + f[b"b"])
        assert etype not in ("turn.failed", "turn.cancelled"), f"{sid}: {etype} {env}"
        key = env["data"]["message_id"] if etype == "message.received" else env["turn_id"]
        kinds[etype, key or ""] += 1
    for etype, want in (("message.received", mids), ("turn.started", turns), ("turn.completed", turns)):
        got = Counter({k: n for (t, k), n in kinds.items() if t == etype})
        assert got == Counter(dict.fromkeys(want, 1)), f"{sid}: {etype} not once per turn/message: {got}"


def write_evidence(tmp_path: Path, log: list[Sent], summary: dict[str, Any]) -> None:
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in log))
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))


def kill(server: ValkeyServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=10)
    server.proc = None


@pytest.mark.slow
async def test_killing_valkey_mid_turn_loses_no_acknowledged_write(
    valkey_always: ValkeyServer, keel: Service, tmp_path: Path
) -> None:
    seed = int(os.environ.get("KEEL_CRASH_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    where = f"(seed {seed}; evidence: {tmp_path}/requests.jsonl, summary.json, keel.log, valkey/valkey.log)"
    summary: dict[str, Any] = {"seed": seed}
    t_start = time.monotonic()
    async with httpx.AsyncClient(base_url=keel.base, timeout=WAIT_S + 5) as http:
        stream = Stream(http, rng)
        try:
            await scenario(stream, valkey_always, summary)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{where}\n{json.dumps(summary)}") from exc
        finally:
            stream.stop.set()
            summary["seconds"] = round(time.monotonic() - t_start, 2)
            summary.setdefault("checks_retried", stream.retried)
            write_evidence(tmp_path, stream.log, summary)
    print(json.dumps(summary))


async def scenario(stream: Stream, vk: ValkeyServer, summary: dict[str, Any]) -> None:
    for k in range(CLIENTS):
        assert (await stream.create_session(k)).acked, stream.log[-1]
    clients = [asyncio.create_task(stream.client(k, stream.rng.randrange(2**32))) for k in range(CLIENTS)]
    try:
        # the kill: once a random number of requests were acknowledged, mid-stream
        summary["kill_after_acks"] = kill_after = stream.rng.randint(20, 120)
        await stream.until(
            f"{kill_after} acknowledged requests", lambda: stream.count(lambda r: r.acked) >= kill_after, 15
        )
        kill(vk)
        killed_at = time.monotonic()
        stream.phase = "outage"
        summary["acked_before_kill"] = dict(
            Counter(f"{r.kind}:{r.status}" for r in stream.log if r.acked and r.answered_in == "before")
        )
        summary["in_flight_at_kill"] = stream.count(lambda r: r.answered_in == "")
        # the outage lasts until the clients have seen a random number of failures
        summary["outage_until_failures"] = failures = stream.rng.randint(3, 100)
        await stream.until("failed requests while Valkey is down", lambda: stream.count(outage_failure) >= failures, 10)
        summary["outage_s"] = round(time.monotonic() - killed_at, 2)
        vk.start()  # same port, same data dir; returns once it answers PING (the AOF is loaded)
        stream.phase = "restarted"
        summary["outage_failures"] = stream.count(outage_failure)
        lies = [asdict(r) for r in stream.log if r.acked and r.sent_in == "outage" and r.answered_in == "outage"]
        assert not lies, f"acknowledged while Valkey was down: {lies}"
        summary["ready_after_s"], polls = await wait_ready(stream.http, READY_DEADLINE_S)
        summary["readyz_before_ready"] = dict(Counter(polls))
        stream.phase = "ready"
        async with Redis.from_url(vk.url) as redis:
            summary.update(await check_snapshot(stream, redis))
            await stream.until(
                "write acknowledged after the recovery",
                lambda: stream.count(lambda r: r.acked and r.sent_in == "ready") >= 10,
                WRITES_DEADLINE_S,
            )
            stream.stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), WAIT_S + 10)
            summary["failed_after_ready"] = [asdict(r) for r in stream.log if r.sent_in == "ready" and not r.acked]
            summary["requests"] = dict(Counter(f"{r.kind}:{r.status or r.error}" for r in stream.log))
            unacked = [r for r in stream.log if r.kind == "message" and not r.acked]
            summary["resent"] = len(unacked)
            t0 = time.monotonic()
            resent = await resend(stream, unacked)
            sids = sorted(stream.sessions)
            await settle(stream, sids, SETTLE_DEADLINE_S)
            summary["resend_and_settle_s"] = round(time.monotonic() - t0, 2)
            summary["sessions"] = len(sids)
            summary["turns"] = await check_final(stream, redis, sids, resent)
            summary["checks_retried"] = stream.retried
    finally:
        for t in clients:
            t.cancel()
        for t in clients:
            with contextlib.suppress(asyncio.CancelledError):
                await t


def outage_failure(r: Sent) -> bool:
    return r.answered_in == "outage" and not r.acked
