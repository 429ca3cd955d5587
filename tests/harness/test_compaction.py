"""I8: compaction trims first, summarizes when it must, keeps tool pairs and framework state,
counts the envelope and the provider's token report; manual compact and clear queue behind the
running turn and emit their events in order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from harness import Agent, tool
from harness.errors import Conflict
from harness.loop.compaction import PREVIOUS_HEADER, SUMMARY_HEADER, TRANSCRIPT_HEADER, Compaction
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall, Usage
from harness.models.tokens import request_tokens
from harness.tools.todo import HEADER as TODO_HEADER


async def run_turn(h: Any, sid: str, text: str, context: Any = None) -> Any:
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", text, context), 10)
    assert turn.status == "completed", turn
    return turn


async def events_until(h: Any, sid: str, last: str, timeout: float = 10) -> list[dict[str, Any]]:
    """Every event of the session from the start until (and with) the first `last` event."""

    out: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        async for event in h.sessions.tail(sid, "0-0", heartbeat=1.0):
            if event is None:
                continue
            out.append(json.loads(event.raw))
            if event.type == last:
                return out
    raise AssertionError("unreachable")


async def all_events(h: Any, sid: str) -> list[dict[str, Any]]:

    out: list[Any] = []
    while batch := await h.store.outbox.events(sid, out[-1].id if out else "0-0"):
        out.extend(batch)
    return [json.loads(e.raw) for e in out]


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def turn_requests(model: ScriptedModel) -> list[ModelRequest]:
    return [r for r in model.requests if r.purpose == "turn"]


def summaries(model: ScriptedModel) -> list[ModelRequest]:
    return [r for r in model.requests if r.purpose == "compaction"]


def summarizing(summary: str = "SUMMARY") -> Any:
    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text=summary)
        return ModelReply(text="reply " + "r" * 40)

    return script


@tool
def fetch(doc: str) -> str:
    """Fetch a document."""
    return doc.upper() * 1250  # 5,000 characters for a 4-character name


async def test_trimming_old_tool_results_is_enough_when_it_can_be(make_harness: Any) -> None:
    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.kind == "message" and last.text == "read":
            return ModelReply(tool_calls=[ToolCall("fetch", {"doc": "abcd"})])
        return ModelReply(text="ok")

    model = ScriptedModel(script)
    config = Compaction(keep_turns=1, tool_result_chars=200)
    h = await make_harness(Agent(instructions="t", tools=[fetch], model=model, context_window=1_000, compaction=config))
    sid = await h.sessions.create("anon")
    for text in ("read", "two", "three"):
        await run_turn(h, sid, text)
    before = await h.sessions.history(sid, "anon")
    assert not summaries(model)
    completed = [e["data"] for e in await all_events(h, sid) if e["type"] == "compaction.completed"]
    assert len(completed) == 1 and completed[0]["trimmed"] == 1 and completed[0]["summarized"] == 0
    result = next(i for i in before if i.role == "tool")
    assert len(result.text) < 300 and result.text.startswith("ABCD" * 50) and "4800 characters trimmed" in result.text
    assert [i.text for i in before if i.role != "tool"] == ["read", "", "ok", "two", "ok", "three", "ok"]
    last = turn_requests(model)[-1]
    assert sum(len(m.text) for m in last.messages) < 500  # the model saw the trimmed history


async def test_summary_replaces_older_turns_when_trimming_cannot(make_harness: Any) -> None:
    model = ScriptedModel(summarizing())
    config = Compaction(keep_turns=2)
    h = await make_harness(Agent(instructions="t", model=model, context_window=500, compaction=config))
    sid = await h.sessions.create("anon")
    n = 0
    while not summaries(model):
        n += 1
        await run_turn(h, sid, f"message {n} " + "m" * 200)
        assert n < 20
    history = await h.sessions.history(sid, "anon")
    assert history[0].kind == "summary" and history[0].text == f"{SUMMARY_HEADER}\nSUMMARY"
    # the two turns before the current one, verbatim, then the current turn
    assert [i.text.split(" ")[:2] for i in history[1:] if i.role == "user"] == [
        ["message", str(n - 2)],
        ["message", str(n - 1)],
        ["message", str(n)],
    ]
    (request,) = summaries(model)
    assert request.messages[-1].text.startswith(TRANSCRIPT_HEADER)
    assert f"message {n - 3} " in request.messages[-1].text and f"message {n - 2} " not in request.messages[-1].text
    info = await h.sessions.info(sid, "anon")
    assert info.usage["model_calls"] == n + 1  # the summary call counts in the session's usage
    usage = [e["data"] for e in await all_events(h, sid) if e["type"] == "usage.recorded"]
    assert [u.get("purpose", "turn") for u in usage].count("compaction") == 1
    assert info.usage["input_tokens"] == sum(u["input_tokens"] for u in usage)


async def test_the_previous_summary_is_passed_separately_and_whole(make_harness: Any) -> None:
    long_summary = "S" * 3_000  # longer than the transcript's per-message cut-off
    model = ScriptedModel(summarizing(long_summary))
    config = Compaction(keep_turns=1, transcript_chars=100)
    h = await make_harness(Agent(instructions="t", model=model, context_window=1_400, compaction=config))
    sid = await h.sessions.create("anon")
    n = 0
    while len(summaries(model)) < 2:
        n += 1
        await run_turn(h, sid, f"message {n} " + "m" * 400)
        assert n < 30
    first, second = summaries(model)
    assert not any(m.text.startswith(PREVIOUS_HEADER) for m in first.messages)
    previous = second.messages[0]
    assert previous.text == f"{PREVIOUS_HEADER}\n{long_summary}"
    assert long_summary not in second.messages[1].text  # not repeated (cut) in the transcript
    assert "m" * 101 not in second.messages[1].text  # transcript messages are cut at 100
    history = await h.sessions.history(sid, "anon")
    assert [i.kind for i in history].count("summary") == 1


async def test_tool_calls_and_results_are_never_split(make_harness: Any) -> None:
    @tool
    def search(q: str) -> str:
        """Search."""
        return "result " + q * 50

    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="SUMMARY")
        last = r.messages[-1]
        if last.kind == "message" and last.role == "user":
            return ModelReply(tool_calls=[ToolCall("search", {"q": "a"}), ToolCall("search", {"q": "b"})])
        if last.role == "tool" and r.step < 2:
            return ModelReply(tool_calls=[ToolCall("search", {"q": "c"})])
        return ModelReply(text="done")

    model = ScriptedModel(script)
    config = Compaction(keep_turns=1, tool_result_chars=5_000)
    h = await make_harness(Agent(instructions="t", tools=[search], model=model, context_window=800, compaction=config))
    sid = await h.sessions.create("anon")
    for n in range(8):
        await run_turn(h, sid, f"go {n}")
    assert len(summaries(model)) >= 2
    for request in turn_requests(model):
        calls = [c.id for m in request.messages if m.role == "assistant" for c in m.tool_calls]
        results = [m.tool_call_id for m in request.messages if m.role == "tool"]
        assert sorted(calls) == sorted(results)  # every call has its result, every result its call
    history = await h.sessions.history(sid, "anon")
    calls = [c.id for m in history if m.role == "assistant" for c in m.tool_calls]
    assert sorted(calls) == sorted(m.tool_call_id for m in history if m.role == "tool")


async def test_todo_list_and_newest_snapshot_survive_the_summary(make_harness: Any) -> None:
    plan = {"value": "pro"}

    def user_plan() -> str:
        return plan["value"]

    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="SUMMARY")
        last = r.messages[-1]
        if last.kind == "message" and last.text.startswith("plan"):
            items = [{"text": "write the report", "status": "done"}, {"text": "send it", "status": "pending"}]
            return ModelReply(tool_calls=[ToolCall("todo", {"items": items})])
        return ModelReply(text="ok " + "o" * 100)

    model = ScriptedModel(script)
    agent = Agent(
        instructions="t",
        model=model,
        todo=True,
        runtime_context=[user_plan],
        context_window=700,
        compaction=Compaction(keep_turns=1),
    )
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    await run_turn(h, sid, "plan the work")
    n = 0
    while not summaries(model):
        n += 1
        await run_turn(h, sid, f"message {n} " + "m" * 150)
        assert n < 20
    history = await h.sessions.history(sid, "anon")
    assert [i.kind for i in history[:3]] == ["summary", "todo", "runtime"]
    assert history[1].text == f"{TODO_HEADER}\n- [x] write the report\n- [ ] send it"
    assert history[2].text.endswith("user_plan: pro")
    await run_turn(h, sid, "after")  # the restored snapshot counts: no new one for the same value
    assert [i.kind for i in await h.sessions.history(sid, "anon")].count("runtime") == 1
    assert "todo" in [t.name for t in turn_requests(model)[-1].tools]


async def test_threshold_counts_the_envelope(make_harness: Any) -> None:
    config = Compaction(keep_turns=1)

    async def compactions(window: int) -> int:
        model = ScriptedModel(summarizing())
        h = await make_harness(Agent(instructions="t", model=model, context_window=window, compaction=config))
        sid = await h.sessions.create("anon")
        for n in range(3):
            await run_turn(h, sid, f"m{n}")
        await h.stop()  # harnesses on one Redis share the job stream: only one may run turns
        return len(summaries(model))

    probe = ScriptedModel(summarizing())
    h = await make_harness(Agent(instructions="t", model=probe))
    sid = await h.sessions.create("anon")
    for n in range(3):
        await run_turn(h, sid, f"m{n}")
    await h.stop()
    prompt = request_tokens(probe.requests[-1])  # the third turn's prompt, where compaction can first act
    # the prompt alone is well under 90% of this window; with the envelope it is over
    assert prompt < 0.9 * (prompt + config.envelope - 10)
    assert await compactions(int((prompt + config.envelope - 10) / 0.9)) == 1
    assert await compactions(int((prompt + config.envelope + 10) / 0.9)) == 0


async def test_threshold_prefers_the_providers_token_count(make_harness: Any) -> None:
    config = Compaction(keep_turns=1)

    async def compactions(reported: int | None) -> int:
        def script(r: ModelRequest) -> ModelReply:
            if r.purpose == "compaction":
                return ModelReply(text="SUMMARY")
            usage = None if reported is None else Usage(input_tokens=reported, output_tokens=5)
            return ModelReply(text="ok", usage=usage)

        model = ScriptedModel(script)
        h = await make_harness(Agent(instructions="t", model=model, context_window=2_000, compaction=config))
        sid = await h.sessions.create("anon")
        for n in range(3):
            await run_turn(h, sid, f"m{n}")
        await h.stop()  # harnesses on one Redis share the job stream: only one may run turns
        return len(summaries(model))

    assert await compactions(None) == 0  # keel's estimate is tiny
    assert await compactions(1_900) == 1  # the provider says the prompt is nearly the window


async def test_manual_compact_waits_for_the_running_turn(make_harness: Any) -> None:
    release, thinking = asyncio.Event(), asyncio.Event()

    async def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="SUMMARY")
        if r.messages[-1].text == "slow":
            thinking.set()
            await release.wait()
        return ModelReply(text="ok")

    model = ScriptedModel(script)
    h = await make_harness(Agent(instructions="t", model=model, compaction=Compaction(keep_turns=1)))
    sid = await h.sessions.create("anon")
    for text in ("one", "two", "three"):
        await run_turn(h, sid, text)
    slow = await h.sessions.submit(sid, "anon", "slow")
    await asyncio.wait_for(thinking.wait(), 10)
    op_id = await h.sessions.compact(sid, "anon")
    assert not summaries(model)
    assert "compaction.requested" not in types(await events_until(h, sid, "turn.started"))
    release.set()
    events = await events_until(h, sid, "session.waiting")
    assert [(e["type"], e["turn_id"]) for e in events[-5:]] == [
        ("turn.completed", slow.turn_id),
        ("compaction.requested", op_id),
        ("usage.recorded", op_id),
        ("compaction.completed", op_id),
        ("session.waiting", op_id),
    ]
    history = await h.sessions.history(sid, "anon")
    assert history[0].kind == "summary" and [i.text for i in history[1:]] == ["slow", "ok"]
    assert all(i.text != "compact" for i in history)  # no user message appended
    info = await h.sessions.info(sid, "anon")
    assert info.status == "idle" and info.queued == 0


async def test_clear_drops_history_and_keeps_the_session(make_harness: Any) -> None:
    def place() -> str:
        return "eu"

    model = ScriptedModel(lambda r: ModelReply(text="ok"))
    h = await make_harness(Agent(instructions="t", model=model, runtime_context=[place]))
    sid = await h.sessions.create("anon", {"user": "ada"})
    await run_turn(h, sid, "one", {"page": "/orders/7"})
    await run_turn(h, sid, "two")
    before = await h.sessions.info(sid, "anon")
    op_id = await h.sessions.clear(sid, "anon")
    events = await events_until(h, sid, "session.waiting")
    assert [(e["type"], e["turn_id"]) for e in events[-2:]] == [("context.cleared", op_id), ("session.waiting", op_id)]
    assert events[-2]["data"] == {"items": 5}
    assert await h.sessions.history(sid, "anon") == []
    after = await h.sessions.info(sid, "anon")
    assert (after.session_id, after.metadata, after.usage, after.status) == (sid, {"user": "ada"}, before.usage, "idle")
    await run_turn(h, sid, "three")
    request = model.requests[-1]
    assert [m.kind for m in request.messages] == ["runtime", "sticky", "message"]  # sticky context kept
    assert request.messages[1].text.endswith("/orders/7") and request.messages[2].text == "three"
    assert [i.text for i in await h.sessions.history(sid, "anon")][1:] == ["three", "ok"]


async def test_compact_and_clear_queue_behind_queued_messages_in_order(make_harness: Any) -> None:
    model = ScriptedModel(summarizing())
    h = await make_harness(Agent(instructions="t", model=model, compaction=Compaction(keep_turns=0)))
    sid = await h.sessions.create("anon")
    await h.sessions.submit(sid, "anon", "a")
    await h.sessions.clear(sid, "anon")
    await h.sessions.submit(sid, "anon", "b")
    await h.sessions.compact(sid, "anon")
    events = await events_until(h, sid, "compaction.completed")
    wanted = ["turn.completed", "context.cleared", "session.waiting", "turn.completed", "compaction.requested"]
    seen = [t for t in types(events) if t in wanted]
    assert seen == wanted
    history = await h.sessions.history(sid, "anon")
    assert [i.kind for i in history] == ["summary"]
    (request,) = summaries(model)
    assert "user: b" in request.messages[-1].text and "user: a" not in request.messages[-1].text


async def test_a_restored_snapshot_is_not_a_turn_to_summarize_again(make_harness: Any) -> None:
    def branch() -> str:
        return "main"

    @tool
    def read(part: int) -> str:
        """Read a part of a long file."""
        return f"part {part}: " + "p" * 600

    def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            return ModelReply(text="SUMMARY")
        if (r.messages[-1].kind == "message" and r.messages[-1].text == "read all") or r.step in range(1, 5):
            return ModelReply(tool_calls=[ToolCall("read", {"part": r.step})])
        return ModelReply(text="ok")

    model = ScriptedModel(script)
    agent = Agent(
        instructions="t",
        tools=[read],
        model=model,
        runtime_context=[branch],
        context_window=700,
        compaction=Compaction(keep_turns=1, tool_result_chars=5_000),
    )
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    for text in ("one " + "a" * 300, "two " + "b" * 300):
        await run_turn(h, sid, text)
    await run_turn(h, sid, "read all")  # every step of this turn is over the threshold
    assert len(summaries(model)) == 1  # once: the restored snapshot alone is nothing to summarize
    assert "user: one" in summaries(model)[0].messages[-1].text


async def test_a_long_todo_list_is_never_trimmed() -> None:
    from harness.loop.compaction import trim
    from harness.models import Item

    todo = Item(id="r1", role="tool", text="[todo list]\n" + "- [ ] step\n" * 400, kind="tool_result", tool_name="todo")
    other = Item(id="r2", role="tool", text="x" * 5_000, kind="tool_result", tool_name="fetch")
    assert set(trim([todo, other], 200)) == {"r2"}


async def test_a_cancel_during_compaction_ends_the_turn(make_harness: Any) -> None:
    summarizing_now, release = asyncio.Event(), asyncio.Event()

    async def script(r: ModelRequest) -> ModelReply:
        if r.purpose == "compaction":
            summarizing_now.set()
            await release.wait()
            return ModelReply(text="SUMMARY")
        return ModelReply(text="ok " + "o" * 200)

    model = ScriptedModel(script)
    h = await make_harness(
        Agent(instructions="t", model=model, context_window=400, compaction=Compaction(keep_turns=1))
    )
    sid = await h.sessions.create("anon")
    n = 0
    results = []
    while not summarizing_now.is_set():
        n += 1
        res = await h.sessions.submit(sid, "anon", f"m{n} " + "m" * 200)
        results.append(res)
        done = asyncio.create_task(h.sessions.wait_turn(res, 10))
        await asyncio.wait({done, asyncio.create_task(summarizing_now.wait())}, return_when=asyncio.FIRST_COMPLETED)
        assert n < 20
    turns_before = len(turn_requests(model))
    assert await h.sessions.cancel(sid, "anon") == results[-1].turn_id
    release.set()
    turn = await h.sessions.wait_turn(results[-1], 10)
    assert turn.status == "cancelled"
    assert len(turn_requests(model)) == turns_before  # no model call after the cancel


async def test_a_fork_before_a_summarized_message_is_refused_with_its_snapshot_put_back(make_harness: Any) -> None:
    """A compaction puts the newest runtime snapshot back after its summary, with the id of the
    turn that made it: that turn is no more in the active history for it. A fork before its
    message is refused, as one before any message summarized away (the summary stands for the
    message, so the fork cannot come before it); one before a kept message has the summary."""

    def branch() -> str:
        return "main"

    model = ScriptedModel(summarizing())
    agent = Agent(instructions="t", model=model, runtime_context=[branch], compaction=Compaction(keep_turns=1))
    h = await make_harness(agent)
    sid = await h.sessions.create("anon")
    ids = {}
    for text in ("one", "two", "three"):  # (only the first turn's snapshot is new)
        sent = await h.sessions.submit(sid, "anon", text, None, f"m-{text}")
        ids[text] = sent.turn_id
        assert (await h.sessions.wait_turn(sent, 10)).status == "completed"
    await h.sessions.compact(sid, "anon")
    await events_until(h, sid, "session.waiting")
    active = await h.sessions.history(sid, "anon")
    assert [(i.kind, i.turn_id) for i in active[:2]] == [("summary", active[0].turn_id), ("runtime", ids["one"])]
    for summarized in ("m-one", "m-two"):
        with pytest.raises(Conflict) as refused:
            await h.sessions.fork(sid, "anon", summarized)
        assert refused.value.code == "message_not_in_history"
    fork = await h.sessions.fork(sid, "anon", "m-three")
    assert [i.kind for i in await h.sessions.history(fork, "anon")] == ["summary", "runtime"]
