"""The per-process history cache makes reads smaller, never different: a session run by two
processes in turn, or whose history start moves, still shows the model exactly its history."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel


def texts(request: ModelRequest) -> list[str]:
    return [m.text for m in request.messages if m.kind == "message"]


async def test_two_processes_taking_turns_each_see_the_whole_history(make_harness: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text=f"a{len(r.messages)}"))
    one = await make_harness(Agent(instructions="t", model=model))
    two = await make_harness(Agent(instructions="t", model=model))
    sid = await one.sessions.create("anon")
    expected: list[str] = []
    for n in range(6):
        h = (one, two)[n % 2]
        turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", f"u{n}"), 10)
        assert turn.status == "completed"
        assert texts(model.requests[-1]) == [*expected, f"u{n}"]
        expected += [f"u{n}", turn.reply]
    assert [i.text for i in await one.sessions.history(sid, "anon")] == expected


async def test_a_moved_history_start_is_read_again(make_harness: Any, redis: Redis) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model))
    sid = await h.sessions.create("anon")
    for n in range(3):
        await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", f"u{n}"), 10)
    # what compaction or clear will do: the active history starts later in the list
    await redis.hset(f"keel:{{{sid}}}:meta", "hist_start", 4)
    await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "u3"), 10)
    assert texts(model.requests[-1]) == ["u2", "ok", "u3"]
