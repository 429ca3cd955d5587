"""One turn's events, for the frontend protocols (`channels.aisdk`, `channels.agui`): read from
the session's durable outbox (from the turn's first event, or from now), then live, until the
turn settles or pauses; each protocol's translator makes its frames of them.

An `input.requested` ends the stream only
while its requests are still open: a turn answered meanwhile is followed on. A translator may
be `muted` up to an event (a continuation after an answer: its frames before the answer were
sent by the stream that asked), so it learns the turn's state without sending it twice. The
client going away stops the reading only: the turn goes on."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from channels.drain import Drain
from channels.errors import ChannelError
from channels.limits import Occupancy
from channels.sse import HEADERS, EventStream
from channels.tokens import TokenSigner
from channels.types import ContextValue
from harness import Harness
from harness.errors import Conflict, NotFound
from harness.events import (
    Event,
    InputRequested,
    InputResolved,
    LiveEvent,
    MessageDelta,
    SessionDeleted,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from harness.types import Armed

Followed = Event | MessageDelta


class CaughtUp:
    """A replay's mark: the events the outbox held when the stream began have all been read."""


CAUGHT_UP = CaughtUp()
Muted = Literal["muted", "last", "open"]  # an event replayed to the translator only, the last such, or the first sent


class Answer(NamedTuple):
    """An answer to an approval request, as a frontend protocol carries it."""

    request_id: str
    decision: str  # approve or deny
    reason: str = ""


ENDINGS = (TurnCompleted, TurnFailed, TurnCancelled)
KEEP_ALIVE = b": keep-alive\n\n"


class Translator(Protocol):
    """A protocol's frames (SSE bytes) for one turn's events."""

    def opening(self) -> bytes: ...

    def feed(self, event: Followed) -> bytes: ...

    def closing(self, last: Event | SessionDeleted) -> bytes:
        """After the event that ended the stream: the turn's outcome, the requests it waits on,
        or the session's end."""
        ...


class _Item:
    __slots__ = ("done", "gap", "pieces", "sent")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.sent = 0  # characters sent
        self.gap = False  # deltas stopped continuing what was sent: the rest comes with the item
        self.done = False


Action = Literal["send", "restart", "skip"]


class TextItems:
    """What a client was sent of each text item, from keel's deltas (live only: a stream that
    joined mid-item, or a retried attempt streaming again from offset 0, shows) and the item's
    committed text. A translator turns the actions into its protocol's frames:
    `send` (text continues what was sent; `first`: nothing was sent before), `restart` (text
    is the item from its start: what was sent is not it), `skip`. O(1) per delta."""

    def __init__(self) -> None:
        self.items: dict[str, _Item] = {}

    def delta(self, item_id: str, delta: str, offset: int) -> tuple[Action, str, bool]:
        item = self.items.setdefault(item_id, _Item())
        if item.done or not delta:
            return "skip", "", False
        if offset == 0 and item.sent:  # a retried attempt streaming again
            item.pieces, item.sent, item.gap = [delta], len(delta), False
            return "restart", delta, False
        if offset != item.sent or item.gap:  # joined mid-item (or a gap): the rest comes whole
            item.gap = True
            return "skip", "", False
        first = not item.sent
        item.pieces.append(delta)
        item.sent += len(delta)
        return "send", delta, first

    def completed(self, item_id: str, text: str) -> tuple[Action, str, bool]:
        item = self.items.setdefault(item_id, _Item())
        if item.done:
            return "skip", "", False
        item.done = True
        shown = "".join(item.pieces)
        item.pieces = [text]
        if text.startswith(shown):
            first = not item.sent
            item.sent = len(text)
            return "send", text[len(shown) :], first
        item.sent = len(text)
        return "restart", text, False

    def sent(self, item_id: str) -> bool:
        item = self.items.get(item_id)
        return item is not None and item.sent > 0

    def abandoned(self, item_id: str) -> list[str]:
        """Other items sent in part and never completed: an attempt a crash or a hand-over cut
        (the step ran again as a new item). They count as done from now on."""
        cut = [i for i, item in self.items.items() if i != item_id and item.sent and not item.done]
        for i in cut:
            self.items[i].done = True
        return cut

    def unfinished(self) -> list[str]:
        """Items sent in part, never completed (the stream ends with them open)."""
        return [i for i, item in self.items.items() if item.sent and not item.done]


