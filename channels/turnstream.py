"""One turn's events, for the frontend protocols (`channels.aisdk`, `channels.agui`): read from
the session's durable outbox (from the turn's first event, or from now), then live, until the
turn settles or pauses; each protocol's translator makes its frames of them.

An `input.requested` ends the stream only
while its requests are still open: a turn answered meanwhile is followed on. A translator may
be `muted` up to an event (a continuation after an answer: its frames before the answer were
sent by the stream that asked), so it learns the turn's state without sending it twice. The
client going away stops the reading only: the turn goes on."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from starlette.requests import Request
from starlette.responses import Response

from channels.drain import Drain
from channels.errors import ChannelError
from channels.limits import Occupancy
from channels.sse import HEADERS, EventStream
from channels.tokens import TokenSigner
from channels.types import ContextValue
from harness import Harness
from harness.events import (
    Event,
    InputRequested,
    LiveEvent,
    MessageDelta,
    SessionDeleted,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
)
from harness.types import Armed

Followed = Event | MessageDelta


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
        self, turn_id: str, after: str, armed: Armed | None = None
    ) -> AsyncIterator[Followed | SessionDeleted | None]:
        """The turn's committed events after `after`, then live, with its deltas; None for a
        heartbeat; a SessionDeleted last if the session ends. Never ends by itself otherwise:
        the caller stops at the event it waits for."""
        beat: float = self.request.app.state.sse_heartbeat
        async for item in self.harness.sessions.tail(self.sid, after, heartbeat=beat, armed=armed):
            if item is None:
                yield None
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

    async def frames(
        self,
        turn_id: str,
        after: str,
        translator: Translator,
        *,
        muted_until: Callable[[Followed], bool] | None = None,
        armed: Armed | None = None,
    ) -> AsyncIterator[bytes]:
        """The translator's frames for the turn, from its opening to its closing: after the
        turn's outcome, or the approval requests it waits on (still open when they are read)."""
        yield translator.opening()
        async for event in self.follow(turn_id, after, armed):
            if event is None:
                yield KEEP_ALIVE
                continue
            if isinstance(event, SessionDeleted):
                yield translator.closing(event)
                return
            out = translator.feed(event)
            if muted_until is not None:
                if muted_until(event):
                    muted_until = None
                continue
            if out:
                yield out
            if isinstance(event, ENDINGS) or (isinstance(event, InputRequested) and await self._waits_on(event)):
                yield translator.closing(event)
                return

    async def answer(self, answers: Sequence[Answer], translator: Translator) -> AsyncIterator[bytes]:
        """Record approval answers, each as `POST .../responses` does (a repeat is accepted, a
        different answer is a 409), then the frames of the rest of their turn: the events up to
        the requests they answer were sent by the stream that asked (they are read, muted)."""
        self.take_place()
        try:
            return await self._answered(answers, translator)
        except BaseException:
            self.give_place()
            raise

    async def _answered(self, answers: Sequence[Answer], translator: Translator) -> AsyncIterator[bytes]:
        for a in answers:
            await self.harness.sessions.respond(self.sid, self.owner, a.request_id, a.decision, a.reason)
        turn_id = await self.harness.sessions.turn_asking(self.sid, self.owner, answers[0].request_id)
        after = await self.harness.sessions.turn_start(self.sid, self.owner, turn_id) if turn_id else None
        if turn_id is None or after is None:
            raise ChannelError(404, "turn_not_found", f"the turn of {answers[0].request_id[:64]} is no longer kept")
        ids = {a.request_id for a in answers}

        def asked(event: Followed) -> bool:
            return isinstance(event, InputRequested) and any(r.request_id in ids for r in event.data.requests)

        return self.frames(turn_id, after, translator, muted_until=asked)

    async def _waits_on(self, asked: InputRequested) -> bool:
        """Whether the turn still waits on these requests (else it went on: follow it)."""
        waiting = set(await self.harness.sessions.pending(self.sid, self.owner))
        return any(r.request_id in waiting for r in asked.data.requests)

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
        await harness.quotas.admit(owner)
        self.take_place()
        armed = harness.sessions.arm(sid)
        try:
            done = await harness.sessions.submit(sid, owner, text, context, message_id)
        except BaseException:
            self.give_place(armed)
            raise
        after = harness.sessions.before(done.received_id)
        frames = self.frames(done.turn_id, after, translator(done.turn_id), armed=armed)
        return self.response(frames, headers, armed)
