"""The session store on Redis: the only module (with the job queue) that talks to Redis.

Every change to a session is one of the scripts in `harness.lua`, guarded where it matters by
the session lease's fencing token. Reads are plain commands.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from redis.asyncio import Redis

from harness import lua
from harness.cache import HistoryCache
from harness.errors import Conflict, NotFound, StaleLease
from harness.events import (
    StoredEvent,
    decode_data,  # noqa: F401  (the decoder lived here first; tests import it from here)
    envelope,
    event_body,
    made,
    written,
)
from harness.keys import TOKEN_SECRET, SessionKeys
from harness.types import (
    Answer,
    ApprovalRequest,
    InboxMessage,
    Item,
    Usage,
    answer_decoder,
    inbox_decoder,
    item_decoder,
    request_decoder,
)
from harness.wire import Wire

_enc = msgspec.json.Encoder()
KNOWN_MAX = 100_000


class Begun(msgspec.Struct, frozen=True):
    """What BEGIN hands a runner: its fencing token and the state of the turn to run."""

    fence: str
    message: InboxMessage
    history: list[Item]  # active history before this turn
    turn_items: list[Item]  # what this turn already committed (non-empty only on resume)
    sticky: dict[str, str]
    started_id: str = ""  # the turn.started event this BEGIN wrote ("" when resuming a turn)
    cancel: bool = False  # a cancel was asked for this turn
    answers: dict[str, Answer | None] = {}  # the paused step's requests and their answers so far
    last_in: int = 0  # provider-reported input tokens of the session's last turn call (0: none)
    last_est: int = 0  # keel's estimate of that same request
    started: StoredEvent | None = None  # the event `started_id` names


def _started_type(message: InboxMessage) -> bytes:
    return b"compaction.requested" if message.kind == "compact" else b"turn.started"


class Submitted(NamedTuple):
    """What Store.submit did: a repeated message_id gives the first one's ids (and no event)."""

    duplicate: bool
    turn_id: str
    received_id: str
    received: StoredEvent | None  # its message.received, when new
    began: Begun | None  # the turn SUBMIT began, if it did
    job_id: str  # the job queued with it


class Busy(msgspec.Struct, frozen=True):
    retry_ms: int


class UsageRecord(msgspec.Struct, frozen=True):
    """A provider attempt's tokens, written by its step's COMMIT script before the fence is
    checked, so a refused or retried step still shows every attempt (I5)."""

    step: int
    usage: Usage
    estimate: int | None = None  # keel's estimate of the request (when compaction needs it)


class Committed(msgspec.Struct, frozen=True):
    events: list[StoredEvent]  # what the commit wrote to the outbox, in order
    more: bool = False  # final commit only: the inbox has another message, lease kept
    paused: bool = False  # pause commit: the session now waits for answers, lease released
    cancel: bool = False  # a cancel was asked for this turn: finish it as cancelled


class Responded(msgspec.Struct, frozen=True):
    """RESPOND's outcome: `answer` is the recorded one (the earlier one if already answered)."""

    recorded: bool
    answer: Answer
    runnable: bool = False  # this was the last open request of the paused turn
    event: StoredEvent | None = None  # its input.resolved, when recorded


COMMIT_MODE = {"step": "0", "final": "1", "pause": "2"}


