"""Claude through Anthropic's Messages API, streaming, on the official SDK (`keel[anthropic]`).

`AnthropicModel("claude-sonnet-4-5")` makes its own `AsyncAnthropic` from the SDK's variables
(`ANTHROPIC_API_KEY`, `ANTHROPIC_BASE_URL`), or takes `client=`; either way the SDK's own
retries are off (keel retries and counts every attempt) and every request carries a connect and
an idle-stream timeout. A request is built the same way every time: tools, then the system
prompt with a cache breakpoint, then the conversation, where consecutive items of one side are
one message (tool results first), keel's call ids are the `tool_use` ids, thinking blocks (with
their signatures) go back unchanged in the assistant content they came with, and the last
durable item carries the second breakpoint (`ModelRequest.cache_breakpoints`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import anthropic
import httpx2  # the SDK's HTTP client: a stream cut or gone idle mid-way surfaces as its error

from harness.errors import ModelError
from harness.models.base import ModelEvent, ModelReply, ModelRequest, TextDelta
from harness.models.failures import from_status, timed_out, unreachable
from harness.types import Item, ToolCall, Usage

PROVIDER = "anthropic"
MAX_BREAKPOINTS = 4
CACHE = {"type": "ephemeral"}


class AnthropicModel:
    PROVIDER = "anthropic"  # (gen_ai.provider.name)

    def __init__(
        self,
        model: str,
        *,
        client: anthropic.AsyncAnthropic | None = None,
        max_tokens: int = 4096,
        thinking: dict[str, Any] | None = None,
        connect_timeout: float = 10.0,
        idle_timeout: float = 60.0,
    ) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.thinking = thinking  # e.g. {"type": "enabled", "budget_tokens": 2048}
        self.timeout = anthropic.Timeout(connect=connect_timeout, read=idle_timeout, write=30.0, pool=connect_timeout)
        self.client = (client or anthropic.AsyncAnthropic()).with_options(max_retries=0, timeout=self.timeout)

    def params(self, request: ModelRequest) -> dict[str, Any]:
        """The Messages API request for `request` (without `stream`)."""
        messages, spots = _messages(request.messages)
        params: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": messages}
        tools = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in request.tools]
        if tools:
            params["tools"] = tools
        if request.system:
            params["system"] = [{"type": "text", "text": request.system}]
        marks = 0
        for point in request.cache_breakpoints:
            if marks == MAX_BREAKPOINTS:
                break
            if point == 0:
                block = params["system"][-1] if request.system else (tools[-1] if tools else None)
            else:
                spot = spots.get(point - 1)
                block = messages[spot[0]]["content"][spot[1]] if spot is not None else None
            if block is not None and "cache_control" not in block:
                block["cache_control"] = CACHE
                marks += 1
        if self.thinking is not None:
            params["thinking"] = self.thinking
        return params

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        try:
            async with self.client.messages.stream(**self.params(request)) as stream:
                async for event in stream:
                    if event.type == "text" and event.text:
                        yield TextDelta(event.text)
                message = await stream.get_final_message()
                if message.stop_reason is None:  # the stream ended before message_delta/message_stop
                    raise unreachable("the Anthropic stream ended before the message was complete")
        except anthropic.APIStatusError as exc:
            raise from_status(
                exc.status_code, _message(exc), kind=exc.type or "", headers=exc.response.headers
            ) from exc
        except (anthropic.APITimeoutError, httpx2.TimeoutException) as exc:
            raise timed_out(f"no reply from Anthropic in time: {type(exc).__name__}") from exc
        except (anthropic.APIConnectionError, httpx2.TransportError) as exc:
            raise unreachable(f"Anthropic is unreachable or the stream broke: {type(exc).__name__}: {exc}") from exc
        except anthropic.AnthropicError as exc:
            raise ModelError(f"the Anthropic call failed: {type(exc).__name__}: {exc}") from exc
        yield _reply(message)


def _message(exc: anthropic.APIStatusError) -> str:
    return f"Anthropic answered {exc.status_code}: {exc.api_message or exc.message}"


def _reply(message: Any) -> ModelReply:
    text: list[str] = []
    calls: list[ToolCall] = []
    kept: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "text":
            text.append(block.text)
        elif block.type == "tool_use":
            calls.append(ToolCall(block.name, dict(block.input or {}), block.id))
        elif block.type in ("thinking", "redacted_thinking"):
            kept.append(block.model_dump(mode="json", exclude_none=True))
    u = message.usage
    read = u.cache_read_input_tokens or 0
    written = u.cache_creation_input_tokens or 0
    usage = Usage(u.input_tokens + read + written, u.output_tokens, read, written)
    return ModelReply(
        text="".join(text),
        tool_calls=calls,
        usage=usage,
        provider={PROVIDER: {"thinking": kept}} if kept else None,
    )


def _blocks(item: Item) -> list[dict[str, Any]]:
    """An item's content blocks (tool results first in their message, by construction)."""
    if item.role == "tool":
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": item.tool_call_id, "is_error": item.is_error}
        if item.text:
            block["content"] = item.text
        return [block]
    if item.role == "assistant":  # (thinking blocks copied: the stored item is never touched)
        out = [dict(block) for block in (item.provider or {}).get(PROVIDER, {}).get("thinking", [])]
        if item.text:
            out.append({"type": "text", "text": item.text})
        out += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in item.tool_calls]
        return out
    return [{"type": "text", "text": item.text}] if item.text else []


def _messages(items: list[Item]) -> tuple[list[dict[str, Any]], dict[int, tuple[int, int]]]:
    """The conversation as Messages API messages, and for each item the (message, block) of its
    last block that may carry a cache breakpoint (not a thinking block, which goes back exactly
    as it came)."""
    messages: list[dict[str, Any]] = []
    spots: dict[int, tuple[int, int]] = {}
    for n, item in enumerate(items):
        blocks = _blocks(item)
        if not blocks:
            continue
        role = "assistant" if item.role == "assistant" else "user"
        if not messages or messages[-1]["role"] != role:
            messages.append({"role": role, "content": []})
        content = messages[-1]["content"]
        content.extend(blocks)
        markable = [i for i, b in enumerate(blocks) if b["type"] not in ("thinking", "redacted_thinking")]
        if markable:
            spots[n] = (len(messages) - 1, len(content) - len(blocks) + markable[-1])
    return messages, spots
