"""Manual compact and clear (I8), run between turns as a message is.

Manual compact and clear (I8): queued in the inbox like messages, so they run after the turns
before them (including a turn waiting for approval) and before the ones after. Neither appends
a user message.

- compact: `compaction.requested` (emitted when it begins), `compaction.completed`, then
  `session.waiting`. Older turns are summarized as automatic compaction would (no threshold).
- clear: `context.cleared`, then `session.waiting`. The model's history (and with it the todo
  list and runtime snapshots) leaves the active context; the session id, its sticky page
  context, usage and event stream stay. Cleared items stay readable nowhere but the events.
"""

from __future__ import annotations

from harness import failpoints
from harness.events import ContextClearedData, SessionWaitingData, pending
from harness.loop.agent import Agent
from harness.loop.compaction import Compactor
from harness.loop.outcomes import Final
from harness.store import Begun, Ended, Store
from harness.types import Item


class Housekeeping:
    """Runs a manual compact or clear a runner has begun."""

    def __init__(self, store: Store, agent: Agent, sid: str, begun: Begun) -> None:
        self.store, self.agent, self.sid, self.begun = store, agent, sid, begun
        self.turn_id = begun.message.turn_id

    async def run(self) -> Final:
        history = self.begun.history
        rebase: list[Item] | None
        if self.begun.message.kind == "clear":
            rebase = []
            events = [pending(self.turn_id, ContextClearedData(len(history)))]
        else:
            compactor = Compactor(self.store, self.agent.model, self.agent.compaction, self.sid, self.turn_id)
            done = await compactor.summarized(history, 0)
            rebase = done.history
            events = [pending(self.turn_id, done.event("manual"))]
        events.append(pending(self.turn_id, SessionWaitingData()))
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
        return Final(more=isinstance(committed, Ended) and committed.more)
