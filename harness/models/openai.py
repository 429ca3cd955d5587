"""OpenAI models on the official SDK (`keel[openai]`), streaming.

OpenAI models on the official SDK (`keel[openai]`), streaming: the Responses API by default,
Chat Completions with `api="chat"` (so OpenAI-compatible servers such as vLLM, Ollama, LiteLLM
or OpenRouter work too).

`OpenAIModel("gpt-5")` makes its own `AsyncOpenAI` from `OPENAI_API_KEY` / `OPENAI_BASE_URL`,
or takes `client=`; the SDK's retries are off (keel retries and counts every attempt). Responses
requests are stateless (`store: false`): the whole conversation is sent each time, reasoning
items (with their encrypted content) go back unchanged before the outputs they came with,
keel's call ids are the `call_id`s, and `prompt_cache_key` is the session id, so a session's
requests reach the same cache.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, Literal

import httpx2  # the SDK's HTTP client: a stream cut or gone idle mid-way surfaces as its error
import openai

from harness.errors import ModelError
from harness.models.base import ModelEvent, ModelReply, ModelRequest, TextDelta
from harness.models.failures import from_status, timed_out, unreachable
from harness.types import Item, ToolCall, Usage

PROVIDER = "openai"


class OpenAIModel:
    PROVIDER = "openai"  # (gen_ai.provider.name)

    def __init__(
        self,
        model: str,
        *,
        client: openai.AsyncOpenAI | None = None,
        api: Literal["responses", "chat"] = "responses",
        max_output_tokens: int | None = None,
        reasoning: dict[str, Any] | None = None,
        connect_timeout: float = 10.0,
        idle_timeout: float = 300.0,  # (a reasoning model may say nothing for minutes)
    ) -> None:
        if api not in ("responses", "chat"):
            raise ValueError("api is 'responses' or 'chat'")
        self.model = model
        self.api = api
        self.max_output_tokens = max_output_tokens
        self.reasoning = reasoning  # Responses only, e.g. {"effort": "low"}
        self.timeout = openai.Timeout(connect=connect_timeout, read=idle_timeout, write=30.0, pool=connect_timeout)
        self.client = (client or openai.AsyncOpenAI()).with_options(max_retries=0, timeout=self.timeout)

    def params(self, request: ModelRequest) -> dict[str, Any]:
        """The request body for `request` (without `stream`)."""
        if self.api == "chat":
            return _chat_params(self.model, request, self.max_output_tokens)
        params: dict[str, Any] = {"model": self.model, "input": _responses_input(request.messages), "store": False}
        if request.system:
            params["instructions"] = request.system
        if request.tools:
            params["tools"] = [
                {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                for t in request.tools
            ]
        if request.session_id:
            params["prompt_cache_key"] = request.session_id
        if self.max_output_tokens is not None:
            params["max_output_tokens"] = self.max_output_tokens
        if self.reasoning is not None:  # (a model without reasoning refuses the include)
            params["reasoning"] = self.reasoning
            params["include"] = ["reasoning.encrypted_content"]
        return params

    async def stream(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        try:
            if self.api == "chat":
                async for event in self._chat(request):
                    yield event
                return
            final: Any = None
            stream = await self.client.responses.create(**self.params(request), stream=True)
            async with stream:
                async for event in stream:
                    if event.type == "response.output_text.delta" and event.delta:
                        yield TextDelta(event.delta)
                    elif event.type in ("response.completed", "response.incomplete"):
                        final = event.response
                    elif event.type in ("response.failed", "error"):
                        raise _stream_error(event)
            if final is None:
                raise unreachable("the Responses stream ended before the response was complete")
        except openai.APIStatusError as exc:
            raise from_status(exc.status_code, _message(exc), kind=_kind(exc), headers=exc.response.headers) from exc
        except (openai.APITimeoutError, httpx2.TimeoutException) as exc:
            raise timed_out(f"no reply from OpenAI in time: {type(exc).__name__}") from exc
        except (openai.APIConnectionError, httpx2.TransportError) as exc:
            raise unreachable(f"OpenAI is unreachable or the stream broke: {type(exc).__name__}: {exc}") from exc
        except openai.APIError as exc:  # an error inside a stream that began with 200
            kind = str(exc.code or exc.type or "server_error")
            raise from_status(200, f"OpenAI failed the stream: {kind}: {exc.message}", kind=kind) from exc
        except openai.OpenAIError as exc:
            raise ModelError(f"the OpenAI call failed: {type(exc).__name__}: {exc}") from exc
        yield _responses_reply(final)

    async def _chat(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        usage = Usage()
        finished = False
        stream = await self.client.chat.completions.create(**self.params(request), stream=True)
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = _chat_usage(chunk.usage)
                for choice in chunk.choices:
                    finished = finished or choice.finish_reason is not None
                    piece = choice.delta
                    if piece.content:
                        text.append(piece.content)
                        yield TextDelta(piece.content)
                    for call in piece.tool_calls or ():
                        slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                        slot["id"] = call.id or slot["id"]
                        if call.function is not None:
                            slot["name"] += call.function.name or ""
                            slot["arguments"] += call.function.arguments or ""
        if not finished:
            raise unreachable("the Chat Completions stream ended before a finish_reason")
        tool_calls = [
            ToolCall(c["name"], _arguments(c["arguments"]), c["id"] or None) for _, c in sorted(calls.items())
        ]
        yield ModelReply(text="".join(text), tool_calls=tool_calls, usage=usage)


# ---- Responses ---------------------------------------------------------------------------


def _responses_input(items: list[Item]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        if item.role == "tool":
            out.append({"type": "function_call_output", "call_id": item.tool_call_id, "output": item.text})
        elif item.role == "assistant":
            if item.text or item.tool_calls:  # a reasoning item goes back only with what followed it
                kept = (item.provider or {}).get(PROVIDER, {}).get("reasoning", [])
                out.extend(r for r in kept if r.get("encrypted_content"))  # (stateless: only these resolve)
            if item.text:
                content = [{"type": "output_text", "text": item.text, "annotations": []}]
                out.append({"type": "message", "role": "assistant", "content": content})
            for c in item.tool_calls:
                arguments = json.dumps(c.arguments)
                out.append({"type": "function_call", "call_id": c.id, "name": c.name, "arguments": arguments})
        elif item.text:
            out.append({"role": "user", "content": item.text})
    return out


def _responses_reply(response: Any) -> ModelReply:
    text: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[dict[str, Any]] = []
    for item in response.output:
        if item.type == "message":
            text.extend(part.text for part in item.content if part.type == "output_text")
        elif item.type == "function_call":
            calls.append(ToolCall(item.name, _arguments(item.arguments), item.call_id))
        elif item.type == "reasoning":
            reasoning.append(item.model_dump(mode="json", exclude_none=True))
    usage = Usage()
    if response.usage is not None:
        details = response.usage.input_tokens_details
        usage = Usage(
            response.usage.input_tokens,
            response.usage.output_tokens,
            getattr(details, "cached_tokens", 0) or 0,
            getattr(details, "cache_write_tokens", 0) or 0,
        )
    return ModelReply(
        text="".join(text),
        tool_calls=calls,
        usage=usage,
        provider={PROVIDER: {"reasoning": reasoning}} if reasoning else None,
    )


def _stream_error(event: Any) -> ModelError:
    """`response.failed` or an `error` event inside a stream that began with 200."""
    error = getattr(getattr(event, "response", None), "error", None) or event
    code = str(getattr(error, "code", "") or "server_error")
    message = f"OpenAI failed the response: {code}: {getattr(error, 'message', '')}"
    return from_status(200, message, kind=code)


# ---- Chat Completions --------------------------------------------------------------------


def _chat_params(model: str, request: ModelRequest, max_tokens: int | None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": request.system}] if request.system else []
    for item in request.messages:
        if item.role == "tool":
            messages.append({"role": "tool", "tool_call_id": item.tool_call_id, "content": item.text})
        elif item.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": item.text}  # (a string, even empty)
            if item.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                    for c in item.tool_calls
                ]
            messages.append(message)
        elif item.text:
            messages.append({"role": "user", "content": item.text})
    params: dict[str, Any] = {"model": model, "messages": messages, "stream_options": {"include_usage": True}}
    if request.tools:
        params["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools
        ]
    if max_tokens is not None:
        params["max_completion_tokens"] = max_tokens
    return params


def _chat_usage(usage: Any) -> Usage:
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", 0) or 0
    written = getattr(details, "cache_write_tokens", 0) or 0
    return Usage(usage.prompt_tokens, usage.completion_tokens, cached, written)


# ---- shared ------------------------------------------------------------------------------


def _arguments(raw: str) -> dict[str, Any]:
    """A call's JSON arguments; ones that are not a JSON object reach the tool's validation as
    they came, so the model is told what was wrong."""
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"_invalid_json": raw}
    return value if isinstance(value, dict) else {"_not_an_object": value}


def _message(exc: openai.APIStatusError) -> str:
    return f"OpenAI answered {exc.status_code}: {exc.message}"


def _kind(exc: openai.APIStatusError) -> str:
    return str(exc.code or exc.type or "")
