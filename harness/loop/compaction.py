"""Compaction (I8): keep a long session inside the model's context window.

Before a model call, the prompt's size is estimated: the provider-reported input tokens of the
session's last call plus an estimate of what changed since (or the estimate alone when there is
no report yet), plus the fixed envelope of the compaction prompt. Past `threshold` of the window:

1. Oversized tool results in older history (every turn but the newest `keep_turns` and the
   current one) are shortened. If that brings the prompt under the threshold, that is all.
2. Otherwise the older turns are summarized by the compaction model (the agent's model unless
   configured), with the previous summary passed separately and untruncated, and replaced:
   the active history becomes [summary][todo list][newest runtime snapshot][recent turns].

Turns are summarized whole, so a tool call is never separated from its result. Page context is
never in history, so it is never summarized. The todo list and the newest runtime snapshot are
re-injected after the summary when the summarized part held them. The new active history is
committed in one atomic rebase (`Store.commit(rebase=...)`); the items it replaces leave the
session's history list in the same commit (their events stay in the outbox for its retention).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from harness.events import CompactionCompletedData, ErrorInfo
from harness.loop.runtime import newest_snapshot
from harness.models.base import Model, ModelRequest, complete
from harness.models.tokens import estimate_tokens, item_tokens, items_tokens, request_tokens
from harness.store import Store
from harness.tools.todo import newest_todo, todo_item
from harness.types import Item, Usage

log = logging.getLogger("keel.compaction")
_enc = msgspec.json.Encoder()

INSTRUCTIONS = (
    "You are compacting a long conversation between a user and an AI agent so that the agent can "
    "continue it with less context. Write one checkpoint that separates completed progress and "
    "decisions from the work that remains, and keeps the constraints, preferences, data, names, "
    "numbers and references needed to continue. If a previous checkpoint is given, merge it with "
    "the transcript into one updated checkpoint. Reply with the checkpoint only."
)
SUMMARY_HEADER = "[summary of the earlier conversation]"
PREVIOUS_HEADER = "[previous checkpoint]"
TRANSCRIPT_HEADER = "[transcript to summarize]"
_TRIMMED = re.compile(r"\n\[\.\.\. \d+ characters trimmed by compaction \.\.\.\]$")


@dataclass(frozen=True)
class Compaction:
    """`Agent(context_window=..., compaction=Compaction(...))`. Automatic compaction needs a
    `context_window`; a manual compact uses these settings either way."""

    threshold: float = 0.9  # of the context window, counting the compaction prompt's envelope
    keep_turns: int = 2  # newest whole turns kept verbatim (the current turn always is)
    model: Model | None = None  # the summarizer; the agent's model when None
    tool_result_chars: int = 2_000  # older tool results longer than this are shortened first
    transcript_chars: int = 4_000  # each message's cut-off in the transcript sent to summarize
    instructions: str = INSTRUCTIONS

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError("compaction threshold must be in (0, 1]")
        if self.keep_turns < 0 or self.tool_result_chars < 100 or self.transcript_chars < 100:
            raise ValueError("keep_turns must be >= 0 and the character limits >= 100")

    @property
    def envelope(self) -> int:
        """Estimated tokens of the compaction prompt's fixed part."""
        return estimate_tokens(self.instructions + PREVIOUS_HEADER + TRANSCRIPT_HEADER + SUMMARY_HEADER) + 16

    def due(self, tokens: int, window: int) -> bool:
        return tokens + self.envelope > self.threshold * window


class Split(NamedTuple):
    previous: Item | None  # the summary the active history starts with, if any
    older: list[Item]  # whole turns to trim or summarize
    recent: list[Item]  # the newest `keep_turns` turns, kept verbatim


def split(history: Sequence[Item], keep_turns: int) -> Split:
    """History before the current turn, cut on turn boundaries. Re-injected todo lists are left
    out (the newest one is derived again from the whole history). Only a group with a message
    or a tool result is a turn: a snapshot restored after a summary (which keeps its old turn
    id) is not one, so it is never all there is to summarize."""
    previous: Item | None = None
    groups: list[list[Item]] = []
    for item in history:
        if item.kind == "summary":
            previous = item
        elif item.kind != "todo":
            if groups and groups[-1][0].turn_id == item.turn_id:
                groups[-1].append(item)
            else:
                groups.append([item])
    turns = [n for n, g in enumerate(groups) if any(i.kind in ("message", "tool_result") for i in g)]
    if len(turns) <= keep_turns:
        return Split(previous, [], [i for g in groups for i in g])
    cut = turns[len(turns) - keep_turns] if keep_turns else len(groups)
    return Split(previous, [i for g in groups[:cut] for i in g], [i for g in groups[cut:] for i in g])


def trim(older: Sequence[Item], limit: int) -> dict[str, Item]:
    """Shortened copies (same ids) of the tool results in `older` longer than `limit`."""
    out: dict[str, Item] = {}
    for item in older:
        if item.role != "tool" or item.tool_name == "todo":  # the todo list is state, kept whole
            continue
        if len(item.text) > limit and not _TRIMMED.search(item.text):
            cut = len(item.text) - limit
            text = f"{item.text[:limit]}\n[... {cut} characters trimmed by compaction ...]"
            out[item.id] = msgspec.structs.replace(item, text=text)
    return out


