"""CachingScriptedModel: a ScriptedModel that reports cached tokens as a prefix cache would.

CachingScriptedModel: a ScriptedModel that reports `Usage.cached_tokens` the way a provider's
prefix cache would, so tests and benchmarks can measure cache reuse without a provider.

A request is a sequence of blocks: the tools + system block, then each message. The cached
part of a request is its longest run of leading blocks that some earlier request of the same
session also began with, counted in estimated tokens (`harness.models.tokens`). Real caches work on
tokens, need a minimum prefix and a breakpoint; this double is deliberately simpler: it
measures whether the prefix keel sends is stable, which is what keel controls.
"""

from __future__ import annotations

import msgspec

from harness.models.base import ModelReply, ModelRequest
from harness.models.scripted import ScriptedModel, ScriptFn
from harness.models.tokens import item_tokens, prefix_tokens
from harness.types import Usage

_enc = msgspec.json.Encoder()


class _Node:
    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[bytes, _Node] = {}


class CachingScriptedModel(ScriptedModel):
    """`CachingScriptedModel(fn)`: replies from `fn` as ScriptedModel does; usage is the
    request's estimated input tokens, of which `cached_tokens` were a prefix seen before in the
    session. `.prefixes` holds each turn request's tools + system bytes (for asserting I6)."""

    def __init__(self, fn: ScriptFn, *, keep: int | None = None) -> None:
        super().__init__(fn, keep=keep)
        self._roots: dict[str, _Node] = {}  # session id -> trie of the block sequences seen
        self.prefixes: list[bytes] = []

    async def reply(self, request: ModelRequest) -> ModelReply:
        reply = await super().reply(request)
        head = _enc.encode((request.system, request.tools))
        if request.purpose == "turn":
            self.prefixes.append(head)
        blocks: list[tuple[bytes, int]] = [(head, prefix_tokens(request.system, request.tools))]
        blocks.extend((_enc.encode(item), item_tokens(item)) for item in request.messages)
        root = self._roots.setdefault(f"{request.session_id}/{request.purpose}", _Node())
        total = sum(n for _, n in blocks)
        cached, node, matching = 0, root, True
        for key, n in blocks:
            child = node.children.get(key)
            if child is None:
                matching = False
                child = node.children[key] = _Node()
            elif matching:
                cached += n
            node = child
        out = reply.usage.output_tokens if reply.usage is not None else 0
        return ModelReply(text=reply.text, tool_calls=reply.tool_calls, usage=Usage(total, out, cached))
