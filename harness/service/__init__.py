"""Harness: the one object a channel talks to. Wire-agnostic: takes validated values, returns
msgspec values, raises `harness.errors`."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from harness import failpoints
from harness.errors import Conflict, InvalidInput, NotFound
from harness.events import StoredEvent
from harness.ids import just_before, new_id
from harness.loop.agent import Agent
from harness.loop.context import split_context
from harness.relay import Destination, Relay
from harness.runner import Runner
from harness.service.ending import SessionEnds
from harness.service.hooktargets import HookTargets
from harness.service.quotas import RateLimit, RateLimiter
from harness.service.sessions import SessionReads, check_session_id
from harness.service.waiting import collect_turn
from harness.store import (
    Client,
    DeadLetter,
    Deliveries,
    Depth,
    EventHub,
    Outbox,
    RateBuckets,
    Responded,
    Store,
    Submitted,
    Subscriptions,
    connect,
)
from harness.telemetry.metrics import HarnessStats
from harness.types import (
    Answer,
    EntryKind,
    InboxMessage,
    PageContext,
    SubmitResult,
    TurnResult,
)

log = logging.getLogger("keel")
MESSAGE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
MAX_REASON = 2_000


class Harness(SessionReads, SessionEnds):
    def __init__(
        self,
        redis: Client,
        agent: Agent,
        *,
        run_turns: bool = True,
        retention: int = 10_000,
        lease_ms: int = 5_000,
        concurrency: int = 64,
        rate_limit: RateLimit | None = None,
        token_rate: RateLimit | None = None,
        max_queued: int = 0,
        job_shards: int = 0,
        replicas: int = 0,
        session_ttl_ms: int = 0,
    ) -> None:
        self.redis = redis
        self.agent = agent
        options = {"job_shards": job_shards, "replicas": replicas, "ttl_ms": session_ttl_ms}  # (ttl 0: never)
        self.store = Store(redis, retention=retention, max_queued=max_queued, **options)
        buckets = RateBuckets(self.store.wire)
        self.limiter = RateLimiter(buckets, rate_limit, "for this API key") if rate_limit is not None else None
        self.token_limiter = RateLimiter(buckets, token_rate, "for this session's tokens") if token_rate else None
        self.stats = HarnessStats()  # what this process counts (app/metrics.py exposes it)
        self.runner: Runner | None = None
        self.hub = EventHub(redis, self.store.wire, runs_here=self._runs_here, cancelled=self._interrupt)
        self.outbox = Outbox(self.store, self.hub)
        self._owns_redis = False
        self.lease_ms = lease_ms
        self.relay: Relay | None = None
        self.hooks = Subscriptions(redis)
        self.targets = HookTargets(self.hooks)
        self.deliveries = Deliveries(redis)
        self._tasks: set[asyncio.Task[None]] = set()
        if run_turns:
            self.runner = Runner(
                self.store,
                self.store.jobs,
                agent,
                self._published,
                live=self.hub,
                on_idle=self.hub.poke,
                concurrency=concurrency,
                lease_ms=lease_ms,
                stats=self.stats,
            )

    @classmethod
    def connect(cls, url: str, agent: Agent, **options: Any) -> Harness:
        """A Harness on a Redis client of its own for `url`, closed by `stop()`."""
        harness = cls(connect(url), agent, **options)
        harness._owns_redis = True
        return harness

    def _interrupt(self, sid: str, turn_id: str) -> None:
        """A cancel of the turn was asked for: if its model call is running here, stop it."""
        if self.runner is not None:
            self.runner.calls.interrupt(sid, turn_id)

    def _runs_here(self, sid: str) -> bool:
        return self.runner is not None and self.runner.runs(sid)

    def _published(self, sid: str, events: list[StoredEvent], settled: bool) -> None:
        self.stats.committed(events)
        self.hub.publish(sid, events, settled=settled)
        if settled:
            self._deliver_settled(sid)

    def _deliver_settled(self, sid: str) -> None:
        """A turn here settled: if its owner has webhooks this process may not have queued a
        relay job for (made while the turn ran), queue them now. A cheap look first: most
        turns' owners are known here to have none."""
        owner = self.store.owner_known(sid)
        if owner is None:
            return  # (a session this process never wrote for: its writer queued the jobs)
        if self.targets.known_none(owner):
            return
        task = asyncio.get_running_loop().create_task(self._queue_hooks(sid, owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _queue_hooks(self, sid: str, owner: str) -> None:
        try:
            hooks = await self._hooks(owner)
            if hooks:
                await self.store.add_relay_jobs(sid, hooks)
        except Exception as exc:  # best effort: the next write to the session queues them too
            log.warning("webhooks: queueing deliveries for %s failed: %s", sid, exc)

    async def start(self) -> None:
        await self.store.jobs.ensure_groups()
        await self.store.load_scripts()
        self.hub.start()
        if self.runner is not None:
            self.runner.start()

    async def start_relay(self, destinations: list[Destination], **options: Any) -> Relay:
        """Deliver committed events to these destinations (webhook channels) from this process
        (every process that serves a channel may: one relay per session at a time)."""
        self.relay = Relay(self.store, self.outbox, destinations, lease_ms=self.lease_ms, **options)
        await self.relay.start()
        return self.relay

    async def hand_over(self, timeout: float) -> int:
        """The process drains: its running turns go to other processes at once (`Runner.hand_over`).
        Returns how many sessions were handed over."""
        return await self.runner.hand_over(timeout) if self.runner is not None else 0

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.relay is not None:
            await self.relay.stop()
        if self.runner is not None:
            await self.runner.stop()
        await self.hub.stop()
        await self.store.close()
        if self._owns_redis:
            await self.redis.aclose()

    async def queue_depth(self) -> Depth:
        """The turn job stream's backlog (jobs not done, the oldest's age), read from Redis now."""
        return await self.store.jobs.depth()

    async def ping(self) -> None:
        """Raises `Unavailable` when storage does not answer (readiness)."""
        await self.store.ping()

    # ---- commands ----------------------------------------------------------------------

    async def admit(self, owner: str) -> None:
        """Count one request that makes work (a session, a message, a token) against `owner`'s
        rate limit, if there is one: Limited (`rate_limited`) past it. One round trip."""
        if self.limiter is not None:
            await self.limiter.admit(owner)

    async def admit_token(self, sid: str) -> None:
        """Count one browser token minted for session `sid` against its own limit (on by
        default: a token is a credential, and minting them needs no more than a page load's
        worth). Limited past it."""
        if self.token_limiter is not None:
            await self.token_limiter.admit(f"tokens:{sid}")

    async def create_session(self, owner: str, metadata: dict[str, Any] | None = None) -> str:
        sid = new_id("ses")
        hooks = await self._hooks(owner)
        created = [await self.store.create(sid, owner, metadata or {}, deliver_to=hooks)]
        self.stats.committed(created)
        self.hub.publish(sid, created)
        return sid

    async def submit(
        self,
        sid: str,
        owner: str,
        text: str,
        context: PageContext = None,
        message_id: str | None = None,
        *,
        author: str = "",
        create: dict[str, Any] | None = None,
        deliver_to: str | None = None,
    ) -> SubmitResult:
        """Queue a user message; one turn per distinct message_id. Returns once it is durable.
        A webhook channel names the `author`, may have the session made on its first message
        (`create`: its metadata) and has the delivery relay told (`deliver_to`: its
        destination), all in the same round trip."""
        check_session_id(sid)
        if message_id is None:
            message_id = new_id("msg")
        elif not MESSAGE_ID.match(message_id):
            raise InvalidInput(
                "message_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", code="invalid_message_id"
            )
        turn_only, sticky = split_context(context)
        message = InboxMessage(
            message_id=message_id, turn_id=new_id("turn"), text=text, context=turn_only, sticky=sticky, author=author
        )
        how: dict[str, Any] = {
            "create": create,
            "deliver_to": [deliver_to] if deliver_to else await self._hooks(owner),
            "look_first": deliver_to is None,
        }
        # A process that runs turns, and runs none of this session's now, lets SUBMIT begin the
        # turn too (one round trip less); the session is held meanwhile, so that its job coming
        # back off the stream cannot start a second drain.
        runner = self.runner
        if runner is not None and await runner.reserve(sid):
            # Shielded: a caller cancelled after SUBMIT began the turn must not strand its lease.
            submitted = await asyncio.shield(self._submit_reserved(runner, sid, owner, message, how))
        else:
            submitted = await self.store.submit(sid, owner, message, **how)
            if runner is not None:
                runner.kick(sid, submitted.job_id)
        duplicate, turn_id, received_id, received = submitted[:4]
        if received is not None:
            made = [submitted.created, received] if submitted.created is not None else [received]
            self._published(sid, made, False)
        return SubmitResult(
            session_id=sid,
            message_id=message_id,
            turn_id=turn_id,
            received_id=received_id,
            duplicate=duplicate,
            received_seq=received.seq if received is not None else 0,
        )

    async def _submit_reserved(
        self, runner: Runner, sid: str, owner: str, message: InboxMessage, how: dict[str, Any]
    ) -> Submitted:
        """SUBMIT that may begin the turn, then the runner runs what it began (or drains as
        usual); the reservation is given back whatever happens."""
        try:
            submitted = await self.store.submit(sid, owner, message, begin_lease_ms=runner.lease_ms, **how)
        except BaseException:
            runner.adopt(sid, None, None)
            raise
        runner.adopt(sid, submitted.job_id, submitted.began)
        return submitted

    async def respond(
        self,
        sid: str,
        owner: str,
        request_id: str,
        decision: str,
        reason: str = "",
        *,
        by: str = "",
        deliver_to: str | None = None,
    ) -> Responded:
        """Answer an approval request. An answer is recorded once: the same answer again is
        accepted (and makes sure the turn resumes), a different one is a Conflict. A webhook
        channel names who answered (`by`) and has the relay told (`deliver_to`); its answer,
        the session's job and the relay's job are then one round trip."""
        check_session_id(sid)
        if decision not in ("approve", "deny"):
            raise InvalidInput("decision must be approve or deny", code="invalid_decision")
        if len(reason) > MAX_REASON:
            raise InvalidInput(f"reason is longer than {MAX_REASON} characters")
        if not MESSAGE_ID.match(request_id):
            raise NotFound(f"no approval request {request_id[:64]} in session {sid}", code="request_not_found")
        answer = Answer(decision, reason, by)  # type: ignore[arg-type]
        to = [deliver_to] if deliver_to else await self._hooks(owner)
        res = await self.store.respond(sid, owner, request_id, answer, deliver_to=to, look_first=deliver_to is None)
        if res.recorded:
            self._published(sid, [res.event] if res.event is not None else [], False)
            failpoints.reached("response.after_accept")
            if res.runnable:
                await self._wake(sid, res.job_id)
        elif res.answer.decision != decision:
            raise Conflict(
                f"request {request_id} was already answered: {res.answer.decision}",
                code="already_answered",
                details={"decision": res.answer.decision},
            )
        else:  # a repeat: the first one may have died before it woke the turn
            await self._wake(sid, res.job_id)
        return res

    async def cancel(
        self, sid: str, owner: str, turn_id: str | None = None, *, deliver_to: str | None = None, once: str = ""
    ) -> str:
        """End the turn in progress (or the next queued one), or only `turn_id` if given (so a
        repeated cancel cannot end the turn after it). Returns the turn id. A webhook channel
        has the relay told (`deliver_to`), in the same round trip, and names its request
        (`once`: a redelivery of it changes nothing)."""
        check_session_id(sid)
        if turn_id == "":
            raise InvalidInput("turn_id, when given, names a turn", code="invalid_turn_id")
        to = [deliver_to] if deliver_to else await self._hooks(owner)
        cancelled, job_id = await self.store.cancel(
            sid, owner, turn_id or "", deliver_to=to, look_first=deliver_to is None, once=once
        )
        if cancelled is None:
            what = f"turn {turn_id} is not in progress" if turn_id else "there is no turn to cancel"
            raise Conflict(what, code="nothing_to_cancel")
        self.hub.cancel(sid, cancelled)  # a model call of it streaming anywhere stops now
        await self._wake(sid, job_id)
        return cancelled

    async def compact(self, sid: str, owner: str) -> str:
        """Queue a manual compaction behind the session's turns. Returns its id (the turn_id of
        its events)."""
        return await self._enqueue(sid, owner, "compact")

    async def clear(self, sid: str, owner: str) -> str:
        """Queue a clear of the model's history behind the session's turns. Returns its id."""
        return await self._enqueue(sid, owner, "clear")

    async def _enqueue(self, sid: str, owner: str, kind: EntryKind) -> str:
        check_session_id(sid)
        op_id = new_id("turn")
        entry = InboxMessage(message_id=new_id(kind), turn_id=op_id, kind=kind)
        job_id = await self.store.enqueue(sid, owner, entry, deliver_to=await self._hooks(owner))
        if self.runner is not None:
            self.runner.kick(sid, job_id)
        return op_id

    # ---- outbound event webhooks ---------------------------------------------------------

    async def _hooks(self, owner: str) -> list[str]:
        return await self.targets.of(owner)

    def forget_hooks(self, owner: str) -> None:
        """The owner's subscriptions changed (in this process): read them again."""
        self.targets.forget(owner)

    async def dead_letters(self, destination: str) -> list[DeadLetter]:
        return await self.deliveries.dead(destination)

    async def retry_dead_letters(self, destination: str) -> int:
        return await self.deliveries.retry(destination, await self.deliveries.dead(destination))

    async def _wake(self, sid: str, job_id: str | None = None) -> None:
        """Queue a job for the session, unless `job_id` was queued already (and run it here at
        once, if this process runs turns)."""
        if job_id is None:
            job_id = await self.store.add_job(sid)
        if self.runner is not None:
            self.runner.kick(sid, job_id)

    # ---- waiting for a turn (the reads are in `SessionReads`) ----------------------------

    async def wait_turn(self, result: SubmitResult, timeout: float) -> TurnResult:
        """Wait until the message's turn settles; returns its events (from message.received on)."""
        after = just_before(result.received_id)
        async with self.hub.watch(result.session_id, settled_only=True) as watch:
            return await collect_turn(self.outbox, result, watch, after, timeout, read_first=True)

    async def submit_and_wait(
        self, sid: str, owner: str, text: str, *, context: PageContext, message_id: str | None, timeout: float
    ) -> TurnResult:
        """`submit`, then `wait_turn`, with the wake-up armed before the message exists: a new
        message's events are then read once, when its turn has moved on."""
        check_session_id(sid)
        async with self.hub.watch(sid, settled_only=True) as watch:
            result = await self.submit(sid, owner, text, context, message_id)
            if not result.duplicate:  # its events, from message.received on, may come published
                watch.last_seq = result.received_seq - 1
            after = just_before(result.received_id)
            return await collect_turn(self.outbox, result, watch, after, timeout, read_first=result.duplicate)
