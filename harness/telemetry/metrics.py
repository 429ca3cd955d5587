"""What the harness counts for operators: plain counters and latency histograms in memory.

The harness stays free of any metrics library: a turn's path pays a dict increment or a
`bisect` into a short tuple, never a lock, a label lookup or a registry. The app exposes these
objects in Prometheus' text format through a collector that reads them when /metrics is scraped
(`app/metrics.py`), so each app or worker has its own registry and nothing here is global.
(An observer the harness would call was the other choice; it would put a call into the app on
every event of every turn, for numbers only a scrape reads.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from harness.events import OUTCOMES, StoredEvent

# seconds: a turn of a zero-latency model takes about a millisecond, a real one seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_redis_errors = [0]  # Redis failures this process met (one Redis client per process)
PREFIXES_KEPT = 10_000  # sessions whose last request's prefix a process remembers (cache-bust detection)


def redis_errors() -> int:
    """How many Redis calls of this process have failed (raised as `Unavailable`, or met by the
    live-event listener and the subscriber) since it started."""
    return _redis_errors[0]


def count_redis_error() -> None:
    _redis_errors[0] += 1


class Histogram:
    """Observations counted per bucket (upper bounds, the last one +Inf), with their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it), as Prometheus wants them, +Inf last."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class HarnessStats:
    """Counted by this process's harness since it started."""

    turns: dict[str, int] = field(default_factory=dict)  # outcome -> turns that came to it here
    events: dict[str, int] = field(default_factory=dict)  # event type -> committed by this process
    turn_seconds: Histogram = field(default_factory=Histogram)  # a turn's run here, begin to settle or pause
    model_seconds: Histogram = field(default_factory=Histogram)  # one model attempt
    model_attempts: dict[str, int] = field(default_factory=dict)  # "ok", "interrupted", "handed_over", error code
    tool_seconds: dict[str, Histogram] = field(default_factory=dict)  # tool name -> its runs
    mcp_catalogue_changes: dict[str, int] = field(default_factory=dict)  # MCP server -> its tool list changed
    lease_takeovers: int = 0  # turns this process resumed from a runner whose lease lapsed
    handed_over: int = 0  # sessions this process gave to other runners when it drained
    # prompt-cache health, by (agent, model): input tokens of turn calls, those read from the
    # cache, and the times a session's tools or system prompt changed between its requests
    prompt_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    cached_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    cache_busts: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (agent, model, "tools"|"system")
    _prefixes: dict[str, tuple[int, int]] = field(default_factory=dict)  # session -> hashes of its last request

    def cache_read(self, agent: str, model: str, input_tokens: int, cached: int) -> None:
        key = (agent, model)
        self.prompt_tokens[key] = self.prompt_tokens.get(key, 0) + input_tokens
        self.cached_tokens[key] = self.cached_tokens.get(key, 0) + cached

    def prefix(self, agent: str, model: str, sid: str, tools: int, system: int) -> list[str]:
        """A turn call's cached prefix (hashes of its tools and of its system prompt): what
        changed since the session's previous request here ("tools", "system"), counted. A
        bounded memo: the oldest session is forgotten past PREFIXES_KEPT."""
        was = self._prefixes.pop(sid, None)
        self._prefixes[sid] = (tools, system)
        if len(self._prefixes) > PREFIXES_KEPT:
            del self._prefixes[next(iter(self._prefixes))]
        if was is None:
            return []
        pairs = (("tools", was[0], tools), ("system", was[1], system))
        changed = [part for part, before, now in pairs if before != now]
        for part in changed:
            key = (agent, model, part)
            self.cache_busts[key] = self.cache_busts.get(key, 0) + 1
        return changed

    def committed(self, events: list[StoredEvent]) -> None:
        counts = self.events
        for event in events:
            etype = event.type
            counts[etype] = counts.get(etype, 0) + 1
            outcome = OUTCOMES.get(etype)  # (a turn's last event says how it came out)
            if outcome is not None:
                self.turns[outcome] = self.turns.get(outcome, 0) + 1

    def attempt(self, outcome: str, seconds: float) -> None:
        self.model_attempts[outcome] = self.model_attempts.get(outcome, 0) + 1
        self.model_seconds.observe(seconds)

    def mcp_catalogue_changed(self, server: str) -> None:
        self.mcp_catalogue_changes[server] = self.mcp_catalogue_changes.get(server, 0) + 1

    def tool(self, name: str, seconds: float) -> None:
        histogram = self.tool_seconds.get(name)
        if histogram is None:
            histogram = self.tool_seconds[name] = Histogram()
        histogram.observe(seconds)
