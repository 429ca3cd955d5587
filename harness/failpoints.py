"""Deterministic crash points for crash tests (DESIGN.md "Failpoints").

`KEEL_FAILPOINTS="step.before_commit=exit,tool.after_run=exit@3"` makes the process stop hard
(`os._exit(137)`, as a `kill -9` would leave it) the first time (or the N-th time, with `@N`) it
reaches a named point. Unset in production: `reached` is then one set lookup on an empty set.

Points: step.before_commit, step.after_commit (committed, nothing published yet),
outbox.after_publish (the first event of a commit written to a client), response.after_accept
(an answer accepted, the resume not yet started), tool.after_run (a tool returned, its result not
committed), compaction.before_commit (a summary returned, the compacted history not committed),
model.mid_stream (a model call's first text delta went out, the rest of the stream not read),
relay.before_send (the delivery relay marked a post in doubt, not made yet), relay.after_send
(the relay made a post, its cursor not moved), steer.after_join (a steered message joined the
running turn, committed, the model call that follows not made)."""

from __future__ import annotations

import os
import sys

NAMES = frozenset(
    {
        "step.before_commit",
        "step.after_commit",
        "outbox.after_publish",
        "response.after_accept",
        "tool.after_run",
        "compaction.before_commit",
        "model.mid_stream",
        "relay.before_send",
        "relay.after_send",
        "steer.after_join",
    }
)


def _parse(spec: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = part.partition("=")
        action, _, nth = (action or "exit").partition("@")
        if name not in NAMES or action != "exit" or (nth and not nth.isdigit()):
            raise ValueError(f"KEEL_FAILPOINTS: cannot use {part!r} (names: {', '.join(sorted(NAMES))})")
        points[name] = int(nth or 1)
    return points


_armed = _parse(os.environ.get("KEEL_FAILPOINTS", ""))


def reached(name: str) -> None:
    """Stop the process here if this point is armed and its turn has come."""
    if name in _armed:
        _armed[name] -= 1
        if _armed[name] == 0:
            sys.stderr.write(f"keel: failpoint {name}: exiting\n")
            sys.stderr.flush()
            os._exit(137)


def armed(name: str) -> bool:
    """Whether the point is armed (so code that folds two writes into one round trip can keep
    the state between them reachable for the crash tests)."""
    return name in _armed