@dataclass(frozen=True)
class TurnReader:
    """A request's reading of one session's turns: the harness, the session, its owner."""

    request: Request
    harness: Harness
    sid: str
    owner: str

    @classmethod
    def of(cls, request: Request, sid: str) -> TurnReader:
        """The reader of session `sid` for this request: its owner is the API key's, or the one a
        session token for `sid` names (401 `unauthorized` for a token of anything else)."""
        owner: str | None = getattr(request.state, "owner", None)
        if owner is None:
            tokens: TokenSigner = request.app.state.tokens
            bearer: str = getattr(request.state, "bearer", "")
            owner = tokens.verify(bearer, sid) if bearer else None
            if owner is None:
                raise ChannelError(401, "unauthorized", "missing or wrong API key, or no valid token for this session")
        return cls(request, request.app.state.harness, sid, owner)

    async def follow(
        self, turn_id: str, after: str, armed: Armed | None = None, upto: str | None = None
    ) -> AsyncGenerator[Followed | SessionDeleted | CaughtUp | None, None]:
        """The turn's committed events after `after`, then live, with its deltas; None for a
        heartbeat; a SessionDeleted last if the session ends. Never ends by itself otherwise:
        the caller stops at the event it waits for. With `upto` (an event id), CAUGHT_UP once
        the session's events up to it have been read (at once if `after` is not before it; at
        the first heartbeat if they left the outbox before they were read)."""
        beat: float = self.request.app.state.sse_heartbeat
        reached = self.harness.sessions.reached
        ahead = upto is not None and not reached(after, upto)
        if upto is not None and not ahead:
            yield CAUGHT_UP
        async for item in self.harness.sessions.tail(self.sid, after, heartbeat=beat, armed=armed):
            if item is None:
                yield None
                if ahead:
                    ahead = False
                    yield CAUGHT_UP
            elif isinstance(item, LiveEvent):
                live = item.decoded()
                if isinstance(live, SessionDeleted):
                    yield live
                    return
                if live.turn_id == turn_id:
                    yield live
            else:
                event = item.decoded()
                if event.turn_id == turn_id:
                    yield event
                if ahead and reached(item.id, cast(str, upto)):
                    ahead = False
                    yield CAUGHT_UP

    async def frames(
        self,
        turn_id: str,
        after: str,
        translator: Translator,
        *,
        muted: Callable[[Followed], Muted] | None = None,
        armed: Armed | None = None,
        upto: str | None = None,
    ) -> AsyncIterator[bytes]:
        """The translator's frames for the turn, from its opening to its closing: after the
        turn's outcome, or the approval requests it waits on (those still open when read).
        `muted`: the events the client was sent already (fed to the translator, not sent), up to
        the `last` of them or the first `open` one. `upto`: the session's newest event when the
        stream began (`newest_event`), for a replay of a turn that may wait on requests asked
        longer ago than events are kept: once the replay has read it, requests the turn waits
        on that it did not show close the stream, rebuilt from the session's record of them
        (sent unless `muted`: an answer's client was shown them with those it answers)."""
        answering = muted is not None
        yield translator.opening()
        async with contextlib.aclosing(self.follow(turn_id, after, armed, upto)) as events:
            async for event in events:
                if event is None:
                    yield KEEP_ALIVE
                    continue
                if isinstance(event, CaughtUp):
                    asked = await self._asking(turn_id)
                    if asked is None:
                        continue
                    out = translator.feed(asked)
                    if out and not answering:
                        yield out
                    yield translator.closing(asked)
                    return
                if isinstance(event, SessionDeleted):
                    yield translator.closing(event)
                    return
                out = translator.feed(event)
                waits = await self._waits_on(event) if isinstance(event, InputRequested) else None
                if muted is not None:
                    verdict = muted(event)
                    # (the turn's end, or requests it waits on now, are never muted: a replay
                    # whose last muted event left the outbox still ends)
                    if verdict == "muted" and not (isinstance(event, ENDINGS) or waits is not None):
                        continue
                    muted = None  # (what follows is new to the client)
                    if verdict == "last":
                        out = b""
                if out:
                    yield out
                if isinstance(event, ENDINGS):
                    yield translator.closing(event)
                    return
                if waits is not None:
                    yield translator.closing(waits)
                    return

    async def answer(self, answers: Sequence[Answer], translator: Translator) -> AsyncIterator[bytes]:
        """Record approval answers, each as `POST .../responses` does (a repeat is accepted, a
        different answer is a 409; one for a request its cancelled turn withdrew is let be),
        then the frames of the rest of their turn: the events up to the requests they answer
        were sent by the stream that asked (they are read, muted). Every answer is checked, and
        its turn found, before the first is recorded."""
        sessions = self.harness.sessions
        for a in answers:
            sessions.check_answer(a.request_id, a.decision, a.reason)
        first = answers[0].request_id
        turn_id = await sessions.turn_asking(self.sid, self.owner, first)
        if turn_id is None:
            raise ChannelError(404, "request_not_found", f"no approval request {first[:64]} in session {self.sid}")
        # (a turn whose first event left the outbox: what is kept of it, from the outbox's start)
        after = await sessions.turn_start(self.sid, self.owner, turn_id) or sessions.resume_after()
        open_now = set(await sessions.pending(self.sid, self.owner))
        # (a new answer writes where the rest begins; repeats only, it must still be kept)
        ids = [a.request_id for a in answers]
        kept = any(r in open_now for r in ids) or await sessions.answers_kept(self.sid, ids)
        # the answers to closed requests first: a repeat changes nothing, a conflict or an
        # unknown request fails before any new answer is recorded
        ordered = sorted(answers, key=lambda a: a.request_id in open_now)
        self.take_place()
        armed = sessions.arm(self.sid)  # (before the answers: the rest of the turn is not missed)
        try:
            for a in ordered:
                try:
                    await sessions.respond(self.sid, self.owner, a.request_id, a.decision, a.reason)
                except Conflict as exc:
                    if exc.details.get("decision") != "withdrawn":
                        raise
            if not kept:  # (repeats, asked and answered longer ago than events are kept: what
                # the stream would show after them cannot be told apart from what the client has)
                raise ChannelError(
                    404, "request_not_found", f"request {first[:64]} was answered longer ago than events are kept"
                )
            upto = await sessions.newest_event(self.sid)  # (after the answers: their events are read first)
        except BaseException:
            self.give_place(armed)
            raise

        answered = set(ids)

        def replayed(event: Followed) -> Muted:
            """The turn up to its requests, which the stream that asked sent; if they are no
            longer kept (asked longer ago than the event window, with all before them), what
            follows their answers' input.resolved."""
            if isinstance(event, InputRequested) and any(r.request_id in answered for r in event.data.requests):
                return "last"
            if isinstance(event, InputResolved) and event.data.request_id in answered:
                return "open"
            return "muted"

        return self.frames(turn_id, after, translator, muted=replayed, armed=armed, upto=upto)

    async def _asking(self, turn_id: str) -> InputRequested | None:
        """The requests turn `turn_id` waits on now, rebuilt (None: none, or the session ended:
        its reader is told next)."""
        try:
            return await self.harness.sessions.asking(self.sid, self.owner, turn_id)
        except NotFound:
            return None

    async def _waits_on(self, asked: InputRequested) -> InputRequested | None:
        """The requests of `asked` the turn still waits on (None: all answered; it went on)."""
        try:
            waiting = set(await self.harness.sessions.pending(self.sid, self.owner))
        except NotFound:  # (the session ended: its reader is told next)
            return None
        still = [r for r in asked.data.requests if r.request_id in waiting]
        if not still:
            return None
        return msgspec.structs.replace(asked, data=msgspec.structs.replace(asked.data, requests=still))

    def take_place(self) -> None:
        """One of the session's reader places in this process (429 `too_many_readers` when it
        has its fill), held until `response`'s stream ends (or `give_place`)."""
        readers: Occupancy = self.request.app.state.readers
        readers.take(self.sid)

    def give_place(self, armed: Armed | None = None) -> None:
        readers: Occupancy = self.request.app.state.readers
        readers.give(self.sid)
        if armed is not None:
            self.harness.sessions.disarm(self.sid, armed)

    def response(self, body: AsyncIterator[bytes], headers: Mapping[str, str], armed: Armed | None = None) -> Response:
        """The SSE answer, for a reader that took its place: it gives the place back (and the
        subscription it `armed`) however the stream ends, even if it never began; and it ends
        cleanly when the process drains (the client resumes elsewhere)."""
        drain: Drain = self.request.app.state.drain
        return EventStream(
            body,
            functools.partial(self.give_place, armed),
            drain,
            media_type="text/event-stream",
            headers={**HEADERS, **headers},
        )

    async def submitted(
        self,
        text: str,
        context: ContextValue,
        message_id: str,
        translator: Callable[[str], Translator],
        headers: Mapping[str, str],
    ) -> Response:
        """Submit a user message and answer with its turn's frames: the subscription is opened
        first, so not one of its live deltas is missed. A message id sent before replays its turn."""
        harness, sid, owner = self.harness, self.sid, self.owner
        waiting = await harness.sessions.waiting_on(sid, owner)
        if waiting is not None and waiting != message_id:  # (its stream would wait behind the approval)
            raise ChannelError(409, "awaiting_approval", "the session's turn waits for approval: answer it first")
        await harness.sessions.admissible(sid, owner, message_id)  # (bad input spends no token)
        await harness.quotas.admit(owner)
        self.take_place()
        armed = harness.sessions.arm(sid)
        try:
            done = await harness.sessions.submit(sid, owner, text, context, message_id)
            sent = (
                await harness.sessions.message_text(sid, owner, done.received_id, message_id)
                if done.duplicate
                else None
            )
            upto = await harness.sessions.newest_event(sid) if done.duplicate else None  # (a replay)
            if sent is not None and sent != text:
                raise ChannelError(
                    409,
                    "message_edited",
                    f"message {message_id[:64]} was sent with other text: to edit it, fork the session before it "
                    "(POST /v1/sessions/{id}/fork) and send the new text there",
                )
        except BaseException:
            self.give_place(armed)
            raise
        after = harness.sessions.before(done.received_id)
        frames = self.frames(done.turn_id, after, translator(done.turn_id), armed=armed, upto=upto)
        return self.response(frames, headers, armed)
