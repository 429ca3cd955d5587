"""The protocol of the scripts in `lua_relay`, as `protocol` has the session's: the delivery
relay's (keys: `DeliveryKeys`, `RelayKeys`) and the rate limiter's token bucket (`QuotaKeys`)."""

from __future__ import annotations

import msgspec

from harness.store import lua_relay
from harness.store.protocol import Count, Done, Reply, Script

# ---- RELAY_TAKE, RELAY_MARK ----------------------------------------------------------------


class RelayTakeArgs(msgspec.Struct, frozen=True):
    fence: str  # the relay's token
    ttl_ms: int
    destination: str  # listed among the session's `relays`


class RelayHeld(Reply, tag="held"):
    state: list[tuple[str, str]] = msgspec.field(default_factory=list)  # the delivery state hash (RELAY_TAKE)
    metadata: str = ""  # the session's metadata (JSON; "" when there is no session)
    quiet: bool = False  # RELAY_MARK with `check`: nothing left to deliver


class RelayBusy(Reply, tag="busy"):
    retry_ms: int


class RelayLost(Reply, tag="lost"):
    pass


class RelayMarkArgs(msgspec.Struct, frozen=True):
    token: str
    ttl_ms: int
    set: list[tuple[str, str]] = msgspec.field(default_factory=list)
    unset: list[str] = msgspec.field(default_factory=list)
    check: str | None = None  # the newest event the relay has seen: is the session quiet?
    release: bool = False  # give the lease up (only if quiet, with `check`)


class PromoteArgs(msgspec.Struct, frozen=True):
    now: int  # ms
    limit: int = 100


# ---- TAKE_TOKEN ----------------------------------------------------------------------------


class TakeTokenArgs(msgspec.Struct, frozen=True):
    capacity: int
    period_ms: int


class NoToken(Reply, tag="limited"):
    """No token: one will be there in `retry_ms`."""

    retry_ms: int


RELAY_TAKE: Script[RelayHeld | RelayBusy] = Script(
    lua_relay.RELAY_TAKE, ("lease", "state", "meta", "relays"), RelayHeld | RelayBusy
)
RELAY_MARK: Script[RelayHeld | RelayLost] = Script(
    lua_relay.RELAY_MARK, ("lease", "state", "meta", "outbox", "inbox"), RelayHeld | RelayLost
)
RELAY_PROMOTE: Script[Count] = Script(lua_relay.RELAY_PROMOTE, ("later", "jobs"), Count)
TAKE_TOKEN: Script[Done | NoToken] = Script(lua_relay.TAKE_TOKEN, ("bucket",), Done | NoToken)
SCRIPTS: tuple[Script[object], ...] = (TAKE_TOKEN, RELAY_PROMOTE, RELAY_TAKE, RELAY_MARK)
