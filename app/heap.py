"""The process's garbage collector, set for a server whose turns make many short-lived objects.

Python runs its cyclic collector's youngest generation whenever the tracked objects made, less
those freed, pass 700. A keel process with turns in flight holds thousands of young objects at
any moment (each turn's request, items, events, futures and tasks), so at 700 the collector runs
again and again over a young generation that is mostly alive, and moves what it finds alive
into the older generations, whose collections then cost more too.

`settle` raises that first threshold (KEEL_GC_THRESHOLD) above what turns in flight hold, and
first freezes what the process made as it started (its modules, classes, the app: never
garbage), so that a full collection no longer scans them. Reference counting still frees almost
every object the moment it is no longer used; only garbage in reference cycles waits for a
collection, and the threshold bounds how much of it can wait.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("keel")

THRESHOLD = 50_000  # KEEL_GC_THRESHOLD's default: the young objects that set off a collection


def settle(threshold: int) -> None:
    """Freeze what the process made so far and collect the youngest generation at `threshold`
    objects (the older generations' ratios stay Python's). 0: the collector is left as it is."""
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)
    log.debug("collector: %d objects frozen, a collection every %d young objects", gc.get_freeze_count(), threshold)
