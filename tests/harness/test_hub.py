"""Readers of a session in one process hear of commits made in another at once (found by
deploy/loadtest: a web process with KEEL_RUN_TURNS=0 and a worker, turns that showed up on the
websocket only at the next heartbeat, 15 s later)."""

from __future__ import annotations

import asyncio
from typing import Any

from harness import Agent
from harness.events import StoredEvent
from harness.models import ModelReply, ScriptedModel


async def test_a_reader_gets_a_turn_run_elsewhere_though_its_own_event_came_with_the_notice(
    make_harness: Any,
) -> None:
    """The web process commits the message (its event handed to its readers directly); the
    worker runs the turn, whose commit notices reach the web process before its reader looks.
    The reader must not take the handed-over event for all there is: it reads the stream and
    gets the turn's events now, not after the heartbeat (60 s here)."""
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="hi")))
    await make_harness(agent)  # the worker
    web = await make_harness(agent, run_turns=False)
    sid = await web.sessions.create("anon")
    reader = web.sessions.tail(sid, "0", heartbeat=60.0)
    try:
        first = await anext(reader)
        assert isinstance(first, StoredEvent) and first.type == "session.created"
        # The reader does not look meanwhile (a busy event loop): the message's event is handed
        # to it, and the notices of the worker's commits arrive (they woke this waiter too).
        turn = await web.sessions.submit_and_wait(sid, "anon", "hello", context=None, message_id=None, timeout=10)
        assert turn.status == "completed"
        seen: list[str] = []
        async with asyncio.timeout(5):
            while not seen or seen[-1] != "turn.completed":
                event = await anext(reader)
                if isinstance(event, StoredEvent):
                    seen.append(event.type)
        assert seen[0] == "message.received" and seen[-1] == "turn.completed"
    finally:
        await reader.aclose()  # type: ignore[attr-defined]
