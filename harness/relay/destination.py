"""The `Destination` port a webhook channel gives the delivery relay, and the relay's figures.

What a webhook channel gives the delivery relay: a `Destination` that renders committed
events into `Outbound` calls and makes them, raising `Retry` or `Undeliverable`; and the
relay's figures (`RelayStats`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from harness.events import StoredEvent
from harness.telemetry.metrics import Histogram


class Outbound(msgspec.Struct, frozen=True):
    """One call to a destination. `post`: a new message named `ref` (kept for later updates
    when `keep`); `update`: change the post named `ref` (skipped if it was never made);
    `forget`: drop a kept ref."""

    kind: Literal["post", "update", "forget"]
    ref: str
    body: dict[str, Any] = {}
    keep: bool = False


class Retry(Exception):
    """The destination cannot take the call now; try again after `after` seconds (None: after
    a backoff that doubles from one second)."""

    def __init__(self, reason: str, after: float | None) -> None:
        super().__init__(reason)
        self.after = after


@dataclass(frozen=True)
class RetryPolicy:
    """How a destination's failing calls are tried again: a backoff doubling from `first`
    seconds (with jitter) up to `cap`, or the wait a Retry names; given up after `attempts`
    tries or `give_up_after` seconds of failing, whichever comes first. A wait longer than
    `park_after` gives the relay's slot back (the session's delivery resumes from a delayed
    job), so a receiver that is down holds up only its own deliveries."""

    attempts: int | None = 6
    give_up_after: float | None = None
    first: float = 1.0
    cap: float = 60.0
    park_after: float = 30.0


class Parked(Exception):
    """The delivery waits `until` (epoch seconds) for its destination, without a slot."""

    def __init__(self, until: float) -> None:
        super().__init__(f"until {until}")
        self.until = until


class Undeliverable(Exception):
    """The destination refused the call; trying again would not help."""


class Destination(Protocol):
    """A webhook channel's outbound side. `where` is the session's metadata (the channel put
    there where its conversation lives)."""

    name: str
    retry: RetryPolicy | None  # None: the relay's default

    def render(self, event: StoredEvent, where: Mapping[str, Any], refs: Mapping[str, str]) -> list[Outbound]:
        """The calls that tell the destination about a committed event (often none)."""
        ...

    def working(self, turn_id: str, where: Mapping[str, Any]) -> Outbound | None:
        """A post that says a turn is running, made when it has been silent for a while."""
        ...

    async def send(self, out: Outbound, where: Mapping[str, Any], handle: str | None) -> str:
        """Make the call (`handle`: the post an update changes); returns the new post's handle.
        Raises Retry or Undeliverable."""
        ...

    async def find(self, refs: list[str], where: Mapping[str, Any], since: str) -> dict[str, str]:
        """Which of `refs` the destination has (posted at or after `since`, if not ""): ref ->
        handle. Raises Retry or Undeliverable."""
        ...


@dataclass
class RelayStats:
    """What the relay has done since the process started; `lags` are the seconds from an
    event's commit to its delivery, for the newest deliveries."""

    delivered: int = 0
    dead: int = 0
    retries: int = 0
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    lag_seconds: Histogram = field(default_factory=Histogram)  # every delivery's lag (for /metrics)

    def delivered_after(self, lag: float) -> None:
        self.delivered += 1
        self.lags.append(lag)
        self.lag_seconds.observe(lag)

    def lag(self, quantile: float) -> float | None:
        """A quantile of the recent commit-to-delivery lags, in seconds (None: no delivery yet)."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]

    def summary(self) -> str:
        p50, p99 = self.lag(0.5), self.lag(0.99)
        lag = (
            f"lag p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
            if p50 is not None and p99 is not None
            else "no lag yet"
        )
        return f"{self.delivered} delivered, {self.dead} dead letters, {self.retries} retries; {lag}"
