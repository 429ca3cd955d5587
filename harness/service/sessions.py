"""`Harness.sessions`: everything a channel asks of one session.

`Harness.sessions`: everything a channel asks of one session. Commands (create, submit,
respond, cancel, compact, clear, delete) check what they are given, write through the store in
one round trip, and have the runner here start on the work; reads (the session, its open
requests, its history, its events) write nothing; the wait for a turn to settle is `waiting`'s.

A session ends when it is deleted (`delete`: all of it at once, the turn in progress stopped and
every reader told) or when it was left alone for the session TTL (all of it expires)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import msgspec

from harness import failpoints
from harness.errors import Conflict, InvalidInput, NotFound
from harness.events import (
    InputRequested,
    InputRequestedData,
    LiveEvent,
    MessageReceived,
    MessageSteered,
    Requested,
    StoredEvent,
)
from harness.ids import MESSAGE_ID, SESSION_ID, new_id
from harness.loop.context import split_context
from harness.runner import Runner
from harness.service.waiting import collect_turn
from harness.store import (
    AlreadyAnswered,
    Cancelling,
    JobId,
    NothingToCancel,
    Recorded,
    Responded,
    Store,
    Submitted,
    Watch,
    cursor_of,
    streamids,
)
from harness.telemetry import tracing
from harness.types import (
    SESSIONS_PAGE_MAX,
    Answer,
    Armed,
    EntryKind,
    InboxMessage,
    Item,
    MessagePolicy,
    PageContext,
    SessionInfo,
    SessionPage,
    SessionStatus,
    SubmitResult,
    TurnAt,
    TurnOutcome,
    TurnResult,
)

MAX_REASON = 2_000
METADATA_KEYS_MAX = 64  # a session's metadata: at most this many keys ...
METADATA_KEY_CHARS = 128  # ... each of 1 to this many characters ...
METADATA_BYTES_MAX = 16_384  # ... and this many bytes as JSON
TITLE_CHARS_MAX = 200
FILTERS_MAX = 8  # metadata filters of one listing
POLICIES = ("queue", "steer", "interrupt", "reject")
NOTE_ONCE_MS = 60_000  # a refused message's note: once in this long, however often it comes
_enc = msgspec.json.Encoder()


def check_metadata(metadata: dict[str, Any]) -> None:
    """A session's metadata within its limits (at creation and after a change)."""
    if len(metadata) > METADATA_KEYS_MAX:
        raise InvalidInput(f"metadata holds at most {METADATA_KEYS_MAX} keys", code="invalid_metadata")
    if any(not 0 < len(key) <= METADATA_KEY_CHARS for key in metadata):
        raise InvalidInput(f"a metadata key is 1 to {METADATA_KEY_CHARS} characters", code="invalid_metadata")
    if len(_enc.encode(metadata)) > METADATA_BYTES_MAX:
        raise InvalidInput(f"metadata is at most {METADATA_BYTES_MAX} bytes as JSON", code="invalid_metadata")


def check_session_id(sid: str) -> str:
    if not SESSION_ID.match(sid):
        raise NotFound(f"no session {sid[:64]}", code="session_not_found")
    return sid


def check_message_id(message_id: str) -> None:
    if not MESSAGE_ID.match(message_id):
        raise InvalidInput("message_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", code="invalid_message_id")


