"""AnthropicModel through the real SDK against a local server that speaks the Messages API's
streaming protocol: text, the tool loop, parallel calls, thinking blocks sent back unchanged,
cache breakpoints and cache usage, and failures (retried or not)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from harness import Agent, Compaction, Harness, tool
from harness.events import LiveEvent, StoredEvent
from harness.models.anthropic import AnthropicModel
from harness.models.base import ModelRequest
from harness.types import Item
from tests.events import env
from tests.models.anthropic_server import AnthropicServer, Reply, text, thinking, tool_use


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
async def server() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer() as s:
        yield s
        for client in s.clients:
            await client.close()


def claude(server: AnthropicServer, **kw: Any) -> AnthropicModel:
    client = anthropic.AsyncAnthropic(api_key="test-key", base_url=server.url)
    server.clients.append(client)
    return AnthropicModel("claude-test", client=client, **kw)


async def turn(h: Harness, text_: str = "hi", sid: str | None = None) -> tuple[str, dict[str, Any]]:
    sid = sid or await h.sessions.create("o")
    result = await h.sessions.wait_turn(await h.sessions.submit(sid, "o", text_), 15)
    return sid, {"status": result.status, "reply": result.reply, "events": [env(e) for e in result.events]}


async def test_a_reply_streams_and_the_request_is_built_for_the_cache(
    make_harness: Any, server: AnthropicServer
) -> None:
    server.replies = [Reply([text("Hello there, human.")], chunks=4)]
    h = await make_harness(Agent(instructions="Be brief.", tools=[add], model=claude(server)))
    sid = await h.sessions.create("o")
    deltas: list[str] = []
    ready = asyncio.Event()

    async def read() -> None:
        async for event in h.sessions.tail(sid, "0-0", heartbeat=5):
            ready.set()  # (the first event, session.created, comes once the reader is in place)
            if isinstance(event, LiveEvent):
                deltas.append(json.loads(event.raw)["data"]["delta"])
            if isinstance(event, StoredEvent) and event.type == "turn.completed":
                return

    reader = asyncio.create_task(read())
    await asyncio.wait_for(ready.wait(), 5)
    _, result = await turn(h, sid=sid)
    await asyncio.wait_for(reader, 5)
    assert result["status"] == "completed" and result["reply"] == "Hello there, human."
    assert "".join(deltas) == "Hello there, human." and len(deltas) == 4
    body = server.requests[0]
    assert body["model"] == "claude-test" and body["stream"] is True and body["max_tokens"] == 4096
    assert body["system"] == [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    assert body["tools"] == [{"name": "add", "description": "Add two integers.", "input_schema": add.spec.parameters}]
    # the second breakpoint: after the last durable item (the user message the next turn repeats)
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
    ]
    assert server.headers[0]["x-stainless-retry-count"] == "0"


async def test_the_tool_loop_uses_keels_call_ids_and_pairs_every_result(
    make_harness: Any, server: AnthropicServer
) -> None:
    server.replies = [
        Reply(
            [
                text("Adding."),
                tool_use("toolu_A", "add", {"a": 2, "b": 3}),
                tool_use("toolu_B", "add", {"a": 1, "b": 1}),
            ]
        ),
        Reply([text("5 and 2.")]),
    ]
    h = await make_harness(Agent(instructions="t", tools=[add], model=claude(server)))
    sid, result = await turn(h)
    assert result["status"] == "completed" and result["reply"] == "5 and 2."
    history = await h.sessions.history(sid, "o")
    calls = history[1].tool_calls
    assert [c.name for c in calls] == ["add", "add"] and all(c.id and c.id.startswith("call_") for c in calls)
    second = server.requests[1]["messages"]
    assistant, results = second[1], second[2]
    assert assistant["role"] == "assistant"
    assert [b["type"] for b in assistant["content"]] == ["text", "tool_use", "tool_use"]
    assert [b["id"] for b in assistant["content"][1:]] == [c.id for c in calls]  # keel's ids, not toolu_*
    assert results["role"] == "user"
    assert results["content"] == [
        {"type": "tool_result", "tool_use_id": calls[0].id, "is_error": False, "content": "5"},
        {"type": "tool_result", "tool_use_id": calls[1].id, "is_error": False, "content": "2"},
    ]


async def test_thinking_blocks_go_back_unchanged_and_are_never_shown(
    make_harness: Any, server: AnthropicServer
) -> None:
    server.replies = [
        Reply([thinking("I should add them.", "sig-123=="), tool_use("toolu_A", "add", {"a": 2, "b": 3})]),
        Reply([text("It is 5.")]),
    ]
    model = claude(server, thinking={"type": "enabled", "budget_tokens": 1024})
    h = await make_harness(Agent(instructions="t", tools=[add], model=model))
    sid, result = await turn(h)
    assert result["reply"] == "It is 5."
    assert server.requests[0]["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    sent = server.requests[1]["messages"][1]["content"]
    assert sent[0] == {"type": "thinking", "thinking": "I should add them.", "signature": "sig-123=="}
    assert sent[1]["type"] == "tool_use"
    shown = json.dumps(result["events"]) + json.dumps([i.text for i in await h.sessions.history(sid, "o")])
    assert "I should add them." not in shown


async def test_cache_usage_is_recorded_and_the_next_turn_marks_the_durable_prefix(
    make_harness: Any, server: AnthropicServer
) -> None:
    usage = {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 50}
    server.replies = [Reply([text("one")], usage=usage), Reply([text("two")], usage=usage)]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    sid, first = await turn(h, "first")
    (recorded,) = [e["data"] for e in first["events"] if e["type"] == "usage.recorded"]
    assert (recorded["input_tokens"], recorded["cached_tokens"], recorded["cache_write_tokens"]) == (160, 100, 50)
    await turn(h, "second", sid)
    info = await h.sessions.info(sid, "o")
    assert info.usage["cached_tokens"] == 200 and info.usage["cache_write_tokens"] == 100
    messages = server.requests[1]["messages"]
    assert [m["content"][-1].get("cache_control") for m in messages] == [None, None, {"type": "ephemeral"}]
    assert messages[2]["content"][-1]["text"] == "second"  # the last durable item: the prefix turn 3 repeats


async def test_a_rate_limit_is_retried_after_retry_after_and_both_attempts_count(
    make_harness: Any, server: AnthropicServer
) -> None:
    limited = {"type": "rate_limit_error", "message": "slow down"}
    server.replies = [Reply(status=429, error=limited, headers={"retry-after-ms": "20"}), Reply([text("ok")])]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    sid, result = await turn(h)
    assert result["status"] == "completed" and result["reply"] == "ok"
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 2
    recorded = [e["data"] for e in result["events"] if e["type"] == "usage.recorded"]
    assert [r.get("failed", False) for r in recorded] == [True, False]


@pytest.mark.parametrize(
    "failure",
    [
        Reply(status=529, error={"type": "overloaded_error", "message": "Overloaded"}, headers={"retry-after": "0"}),
        Reply([text("partial words here")], error_event_after=4),
        Reply([text("partial words here")], cut_after=4),
        Reply([text("partial words here")], end_after=5),
    ],
    ids=["529", "error event mid-stream", "stream cut", "stream ended early"],
)
async def test_failures_that_may_pass_are_retried_and_nothing_partial_is_stored(
    make_harness: Any, server: AnthropicServer, failure: Reply
) -> None:
    server.replies = [failure, Reply([text("whole reply")])]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    sid, result = await turn(h)
    assert result["status"] == "completed" and result["reply"] == "whole reply"
    assert [i.text for i in await h.sessions.history(sid, "o")] == ["hi", "whole reply"]
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 2


async def test_an_idle_stream_times_out_and_is_retried(make_harness: Any, server: AnthropicServer) -> None:
    server.replies = [Reply([text("never finished")], idle_after=3), Reply([text("fine")])]
    h = await make_harness(Agent(instructions="t", model=claude(server, idle_timeout=0.3)))
    sid, result = await turn(h)
    assert result["status"] == "completed" and result["reply"] == "fine"
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 2


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (401, {"type": "authentication_error", "message": "invalid x-api-key"}, "model_auth"),
        (
            400,
            {"type": "invalid_request_error", "message": "prompt is too long: 210000 tokens"},
            "model_context_length",
        ),
        (400, {"type": "invalid_request_error", "message": "messages: bad"}, "model_invalid_request"),
        (404, {"type": "not_found_error", "message": "model: claude-nope"}, "model_not_found"),
    ],
)
async def test_failures_that_will_not_pass_fail_the_turn_at_once(
    make_harness: Any, server: AnthropicServer, status: int, error: dict[str, Any], code: str
) -> None:
    server.replies = [Reply(status=status, error=error)]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    sid, result = await turn(h)
    assert result["status"] == "failed"
    assert result["events"][-1]["data"]["error"]["code"] == code
    assert len(server.requests) == 1 and (await h.sessions.info(sid, "o")).usage["model_calls"] == 1


@pytest.mark.parametrize("where", ["this process", "another process"])
async def test_cancel_mid_stream_closes_the_provider_stream_and_stores_nothing_of_it(
    make_harness: Any, server: AnthropicServer, redis: Any, where: str
) -> None:
    server.replies = [Reply([text("a long answer that never ends")], idle_after=5)]  # two deltas, then silence
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    other = await make_harness(Agent(instructions="t", model=claude(server)), run_turns=False)
    canceller = h if where == "this process" else other
    sid = await h.sessions.create("o")
    submitted = await h.sessions.submit(sid, "o", "hi")
    await asyncio.wait_for(server.streaming.wait(), 5)
    asked = time.monotonic()
    await canceller.sessions.cancel(sid, "o")
    await asyncio.wait_for(server.dropped.wait(), 5)
    assert server.dropped_at - asked < 0.2  # the provider's connection closed within 200 ms
    result = await h.sessions.wait_turn(submitted, 5)
    assert result.status == "cancelled"
    assert [(i.role, i.text) for i in await h.sessions.history(sid, "o")] == [("user", "hi")]  # nothing partial
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 1


async def test_a_prompt_too_long_compacts_and_tries_the_step_once_more(
    make_harness: Any, server: AnthropicServer
) -> None:
    too_long = {"type": "invalid_request_error", "message": "prompt is too long: 250000 tokens > 200000 maximum"}
    server.replies = [
        Reply([text("first answer")]),
        Reply([text("second answer")]),
        Reply(status=400, error=too_long),
        Reply([text("The user asked two questions; both were answered.")]),  # the summary call
        Reply([text("third answer")]),
    ]
    agent = Agent(instructions="t", model=claude(server), compaction=Compaction(keep_turns=1))
    h = await make_harness(agent)
    sid, _ = await turn(h, "one")
    await turn(h, "two", sid)
    _, result = await turn(h, "three", sid)
    assert result["status"] == "completed" and result["reply"] == "third answer"
    types = [e["type"] for e in result["events"]]
    assert types.count("compaction.completed") == 1
    reasons = [e["data"]["reason"] for e in result["events"] if e["type"].startswith("compaction.")]
    assert set(reasons) == {"context_length"}
    assert "first answer" not in json.dumps(server.requests[-1]["messages"])  # older turns summarized
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 5  # 1 + 1 + (refused, summary, retry)


async def test_a_prompt_too_long_with_nothing_to_compact_fails_the_turn(
    make_harness: Any, server: AnthropicServer
) -> None:
    too_long = {"type": "invalid_request_error", "message": "prompt is too long"}
    server.replies = [Reply(status=400, error=too_long)]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    _, result = await turn(h)
    assert result["status"] == "failed"
    assert result["events"][-1]["data"]["error"]["code"] == "model_context_length" and len(server.requests) == 1


async def test_cancel_during_a_retry_backoff_ends_the_turn_without_another_attempt(
    make_harness: Any, server: AnthropicServer
) -> None:
    limited = {"type": "rate_limit_error", "message": "slow down"}
    server.replies = [Reply(status=429, error=limited, headers={"retry-after": "30"}), Reply([text("too late")])]
    h = await make_harness(Agent(instructions="t", model=claude(server)))
    sid = await h.sessions.create("o")
    submitted = await h.sessions.submit(sid, "o", "hi")
    await asyncio.wait_for(server.requested.wait(), 5)  # refused: the turn now waits 30 s to retry
    await h.sessions.cancel(sid, "o")  # the turn is in its 30 s backoff
    result = await h.sessions.wait_turn(submitted, 5)
    assert result.status == "cancelled"
    assert len(server.requests) == 1 and (await h.sessions.info(sid, "o")).usage["model_calls"] == 1


def test_a_cache_breakpoint_never_lands_on_a_thinking_block_and_history_is_not_touched() -> None:
    block = {"type": "thinking", "thinking": "hmm", "signature": "sig=="}
    thought = Item(id="a1", role="assistant", provider={"anthropic": {"thinking": [block]}})
    items = [Item(id="u1", role="user", text="hi"), thought, Item(id="u2", role="user", text="go on")]
    model = AnthropicModel("claude-test", client=anthropic.AsyncAnthropic(api_key="k", base_url="http://127.0.0.1:9"))
    params = model.params(ModelRequest("sys", (), items, cache_breakpoints=(0, 2)))
    assert params["messages"][1]["content"] == [block]  # sent back exactly as it came, unmarked
    assert block == {"type": "thinking", "thinking": "hmm", "signature": "sig=="}  # the stored one, untouched
    marks = [b for m in params["messages"] for b in m["content"] if "cache_control" in b]
    assert marks == []  # the item after which the mark belongs has nothing it may go on
