"""Waiting for a turn to settle (`?wait=true`, an answer that resumes a turn): its events, read
from a given point on, until the newest of them says how the turn came out (NotFound if the
session ends meanwhile)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from harness.errors import Conflict, NotFound
from harness.events import OUTCOMES, StoredEvent, TurnCompleted
from harness.store import Outbox, Watch
from harness.types import TurnOutcome


async def collect_turn(
    outbox: Outbox,
    sid: str,
    turn_id: str,
    watch: Watch,
    *,
    after: str,
    timeout: float,
    read_first: bool,
    ended: Callable[[], Awaitable[bool]] | None = None,
) -> TurnOutcome:
    """The turn's events after `after`, until the turn's newest event settles it: a turn.*
    event, or an input.requested with nothing after it (so asking again later about a turn
    that paused and then finished reports how it finished). `ended`, for a turn asked about
    again: whether it is over; one whose events all left the outbox is then a Conflict
    (`turn_events_gone`), not a wait for events that will not come."""
    events: list[StoredEvent] = []
    marker = b'"turn_id":"' + turn_id.encode() + b'"'
    loop = asyncio.get_running_loop()
    # The deadline bounds each wait and each read of Redis (not the events handed over here:
    # a turn that settles in this process costs no timer but its watch's)
    deadline = loop.time() + timeout

    position, read = after, read_first
    try:
        while True:
            if read:
                batch, more = await outbox.next(sid, watch, position, deadline=deadline)
                if batch:
                    position = batch[-1].id
                events.extend(e for e in batch if marker in e.raw)
                if more:
                    continue  # read everything there is before judging the newest event
                if not events and ended is not None and await ended():
                    raise Conflict(
                        "this message's turn has ended and its events are not in this session's outbox (more "
                        "came after them than KEEL_EVENT_RETENTION keeps, or a fork copied the message): how it "
                        "came out is not known here; its items are in the session's history",
                        code="turn_events_gone",
                    )
                ended = None  # (asked once)
                status = OUTCOMES.get(events[-1].type) if events else None
                if status is not None:
                    completed = events[-1].of(TurnCompleted)
                    reply = completed.data.reply if completed is not None else None
                    return TurnOutcome(status=status, reply=reply, events=events)
            left = deadline - loop.time()
            if left <= 0:
                break
            outbox.hub.listen(sid, watch)  # (a deferred watch: it follows unless this process writes the turn)
            woken = await watch.wait(min(left, 5.0))  # or a periodic look in case a wake-up was lost
            if watch.ended is not None:
                raise NotFound(f"session {sid} was deleted", code="session_not_found")
            if not woken:
                if loop.time() >= deadline:
                    break
                async with asyncio.timeout_at(deadline):
                    if not await outbox.exists(sid):
                        raise NotFound(f"session {sid} was deleted", code="session_not_found")
                    await outbox.settle(sid)  # (with replicas: a mark a failover lost)
            read = True
    except TimeoutError:  # (a read of Redis past the deadline)
        pass
    return TurnOutcome(status="pending", reply=None, events=events)