class Sessions:
    def __init__(self, store: Store, runner: Runner | None) -> None:
        self.store = store
        self.runner = runner

    # ---- commands ----------------------------------------------------------------------

    async def create(self, owner: str, metadata: dict[str, Any] | None = None) -> str:
        """A new session of `owner`; its id."""
        check_metadata(metadata or {})
        sid = new_id("ses")
        await self.store.create(sid, owner, metadata or {})
        return sid

    async def fork(self, sid: str, owner: str, before_message_id: str | None = None) -> str:
        """A new session of `owner` with the source's metadata and history: all of it (but a
        turn in progress), or what came before message `before_message_id`'s turn; no pending
        requests, no queue, no page context. The source stays as it is. The new session's id."""
        check_session_id(sid)
        if before_message_id is not None:
            check_message_id(before_message_id)
        new_sid = new_id("ses")
        await self.store.fork(sid, owner, new_sid, before_message_id)
        return new_sid

    async def update(
        self, sid: str, owner: str, *, title: str | None = None, metadata: dict[str, Any] | None = None
    ) -> SessionInfo:
        """Rename the session, and change its metadata: the keys given set (a None value
        removes its key), the others kept. The session as it is then."""
        check_session_id(sid)
        if title is not None and not 0 < len(title) <= TITLE_CHARS_MAX:
            raise InvalidInput(f"a title is 1 to {TITLE_CHARS_MAX} characters", code="invalid_title")
        if metadata is not None and any(not 0 < len(key) <= METADATA_KEY_CHARS for key in metadata):
            raise InvalidInput(f"a metadata key is 1 to {METADATA_KEY_CHARS} characters", code="invalid_metadata")
        if title is not None or metadata:
            await self.store.update(sid, owner, title=title, metadata=metadata or None, check=check_metadata)
        return await self.info(sid, owner)

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
        policy: MessagePolicy = "queue",
    ) -> SubmitResult:
        """Queue a user message; one turn per distinct message_id. Returns once it is durable.
        `policy`, for a message sent while a turn runs or waits: `queue` it behind the turn,
        `steer` it into the running turn (it joins before the turn's next model call; a turn
        that waits for answers is not steered: the message queues), `interrupt` the turn (it
        ends as a cancel ends it, and the message runs next), or `reject` it (Conflict `busy`,
        nothing written). A message that arrives when nothing runs starts a turn whatever its
        policy.
        A webhook channel names the `author`, may have the session made on its first message
        (`create`: its metadata) and has the delivery relay told (`deliver_to`: its
        destination), all in the same round trip."""
        result, _ = await self._submit(
            sid, owner, text, context, message_id, author=author, create=create, deliver_to=deliver_to, policy=policy
        )
        return result

    async def _submit(
        self,
        sid: str,
        owner: str,
        text: str,
        context: PageContext,
        message_id: str | None,
        *,
        author: str = "",
        create: dict[str, Any] | None = None,
        deliver_to: str | None = None,
        policy: MessagePolicy = "queue",
    ) -> tuple[SubmitResult, bool]:
        """`submit`, and whether its turn began here (this process writes it)."""
        check_session_id(sid)
        if message_id is None:
            message_id = new_id("msg")
        else:
            check_message_id(message_id)
        if policy not in POLICIES:
            raise InvalidInput("policy is queue, steer, interrupt or reject", code="invalid_policy")
        turn_only, sticky = split_context(context)
        message = InboxMessage(
            message_id=message_id,
            turn_id=new_id("turn"),
            text=text,
            context=turn_only,
            sticky=sticky,
            author=author,
            trace=tracing.traceparent(),  # (its turn's spans are this request's children)
        )
        # A process that runs turns, and runs none of this session's now, lets SUBMIT begin the
        # turn too (one round trip less); the session is held meanwhile, so that its job coming
        # back off the stream cannot start a second drain.
        runner = self.runner
        if runner is not None and await runner.reserve(sid):
            # (made by the session's task: a caller cancelled after SUBMIT began the turn must
            # not strand its lease)
            def begin(lease_ms: int) -> Awaitable[Submitted]:
                return self.store.submit(
                    sid, owner, message, begin_lease_ms=lease_ms, create=create, deliver_to=deliver_to, policy=policy
                )

            submitted = await runner.launch(sid, begin)
        else:
            submitted = await self.store.submit(
                sid, owner, message, create=create, deliver_to=deliver_to, policy=policy
            )
            if runner is not None:
                runner.kick(sid, submitted.job)
        result = SubmitResult(
            session_id=sid,
            message_id=message_id,
            turn_id=submitted.turn_id,
            received_id=submitted.received_id,
            duplicate=submitted.duplicate,
            received_seq=submitted.received.seq if submitted.received is not None else 0,
            handled="steered" if submitted.steered else "interrupting" if submitted.interrupted else "queued",
        )
        return result, submitted.began is not None

    async def admissible(self, sid: str, owner: str, message_id: str | None = None) -> None:
        """What `submit` (or a compact) would refuse as bad input, checked before a rate-limit
        token is spent on it: a session id or message id of the wrong shape (InvalidInput), a
        session that is not there or not `owner`'s (NotFound; free for one this process knows)."""
        check_session_id(sid)
        if message_id is not None:
            check_message_id(message_id)
        await self.store.look(sid, owner)

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
        message_id: str = "",
    ) -> Responded:
        """Answer an approval request. An answer is recorded once: the same answer again is
        accepted (and makes sure the turn resumes), a different one is a Conflict. A webhook
        channel names who answered (`by`) and has the relay told (`deliver_to`); its answer,
        the session's job and the relay's job are then one round trip. `message_id`: the id the
        channel's message that answered would have as a message: recorded with the answer, so
        that message redelivered later is not a message of its own."""
        check_session_id(sid)
        self.check_answer(request_id, decision, reason, sid)
        answer = Answer(decision, reason, by)  # type: ignore[arg-type]
        res = await self.store.respond(sid, owner, request_id, answer, deliver_to=deliver_to, message_id=message_id)
        match res:
            case Recorded(runnable=runnable, job=job):
                failpoints.reached("response.after_accept")
                if runnable:
                    await self._wake(sid, job)
            case AlreadyAnswered(answer=recorded) if recorded.decision != decision:
                raise Conflict(
                    f"request {request_id} was already answered: {recorded.decision}",
                    code="already_answered",
                    details={"decision": recorded.decision},
                )
            case AlreadyAnswered(job=job):  # a repeat: the first one may have died before it woke the turn
                await self._wake(sid, job)
        return res

    @staticmethod
    def check_answer(request_id: str, decision: str, reason: str, sid: str = "") -> None:
        """What `respond` refuses before it looks at the session: a decision other than approve
        or deny, a reason too long, a request id of no request's shape."""
        if decision not in ("approve", "deny"):
            raise InvalidInput("decision must be approve or deny", code="invalid_decision")
        if len(reason) > MAX_REASON:
            raise InvalidInput(f"reason is longer than {MAX_REASON} characters")
        if not MESSAGE_ID.match(request_id):
            raise NotFound(f"no approval request {request_id[:64]} in session {sid}", code="request_not_found")

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
        match await self.store.cancel(sid, owner, turn_id or "", deliver_to=deliver_to, once=once):
            case NothingToCancel():
                what = f"turn {turn_id} is not in progress" if turn_id else "there is no turn to cancel"
                raise Conflict(what, code="nothing_to_cancel")
            case Cancelling(turn_id=cancelled, job=job):
                await self._wake(sid, job)
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
        job = await self.store.enqueue(sid, owner, InboxMessage(message_id=new_id(kind), turn_id=op_id, kind=kind))
        if self.runner is not None:
            self.runner.kick(sid, job)
        return op_id

    async def delete(self, sid: str, owner: str) -> None:
        """Remove the session and everything of it (its history, events, queued messages, open
        requests, delivery state) in one atomic step; NotFound if it is not there or not the
        owner's. A turn in progress is told to stop, wherever it runs: its model call is cut,
        and its next write is refused (it cannot make the session again). Readers of the
        session, in this process and in others, get `session.deleted` and their stream ends.
        A later message to the id is NotFound (a webhook channel's conversation, whose
        messages make their session, starts a new one)."""
        check_session_id(sid)
        await self.store.delete(sid, owner)

    async def _wake(self, sid: str, job: JobId | None = None) -> None:
        """Queue a job for the session, unless `job` was queued already (and run it here at
        once, if this process runs turns)."""
        if job is None:
            job = await self.store.add_job(sid)
        if self.runner is not None:
            self.runner.kick(sid, job)

    # ---- reads -------------------------------------------------------------------------

    async def info(self, sid: str, owner: str) -> SessionInfo:
        """The session's status, open requests, queue and usage."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        # the inbox's head is the turn in progress (running or paused) while `turn` names it:
        # queued counts the messages behind it
        queued = max(0, await self.store.queued(sid) - (1 if meta.turn else 0))
        pending = [Requested(r.request_id, r.tool, r.arguments) for r in await self.store.open_requests(sid, meta)]
        usage = {
            "input_tokens": meta.input_tokens,
            "output_tokens": meta.output_tokens,
            "cached_tokens": meta.cached_tokens,
            "cache_write_tokens": meta.cache_write_tokens,
            "model_calls": meta.model_calls,
        }
        return SessionInfo(
            session_id=sid,
            status=meta.status,
            pending=pending,
            queued=queued,
            usage=usage,
            metadata=meta.metadata,
            created_at=meta.created_at,
            title=meta.title,
            updated_at=meta.updated_at,
        )

    async def listing(
        self,
        owner: str,
        *,
        limit: int = 20,
        cursor: str | None = None,
        status: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> SessionPage:
        """The owner's sessions, most recent activity first, a page at a time (`cursor`: the
        page before's `next_cursor`), those with `status` and these metadata values only."""
        if not 0 < limit <= SESSIONS_PAGE_MAX:
            raise InvalidInput(f"limit is 1 to {SESSIONS_PAGE_MAX}", code="invalid_query")
        if status is not None and status not in ("idle", "running", "waiting"):
            raise InvalidInput("status is idle, running or waiting", code="invalid_query")
        if metadata is not None and len(metadata) > FILTERS_MAX:
            raise InvalidInput(f"at most {FILTERS_MAX} metadata filters", code="invalid_query")
        at = cursor_of(cursor) if cursor is not None else None
        return await self.store.catalog.page(
            owner, limit=limit, cursor=at, status=cast(SessionStatus | None, status), metadata=metadata, now=time.time()
        )

    async def turn_in_progress(self, sid: str, owner: str) -> TurnAt | None:
        """The message's turn running, paused for answers, or queued next (the inbox's head),
        and where a replay of it from its first event starts; None when there is none (or a
        compact or clear is what runs)."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        head = await self.store.head(sid)
        if head is None or head.kind != "message":
            return None
        found = await self.store.received(sid, head.message_id)
        if found is None:
            return None
        return TurnAt(head.turn_id, streamids.before(found[1]), head.message_id, meta.status == "waiting")

    async def waiting_on(self, sid: str, owner: str) -> str | None:
        """The message id of the turn that waits for answers, if one does (NotFound unless the
        session is `owner`'s)."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        if meta.status != "waiting":
            return None
        head = await self.store.head(sid)
        return head.message_id if head is not None else None

    async def message_text(self, sid: str, owner: str, received_id: str, message_id: str = "") -> str | None:
        """The text of the message whose message.received (or message.steered) is
        `received_id`, if still kept; else, with `message_id`, its user item's in the active
        history (an event trimmed, or a message a fork copied)."""
        check_session_id(sid)
        await self.store.look(sid, owner)
        event = await self.store.outbox.event(sid, received_id)
        if event is not None:
            found = event.of(MessageReceived) or event.of(MessageSteered)
            if found is not None:
                return found.data.text
        if message_id:
            for item in await self.store.history(sid, owner):
                if item.role == "user" and item.kind == "message" and item.message_id == message_id:
                    return item.text
        return None

    async def turn_start(self, sid: str, owner: str, turn_id: str) -> str | None:
        """Where a replay of turn `turn_id` from its first event starts; None if the session
        does not hold it any more."""
        check_session_id(sid)
        await self.store.look(sid, owner)  # (the owner's, free when this process knows the session)
        head = await self.store.head(sid)
        if head is not None and head.turn_id == turn_id:
            found = await self.store.received(sid, head.message_id)
            if found is not None:
                return streamids.before(found[1])
        begins = await self.store.outbox.turn_begins(sid, turn_id)  # (a turn that ended: looked for)
        return streamids.before(begins) if begins is not None else None

    async def turn_asking(self, sid: str, owner: str, request_id: str) -> str | None:
        """The id of the turn that made approval request `request_id`, if the session has it
        (however long ago it was asked: its event may have left the outbox)."""
        check_session_id(sid)
        await self.store.look(sid, owner)
        request = await self.store.request(sid, request_id)
        return request.turn_id if request is not None else None

    async def answers_kept(self, sid: str, request_ids: list[str]) -> bool:
        """Whether the outbox still holds where the rest of a turn after answers to these
        requests begins: an input.requested of one of them, or an input.resolved."""
        return await self.store.outbox.answers_kept(sid, request_ids)

    async def first_note(self, sid: str, message_id: str) -> bool:
        """Whether a channel should tell the author that message `message_id` was refused: once
        a minute at most, however often the message comes (a Slack mention comes as two events,
        a provider retries)."""
        return await self.store.first_note(sid, message_id, NOTE_ONCE_MS)

    async def newest_event(self, sid: str) -> str:
        """The id of the session's newest event now, as a reader reads them: a replay that has
        read it has caught up with the outbox as it was (START when it holds none)."""
        return await self.store.outbox.newest(sid)

    async def asking(self, sid: str, owner: str, turn_id: str) -> InputRequested | None:
        """The approval requests turn `turn_id` waits on now, as an input.requested rebuilt
        from the session's record of them (`pending`), if the event that asked them left the
        outbox (asked longer ago than events are kept): for a reader whose replay of the turn
        lacks it. It has no place in the outbox (id "", seq 0). None when the turn waits on
        nothing, or on requests whose event is still there (asked as the reader began, say:
        the reader reads it)."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        requests = [
            Requested(r.request_id, r.tool, r.arguments)
            for r in await self.store.open_requests(sid, meta)
            if r.turn_id == turn_id
        ]
        if not requests or await self.store.outbox.asked_kept(sid, [r.request_id for r in requests]):
            return None
        data = InputRequestedData(requests=requests)
        return InputRequested(session_id=sid, turn_id=turn_id, at=time.time(), id="", seq=0, data=data)

    @staticmethod
    def before(event_id: str) -> str:
        """Where a replay that begins with event `event_id` starts."""
        return streamids.before(event_id)

    @staticmethod
    def reached(event_id: str, mark: str) -> bool:
        """Whether a reader that has read event `event_id` has read up to event `mark`."""
        return streamids.key(event_id) >= streamids.key(mark)

    async def pending(self, sid: str, owner: str) -> list[str]:
        """The ids of the approval requests the session waits for, in the order they were made."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        return [r.request_id for r in await self.store.open_requests(sid, meta)]

    async def history(self, sid: str, owner: str, offset: int = 0, limit: int | None = None) -> list[Item]:
        """The session's active history (after its last clear or compaction), or a page of it."""
        check_session_id(sid)
        return await self.store.history(sid, owner, offset, limit)

    async def history_page(
        self, sid: str, owner: str, *, cursor: str | None, offset: int, limit: int
    ) -> tuple[list[Item], int | None, str | None]:
        """A page of the active history, `limit` items from `cursor` (a page's next) or from
        `offset` in it; with where the next page starts, as an offset into the active history
        as it is now and as a cursor (None after the last page). A cursor is an item's index
        counted from the history's first item ever: after a compaction or a clear it is
        refused (Conflict `history_replaced`), where an offset would read on in the new history."""
        check_session_id(sid)
        at = -1
        if cursor is not None:
            if not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 12):
                raise InvalidInput("cursor is the next_cursor a page gave", code="invalid_cursor")
            at = int(cursor)
        start, items = await self.store.history_page(sid, owner, at=at, offset=offset, limit=limit + 1)
        first = at if at >= 0 else start + offset
        if len(items) <= limit:
            return items, None, None
        return items[:limit], first + limit - start, str(first + limit)

    async def check_owner(self, sid: str, owner: str) -> None:
        """NotFound unless the session is there and `owner`'s."""
        check_session_id(sid)
        await self.store.meta(sid, owner)

    @staticmethod
    def resume_after(*given: str | None) -> str:
        """Where a reader resumes: the newest of the event ids it gave (`?after=`, the
        `Last-Event-ID` an EventSource sends when it reconnects), each checked
        (`invalid_event_id`); from the start with none."""
        return streamids.newest(*(streamids.check_event_id(eid) for eid in given if eid))

    def tail(
        self,
        sid: str,
        after: str,
        *,
        heartbeat: float,
        gate: asyncio.Semaphore | None = None,
        armed: Armed | None = None,
    ) -> AsyncIterator[StoredEvent | LiveEvent | None]:
        """Committed events after `after`, then new ones as they come, with live events
        (`Outbox.tail` itself: no generator layer of its own on every event's path). The caller
        checks ownership first. `armed`: its subscription, opened before (`arm`)."""
        watch = cast(Watch, armed) if armed is not None else None
        return self.store.outbox.tail(sid, after, heartbeat=heartbeat, gate=gate, opened=watch)

    def arm(self, sid: str) -> Armed:
        """A subscription to the session's events (live ones too) before the command whose
        events a reader will follow: `tail(armed=)` takes it; `disarm` it however that ends."""
        return self.store.hub.open_watch(sid)

    def disarm(self, sid: str, armed: Armed) -> None:
        self.store.hub.close_watch(sid, cast(Watch, armed))

    # ---- waiting for a turn ----------------------------------------------------------------

    async def wait_turn(self, result: SubmitResult, timeout: float) -> TurnResult:
        """Wait until the message's turn settles; returns its events (from message.received on)."""
        after = streamids.before(result.received_id)
        async with self.store.hub.watch(result.session_id, settled_only=True) as watch:
            outcome = await collect_turn(
                self.store.outbox,
                result.session_id,
                result.turn_id,
                watch,
                after=after,
                timeout=timeout,
                read_first=True,
                ended=self._ended(result),
            )
        return _result(result, outcome)

    async def submit_and_wait(
        self,
        sid: str,
        owner: str,
        text: str,
        *,
        context: PageContext,
        message_id: str | None,
        timeout: float,
        policy: MessagePolicy = "queue",
    ) -> TurnResult:
        """`submit`, then `wait_turn`, with the wake-up armed before the message exists: a new
        message's events are then read once, when its turn has moved on. A steered message's
        turn is the one it joined; if that turn ended before taking it, the wait goes on with
        the message's own turn."""
        check_session_id(sid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        hub = self.store.hub
        # (deferred: a turn this process begins comes published here, no notice from Redis needed;
        # opened and closed by hand, not by `hub.watch`: its async generator cost a few us a turn)
        watch = hub.open_watch(sid, settled_only=True, deferred=True)
        try:
            result, here = await self._submit(sid, owner, text, context, message_id, policy=policy)
            if not here:  # (another runner's turn, or a later one: commits made elsewhere wake it)
                hub.follow(sid, watch)
            if not result.duplicate:  # its events, from message.received on, may come published
                watch.last_seq = result.received_seq - 1
            after = streamids.before(result.received_id)
            ended = self._ended(result)
            outcome = await collect_turn(
                self.store.outbox,
                sid,
                result.turn_id,
                watch,
                after=after,
                timeout=timeout,
                read_first=result.duplicate,
                ended=ended,
            )
            steered = result.handled == "steered" and outcome.status != "pending"
            own = await self.store.received(sid, result.message_id) if steered else None
            if own is not None and own[0] != result.turn_id:  # (steered, and run as a turn of its own)
                result = msgspec.structs.replace(result, turn_id=own[0], received_id=own[1])
                outcome = await collect_turn(
                    self.store.outbox,
                    sid,
                    own[0],
                    watch,
                    after=streamids.before(own[1]),
                    timeout=max(deadline - loop.time(), 0.001),
                    read_first=True,
                    ended=ended,
                )
        finally:
            hub.close_watch(sid, watch)
        return _result(result, outcome)

    def _ended(self, result: SubmitResult) -> Callable[[], Awaitable[bool]] | None:
        """For a message sent again, whether its turn is over (`collect_turn`'s `ended`)."""
        return (
            functools.partial(self.store.turn_ended, result.session_id, result.message_id) if result.duplicate else None
        )

    async def respond_and_wait(
        self, sid: str, owner: str, request_id: str, decision: str, reason: str = "", *, timeout: float
    ) -> TurnOutcome:
        """`respond`, then wait for the turn it resumes to settle again: its events after the
        answer. An answer that leaves other requests open is `waiting` at once; a repeated
        answer (the turn went on with the first) is `pending`: the session says how it stands."""
        check_session_id(sid)
        async with self.store.hub.watch(sid, settled_only=True) as watch:
            res = await self.respond(sid, owner, request_id, decision, reason)
            match res:
                case Recorded(runnable=True, event=event):
                    turn_id = event.decoded().turn_id or ""
                    return await collect_turn(
                        self.store.outbox, sid, turn_id, watch, after=event.id, timeout=timeout, read_first=True
                    )
                case Recorded(event=event):
                    return TurnOutcome(status="waiting", reply=None, events=[event])
                case AlreadyAnswered():
                    return TurnOutcome(status="pending", reply=None, events=[])


def _result(submitted: SubmitResult, outcome: TurnOutcome) -> TurnResult:
    return TurnResult(submitted.session_id, submitted.message_id, outcome.status, outcome.reply, outcome.events)