class Store:
    def __init__(self, redis: Redis, *, retention: int = 10_000, cache_sessions: int = 1024) -> None:
        self.redis = redis
        self.wire = Wire(redis)  # the turn's hot scripts go this way
        self.retention = retention
        self._create = redis.register_script(lua.CREATE)
        self._submit = redis.register_script(lua.SUBMIT)
        self._enqueue = redis.register_script(lua.ENQUEUE)
        self._begin = redis.register_script(lua.BEGIN)
        self._commit = redis.register_script(lua.COMMIT)
        self._usage = redis.register_script(lua.USAGE)
        self._attempt = redis.register_script(lua.ATTEMPT)
        self._respond = redis.register_script(lua.RESPOND)
        self._cancel = redis.register_script(lua.CANCEL)
        self._renew = redis.register_script(lua.RENEW)
        self._release = redis.register_script(lua.RELEASE)
        self._known: dict[str, str] = {}  # session id -> owner, seen to exist
        self._cache = HistoryCache(cache_sessions)

    async def close(self) -> None:
        await self.wire.close()

    async def load_scripts(self) -> None:
        """Have Redis know every script before the first one runs. (A Redis that forgets them
        later, restarted or flushed, answers NOSCRIPT, and the caller loads and runs again; a
        submit then adds its job twice, which is harmless.)"""
        async with self.redis.pipeline(transaction=False) as pipe:
            for source in lua.SCRIPTS:
                pipe.script_load(source)
            await pipe.execute()

    # ---- session lifecycle -------------------------------------------------------------

    async def create(self, sid: str, owner: str, metadata: dict[str, Any]) -> StoredEvent:
        k = SessionKeys(sid)
        body = event_body(None, {"metadata": metadata})
        res = await self._create(
            keys=[k.meta, k.outbox], args=[owner, repr(time.time()), _enc.encode(metadata), self.retention, body]
        )
        if res[0] == b"exists":
            raise Conflict(f"session {sid} exists", code="session_exists")
        self._remember(sid, owner)
        return written(sid, [res[1]], int(res[2]), [("session.created", body)])[0]

    async def meta(self, sid: str, owner: str) -> dict[str, str]:
        raw: Any = await self.redis.hgetall(SessionKeys(sid).meta)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        if not meta or meta.get("owner") != owner:
            raise NotFound(f"no session {sid}", code="session_not_found")
        return meta

    async def queued(self, sid: str) -> int:
        return int(await self.redis.llen(SessionKeys(sid).inbox))

    async def submit(
        self,
        sid: str,
        owner: str,
        message: InboxMessage,
        *,
        also: Sequence[Sequence[Any]],
        begin_lease_ms: int | None = None,
    ) -> Submitted:
        """Record a message with its message.received event and, in the same round trip, what
        `also` adds to the pipeline (the job, whose id comes back as `job_id`); a repeated
        message_id returns the first one's ids. A session this process has not seen is looked up first, so a request
        for an unknown one writes nothing. With `begin_lease_ms`, a message that is alone in the
        inbox (lease free) has its turn begun in the same script: the Begun comes back too."""
        k = SessionKeys(sid)
        body = event_body(message.turn_id, {"message_id": message.message_id, "text": message.text})
        args: list[str | bytes | int] = [
            owner,
            message.message_id,
            message.turn_id,
            _enc.encode(message)[1:],
            self.retention,
            body,
        ]
        have_start, have = self._cached(sid)
        if begin_lease_ms is not None:
            args += ("1", begin_lease_ms, repr(time.time()), have_start, len(have))
        keys = [k.meta, k.inbox, k.mids, k.outbox, k.lease, k.history, k.sticky, k.decisions]
        res, extra = await self._with(
            sid, owner=owner, script=self._submit, source=lua.SUBMIT, keys=keys, args=args, also=also
        )
        if res[0] == b"dup":
            turn_id, received_id = res[1].decode().split(" ", 1)
            return Submitted(True, turn_id, received_id, None, None, extra[0].decode())
        event = written(sid, [res[1]], int(res[2]), [("message.received", body)])[0]
        began = self._begun(sid, res[3], have) if len(res) > 3 else None
        began_now = began if isinstance(began, Begun) else None
        return Submitted(False, message.turn_id, event.id, event, began_now, extra[0].decode())

    async def enqueue(self, sid: str, owner: str, entry: InboxMessage, *, also: Sequence[Sequence[Any]]) -> list[Any]:
        """Queue a compact or clear entry behind the session's turns, with `also` (the job) in
        the same round trip. Returns the replies of `also`."""
        k = SessionKeys(sid)
        keys, args = [k.meta, k.inbox], [owner.encode(), _enc.encode(entry)]
        _, extra = await self._with(
            sid, owner=owner, script=self._enqueue, source=lua.ENQUEUE, keys=keys, args=args, also=also
        )
        return extra

    async def _with(
        self,
        sid: str,
        *,
        owner: str,
        script: Any,
        source: str,
        keys: list[str],
        args: Sequence[str | bytes | int],
        also: Sequence[Sequence[Any]],
    ) -> tuple[Any, list[Any]]:
        """Run an owner-checked script and `also` in one pipeline. A session this process has
        not seen is looked up first, so a request for an unknown one writes nothing."""
        if self._known.get(sid) != owner:
            if await self.redis.hget(SessionKeys(sid).meta, "owner") != owner.encode():
                raise NotFound(f"no session {sid}", code="session_not_found")
            self._remember(sid, owner)
        replies = await self.wire.script_with(script.sha, source, keys, args, also)
        if replies[0][0] == b"missing":  # sessions are never deleted: only an owner mismatch gets here
            raise NotFound(f"no session {sid}", code="session_not_found")
        return replies[0], replies[1:]

    def _remember(self, sid: str, owner: str) -> None:
        """Sessions are never deleted, so one seen to exist stays known (a bounded memo)."""
        if len(self._known) >= KNOWN_MAX:
            self._known.clear()
        self._known[sid] = owner

    # ---- turns ---------------------------------------------------------------------------

    async def begin(self, sid: str, fence: str, lease_ms: int) -> Begun | Busy | None:
        """Take the session for its next turn. None: nothing to do (or no session)."""
        k = SessionKeys(sid)
        have_start, have = self._cached(sid)
        res = await self.wire.script(
            self._begin.sha,
            lua.BEGIN,
            [k.meta, k.inbox, k.lease, k.history, k.sticky, k.outbox, k.decisions],
            [fence, lease_ms, repr(time.time()), self.retention, have_start, len(have)],
        )
        return self._begun(sid, res, have)

    def _cached(self, sid: str) -> tuple[int, list[Item]]:
        cached = self._cache.get(sid)
        return (cached[0], cached[1]) if cached is not None else (-1, [])

    def _begun(self, sid: str, res: list[Any], have: list[Item]) -> Begun | Busy | None:
        """BEGIN's reply (or the one SUBMIT gives when it began the turn), decoded."""
        tag = res[0]
        if tag == b"busy":
            return Busy(retry_ms=max(int(res[1]), 1))
        if tag != b"ok":
            return None
        message = inbox_decoder.decode(res[2])
        n_before = int(res[3])
        flat = res[4]
        sticky = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        start, reused = int(res[6]), int(res[7])
        items = have if reused == len(have) else have[:reused]
        items.extend(item_decoder.decode(raw) for raw in res[5])
        self._cache.put(sid, start, items)
        return Begun(
            fence=str(res[1]),
            message=message,
            history=items[:n_before],
            turn_items=items[n_before:],
            sticky=sticky,
            started_id=res[8].decode(),
            cancel=res[9] == b"1",
            answers={
                res[10][i].decode(): answer_decoder.decode(res[10][i + 1]) if res[10][i + 1] else None
                for i in range(0, len(res[10]), 2)
            },
            last_in=int(res[11][0] or 0),
            last_est=int(res[11][1] or 0),
            started=made(sid, res[8], str(res[12]).encode(), _started_type(message), res[13]) if res[8] else None,
        )

    async def commit(
        self,
        sid: str,
        fence: str,
        turn_id: str,
        items: Sequence[Item],
        events: Sequence[tuple[str, bytes]],
        *,
        mode: str = "step",
        requests: Sequence[ApprovalRequest] = (),
        answers: Sequence[tuple[str, Answer]] = (),
        attempt: bool = False,
        rebase: int | None = None,
        usage: UsageRecord | None = None,
    ) -> Committed:
        """Commit a step (mode "step"), the end of a turn ("final"), or a pause for the
        approval `requests` ("pause"). `answers` records answers the harness gives itself
        (withdrawn requests of a cancelled turn). `attempt`: a model call follows; count it now.
        `rebase`: `items` become the whole active history (compaction, clear), the current
        turn's items beginning at that offset in them. `usage`: the model call's tokens, written
        by the same script first (its usage.recorded comes first in `events`; written even if
        the commit is refused as stale)."""
        k = SessionKeys(sid)
        waiting_on = " ".join(r.request_id for r in requests) if mode == "pause" else ""
        args: list[Any] = [fence, turn_id, self.retention, COMMIT_MODE[mode], waiting_on, int(attempt)]
        args.append("" if rebase is None else rebase)
        recorded: list[tuple[str, bytes]] = []
        if usage is None:
            args += ("", 0, 0, 0, "", "")
        else:
            body, usage_args = self._usage_call(
                turn_id, usage.step, usage.usage, failed=False, purpose="turn", estimate=usage.estimate
            )
            args += ("1", *usage_args[1:])  # (the USAGE script's arguments, without its retention)
            recorded.append(("usage.recorded", body))
        args.append(len(items))
        args.extend(_enc.encode(item) for item in items)
        args.append(len(requests))
        for r in requests:
            args += (r.request_id, _enc.encode(r))
        args.append(len(answers))
        resolved: list[tuple[str, bytes]] = []
        for rid, answer in answers:
            data = {"request_id": rid, "decision": answer.decision, "reason": answer.reason}
            resolved.append(("input.resolved", event_body(turn_id, data)))
            args += (rid, _enc.encode(answer), resolved[-1][1])
        for etype, body in events:
            args += (etype, body)
        keys = [k.meta, k.lease, k.history, k.outbox, k.inbox, k.pending, k.decisions]
        res = await self.wire.script(self._commit.sha, lua.COMMIT, keys, args)
        if res[0] == b"stale":
            raise StaleLease(f"session {sid}: lease {fence} is no longer held")
        if rebase is None:
            self._cache.extend(sid, list(items), int(res[2]))
        else:
            self._cache.put(sid, int(res[2]) - len(items), list(items))
        emitted = recorded + [resolved[int(n)] for n in res[5]] + list(events)
        return Committed(
            events=written(sid, res[1], int(res[4]), emitted),
            more=res[0] == b"more",
            paused=res[0] == b"paused",
            cancel=res[3] == b"1",
        )

    async def record_usage(
        self,
        sid: str,
        turn_id: str,
        step: int,
        usage: Usage,
        *,
        failed: bool = False,
        purpose: str = "turn",
        estimate: int | None = None,
    ) -> StoredEvent:
        """Account one provider attempt, before its step commits (I5); a failed attempt too.
        `estimate`: keel's estimate of the request, kept with its reported input tokens (turn
        calls only) for compaction's threshold. Returns the usage.recorded event."""
        k = SessionKeys(sid)
        body, args = self._usage_call(turn_id, step, usage, failed=failed, purpose=purpose, estimate=estimate)
        res = await self._usage(keys=[k.meta, k.outbox], args=args)
        return written(sid, [res[0]], int(res[1]), [("usage.recorded", body)])[0]

    def _usage_call(
        self, turn_id: str, step: int, usage: Usage, *, failed: bool, purpose: str, estimate: int | None
    ) -> tuple[bytes, list[Any]]:
        """The usage.recorded body and the USAGE script's arguments."""
        data: dict[str, Any] = {
            "step": step,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_tokens": usage.cached_tokens,
        }
        if failed:
            data["failed"] = True
        if purpose != "turn":
            data["purpose"] = purpose
        body = event_body(turn_id, data)
        args = [self.retention, usage.input_tokens, usage.output_tokens, usage.cached_tokens, body]
        args.append("" if estimate is None or failed else estimate)
        return body, args

    async def count_attempt(self, sid: str) -> None:
        """Count a model call about to be made, when no commit or BEGIN just did."""
        await self._attempt(keys=[SessionKeys(sid).meta])

    async def respond(self, sid: str, owner: str, request_id: str, answer: Answer) -> Responded:
        k = SessionKeys(sid)
        data = {"request_id": request_id, "decision": answer.decision, "reason": answer.reason}
        res = await self._respond(
            keys=[k.meta, k.pending, k.decisions, k.outbox],
            args=[
                owner,
                request_id,
                _enc.encode(answer),
                self.retention,
                repr(round(time.time(), 6)),
                _enc.encode(data),
            ],
        )
        tag = res[0]
        if tag == b"missing":
            raise NotFound(f"no session {sid}", code="session_not_found")
        if tag == b"unknown":
            raise NotFound(f"no approval request {request_id} in session {sid}", code="request_not_found")
        if tag == b"answered":
            return Responded(recorded=False, answer=answer_decoder.decode(res[1]))
        event = made(sid, res[1], str(res[3]).encode(), b"input.resolved", res[4])
        return Responded(recorded=True, answer=answer, runnable=int(res[2]) == 0, event=event)

    async def open_requests(self, sid: str, meta: dict[str, str]) -> list[ApprovalRequest]:
        """The paused turn's requests that have no answer yet, in the order they were made."""
        rids = meta.get("waiting_on", "").split()
        if not rids:
            return []
        k = SessionKeys(sid)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(k.pending, rids)
            pipe.hmget(k.decisions, rids)
            requests, answers = await pipe.execute()
        return [request_decoder.decode(r) for r, a in zip(requests, answers, strict=True) if r and not a]

    async def cancel(self, sid: str, owner: str, turn_id: str = "") -> str | None:
        """Ask the current (or next) turn, or only `turn_id`, to end. Returns the turn id; None
        if there is no such turn."""
        k = SessionKeys(sid)
        res = await self._cancel(keys=[k.meta, k.inbox], args=[owner, turn_id])
        if res[0] == b"missing":
            raise NotFound(f"no session {sid}", code="session_not_found")
        return None if res[0] == b"idle" else res[1].decode()

    async def renew(self, sid: str, fence: str, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[SessionKeys(sid).lease], args=[fence, lease_ms]))

    async def release(self, sid: str, fence: str) -> None:
        await self._release(keys=[SessionKeys(sid).lease], args=[fence])

    async def shared_secret(self) -> bytes:
        """A random secret made by the first process that asks and read by all the others."""
        await self.redis.set(TOKEN_SECRET, os.urandom(32).hex(), nx=True)
        secret: Any = await self.redis.get(TOKEN_SECRET)
        return bytes(secret)

    # ---- reads ---------------------------------------------------------------------------

    async def history(self, sid: str, owner: str, offset: int = 0, limit: int | None = None) -> list[Item]:
        """Active history from `offset` on, at most `limit` items (all when None)."""
        meta = await self.meta(sid, owner)
        first = int(meta["hist_start"]) + offset
        last = -1 if limit is None else first + limit - 1
        raw: Any = await self.redis.lrange(SessionKeys(sid).history, first, last)
        return [item_decoder.decode(r) for r in raw]

    async def events(self, sid: str, after: str, count: int = 200) -> list[StoredEvent]:
        """Events after stream id `after` ("0-0" = from the start)."""
        raw: Any = await self.redis.xrange(
            SessionKeys(sid).outbox, min=f"({after}" if after != "0-0" else "-", count=count
        )
        return [envelope(sid, eid, fields) for eid, fields in raw]
