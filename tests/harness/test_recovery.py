"""A runner that loses its session mid-turn strands nothing: its job is not acknowledged, another
drain picks the turn up from its last commit, and nothing committed is recomputed."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from harness import Agent, ToolContext, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall


async def test_a_lost_lease_mid_turn_is_recovered_from_the_last_commit(make_harness: Any, redis: Redis) -> None:
    keys_seen: list[str] = []

    @tool
    async def charge(amount: int, ctx: ToolContext) -> str:
        """Charge a card (an outside effect: deduplicate on ctx.call_id)."""
        keys_seen.append(ctx.call_id)
        if len(keys_seen) == 1:  # the runner stalls past its lease while the tool runs
            await redis.delete(f"keel:{{{ctx.session_id}}}:lease")
        return f"charged {amount}"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user":
            return ModelReply(tool_calls=[ToolCall("charge", {"amount": 5})])
        return ModelReply(text="done: " + r.messages[-1].text)

    model = ScriptedModel(script)
    h = await make_harness(Agent(instructions="t", tools=[charge], model=model), lease_ms=500)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(await h.sessions.submit(sid, "anon", "pay"), 15)
    assert turn.status == "completed" and turn.reply == "done: charged 5"
    assert len(keys_seen) == 2 and keys_seen[0] == keys_seen[1]  # re-run with the same idempotency key
    assert len(model.requests) == 2  # the committed first step was not recomputed
    assert h.stats.lease_takeovers == 1  # (keel_lease_takeovers_total)
    assert h.stats.turns == {"completed": 1}
    history = await h.sessions.history(sid, "anon")
    assert [(i.role, i.text) for i in history] == [
        ("user", "pay"),
        ("assistant", ""),
        ("tool", "charged 5"),
        ("assistant", "done: charged 5"),
    ]
    types = [e.type for e in turn.events]
    assert types.count("turn.started") == 1 and types.count("tool.completed") == 1
    assert (await h.sessions.info(sid, "anon")).status == "idle"


async def test_an_attempt_whose_reply_dies_with_the_process_is_still_counted(
    make_harness: Any, monkeypatch: Any
) -> None:
    from harness.store import Store

    real = Store.commit
    died: list[int] = []

    async def dying(self: Store, *args: Any, **kw: Any) -> Any:
        # the process "dies" after the provider answered, before its tokens (written together
        # with the step's commit, in one round trip) reach Redis
        if not died and kw.get("usage") is not None:
            died.append(1)
            raise RuntimeError("process died")
        return await real(self, *args, **kw)

    monkeypatch.setattr(Store, "commit", dying)
    model = ScriptedModel(lambda r: ModelReply(text="hi"))
    h = await make_harness(Agent(instructions="t", model=model), lease_ms=500)
    sid = await h.sessions.create("anon")
    turn = await h.sessions.wait_turn(
        await h.sessions.submit(sid, "anon", "hello"), 15
    )  # the reclaimed job retries the step
    assert turn.status == "completed" and died == [1]
    info = await h.sessions.info(sid, "anon")
    assert len(model.requests) == 2
    assert info.usage["model_calls"] == 2  # both provider attempts, the one whose reply was lost too
    assert [e.type for e in turn.events].count("usage.recorded") == 1  # tokens known for one only
