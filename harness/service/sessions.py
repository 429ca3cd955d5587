"""The Harness's reads of a session: its state, its open requests, its history, its events.
Nothing here writes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from harness.errors import InvalidInput, NotFound
from harness.events import LiveEvent, StoredEvent, decode_data
from harness.ids import stream_key
from harness.store import Outbox, Store
from harness.types import Item, SessionInfo, SessionStatus

SESSION_ID = re.compile(r"^ses_[0-9a-z]{26}$")
EVENT_ID = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")  # ASCII digits only (\d takes any script's)


def check_session_id(sid: str) -> str:
    if not SESSION_ID.match(sid):
        raise NotFound(f"no session {sid[:64]}", code="session_not_found")
    return sid


def check_event_id(eid: str) -> str:
    """A stream id a client may resume after: `<ms>-<seq>`, both below 2**64, not the last."""
    if EVENT_ID.match(eid):
        ms, seq = stream_key(eid)
        if ms < 2**64 and seq < 2**64 and (ms, seq) != (2**64 - 1, 2**64 - 1):
            return eid
    raise InvalidInput("an event id looks like 1700000000000-0", code="invalid_event_id")


class SessionReads:
    store: Store
    outbox: Outbox

    async def session(self, sid: str, owner: str) -> SessionInfo:
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        # the inbox's head is the turn in progress (running or paused) while `turn` names it:
        # queued counts the messages behind it
        queued = max(0, await self.store.queued(sid) - (1 if meta.get("turn") else 0))
        pending = [
            {"request_id": r.request_id, "tool": r.tool, "arguments": r.arguments}
            for r in await self.store.open_requests(sid, meta)
        ]
        usage = {
            "input_tokens": int(meta.get("u_in", 0)),
            "output_tokens": int(meta.get("u_out", 0)),
            "cached_tokens": int(meta.get("u_cached", 0)),
            "cache_write_tokens": int(meta.get("u_cwrite", 0)),
            "model_calls": int(meta.get("u_calls", 0)),
        }
        status: SessionStatus = meta["status"]  # type: ignore[assignment]
        return SessionInfo(
            session_id=sid,
            status=status,
            pending=pending,
            queued=queued,
            usage=usage,
            metadata=decode_data(meta["metadata"].encode()),
            created_at=float(meta["created_at"]),
        )

    async def pending(self, sid: str, owner: str) -> list[str]:
        """The ids of the approval requests the session waits for, in the order they were made."""
        check_session_id(sid)
        meta = await self.store.meta(sid, owner)
        return [r.request_id for r in await self.store.open_requests(sid, meta)]

    async def history(self, sid: str, owner: str, offset: int = 0, limit: int | None = None) -> list[Item]:
        """The session's active history (after its last clear or compaction), or a page of it."""
        check_session_id(sid)
        return await self.store.history(sid, owner, offset, limit)

    async def shared_secret(self) -> bytes:
        """A secret every process of this deployment shares (for signing browser tokens)."""
        return await self.store.shared_secret()

    async def check_owner(self, sid: str, owner: str) -> None:
        check_session_id(sid)
        await self.store.meta(sid, owner)

    def tail(
        self, sid: str, after: str, *, heartbeat: float, gate: asyncio.Semaphore | None = None
    ) -> AsyncIterator[StoredEvent | LiveEvent | None]:
        """Committed events after `after`, then new ones as they come, with live events
        (`Outbox.tail` itself: no generator layer of its own on every event's path). The caller
        checks ownership first."""
        return self.outbox.tail(sid, after, heartbeat=heartbeat, gate=gate)
