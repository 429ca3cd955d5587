"""The session store (`Store`): a session's commands, its turns', and what it publishes.

The session store: every change to a session is one script of `protocol`, guarded where it
matters by the session lease's fencing token; reads are plain commands. The turn's scripts
(SUBMIT with its job, BEGIN, COMMIT) and the rest go by the `Wire`.

The store publishes what it commits: every command that writes events hands them (byte for byte
what a read of the outbox returns) to the `EventHub` it owns, for this process's readers, and
counts them. A commit that settles a turn also queues the relay jobs of webhooks its owner made
while the turn ran. Where a command delivers to is the caller's destination (a webhook
channel's), else the owner's event webhooks (`Subscriptions.targets`).

A session ends when it is deleted (`delete`: every key at once) or, with `ttl_ms`, when it was
left alone that long (every key but the lease expires at the same moment, kept by the scripts
that create it, take a message, and end or pause a turn: at most an hour early, `lua.keep`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
from redis.asyncio.cluster import RedisCluster

from harness import failpoints
from harness.errors import Conflict, Limited, NotFound, StaleLease, Unavailable
from harness.events import (
    CompactionRequested,
    InputResolved,
    InputResolvedData,
    MessageReceived,
    MessageReceivedData,
    MessageSteered,
    MessageSteeredData,
    Pending,
    SessionCreated,
    SessionCreatedData,
    StoredEvent,
    TurnStarted,
    UsageRecordedData,
    body,
    made,
    pending,
    written,
)
from harness.store import catalog, protocol_relay, quotas
from harness.store import protocol as p
from harness.store.cache import HistoryCache
from harness.store.client import Client, translated
from harness.store.clusterwire import wire_for
from harness.store.deliveries import Deliveries, relay_job
from harness.store.hooks import Subscriptions
from harness.store.hub import EventHub
from harness.store.keys import TOKEN_SECRET, DeliveryKeys, SessionKeys
from harness.store.outbox import Outbox
from harness.store.queue import JobId, JobShards
from harness.store.types import (
    AlreadyAnswered,
    AwaitingAnswers,
    BeginOutcome,
    Begun,
    Busy,
    CancelAsked,
    Cancelling,
    CancelPending,
    Commit,
    CommitMode,
    Ended,
    NothingToCancel,
    NoWork,
    Recorded,
    Responded,
    SessionMeta,
    Stepped,
    Submitted,
    UsageRecord,
    Withheld,
)
from harness.store.wire import Replicas, raised
from harness.telemetry.metrics import HarnessStats
from harness.types import (
    Answer,
    ApprovalRequest,
    InboxMessage,
    Item,
    MessagePolicy,
    Usage,
    answer_decoder,
    inbox_decoder,
    item_decoder,
    request_decoder,
)

log = logging.getLogger("keel")
R = TypeVar("R")
_enc = msgspec.json.Encoder()
_MADE = ("summary", "todo")  # items a compaction makes, with the id of the turn it ran in
_inbox = msgspec.json.Decoder(InboxMessage)
_metadata = msgspec.json.Decoder(dict[str, Any])
KNOWN_MAX = 100_000
DAY_MS = 86_400_000
# a note on a refused message, once: its field, expiring (a server without field expiry keeps
# it as long as the hash, `ttl` after the newest note)
_NOTED = """
if redis.call('HSETNX', KEYS[1], ARGV[1], 1) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.pcall('HPEXPIRE', KEYS[1], ARGV[2], 'FIELDS', 1, ARGV[1])
return 1
"""
DELETE_TRIES = 5  # a delete that finds a relay begun on another destination reads `relays` again
UPDATE_TRIES = 32  # a metadata change that finds another made meanwhile merges again (each round one wins)


def _missing(sid: str) -> NotFound:
    return NotFound(f"no session {sid}", code="session_not_found")


class Store:
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
        retention_ms: int = DAY_MS,
        idempotency_ms: int = DAY_MS,
        stats: HarnessStats | None = None,
    ) -> None:
        if 0 < retention_ms < idempotency_ms or (retention_ms > 0 and idempotency_ms == 0):
            # (a message sent again within its id's window is answered from its turn's events)
            raise ValueError("events must be kept at least as long as message ids (retention_ms >= idempotency_ms)")
        self.redis = redis
        # every script goes this way; with `replicas`, each waits for that many (KEEL_DURABILITY)
        # (this process's name to the others: its scripts' notices skip it, its live events too)
        self.origin = os.urandom(8).hex()
        self.wire = wire_for(redis, Replicas(replicas, replica_wait_ms) if replicas else None, self.origin)
        self.retention_ms = retention_ms  # events older than this leave the outbox (0: kept by count only)
        self.idempotency_ms = idempotency_ms  # a message id is remembered this long (0: for the session's life)
        self._windows()
        self.jobs = JobShards(redis, job_shards, wire=self.wire)
        self.hub = EventHub(redis, self.wire, self.origin)
        self.outbox = Outbox(redis, self.wire, self.hub)
        self.hooks = Subscriptions(redis, self.wire)
        self.deliveries = Deliveries(redis, self.wire)
        self.buckets = quotas.RateBuckets(self.wire)
        self.catalog = catalog.Catalog(self.wire, ttl_ms)
        self.stats = stats or HarnessStats()
        self.retention = retention
        self.ttl_ms = ttl_ms  # a session left alone this long expires, all of it (0: never)
        self.max_queued = max_queued  # messages that may wait behind a session's current turn (0: any)
        self._known: dict[str, str] = {}  # session id -> owner, seen to exist
        self._cache = HistoryCache(cache_sessions)
        self._tasks: set[asyncio.Task[None]] = set()

    def _windows(self) -> None:
        """Every script's ARGV past its own: this process's origin, and the windows (lua._EMIT)."""
        self.wire.argv = (self.origin, str(self.retention_ms), str(self.idempotency_ms))

    async def _field_expiry(self) -> bool:
        """Whether the server expires a hash's fields one by one (HPEXPIRE: Valkey 9, Redis 7.4)."""
        info: Any = await self.redis.execute_command("COMMAND", "INFO", "HPEXPIRE")
        found = info.values() if isinstance(info, dict) else info  # (a cluster client's: by node)
        return any(bool(i) for i in found)

    @translated
    async def start(self) -> None:
        """Have Redis know every script before the first one runs, the job streams' groups made,
        and the hub listening. (A Redis that forgets the scripts later, restarted or flushed,
        answers NOSCRIPT, and the caller loads and runs again; a submit then adds its job twice,
        which is harmless.)"""
        await self.jobs.ensure_groups()
        if self.idempotency_ms > 0 and not await self._field_expiry():
            log.warning(
                "this Redis cannot expire a hash's fields (HPEXPIRE: Valkey >= 9, Redis >= 7.4): "
                "message ids are remembered for their session's life, not KEEL_IDEMPOTENCY_HOURS"
            )
            self.idempotency_ms = 0
            self._windows()
        scripts = (*p.SCRIPTS, *protocol_relay.SCRIPTS, *quotas.SCRIPTS)
        if isinstance(self.redis, RedisCluster):  # (on every primary; redis-py's cluster pipeline has no SCRIPT LOAD)
            for script in scripts:
                await self.redis.script_load(script.source)
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for script in scripts:
                    pipe.script_load(script.source)
                await pipe.execute()
        self.hub.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.jobs.flush()
        await self.hub.stop()
        await self.wire.close()

    @translated
    async def ping(self) -> None:
        await self.redis.ping()

    async def _run(self, script: p.Script[R], sid: str, args: msgspec.Struct, lazy: Sequence[Any] = ()) -> R:
        keys = script.session_keys(sid)
        if lazy:
            raw, *_ = await self.wire.script_with(
                script.sha, script.source, keys, script.args(args), (), lazy=lazy, post=True
            )
        else:
            raw = await self.wire.script(script.sha, script.source, keys, script.args(args))
        return script.reply(raw)

    async def _read(self, script: p.Script[R], sid: str, args: msgspec.Struct) -> R:
        """A script that writes nothing (not waited for by replicas, as a plain read is not)."""
        keys = script.session_keys(sid)
        return script.reply(await self.wire.read(script.sha, script.source, keys, script.args(args)))

    @staticmethod
    def _activity(sid: str, items: Sequence[Item], mode: CommitMode) -> dict[str, str]:
        """A turn's end or pause as its session's activity: when, and the start of its reply."""
        if mode == "step":
            return {}
        reply = next((i.text for i in reversed(items) if i.role == "assistant" and i.kind == "message" and i.text), "")
        return {"at": repr(time.time()), "preview": reply[: catalog.PREVIEW_CHARS]}

    def _touched(self, sid: str, at: str) -> list[tuple[Any, ...]]:
        """The session's new place in its owner's list (its owner known here: a turn's BEGIN
        tells it), to go with the script that records the activity `at`."""
        owner = self._known.get(sid)
        return catalog.touch(owner, sid, float(at), self.ttl_ms) if at and owner is not None else []

    def _published(self, sid: str, events: list[StoredEvent], *, settled: bool = False) -> None:
        """What this process committed: counted, handed to its readers; a settled turn's owner's
        new webhooks get their relay jobs."""
        if events:
            self.stats.committed(events)
            self.hub.publish(sid, events, settled=settled)
        if settled:
            self._settled(sid)

    # ---- session lifecycle -------------------------------------------------------------

    @translated
    async def create(self, sid: str, owner: str, metadata: dict[str, Any]) -> StoredEvent:
        """A new session of `owner` (Conflict if the id is taken), its session.created event,
        and a relay job for each of the owner's webhooks, in one round trip."""
        created = body(None, SessionCreatedData(metadata))
        metadata_json = _enc.encode(metadata).decode()
        now = time.time()
        args = p.CreateArgs(owner, repr(now), metadata_json, self.retention, created.decode(), self.ttl_ms)
        return await self._new_session(p.CREATE, sid, owner, args, created=created, now=now)

    async def _new_session(
        self,
        script: p.Script[p.Added | p.Exists],
        sid: str,
        owner: str,
        args: msgspec.Struct,
        *,
        created: bytes,
        now: float,
    ) -> StoredEvent:
        """Run the script that makes session `sid` (CREATE, FORK) with, in the same round trip,
        its place in its owner's list and a relay job for each of the owner's webhooks; its
        session.created (Conflict if the id is taken)."""
        destinations = await self.hooks.targets(owner)
        also = [relay_job(sid, d) for d in destinations]
        keys = script.session_keys(sid)
        lazy = catalog.touch(owner, sid, now, self.ttl_ms)
        raw, *_ = await self.wire.script_with(script.sha, script.source, keys, script.args(args), also, lazy=lazy)
        res = script.reply(raw)
        if isinstance(res, p.Exists):
            raise Conflict(f"session {sid} exists", code="session_exists")
        self._remember(sid, owner)
        event = made(sid, res.id, res.seq, SessionCreated.TYPE, created)
        self._published(sid, [event])
        return event

    @translated
    async def delete(self, sid: str, owner: str) -> str:
        """Remove every key of the session, the delivery relay's too, in one script; the turn
        in progress is told to stop wherever it runs, and the session's readers everywhere that
        it ended. Returns that turn ("" if none): its runner's next write is refused."""
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
                with contextlib.suppress(Exception):  # (best effort: a page drops what is gone anyway)
                    raised(await self.wire.call([catalog.untouch(owner, sid)]))
                self._known.pop(sid, None)
                self._cache.drop(sid)
                if res.turn_id:
                    self.hub.cancel(sid, res.turn_id)
                self.hub.ended(sid)
                return res.turn_id
        raise Unavailable(f"session {sid}: its deliveries kept changing; delete it again")

    @translated
    async def fork(self, sid: str, owner: str, new_sid: str, before_message_id: str | None = None) -> StoredEvent:
        """A new session `new_sid` of the same owner and metadata whose history is the source's
        active history: all of it, or what came before message `before_message_id`'s turn; a
        turn in progress is never in it. The source is only read. NotFound (`message_not_found`)
        for a message the source does not have; Conflict (`message_not_in_history`) for one
        whose turn left nothing in the active history (compacted away or cleared). Returns the
        new session's session.created."""
        src = await self._read(p.FORK_READ, sid, p.ForkReadArgs(owner, before_message_id or ""))
        if isinstance(src, p.Missing):
            raise _missing(sid)
        items = [item_decoder.decode(raw) for raw in src.items]
        end = max(0, src.turn_start - src.hist_start) if src.turn else len(items)  # (finished turns only)
        if before_message_id is not None:
            if not src.message_turn:
                raise NotFound(f"no message {before_message_id} in session {sid}", code="message_not_found")
            # (the turn's own first item: a summary or to-do list a compaction during that turn
            # wrote carries its id too, and is what came before it; a runtime snapshot a
            # compaction put back after its summary keeps the id of the turn that made it, which
            # is in the active history only if an item of its own besides is)
            own = [n for n, item in enumerate(items) if item.turn_id == src.message_turn and item.kind not in _MADE]
            cut = own[0] if any(items[n].kind != "runtime" for n in own) else None
            if cut is None and not (src.queued or src.message_turn == src.turn):
                raise Conflict(
                    f"message {before_message_id}'s turn left nothing in the active history (compacted away "
                    "or cleared): fork before a later message",
                    code="message_not_in_history",
                )
            end = min(end, cut if cut is not None else end)
        kept = items[:end]
        metadata = _metadata.decode(src.metadata)
        created = body(None, SessionCreatedData(metadata))
        now = time.time()
        create = p.CreateArgs(owner, repr(now), src.metadata, self.retention, created.decode(), self.ttl_ms)
        last = next((i.text for i in reversed(kept) if i.kind == "message" and i.text), "")
        copied = [(i.message_id, i.turn_id) for i in kept if i.role == "user" and i.kind == "message" and i.message_id]
        encoded = [_enc.encode(i).decode() for i in kept]
        args = p.ForkArgs(create, encoded, src.title, last[: catalog.PREVIEW_CHARS], copied)
        return await self._new_session(p.FORK, new_sid, owner, args, created=created, now=now)

    @translated
    async def update(
        self,
        sid: str,
        owner: str,
        *,
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        check: Callable[[dict[str, Any]], None] = lambda merged: None,
    ) -> None:
        """Set the session's title, and merge `metadata` into its metadata (a None value
        removes its key); `check` sees the merged metadata before it is written (and may refuse
        it). A merge is written only onto the metadata it was made from: a concurrent change
        makes it merge again."""
        k = SessionKeys(sid)
        for _ in range(UPDATE_TRIES):
            args = p.UpdateArgs(owner, title)
            if metadata is not None:
                raw: Any = await self.redis.hmget(k.meta, ["owner", "metadata"])
                if raw[0] != owner.encode():
                    raise _missing(sid)
                merged = _metadata.decode(raw[1])
                for key, value in metadata.items():
                    if value is None:
                        merged.pop(key, None)
                    else:
                        merged[key] = value
                check(merged)
                args = p.UpdateArgs(owner, title, _enc.encode(merged).decode(), raw[1].decode())
            res = await self._run(p.UPDATE, sid, args)
            if isinstance(res, p.Missing):
                raise _missing(sid)
            if isinstance(res, p.Done):
                return
        raise Unavailable(f"session {sid}: its metadata kept changing; send the change again")

    @translated
    async def meta(self, sid: str, owner: str) -> SessionMeta:
        """The session's meta; NotFound if it is not there or not the owner's."""
        raw: Any = await self.redis.hgetall(SessionKeys(sid).meta)
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        if not meta or meta.get("owner") != owner:
            raise _missing(sid)
        return SessionMeta(
            owner=owner,
            status=meta["status"],
            created_at=float(meta["created_at"]),
            metadata=_metadata.decode(meta["metadata"]),
            turn=meta.get("turn", ""),
            waiting_on=tuple(meta.get("waiting_on", "").split()),
            input_tokens=int(meta.get("u_in", 0)),
            output_tokens=int(meta.get("u_out", 0)),
            cached_tokens=int(meta.get("u_cached", 0)),
            cache_write_tokens=int(meta.get("u_cwrite", 0)),
            model_calls=int(meta.get("u_calls", 0)),
            title=meta.get("title"),
            updated_at=float(meta.get("updated_at", meta["created_at"])),
        )

    @translated
    async def queued(self, sid: str) -> int:
        return int(await self.redis.llen(SessionKeys(sid).inbox))

    @translated
    async def head(self, sid: str) -> InboxMessage | None:
        """The inbox's first entry: the turn in progress, or the next one to begin."""
        raw = await self.redis.lindex(SessionKeys(sid).inbox, 0)
        return _inbox.decode(raw) if raw is not None else None

    @translated
    async def received(self, sid: str, message_id: str) -> tuple[str, str] | None:
        """(turn_id, the id of its message.received) of message `message_id`, if recorded."""
        raw = await self.redis.hget(SessionKeys(sid).mids, message_id)
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        turn_id, _, received_id = text.partition(" ")
        return (turn_id, received_id) if received_id else None

    @translated
    async def first_note(self, sid: str, message_id: str, ttl_ms: int) -> bool:
        """Whether no note on message `message_id` was made in the last `ttl_ms` (one is now).
        The session's `noted` hash: a field a message, expiring (and all of it `ttl_ms` after the
        newest; deleted with the session)."""
        return bool(await self.redis.eval(_NOTED, 1, SessionKeys(sid).noted, message_id, ttl_ms))

    @translated
    async def turn_ended(self, sid: str, message_id: str) -> bool:
        """Whether message `message_id`'s turn has ended, as its id shows: the id's window (its
        field's expiry) starts when its turn ends. False where ids have no window (none set, or
        a server without field expiry): not known then."""
        if self.idempotency_ms <= 0:
            return False
        ttl: Any = await self.redis.execute_command("HPTTL", SessionKeys(sid).mids, "FIELDS", 1, message_id)
        return bool(ttl) and int(ttl[0]) > 0

    @translated
    async def submit(
        self,
        sid: str,
        owner: str,
        message: InboxMessage,
        *,
        begin_lease_ms: int | None = None,
        create: dict[str, Any] | None = None,
        deliver_to: str | None = None,
        policy: MessagePolicy = "queue",
    ) -> Submitted:
        """Record a message with its message.received event and, in the same round trip, its
        session's job; a repeated message_id returns the first one's ids (and queues the job
        again: had the first attempt died before its job, the retry repairs it). With
        `begin_lease_ms`, a message that is alone in the inbox (lease free) has its turn begun
        in the same script: the Begun comes back too. With `create` (metadata), a session that
        does not exist is created by the same script; a relay job for `deliver_to` (a webhook
        channel's destination: then it is one round trip whatever this process knows of the
        session), else for each of the owner's webhooks, goes in the same round trip."""
        received = body(message.turn_id, MessageReceivedData(message.message_id, message.text))
        now = time.time()
        begin = None
        have_start, have, epoch = self._cached(sid)
        if begin_lease_ms is not None:
            begin = p.BeginArgs("", begin_lease_ms, repr(time.time()), self.retention, have_start, len(have), epoch)
        new_session = None
        created = body(None, SessionCreatedData(create)) if create is not None else b""
        if create is not None:
            metadata = _enc.encode(create).decode()
            new_session = p.CreateArgs(
                owner, repr(time.time()), metadata, self.retention, created.decode(), self.ttl_ms
            )
        args = p.SubmitArgs(
            owner,
            message.message_id,
            message.turn_id,
            _enc.encode(message).decode(),
            self.retention,
            received.decode(),
            begin,
            new_session,
            self.max_queued,
            self.ttl_ms,
            at=repr(now),
            preview=message.text[: catalog.PREVIEW_CHARS],
            title=message.text[: catalog.TITLE_CHARS],
            policy=policy,
            # (the message.steered event's data, should it join the running turn)
            steered=_enc.encode(MessageSteeredData(message.message_id, message.text)).decode()
            if policy == "steer"
            else "",
        )
        if policy == "reject" and await self._busy_for(sid, message.message_id):
            raise self._busy(sid)  # (nothing written, the job neither; SUBMIT checks again)
        destinations = [deliver_to] if deliver_to else await self.hooks.targets(owner)
        look = deliver_to is None and create is None
        res, job = await self._with_job(
            p.SUBMIT, sid, owner, args, destinations, look_first=look, touch=now, listed=create is None
        )
        if isinstance(res, p.Duplicate):
            return Submitted(True, res.turn_id, res.received_id, job)
        if isinstance(res, p.Full):
            raise self._full()
        if isinstance(res, p.Rejected):
            raise self._busy(sid)
        assert isinstance(res, p.New)
        if res.steered is not None:
            steered = made(sid, res.id, res.seq, MessageSteered.TYPE, res.body.encode())
            self._published(sid, [steered])
            return Submitted(False, res.steered, steered.id, job, steered, steered=True)
        if res.interrupted is not None:
            self.hub.cancel(sid, res.interrupted)  # (its model call, wherever it streams, stops now)
        event = made(sid, res.id, res.seq, MessageReceived.TYPE, received)
        made_session = made(sid, res.created, res.seq - 1, SessionCreated.TYPE, created) if res.created else None
        publish = [made_session, event] if made_session is not None else [event]
        began = None
        if res.began is not None:
            outcome, started = self._begun(sid, res.began, have)
            began = outcome if isinstance(outcome, Begun) else None
            publish += [started] if started is not None else []
        self._published(sid, publish)
        return Submitted(False, message.turn_id, event.id, job, event, began, made_session, interrupted=res.interrupted)

    @translated
    async def enqueue(self, sid: str, owner: str, entry: InboxMessage) -> JobId:
        """Queue a compact or clear entry behind the session's turns, with its job (and relay
        jobs for the owner's webhooks) in the same round trip. Returns the job."""
        args = p.EnqueueArgs(owner, _enc.encode(entry).decode(), self.max_queued)
        res, job = await self._with_job(p.ENQUEUE, sid, owner, args, await self.hooks.targets(owner))
        if isinstance(res, p.Full):
            raise self._full()
        return job

    async def _busy_for(self, sid: str, message_id: str) -> bool:
        """Whether a new message `message_id` would find a turn running or waiting (a message
        already recorded is not new: SUBMIT answers it as the same message)."""
        k = SessionKeys(sid)
        queued, known = raised(await self.wire.call([("LLEN", k.inbox), ("HEXISTS", k.mids, message_id)]))
        return bool(queued) and not known

    @staticmethod
    def _busy(sid: str) -> Conflict:
        return Conflict(f"session {sid} is busy: a turn runs or waits (the message's policy is reject)", code="busy")

    def _full(self) -> Limited:
        """The session's queue is full (nothing was written; the job that came along is harmless)."""
        message = f"{self.max_queued} messages already wait in this session; try again when it has answered"
        return Limited(message, code="queue_full", retry_after=1)

    @translated
    async def add_job(self, sid: str) -> JobId:
        """Queue a job for the session (it has work: an answer, a cancel). With replicas, it is
        acknowledged once a replica has it: the write it stands for was, and a job a failover
        took back would leave that work with nothing to run it."""
        (job_id,) = raised(await self.wire.call([self.jobs.job(sid)], durable=True))
        return self.jobs.added(sid, job_id)

    async def _with_job(
        self,
        script: p.Script[R],
        sid: str,
        owner: str,
        args: msgspec.Struct,
        destinations: Sequence[str] = (),
        *,
        look_first: bool = True,
        touch: float | None = None,
        listed: bool = True,
    ) -> tuple[R, JobId]:
        """Run an owner-checked script and add the session's job (and a relay job for each of
        `destinations`), in one round trip. A session this process has not seen is looked up
        first (unless not `look_first`), so a request for an unknown one writes nothing; without
        the look, a request for an unknown one leaves a job that finds nothing to do. `touch`:
        the session's activity (its place in its owner's list) is then; `listed`: it is in the
        list already (then the move is not waited for; a session the script may make is)."""
        if look_first:
            await self.look(sid, owner)
        keys = script.session_keys(sid)
        also = [self.jobs.job(sid), *(relay_job(sid, d) for d in destinations)]
        lazy = catalog.touch(owner, sid, touch, self.ttl_ms) if touch is not None else []
        raw, job_id, *_ = await self.wire.script_with(
            script.sha, script.source, keys, script.args(args), also, lazy=lazy, post=listed
        )
        res = script.reply(raw)
        if isinstance(res, p.Missing):  # another owner's, or one deleted (or expired) since it was seen
            self._known.pop(sid, None)
            raise _missing(sid)
        self._remember(sid, owner)
        return res, self.jobs.added(sid, job_id)

    @translated
    async def look(self, sid: str, owner: str) -> None:
        """NotFound unless the session is there and `owner`'s: free for a session this process
        has seen (its scripts check the owner again), one read for another."""
        if self._known.get(sid) != owner:
            if await self.redis.hget(SessionKeys(sid).meta, "owner") != owner.encode():
                raise _missing(sid)
            self._remember(sid, owner)

    def _settled(self, sid: str) -> None:
        """A turn here settled: if its owner has webhooks this process may not have queued a
        relay job for (made while the turn ran), queue them now. A cheap look first: most
        turns' owners are known here to have none."""
        owner = self._known.get(sid)
        if owner is None or self.hooks.known_none(owner):
            return  # (a session this process never wrote for: its writer queued the jobs)
        task = asyncio.get_running_loop().create_task(self._queue_hooks(sid, owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _queue_hooks(self, sid: str, owner: str) -> None:
        try:
            destinations = await self.hooks.targets(owner)
            if destinations:
                await self.add_relay_jobs(sid, destinations)
        except Exception as exc:  # best effort: the next write to the session queues them too
            log.warning("webhooks: queueing deliveries for %s failed: %s", sid, exc)

    @translated
    async def add_relay_jobs(self, sid: str, destinations: Sequence[str]) -> None:
        """Relay jobs for the session and these destinations, in one round trip."""
        raised(await self.wire.call([relay_job(sid, d) for d in destinations], durable=True))

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
        deliver_to: str | None = None,
        message_id: str = "",
    ) -> Responded:
        """Record an answer. With a destination to deliver to (`deliver_to`, a webhook
        channel's, or the owner's webhooks), the session's job and a relay job for each go in
        the same round trip (a webhook channel's click is one round trip)."""
        data = _enc.encode(InputResolvedData(request_id, answer.decision, answer.reason, answer.by))
        now = repr(round(time.time(), 6))
        args = p.RespondArgs(
            owner, request_id, _enc.encode(answer).decode(), self.retention, now, data.decode(), message_id
        )
        destinations = [deliver_to] if deliver_to else await self.hooks.targets(owner)
        job = None
        if destinations:
            res, job = await self._with_job(p.RESPOND, sid, owner, args, destinations, look_first=deliver_to is None)
        else:
            res = await self._run(p.RESPOND, sid, args)
        if isinstance(res, p.Missing):
            raise _missing(sid)
        if isinstance(res, p.Unknown):
            raise NotFound(f"no approval request {request_id} in session {sid}", code="request_not_found")
        if isinstance(res, p.Answered):
            return AlreadyAnswered(answer_decoder.decode(res.answer), job)
        event = made(sid, res.id, res.seq, InputResolved.TYPE, res.body.encode())
        self._published(sid, [event])
        return Recorded(answer, event, runnable=res.left == 0, job=job)

    @translated
    async def request(self, sid: str, request_id: str) -> ApprovalRequest | None:
        """Approval request `request_id` of the session, if it has it (answered or not)."""
        raw = await self.redis.hget(SessionKeys(sid).pending, request_id)
        return request_decoder.decode(raw) if raw is not None else None

    @translated
    async def open_requests(self, sid: str, meta: SessionMeta) -> list[ApprovalRequest]:
        """The paused turn's requests that have no answer yet, in the order they were made."""
        if not meta.waiting_on:
            return []
        k = SessionKeys(sid)
        rids = list(meta.waiting_on)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(k.pending, rids)
            pipe.hmget(k.decisions, rids)
            requests, answers = await pipe.execute()
        return [request_decoder.decode(r) for r, a in zip(requests, answers, strict=True) if r and not a]

    @translated
    async def cancel(
        self, sid: str, owner: str, turn_id: str = "", *, deliver_to: str | None = None, once: str = ""
    ) -> CancelAsked:
        """Ask the current (or next) turn, or only `turn_id`, to end; its model call, streaming
        in whichever process, is stopped at once. With a destination to deliver to (as
        `respond`), the session's job goes with it, in the same round trip."""
        args = p.CancelArgs(owner, turn_id, once)
        destinations = [deliver_to] if deliver_to else await self.hooks.targets(owner)
        job = None
        if destinations:
            res, job = await self._with_job(p.CANCEL, sid, owner, args, destinations, look_first=deliver_to is None)
        else:
            res = await self._run(p.CANCEL, sid, args)
        if isinstance(res, p.Missing):
            raise _missing(sid)
        if not isinstance(res, p.CancelSet):
            return NothingToCancel()
        self.hub.cancel(sid, res.turn_id)
        return Cancelling(res.turn_id, job)

    @translated
    async def renew(self, sid: str, fence: str, lease_ms: int) -> bool:
        return (await self._run(p.RENEW, sid, p.LeaseArgs(fence, lease_ms))).held

    @translated
    async def release(self, sid: str, fence: str) -> None:
        await self._run(p.RELEASE, sid, p.LeaseArgs(fence))

    @translated
    async def shared_secret(self) -> bytes:
        """A random secret made by the first process that asks and read by all the others (with
        replicas, once a replica has it: a secret a failover took back would be made again, and
        processes would refuse each other's tokens)."""
        made = ("SET", TOKEN_SECRET, os.urandom(32).hex(), "NX")
        _, secret = raised(await self.wire.call([made, ("GET", TOKEN_SECRET)], durable=True))
        return bytes(secret)

    async def history(self, sid: str, owner: str, offset: int = 0, limit: int | None = None) -> list[Item]:
        """Active history from `offset` on, at most `limit` items (all when None)."""
        return (await self.history_page(sid, owner, offset=offset, limit=limit or 0))[1]

    @translated
    async def history_page(
        self, sid: str, owner: str, *, at: int = -1, offset: int = 0, limit: int = 0
    ) -> tuple[int, list[Item]]:
        """(where the active history starts, its items from index `at` on: counted from the
        history's first item ever, so that a page read after a compaction or clear cannot pass
        for the one after an earlier page; or, with `at` -1, from `offset` in the active
        history), at most `limit` items (0: all). Conflict (`history_replaced`) for an `at` the
        active history no longer holds."""
        res = await self._read(p.HISTORY, sid, p.HistoryArgs(owner, at, offset, limit))
        if isinstance(res, p.Missing):
            raise _missing(sid)
        if isinstance(res, p.Replaced):
            raise Conflict(
                f"session {sid}'s history was compacted or cleared since that page: read it again from its start",
                code="history_replaced",
            )
        return res.start, [item_decoder.decode(r) for r in res.items]

    # ---- a turn: BEGIN, COMMIT, the attempts' accounting -------------------------------------

    @translated
    async def begin(self, sid: str, fence: str, lease_ms: int) -> BeginOutcome:
        """Take the session for its next turn."""
        have_start, have, epoch = self._cached(sid)
        args = p.BeginArgs(fence, lease_ms, repr(time.time()), self.retention, have_start, len(have), epoch)
        outcome, started = self._begun(sid, await self._run(p.BEGIN, sid, args), have)
        if started is not None:
            self._published(sid, [started])
        return outcome

    def _cached(self, sid: str) -> tuple[int, list[Item], str]:
        """(start, items, epoch) of this process's copy of the session's history."""
        cached = self._cache.get(sid)
        return cached if cached is not None else (-1, [], "")

    def _begun(self, sid: str, res: p.BeginReply, have: list[Item]) -> tuple[BeginOutcome, StoredEvent | None]:
        """BEGIN's reply (or the one SUBMIT gives when it began the turn), decoded, with the
        event it wrote (turn.started, or a manual compaction's compaction.requested)."""
        if isinstance(res, p.LeaseTaken):
            return Busy(retry_ms=max(res.retry_ms, 1)), None
        if not isinstance(res, p.Began):
            return NoWork(), None
        message = inbox_decoder.decode(res.head)
        if res.owner:  # (a turn's end moves the session in its owner's list)
            self._remember(sid, res.owner)
        items = have if res.reused == len(have) else have[: res.reused]
        items.extend(item_decoder.decode(raw) for raw in res.items)
        self._cache.put(sid, res.start, items, res.epoch)
        started = None
        if res.started_id:
            etype = CompactionRequested.TYPE if message.kind == "compact" else TurnStarted.TYPE
            started = made(sid, res.started_id, res.started_seq, etype, res.started_body.encode())
        begun = Begun(
            fence=str(res.fence),
            message=message,
            history=items[: res.n_before],
            turn_items=items[res.n_before :],
            sticky=dict(res.sticky),
            started_id=res.started_id,
            cancel=res.cancel,
            answers={rid: answer_decoder.decode(a) if a else None for rid, a in res.decisions},
            last_in=res.last_in,
            last_est=res.last_est,
            took_over=res.took_over,
            announced=res.announced,
        )
        return begun, started

    @translated
    async def commit(
        self,
        sid: str,
        fence: str,
        turn_id: str,
        items: Sequence[Item],
        events: Sequence[Pending],
        *,
        mode: CommitMode = "step",
        requests: Sequence[ApprovalRequest] = (),
        answers: Sequence[tuple[str, Answer]] = (),
        attempt: bool = False,
        rebase: int | None = None,
        usage: UsageRecord | None = None,
        guard: bool = False,
        announce: Sequence[Pending] = (),
        announced: str = "",
        failpoint: str | None = None,
    ) -> Commit:
        """Commit a step (mode "step"), the end of a turn ("final"), or a pause for the
        approval `requests` ("pause"); StaleLease if the lease is no longer `fence` (or the
        session is no more). `answers` records answers the harness gives itself (withdrawn
        requests of a cancelled turn). `attempt`: a model call follows; count it now. `rebase`:
        `items` become the whole active history (compaction, clear), the current turn's items
        beginning at that offset in them. `usage`: the model call's tokens, written by the same
        script first (its usage.recorded comes first; written even if the commit is refused as
        stale). `guard`: with a cancel pending for the turn, write nothing else (`Withheld`).
        `announce`: events written only if no cancel is pending (step mode). `announced`: the
        call whose tool.started `events` is, when a resumed paused step writes it alone (BEGIN
        tells a runner that takes the turn over, which then does not write it again). `failpoint`: the
        crash point reached once the commit is made, before anything is published."""
        recorded: list[Pending] = []
        usage_args = None
        if usage is not None:
            recorded.append(self._usage(turn_id, usage.step, usage.usage, failed=False))
            usage_args = self._usage_args(recorded[-1], usage.usage, failed=False, estimate=usage.estimate)
        resolved: list[Pending] = []
        answer_args = []
        for rid, answer in answers:
            resolved.append(pending(turn_id, InputResolvedData(rid, answer.decision, answer.reason)))
            answer_args.append(p.AnswerArg(rid, _enc.encode(answer).decode(), resolved[-1].body.decode()))
        args = p.CommitArgs(
            fence=fence,
            turn_id=turn_id,
            retention=self.retention,
            mode=mode,
            waiting_on=[r.request_id for r in requests] if mode == "pause" else [],
            attempt=attempt,
            items=[_enc.encode(item).decode() for item in items],
            requests=[p.RequestArg(r.request_id, _enc.encode(r).decode()) for r in requests],
            answers=answer_args,
            events=[p.EventArg(e.type, e.body.decode()) for e in events],
            rebase=rebase,
            usage=usage_args,
            guard=guard,
            announce=[p.EventArg(e.type, e.body.decode()) for e in announce],
            announced=announced,
            ttl_ms=self.ttl_ms,
            **self._activity(sid, items, mode),
        )
        res = await self._run(p.COMMIT, sid, args, lazy=self._touched(sid, args.at))
        if isinstance(res, p.Stale):
            raise StaleLease(f"session {sid}: lease {fence} is no longer held (or the session is no more)")
        if failpoint is not None:
            failpoints.reached(failpoint)
        if isinstance(res, p.DroppedStep):
            dropped = written(sid, res.ids, res.first_seq, recorded)
            self._published(sid, dropped)
            return Withheld(dropped)
        if announce and not res.cancel:
            events = [*events, *announce]
        steered = [item_decoder.decode(raw) for raw in getattr(res, "steered", ())]
        if rebase is None:
            self._cache.extend(sid, [*items, *steered], res.length)
        else:
            _, _, epoch = self._cached(sid)
            self._cache.put(sid, res.length - len(items), list(items), epoch)
        emitted = written(sid, res.ids, res.first_seq, [*recorded, *(resolved[n] for n in res.resolved), *events])
        # (steered messages the turn ended before taking: the next turns, their message.received last)
        emitted += [made(sid, r.id, r.seq, MessageReceived.TYPE, r.body.encode()) for r in res.received]
        self._published(sid, emitted, settled=mode != "step")
        match res:
            case p.EndedMore() | p.EndedIdle():
                return Ended(emitted, more=isinstance(res, p.EndedMore))
            case p.PausedTurn():
                return AwaitingAnswers(emitted)
            case _ if res.cancel:
                return CancelPending(emitted)
        return Stepped(emitted, steered)

    @translated
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
        event = self._usage(turn_id, step, usage, failed=failed, purpose=purpose)
        args = self._usage_args(event, usage, failed=failed, estimate=estimate)
        res = await self._run(p.USAGE, sid, p.RecordUsageArgs(self.retention, args))
        if isinstance(res, p.Stale):
            raise StaleLease(f"session {sid} is no more (deleted or expired)")
        recorded = made(sid, res.id, res.seq, event.type, event.body)
        self._published(sid, [recorded])
        return recorded

    @staticmethod
    def _usage(turn_id: str, step: int, usage: Usage, *, failed: bool, purpose: str = "turn") -> Pending:
        """An attempt's usage.recorded."""
        return pending(
            turn_id,
            UsageRecordedData(
                step,
                usage.input_tokens,
                usage.output_tokens,
                usage.cached_tokens,
                usage.cache_write_tokens,
                failed=failed,
                purpose=purpose,
            ),
        )

    @staticmethod
    def _usage_args(event: Pending, usage: Usage, *, failed: bool, estimate: int | None) -> p.UsageArgs:
        """The tokens as a script records them, with their event's body."""
        return p.UsageArgs(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            body=event.body.decode(),
            last_est=None if estimate is None or failed else estimate,
        )

    @translated
    async def count_attempt(self, sid: str) -> None:
        """Count a model call about to be made, when no commit or BEGIN just did."""
        if (await self._run(p.ATTEMPT, sid, p.NoArgs())).n < 0:
            raise StaleLease(f"session {sid} is no more (deleted or expired)")
