"""The typed arguments and replies of the delivery relay's scripts.

The protocol of the delivery relay's scripts in `lua_relay` (keys: `DeliveryKeys`,
`RelayKeys`), as `protocol` has the session's."""

from __future__ import annotations

import msgspec

from harness.store import lua_relay
from harness.store.protocol import Count, Reply, Script

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


RELAY_TAKE: Script[RelayHeld | RelayBusy] = Script(
    lua_relay.RELAY_TAKE, ("lease", "state", "meta", "relays"), RelayHeld | RelayBusy
)
RELAY_MARK: Script[RelayHeld | RelayLost] = Script(
    lua_relay.RELAY_MARK, ("lease", "state", "meta", "outbox", "inbox"), RelayHeld | RelayLost
)
RELAY_PROMOTE: Script[Count] = Script(lua_relay.RELAY_PROMOTE, ("later", "jobs"), Count)
SCRIPTS: tuple[Script[object], ...] = (RELAY_PROMOTE, RELAY_TAKE, RELAY_MARK)
