"""OpenAIModel through the real SDK against a local server speaking the Responses and Chat
Completions streaming protocols: text, the tool loop with keel's call ids, reasoning items sent
back unchanged, the cache key and cache usage, retries and failures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from harness import Agent, Harness, tool
from harness.models.openai import OpenAIModel
from tests.events import env
from tests.models.openai_server import OpenAIServer, Turn


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
async def server() -> AsyncIterator[OpenAIServer]:
    async with OpenAIServer() as s:
        yield s


def gpt(server: OpenAIServer, api: str = "responses", **kw: Any) -> OpenAIModel:
    client = openai.AsyncOpenAI(api_key="test-key", base_url=server.url)
    server.clients.append(client)
    return OpenAIModel("gpt-test", client=client, api=api, **kw)  # type: ignore[arg-type]


async def turn(h: Harness, text: str = "hi") -> tuple[str, Any]:
    sid = await h.sessions.create("o")
    return sid, await h.sessions.wait_turn(await h.sessions.submit(sid, "o", text), 15)


async def test_responses_text_cache_key_and_usage(make_harness: Any, server: OpenAIServer) -> None:
    server.turns = [Turn("Hello from GPT.", usage={"input": 1200, "output": 9, "cached": 1024, "written": 100})]
    h = await make_harness(Agent(instructions="Be brief.", tools=[add], model=gpt(server)))
    sid, result = await turn(h)
    assert result.status == "completed" and result.reply == "Hello from GPT."
    body = server.requests[0]
    assert body["stream"] is True and body["store"] is False and body["prompt_cache_key"] == sid
    assert body["instructions"] == "Be brief." and "include" not in body  # (a model without reasoning refuses it)
    assert body["tools"][0]["type"] == "function" and body["tools"][0]["name"] == "add"
    assert body["input"] == [{"role": "user", "content": "hi"}]
    (usage,) = [env(e)["data"] for e in result.events if e.type == "usage.recorded"]
    assert (usage["input_tokens"], usage["cached_tokens"], usage["cache_write_tokens"]) == (1200, 1024, 100)


async def test_responses_tool_loop_sends_reasoning_back_with_keels_call_ids(
    make_harness: Any, server: OpenAIServer
) -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-opaque"}
    server.turns = [
        Turn(calls=[("call_p1", "add", {"a": 2, "b": 3}), ("call_p2", "add", {"a": 4, "b": 4})], reasoning=[reasoning]),
        Turn("5 and 8."),
    ]
    h = await make_harness(Agent(instructions="t", tools=[add], model=gpt(server, reasoning={"effort": "low"})))
    sid, result = await turn(h)
    assert result.status == "completed" and result.reply == "5 and 8."
    first = server.requests[0]
    assert first["reasoning"] == {"effort": "low"} and first["include"] == ["reasoning.encrypted_content"]
    calls = (await h.sessions.history(sid, "o"))[1].tool_calls
    sent = server.requests[1]["input"]
    assert sent[0] == {"role": "user", "content": "hi"}
    assert sent[1] == reasoning  # unchanged, before the calls it came with
    assert [(i["type"], i["call_id"]) for i in sent[2:4]] == [("function_call", c.id) for c in calls]
    assert sent[4:] == [
        {"type": "function_call_output", "call_id": calls[0].id, "output": "5"},
        {"type": "function_call_output", "call_id": calls[1].id, "output": "8"},
    ]
    assert all(c.id and c.id.startswith("call_") and c.id not in ("call_p1", "call_p2") for c in calls)
    assert "gAAAA-opaque" not in str(result.events)


async def test_chat_completions_text_and_tool_loop(make_harness: Any, server: OpenAIServer) -> None:
    server.turns = [Turn("Let me add.", calls=[("call_c1", "add", {"a": 20, "b": 22})]), Turn("It is 42.")]
    h = await make_harness(Agent(instructions="sys", tools=[add], model=gpt(server, "chat")))
    sid, result = await turn(h)
    assert result.status == "completed" and result.reply == "It is 42."
    call = (await h.sessions.history(sid, "o"))[1].tool_calls[0]
    messages = server.requests[1]["messages"]
    assert messages[0] == {"role": "system", "content": "sys"} and messages[1] == {"role": "user", "content": "hi"}
    assert messages[2]["role"] == "assistant" and messages[2]["tool_calls"][0]["id"] == call.id
    assert messages[3] == {"role": "tool", "tool_call_id": call.id, "content": "42"}
    assert server.requests[0]["stream_options"] == {"include_usage": True}


async def test_a_rate_limit_then_success_counts_two_calls(make_harness: Any, server: OpenAIServer) -> None:
    limited = {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}
    server.turns = [Turn(status=429, error=limited, headers={"retry-after-ms": "10"}), Turn("ok")]
    h = await make_harness(Agent(instructions="t", model=gpt(server)))
    sid, result = await turn(h)
    assert result.status == "completed" and (await h.sessions.info(sid, "o")).usage["model_calls"] == 2


async def test_a_bad_key_fails_the_turn_without_retrying(make_harness: Any, server: OpenAIServer) -> None:
    server.turns = [Turn(status=401, error={"message": "Incorrect API key provided", "code": "invalid_api_key"})]
    h = await make_harness(Agent(instructions="t", model=gpt(server, "chat")))
    _, result = await turn(h)
    assert result.status == "failed" and env(result.events[-1])["data"]["error"]["code"] == "model_auth"
    assert len(server.requests) == 1


@pytest.mark.parametrize("api", ["responses", "chat"])
@pytest.mark.parametrize(
    "failure",
    [
        Turn(status=500, error={"message": "The server had an error", "type": "server_error"}),
        Turn("never finished", cut_after=2),
        Turn("never finished", idle_after=2),
    ],
    ids=["500", "stream cut", "idle stream"],
)
async def test_failures_that_may_pass_are_retried(
    make_harness: Any, server: OpenAIServer, api: str, failure: Turn
) -> None:
    server.turns = [failure, Turn("whole reply")]
    client = openai.AsyncOpenAI(api_key="test-key", base_url=server.url)
    server.clients.append(client)
    model = OpenAIModel("gpt-test", client=client, api=api, idle_timeout=0.3)  # type: ignore[arg-type]
    h = await make_harness(Agent(instructions="t", model=model))
    sid, result = await turn(h)
    assert result.status == "completed" and result.reply == "whole reply"
    assert [i.text for i in await h.sessions.history(sid, "o")] == ["hi", "whole reply"]
    assert (await h.sessions.info(sid, "o")).usage["model_calls"] == 2


async def test_a_context_length_error_with_nothing_to_compact_fails_the_turn(
    make_harness: Any, server: OpenAIServer
) -> None:
    too_long = {"message": "This model's maximum context length is 128000 tokens.", "code": "context_length_exceeded"}
    server.turns = [Turn(status=400, error=too_long)]
    h = await make_harness(Agent(instructions="t", model=gpt(server)))
    _, result = await turn(h)
    assert result.status == "failed"
    assert env(result.events[-1])["data"]["error"]["code"] == "model_context_length"


async def test_reasoning_with_nothing_after_it_is_not_sent_back(make_harness: Any, server: OpenAIServer) -> None:
    alone = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA-alone"}
    server.turns = [Turn(reasoning=[alone]), Turn("second")]
    h = await make_harness(Agent(instructions="t", model=gpt(server, reasoning={"effort": "low"})))
    sid, first = await turn(h, "one")
    assert first.status == "completed"
    await h.sessions.wait_turn(await h.sessions.submit(sid, "o", "two"), 15)
    # (OpenAI refuses a reasoning item without the item that followed it)
    assert "gAAAA-alone" not in str(server.requests[1]["input"])


async def test_a_chat_stream_without_a_finish_reason_is_retried(make_harness: Any, server: OpenAIServer) -> None:
    server.turns = [Turn("half a sent", finish=False), Turn("whole")]
    h = await make_harness(Agent(instructions="t", model=gpt(server, "chat")))
    sid, result = await turn(h)
    assert result.reply == "whole" and (await h.sessions.info(sid, "o")).usage["model_calls"] == 2
