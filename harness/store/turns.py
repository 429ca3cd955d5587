"""The session store's turn operations, as the runner makes them: BEGIN takes the session for
a turn (with what it needs to run, the history partly from this process's cache), COMMIT writes
a step's results and events under the lease's fencing token, and the provider attempts are
counted and their tokens recorded. `Store` has them from `Turns`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from harness.errors import StaleLease
from harness.events import StoredEvent, event_body, made, written
from harness.store import protocol as p
from harness.store.cache import HistoryCache
from harness.store.client import translated
from harness.store.types import Begun, Busy, Committed, UsageRecord
from harness.types import Answer, ApprovalRequest, Item, Usage, answer_decoder, inbox_decoder, item_decoder

R = TypeVar("R")
_enc = msgspec.json.Encoder()


class Turns:
    """BEGIN, COMMIT and the attempts' accounting, for `Store` (which has what they use)."""

    retention: int
    ttl_ms: int
    _cache: HistoryCache

    if TYPE_CHECKING:

        async def _run(self, script: p.Script[R], sid: str, args: msgspec.Struct) -> R: ...

    # ---- turns ---------------------------------------------------------------------------

    @translated
    async def begin(self, sid: str, fence: str, lease_ms: int) -> Begun | Busy | None:
        """Take the session for its next turn. None: nothing to do (or no session)."""
        have_start, have, epoch = self._cached(sid)
        args = p.BeginArgs(fence, lease_ms, repr(time.time()), self.retention, have_start, len(have), epoch)
        return self._begun(sid, await self._run(p.BEGIN, sid, args), have)

    def _cached(self, sid: str) -> tuple[int, list[Item], str]:
        """(start, items, epoch) of this process's copy of the session's history."""
        cached = self._cache.get(sid)
        return cached if cached is not None else (-1, [], "")

    def _begun(self, sid: str, res: p.BeginReply, have: list[Item]) -> Begun | Busy | None:
        """BEGIN's reply (or the one SUBMIT gives when it began the turn), decoded."""
        if isinstance(res, p.LeaseTaken):
            return Busy(retry_ms=max(res.retry_ms, 1))
        if not isinstance(res, p.Began):
            return None
        message = inbox_decoder.decode(res.head)
        items = have if res.reused == len(have) else have[: res.reused]
        items.extend(item_decoder.decode(raw) for raw in res.items)
        self._cache.put(sid, res.start, items, res.epoch)
        started = None
        if res.started_id:
            etype = "compaction.requested" if message.kind == "compact" else "turn.started"
            started = made(sid, res.started_id, res.started_seq, etype, res.started_body.encode())
        return Begun(
            fence=str(res.fence),
            message=message,
            history=items[: res.n_before],
            turn_items=items[res.n_before :],
            sticky=dict(res.sticky),
            started_id=res.started_id,
            cancel=res.cancel,
            answers={rid: answer_decoder.decode(a) if a else None for rid, a in res.decisions},
            last_in=res.last_in,
            last_est=res.last_est,
            started=started,
            took_over=res.took_over,
        )

    @translated
    async def commit(
        self,
        sid: str,
        fence: str,
        turn_id: str,
        items: Sequence[Item],
        events: Sequence[tuple[str, bytes]],
        *,
        mode: p.CommitMode = "step",
        requests: Sequence[ApprovalRequest] = (),
        answers: Sequence[tuple[str, Answer]] = (),
        attempt: bool = False,
        rebase: int | None = None,
        usage: UsageRecord | None = None,
        guard: bool = False,
        announce: Sequence[tuple[str, bytes]] = (),
    ) -> Committed:
        """Commit a step (mode "step"), the end of a turn ("final"), or a pause for the
        approval `requests` ("pause"). `answers` records answers the harness gives itself
        (withdrawn requests of a cancelled turn). `attempt`: a model call follows; count it now.
        `rebase`: `items` become the whole active history (compaction, clear), the current
        turn's items beginning at that offset in them. `usage`: the model call's tokens, written
        by the same script first (its usage.recorded comes first in `events`; written even if
        the commit is refused as stale). `guard`: with a cancel pending for the turn, write
        nothing else (`dropped`). `announce`: events written only if no cancel is pending (step
        mode)."""
        recorded: list[tuple[str, bytes]] = []
        usage_args = None
        if usage is not None:
            body, usage_args = self._usage_args(
                turn_id, usage.step, usage.usage, failed=False, purpose="turn", estimate=usage.estimate
            )
            recorded.append(("usage.recorded", body))
        resolved: list[tuple[str, bytes]] = []
        answer_args = []
        for rid, answer in answers:
            data = {"request_id": rid, "decision": answer.decision, "reason": answer.reason}
            resolved.append(("input.resolved", event_body(turn_id, data)))
            answer_args.append(p.AnswerArg(rid, _enc.encode(answer).decode(), resolved[-1][1].decode()))
        args = p.CommitArgs(
            fence=fence,
            turn_id=turn_id,
            retention=self.retention,
            mode=mode,
            waiting_on=[r.request_id for r in requests] if mode == "pause" else [],
            attempt=attempt,
            items=[_enc.encode(item).decode() for item in items],
            requests=[p.RequestArg(r.request_id, _enc.encode(r).decode()) for r in requests],
            answers=answer_args,
            events=[p.EventArg(etype, body.decode()) for etype, body in events],
            rebase=rebase,
            usage=usage_args,
            guard=guard,
            announce=[p.EventArg(etype, body.decode()) for etype, body in announce],
            ttl_ms=self.ttl_ms,
        )
        res = await self._run(p.COMMIT, sid, args)
        if isinstance(res, p.Stale):
            raise StaleLease(f"session {sid}: lease {fence} is no longer held (or the session is no more)")
        if isinstance(res, p.Dropped):
            return Committed(events=written(sid, res.ids, res.first_seq, recorded), cancel=True, dropped=True)
        if announce and not res.cancel:
            events = [*events, *announce]
        if rebase is None:
            self._cache.extend(sid, list(items), res.length)
        else:
            _, _, epoch = self._cached(sid)
            self._cache.put(sid, res.length - len(items), list(items), epoch)
        emitted = recorded + [resolved[n] for n in res.resolved] + list(events)
        return Committed(
            events=written(sid, res.ids, res.first_seq, emitted),
            more=isinstance(res, p.More),
            paused=isinstance(res, p.Paused),
            cancel=res.cancel,
        )

    @translated
    async def record_usage(
        self,
        sid: str,
        turn_id: str,
        step: int,
        usage: Usage,
        *,
        failed: bool = False,
        purpose: str = "turn",
        estimate: int | None = None,
    ) -> StoredEvent:
        """Account one provider attempt, before its step commits (I5); a failed attempt too.
        `estimate`: keel's estimate of the request, kept with its reported input tokens (turn
        calls only) for compaction's threshold. Returns the usage.recorded event."""
        body, args = self._usage_args(turn_id, step, usage, failed=failed, purpose=purpose, estimate=estimate)
        res = await self._run(p.USAGE, sid, p.RecordUsageArgs(self.retention, args))
        if isinstance(res, p.Stale):
            raise StaleLease(f"session {sid} is no more (deleted or expired)")
        return made(sid, res.id, res.seq, "usage.recorded", body)

    @staticmethod
    def _usage_args(
        turn_id: str, step: int, usage: Usage, *, failed: bool, purpose: str, estimate: int | None
    ) -> tuple[bytes, p.UsageArgs]:
        """The usage.recorded body and the tokens as a script records them."""
        data: dict[str, Any] = {
            "step": step,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
        }
        if failed:
            data["failed"] = True
        if purpose != "turn":
            data["purpose"] = purpose
        body = event_body(turn_id, data)
        last_est = None if estimate is None or failed else estimate
        args = p.UsageArgs(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            cache_write_tokens=usage.cache_write_tokens,
            body=body.decode(),
            last_est=last_est,
        )
        return body, args

    @translated
    async def count_attempt(self, sid: str) -> None:
        """Count a model call about to be made, when no commit or BEGIN just did."""
        if (await self._run(p.ATTEMPT, sid, p.NoArgs())).n < 0:
            raise StaleLease(f"session {sid} is no more (deleted or expired)")
