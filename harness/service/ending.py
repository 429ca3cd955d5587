"""The end of a session: `delete` removes all of it at once (the turn in progress is stopped
and every reader is told), and a session left alone for the session TTL expires, all of it
(`Store`'s scripts keep every key of a session on one deadline)."""

from __future__ import annotations

from harness.service.sessions import check_session_id
from harness.store import EventHub, Store


class SessionEnds:
    store: Store
    hub: EventHub

    async def delete(self, sid: str, owner: str) -> None:
        """Remove the session and everything of it (its history, events, queued messages, open
        requests, delivery state) in one atomic step; NotFound if it is not there or not the
        owner's. A turn in progress is told to stop, wherever it runs: its model call is cut,
        and its next write is refused (it cannot make the session again). Readers of the
        session, in this process and in others, get `session.deleted` and their stream ends.
        A later message to the id is NotFound (a webhook channel's conversation, whose
        messages make their session, starts a new one)."""
        check_session_id(sid)
        turn_id = await self.store.delete(sid, owner)
        if turn_id:
            self.hub.cancel(sid, turn_id)
        self.hub.ended(sid)
