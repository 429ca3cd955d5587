"""I7: whatever an input callback does to the model input, what is stored is the history as it
was plus this turn's genuinely new input and the model's outputs, each exactly once; and the
model is shown exactly what the callback returned."""

from __future__ import annotations

import asyncio
import copy
import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Agent, Compaction, tool
from harness.models import Item, ModelReply, ModelRequest, ScriptedModel, ToolCall

OPS = ("repeat", "pop", "reorder", "filter", "deepcopy", "reconstruct", "drop_new", "invent", "none")


@dataclass
class Turn:
    ops: list[tuple[str, int]]
    tool: bool
    branch: str
    is_async: bool


@dataclass
class Plan:
    """What the callback and the model do in the turn now running (the test drives one at a time)."""

    n: int = 0
    turn: Turn | None = None
    returned: list[list[Item]] = field(default_factory=list)
    received: list[list[Item]] = field(default_factory=list)  # the history each call was given

    def reply(self, r: ModelRequest) -> ModelReply:
        assert self.turn is not None
        if self.turn.tool and r.step == 0:
            return ModelReply(tool_calls=[ToolCall("ping", {"n": self.n})])
        return ModelReply(text=f"reply {self.n}")


def reshape(history: list[Item], fresh: list[Item], turn: Turn) -> list[Item]:
    extra: list[Item] = []
    shuffle = False
    for op, k in turn.ops:
        if op == "repeat" and history:
            extra.append(history[k % len(history)])
        elif op == "pop" and history:
            extra.append(history.pop(k % len(history)))  # out of the list it was given, then returned
        elif op == "filter" and history:
            del history[k % len(history)]
        elif op == "deepcopy" and history:
            history[k % len(history)] = copy.deepcopy(history[k % len(history)])
        elif op == "reconstruct" and history:
            history[k % len(history)] = Item(**msgspec.structs.asdict(history[k % len(history)]))
        elif op == "drop_new":
            fresh.clear()
        elif op == "invent":
            extra.append(Item(id=f"inv_{k}", role="user", text=f"invented {k}"))
        elif op == "reorder":
            shuffle = True
    out = history + fresh + extra
    if shuffle:
        random.Random(len(out)).shuffle(out)
    return out


turns = st.lists(
    st.builds(
        Turn,
        ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 50)), max_size=4),
        tool=st.booleans(),
        branch=st.sampled_from(["main", "main", "dev"]),
        is_async=st.booleans(),
    ),
    min_size=2,
    max_size=7,
)


@tool
def ping(n: int) -> str:
    """Ping."""
    return f"pong {n}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=turns)
async def test_history_is_stored_once_whatever_the_callback_does(make_harness: Any, script: list[Turn]) -> None:
    plan = Plan()
    model = ScriptedModel(plan.reply)
    h = await make_harness(agent_for(plan, model))
    try:
        await check(h, model, plan, script)
    finally:
        await h.stop()  # one harness at a time: harnesses on one Redis share the job stream


async def check(h: Any, model: ScriptedModel, plan: Plan, script: list[Turn]) -> None:
    sid = await h.sessions.create("anon")
    expected: list[tuple[str, str, str]] = []
    newest_branch: str | None = None
    for n, turn in enumerate(script):
        plan.n, plan.turn, plan.returned, plan.received = n, turn, [], []
        first = len(model.requests)
        before = await h.sessions.history(sid, "anon")
        result = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", f"message {n}"), 10)
        assert result.status == "completed", result
        if turn.branch != newest_branch:
            expected.append(("user", "runtime", f"branch: {turn.branch}"))
            newest_branch = turn.branch
        expected.append(("user", "message", f"message {n}"))
        if turn.tool:
            expected += [("assistant", "message", ""), ("tool", "tool_result", f"pong {n}")]
        expected.append(("assistant", "message", f"reply {n}"))
        stored = await h.sessions.history(sid, "anon")
        assert stored[: len(before)] == before  # append-only
        assert all(given == before for given in plan.received)  # each call got the history as stored
        assert [(i.role, i.kind, i.text.splitlines()[-1] if i.text else "") for i in stored] == expected
        assert len({i.id for i in stored}) == len(stored)  # no item stored twice
        requests = model.requests[first:]
        assert len(requests) == len(plan.returned) == (2 if turn.tool else 1)
        for request, returned in zip(requests, plan.returned, strict=True):
            assert request.messages[: len(returned)] == returned  # exactly what the callback returned ...
            outputs = request.messages[len(returned) :]
            assert all(i.turn_id == request.turn_id and i.role != "user" for i in outputs)  # ... then outputs


def agent_for(plan: Plan, model: ScriptedModel) -> Agent:
    def callback(history: list[Item], fresh: list[Item]) -> list[Item]:
        assert plan.turn is not None
        plan.received.append(list(history))
        assert [i.kind for i in fresh][-1] == "message"  # new input ends with the user message
        out = reshape(history, fresh, plan.turn)
        plan.returned.append(list(out))
        return out

    async def async_callback(history: list[Item], fresh: list[Item]) -> list[Item]:
        return callback(history, fresh)

    def either(history: list[Item], fresh: list[Item]) -> Any:
        assert plan.turn is not None
        return async_callback(history, fresh) if plan.turn.is_async else callback(history, fresh)

    def branch() -> str:
        assert plan.turn is not None
        return plan.turn.branch

    return Agent(instructions="t", tools=[ping], model=model, runtime_context=[branch], input_callback=either)


async def test_a_callback_that_edits_tool_arguments_in_place_changes_nothing_stored(make_harness: Any) -> None:
    def redact(history: list[Item], fresh: list[Item]) -> list[Item]:
        for item in history:
            for call in item.tool_calls:
                call.arguments["n"] = -1  # in place: a dict inside a frozen Item
        return history + fresh

    def script(r: ModelRequest) -> ModelReply:
        if r.step == 0 and r.messages[-1].text == "go":
            return ModelReply(tool_calls=[ToolCall("ping", {"n": 7})])
        return ModelReply(text="ok")

    model = ScriptedModel(script)
    agent = Agent(
        instructions="t", tools=[ping], model=model, input_callback=redact, compaction=Compaction(keep_turns=3)
    )
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    for text in ("first", "go", "again", "once more"):  # compact keeps the last three turns verbatim
        assert (await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", text), 10)).status == "completed"
    stored = await h.sessions.history(sid, "anon")
    assert [c.arguments for i in stored for c in i.tool_calls] == [{"n": 7}]
    assert model.requests[-1].messages[3].tool_calls[0].arguments == {"n": -1}  # the model saw the edit
    await h.sessions.compact(sid, "anon")
    async with asyncio.timeout(10):
        async for event in h.sessions.tail(sid, "0-0", heartbeat=1.0):
            if event is not None and event.type == "session.waiting":
                break
    raw = await h.redis.lrange(f"keel:{{{sid}}}:history", 0, -1)
    assert not any(b'"n":-1' in r for r in raw)  # nor did the edit reach Redis through a rebase