def transcript(items: Sequence[Item], limit: int) -> str:
    """The older turns as the summarizer reads them, each message cut at `limit` characters."""
    lines: list[str] = []
    for item in items:
        if item.kind == "runtime":
            continue  # the newest snapshot is restored after the summary
        text = item.text if len(item.text) <= limit else f"{item.text[:limit]} [... {len(item.text) - limit} more]"
        if item.role == "tool":
            lines.append(f"tool result ({item.tool_name}): {text}")
        elif item.role == "assistant":
            calls = "; ".join(f"{c.name}({_enc.encode(c.arguments).decode()})" for c in item.tool_calls)
            lines.append(f"assistant: {text}" + (f" [calls {calls}]" if calls else ""))
        else:
            lines.append(f"user: {text}")
    return "\n".join(lines)


def summary_body(summary: Item) -> str:
    return summary.text.removeprefix(SUMMARY_HEADER + "\n")


class Compacted(NamedTuple):
    """A compaction's result: the new active history before the current turn (None: unchanged),
    and what its compaction.completed says (a count left None is not said)."""

    history: list[Item] | None
    trimmed: int | None = None
    summarized: int | None = None
    tokens_after: int | None = None
    tokens_saved: int | None = None
    error: ErrorInfo | None = None

    def event(self, reason: str, tokens_before: int | None = None) -> CompactionCompletedData:
        """Its compaction.completed (`reason`: why it ran; `tokens_before`: the prompt's size then)."""
        return CompactionCompletedData(
            reason, tokens_before, self.trimmed, self.summarized, self.tokens_after, self.tokens_saved, self.error
        )


class Compactor:
    """One compaction of one session's active history, for a turn (automatic) or a manual
    compact. The caller commits the result as a rebase."""

    def __init__(self, store: Store, model: Model, config: Compaction, sid: str, turn_id: str) -> None:
        self.store, self.model, self.config = store, config.model or model, config
        self.sid, self.turn_id = sid, turn_id

    def trimmed(self, history: list[Item], tokens: int, window: int) -> Compacted | None:
        """Step 1: the history with older tool results shortened, if that is enough."""
        parts = split(history, self.config.keep_turns)
        short = trim(parts.older, self.config.tool_result_chars)
        saved = sum(item_tokens(history_item) for history_item in parts.older if history_item.id in short)
        saved -= items_tokens(short.values())
        if not short or self.config.due(tokens - saved, window):
            return None
        return Compacted([short.get(i.id, i) for i in history], len(short), 0, tokens_after=tokens - saved)

    async def summarized(self, history: list[Item], step: int) -> Compacted:
        """Step 2: older turns replaced by a summary (history None if there was nothing older,
        or the summarizer failed: its counts or `error` say which)."""
        parts = split(history, self.config.keep_turns)
        if not parts.older:
            return Compacted(None, 0, 0)
        messages: list[Item] = []
        if parts.previous is not None:  # separately, and never cut
            messages.append(_note("cmp_previous", PREVIOUS_HEADER, summary_body(parts.previous)))
        messages.append(
            _note("cmp_transcript", TRANSCRIPT_HEADER, transcript(parts.older, self.config.transcript_chars))
        )
        request = ModelRequest(
            system=self.config.instructions,
            tools=(),
            messages=messages,
            session_id=self.sid,
            turn_id=self.turn_id,
            step=step,
            purpose="compaction",
        )
        await self.store.count_attempt(self.sid)
        try:
            reply = await complete(self.model, request)
        except Exception as exc:
            log.warning("session %s: compaction model failed: %s", self.sid, type(exc).__name__)
            await self.store.record_usage(self.sid, self.turn_id, step, Usage(), failed=True, purpose="compaction")
            return Compacted(None, error=ErrorInfo("model_error", f"{type(exc).__name__}: {exc}"))
        usage = reply.usage or Usage(input_tokens=request_tokens(request), output_tokens=estimate_tokens(reply.text))
        await self.store.record_usage(self.sid, self.turn_id, step, usage, purpose="compaction")
        if not reply.text.strip():
            return Compacted(None, error=ErrorInfo("empty_summary", "the summary was empty"))
        summary = Item(
            id=f"it_{self.turn_id}_s{step}",
            role="user",
            text=f"{SUMMARY_HEADER}\n{reply.text}",
            kind="summary",
            turn_id=self.turn_id,
        )
        rebuilt = [summary]
        todo = newest_todo(history)
        if todo is not None and newest_todo(parts.recent) is None:
            rebuilt.append(todo_item(self.turn_id, todo, f"td{step}"))
        snapshot = newest_snapshot(history)
        if snapshot is not None and newest_snapshot(parts.recent) is None:
            rebuilt.append(snapshot)
        rebuilt.extend(parts.recent)
        saved = items_tokens(history) - items_tokens(rebuilt)
        return Compacted(rebuilt, 0, len(parts.older), tokens_saved=saved)


def _note(item_id: str, header: str, body: str) -> Item:
    return Item(id=item_id, role="user", text=f"{header}\n{body}")
