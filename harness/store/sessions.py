"""The session store: every change to a session is one script of `protocol`, guarded where it
matters by the session lease's fencing token; reads are plain commands. The turn's scripts
(SUBMIT with its job, BEGIN, COMMIT) and the rest go by the `Wire`. The turn's own operations
(BEGIN, COMMIT, the attempts' accounting) are in `turns`.

A session ends when it is deleted (`delete`: every key at once) or, with `ttl_ms`, when it was
left alone that long (every key but the lease expires at the same moment, kept by the scripts
that create it, take a message, and end or pause a turn: at most an hour early, `lua.keep`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
from redis.asyncio.cluster import RedisCluster

from harness.errors import Conflict, Limited, NotFound, Unavailable
from harness.events import StoredEvent, envelope, event_body, made
from harness.store import protocol as p
from harness.store import protocol_relay
from harness.store.cache import HistoryCache
from harness.store.client import Client, translated
from harness.store.clusterwire import wire_for
from harness.store.deliveries import relay_job
from harness.store.keys import TOKEN_SECRET, DeliveryKeys, SessionKeys
from harness.store.queue import JobShards
from harness.store.turns import Turns
from harness.store.types import Begun, Responded, Submitted
from harness.store.wire import Replicas
from harness.types import (
    Answer,
    ApprovalRequest,
    InboxMessage,
    Item,
    answer_decoder,
    item_decoder,
    request_decoder,
)

R = TypeVar("R")
CommitMode = p.CommitMode
_enc = msgspec.json.Encoder()
KNOWN_MAX = 100_000
DELETE_TRIES = 5  # a delete that finds a relay begun on another destination reads `relays` again


def _missing(sid: str) -> NotFound:
    return NotFound(f"no session {sid}", code="session_not_found")


class Store(Turns):
    def __init__(
        self,
        redis: Client,
        *,
        retention: int = 10_000,
        cache_sessions: int = 1024,
        max_queued: int = 0,
        job_shards: int = 0,
        replicas: int = 0,
        replica_wait_ms: int = 1000,
        ttl_ms: int = 0,
    ) -> None:
        self.redis = redis
        # every script goes this way; with `replicas`, each waits for that many (KEEL_DURABILITY)
        self.wire = wire_for(redis, Replicas(replicas, replica_wait_ms) if replicas else None)
        self.jobs = JobShards(redis, job_shards)
        self.retention = retention
        self.ttl_ms = ttl_ms  # a session left alone this long expires, all of it (0: never)
        self.max_queued = max_queued  # messages that may wait behind a session's current turn (0: any)
        self._known: dict[str, str] = {}  # session id -> owner, seen to exist
        self._cache = HistoryCache(cache_sessions)

    async def close(self) -> None:
        await self.wire.close()

    @translated
    async def ping(self) -> None:
        await self.redis.ping()

    @translated
    async def load_scripts(self) -> None:
        """Have Redis know every script before the first one runs. (A Redis that forgets them
        later, restarted or flushed, answers NOSCRIPT, and the caller loads and runs again; a
        submit then adds its job twice, which is harmless.)"""
        if isinstance(self.redis, RedisCluster):  # (on every primary; redis-py's cluster pipeline has no SCRIPT LOAD)
            for script in p.SCRIPTS:
                await self.redis.script_load(script.source)
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for script in (*p.SCRIPTS, *protocol_relay.SCRIPTS):
                pipe.script_load(script.source)
            await pipe.execute()

    async def _run(self, script: p.Script[R], sid: str, args: msgspec.Struct) -> R:
        raw = await self.wire.script(script.sha, script.source, script.keys(SessionKeys(sid)), script.args(args))
        return script.reply(raw)

    # ---- session lifecycle -------------------------------------------------------------

    @translated
    async def create(
        self, sid: str, owner: str, metadata: dict[str, Any], *, deliver_to: Sequence[str] = ()
    ) -> StoredEvent:
        body = event_body(None, {"metadata": metadata})
        metadata_json = _enc.encode(metadata).decode()
        args = p.CreateArgs(owner, repr(time.time()), metadata_json, self.retention, body.decode(), self.ttl_ms)
        if deliver_to:
            keys = p.CREATE.keys(SessionKeys(sid))
            also = [relay_job(sid, d) for d in deliver_to]
            raw, *_ = await self.wire.script_with(p.CREATE.sha, p.CREATE.source, keys, p.CREATE.args(args), also)
            res = p.CREATE.reply(raw)
        else:
            res = await self._run(p.CREATE, sid, args)
        if isinstance(res, p.Exists):
            raise Conflict(f"session {sid} exists", code="session_exists")
        self._remember(sid, owner)
        return made(sid, res.id, res.seq, "session.created", body)

    @translated
    async def delete(self, sid: str, owner: str) -> str:
        """Remove every key of the session, the delivery relay's too, in one script. Returns
        the turn that was in progress ("" if none): its runner's next write is refused."""
        k = SessionKeys(sid)
        for _ in range(DELETE_TRIES):
            relays: Any = await self.redis.smembers(k.relays)
            destinations = sorted(d.decode() for d in relays)
            keys = p.DELETE.keys(k)
            for d in destinations:
                keys += [DeliveryKeys(sid, d).state, DeliveryKeys(sid, d).lease]
            args = p.DELETE.args(p.DeleteArgs(owner, destinations))
            res = p.DELETE.reply(await self.wire.script(p.DELETE.sha, p.DELETE.source, keys, args))
            if isinstance(res, p.Missing):
                raise _missing(sid)
            if isinstance(res, p.Deleted):
                self._known.pop(sid, None)
                self._cache.drop(sid)
                return res.turn_id
        raise Unavailable(f"session {sid}: its deliveries kept changing; delete it again")

    @translated
    async def exists(self, sid: str) -> bool:
        """Whether the session is there (a reader's look: no owner check)."""
        return bool(await self.redis.exists(SessionKeys(sid).meta))

    @translated
    async def meta(self, sid: str, owner: str) -> dict[str, str]:
        raw: Any = await self.redis.hgetall(SessionKeys(sid).meta)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        if not meta or meta.get("owner") != owner:
            raise _missing(sid)
        return meta

    @translated
    async def queued(self, sid: str) -> int:
        return int(await self.redis.llen(SessionKeys(sid).inbox))

    @translated
    async def submit(
        self,
        sid: str,
        owner: str,
        message: InboxMessage,
        *,
        begin_lease_ms: int | None = None,
        create: dict[str, Any] | None = None,
        deliver_to: Sequence[str] = (),
        look_first: bool = True,
    ) -> Submitted:
        """Record a message with its message.received event and, in the same round trip, its
        session's job; a repeated message_id returns the first one's ids (and queues the job
        again: had the first attempt died before its job, the retry repairs it). With
        `begin_lease_ms`, a message that is alone in the inbox (lease free) has its turn begun
        in the same script: the Begun comes back too. With `create` (metadata), a session that
        does not exist is created by the same script; with `deliver_to`, a relay job for each
        destination goes in the same round trip. Without `look_first` (a webhook channel's
        submit) it is one round trip whatever this process knows of the session."""
        body = event_body(message.turn_id, {"message_id": message.message_id, "text": message.text})
        begin = None
        have_start, have, epoch = self._cached(sid)
        if begin_lease_ms is not None:
            begin = p.BeginArgs("", begin_lease_ms, repr(time.time()), self.retention, have_start, len(have), epoch)
        new_session = None
        created_body = event_body(None, {"metadata": create}) if create is not None else b""
        if create is not None:
            metadata = _enc.encode(create).decode()
            new_session = p.CreateArgs(
                owner, repr(time.time()), metadata, self.retention, created_body.decode(), self.ttl_ms
            )
        entry = _enc.encode(message).decode()
        args = p.SubmitArgs(
            owner,
            message.message_id,
            message.turn_id,
            entry,
            self.retention,
            body.decode(),
            begin,
            new_session,
            self.max_queued,
            self.ttl_ms,
        )
        also = [relay_job(sid, d) for d in deliver_to]
        look = look_first and create is None
        res, job_id = await self._with_job(p.SUBMIT, sid, owner, args, also=also, look_first=look)
        if isinstance(res, p.Duplicate):
            return Submitted(True, res.turn_id, res.received_id, None, None, job_id)
        if isinstance(res, p.Full):
            raise self._full()
        assert isinstance(res, p.New)
        event = made(sid, res.id, res.seq, "message.received", body)
        began = self._begun(sid, res.began, have) if res.began is not None else None
        began_now = began if isinstance(began, Begun) else None
        created = made(sid, res.created, res.seq - 1, "session.created", created_body) if res.created else None
        return Submitted(False, message.turn_id, event.id, event, began_now, job_id, created)

    @translated
    async def enqueue(self, sid: str, owner: str, entry: InboxMessage, *, deliver_to: Sequence[str] = ()) -> str:
        """Queue a compact or clear entry behind the session's turns, with its job (and relay
        jobs for `deliver_to`) in the same round trip. Returns the job id."""
        args = p.EnqueueArgs(owner, _enc.encode(entry).decode(), self.max_queued)
        res, job_id = await self._with_job(p.ENQUEUE, sid, owner, args, also=[relay_job(sid, d) for d in deliver_to])
        if isinstance(res, p.Full):
            raise self._full()
        return job_id

    def _full(self) -> Limited:
        """The session's queue is full (nothing was written; the job that came along is harmless)."""
        message = f"{self.max_queued} messages already wait in this session; try again when it has answered"
        return Limited(message, code="queue_full", retry_after=1)

    @translated
    async def add_job(self, sid: str) -> str:
        """Queue a job for the session (it has work: an answer, a cancel). Returns its id."""
        (job_id,) = await self.wire.call([self.jobs.job(sid)])
        if isinstance(job_id, Exception):
            raise job_id
        return str(job_id.decode())

    async def _with_job(
        self,
        script: p.Script[R],
        sid: str,
        owner: str,
        args: msgspec.Struct,
        *,
        also: Sequence[Sequence[Any]] = (),
        look_first: bool = True,
    ) -> tuple[R, str]:
        """Run an owner-checked script and add the session's job (and `also`), in one round
        trip. A session this process has not seen is looked up first (unless not
        `look_first`), so a request for an unknown one writes nothing; without the look, a
        request for an unknown one leaves a job that finds nothing to do."""
        if look_first and self._known.get(sid) != owner:
            if await self.redis.hget(SessionKeys(sid).meta, "owner") != owner.encode():
                raise _missing(sid)
            self._remember(sid, owner)
        keys = script.keys(SessionKeys(sid))
        raw, job_id, *_ = await self.wire.script_with(
            script.sha, script.source, keys, script.args(args), [self.jobs.job(sid), *also]
        )
        res = script.reply(raw)
        if isinstance(res, p.Missing):  # another owner's, or one deleted (or expired) since it was seen
            self._known.pop(sid, None)
            raise _missing(sid)
        self._remember(sid, owner)
        return res, job_id.decode()

    def owner_known(self, sid: str) -> str | None:
        """The session's owner, if this process has seen it (no round trip)."""
        return self._known.get(sid)

    @translated
    async def add_relay_jobs(self, sid: str, destinations: Sequence[str]) -> None:
        """Relay jobs for the session and these destinations, in one round trip."""
        replies = await self.wire.call([relay_job(sid, d) for d in destinations])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply

    def _remember(self, sid: str, owner: str) -> None:
        """A session seen to exist stays known (a bounded memo: it only spares a look; the
        scripts check the owner, so one deleted since is still refused)."""
        if len(self._known) >= KNOWN_MAX:
            self._known.clear()
        self._known[sid] = owner

    @translated
    async def respond(
        self,
        sid: str,
        owner: str,
        request_id: str,
        answer: Answer,
        *,
        deliver_to: Sequence[str] = (),
        look_first: bool = True,
    ) -> Responded:
        """Record an answer. With `deliver_to`, the session's job and a relay job for each
        destination go in the same round trip (a webhook channel's click is one round trip)."""
        data: dict[str, str] = {"request_id": request_id, "decision": answer.decision, "reason": answer.reason}
        if answer.by:
            data["by"] = answer.by
        now = repr(round(time.time(), 6))
        args = p.RespondArgs(
            owner, request_id, _enc.encode(answer).decode(), self.retention, now, _enc.encode(data).decode()
        )
        job_id = None
        if deliver_to:
            also = [relay_job(sid, d) for d in deliver_to]
            res, job_id = await self._with_job(p.RESPOND, sid, owner, args, also=also, look_first=look_first)
        else:
            res = await self._run(p.RESPOND, sid, args)
        if isinstance(res, p.Missing):
            raise _missing(sid)
        if isinstance(res, p.Unknown):
            raise NotFound(f"no approval request {request_id} in session {sid}", code="request_not_found")
        if isinstance(res, p.Answered):
            return Responded(recorded=False, answer=answer_decoder.decode(res.answer), job_id=job_id)
        event = made(sid, res.id, res.seq, "input.resolved", res.body.encode())
        return Responded(recorded=True, answer=answer, runnable=res.left == 0, event=event, job_id=job_id)

    @translated
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

    @translated
    async def cancel(
        self,
        sid: str,
        owner: str,
        turn_id: str = "",
        *,
        deliver_to: Sequence[str] = (),
        look_first: bool = True,
        once: str = "",
    ) -> tuple[str | None, str | None]:
        """Ask the current (or next) turn, or only `turn_id`, to end. Returns the turn id (None
        if there is no such turn) and, with `deliver_to`, the session's job, queued in the same
        round trip with a relay job for that destination."""
        args = p.CancelArgs(owner, turn_id, once)
        job_id = None
        if deliver_to:
            also = [relay_job(sid, d) for d in deliver_to]
            res, job_id = await self._with_job(p.CANCEL, sid, owner, args, also=also, look_first=look_first)
        else:
            res = await self._run(p.CANCEL, sid, args)
        if isinstance(res, p.Missing):
            raise _missing(sid)
        return (res.turn_id if isinstance(res, p.Cancelling) else None), job_id

    @translated
    async def renew(self, sid: str, fence: str, lease_ms: int) -> bool:
        return (await self._run(p.RENEW, sid, p.LeaseArgs(fence, lease_ms))).held

    @translated
    async def release(self, sid: str, fence: str) -> None:
        await self._run(p.RELEASE, sid, p.LeaseArgs(fence))

    @translated
    async def shared_secret(self) -> bytes:
        """A random secret made by the first process that asks and read by all the others."""
        await self.redis.set(TOKEN_SECRET, os.urandom(32).hex(), nx=True)
        secret: Any = await self.redis.get(TOKEN_SECRET)
        return bytes(secret)

    # ---- reads ---------------------------------------------------------------------------

    @translated
    async def history(self, sid: str, owner: str, offset: int = 0, limit: int | None = None) -> list[Item]:
        """Active history from `offset` on, at most `limit` items (all when None)."""
        meta = await self.meta(sid, owner)
        first = int(meta["hist_start"]) + offset
        last = -1 if limit is None else first + limit - 1
        raw: Any = await self.redis.lrange(SessionKeys(sid).history, first, last)
        return [item_decoder.decode(r) for r in raw]

    @translated
    async def events(self, sid: str, after: str, count: int = 200) -> list[StoredEvent]:
        """Events after stream id `after` ("0-0" = from the start). By the wire: a reader's read,
        on its path, and cancellable (redis-py's write, in `wait_for` on Python 3.11, can swallow
        the cancellation of a reader that goes away)."""
        start = f"({after}" if after != "0-0" else "-"
        (raw,) = await self.wire.call([("XRANGE", SessionKeys(sid).outbox, start, "+", "COUNT", count)])
        if isinstance(raw, Exception):
            raise raw
        return [envelope(sid, eid, dict(zip(f[::2], f[1::2], strict=True))) for eid, f in raw]
