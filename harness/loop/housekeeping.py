"""Manual compact and clear (I8): queued in the inbox like messages, so they run after the turns
before them (including a turn waiting for approval) and before the ones after. Neither appends
a user message.

- compact: `compaction.requested` (emitted when it begins), `compaction.completed`, then
  `session.waiting`. Older turns are summarized as automatic compaction would (no threshold).
- clear: `context.cleared`, then `session.waiting`. The model's history (and with it the todo
  list and runtime snapshots) leaves the active context; the session id, its sticky page
  context, usage and event stream stay. Cleared items stay readable nowhere but the events.
"""

from __future__ import annotations

from typing import Any

from harness import failpoints
from harness.events import event_body
from harness.loop.agent import Agent
from harness.loop.compaction import Compactor
from harness.loop.outcomes import Final, Publish
from harness.store import Begun, Store
from harness.types import Item


class OpRunner:
    def __init__(self, store: Store, agent: Agent, sid: str, begun: Begun, publish: Publish) -> None:
        self.store, self.agent, self.sid, self.begun = store, agent, sid, begun
        self.turn_id = begun.message.turn_id
        self._publish = publish

    async def run(self) -> Final:
        history = self.begun.history
        rebase: list[Item] | None
        if self.begun.message.kind == "clear":
            rebase = []
            events = [self._event("context.cleared", {"items": len(history)})]
        else:
            compactor = Compactor(self.store, self.agent.model, self.agent.compaction, self.sid, self.turn_id)
            done = await compactor.summarized(history, 0)
            rebase = done.history
            events = [self._event("compaction.completed", {"reason": "manual", **done.data})]
        events.append(self._event("session.waiting", {}))
        failpoints.reached("compaction.before_commit")
        committed = await self.store.commit(
            self.sid,
            self.begun.fence,
            self.turn_id,
            rebase or [],
            events,
            mode="final",
            rebase=None if rebase is None else len(rebase),
        )
        self._publish(self.sid, committed.events, True)
        return Final(more=committed.more)

    def _event(self, etype: str, data: dict[str, Any]) -> tuple[str, bytes]:
        return etype, event_body(self.turn_id, data)
