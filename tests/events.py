"""Reading events in tests: an event's envelope as plain JSON (what a client decodes)."""

from __future__ import annotations

import json
from typing import Any

from harness.events import StoredEvent


def env(event: StoredEvent) -> dict[str, Any]:
    """The envelope of a committed event, as a client decodes it."""
    out: dict[str, Any] = json.loads(event.raw)
    return out
