"""keel's storage on Redis (or Valkey): the only code that knows Redis.

keel's storage on Redis (or Valkey): the only code that imports `redis`, knows key names,
Lua, RESP or what a stream id is made of.

What it promises:
- every change to a session is one atomic script, fenced by the session lease's token where a
  runner writes (a stale owner's commit changes nothing but its usage: I4, I5);
- every key of a session shares one hash tag, so each script touches one cluster slot;
- a session ends whole: deleted in one script, or (with a session TTL) every key but the lease
  expiring at the same moment; nothing is written into a session that has ended;
- events are written to the session's outbox stream by the same script as the state they
  describe, read back byte for byte (I2), and handed to this process's readers by the store
  itself once committed (its `EventHub`);
- a command with several outcomes answers a tagged union (`types`) its caller matches on;
- a Redis failure leaves the package as `harness.errors.Unavailable`, never a Redis error.

Modules, one noun each: `sessions` (the `Store`: a session's commands, its turn's BEGIN and
COMMIT, the attempts' accounting, and what it publishes), `types` (what the commands hand
back), `keys` (every key), `lua`, `lua_turn`, `lua_relay`, `protocol` and `protocol_relay` (the
scripts and their typed arguments and replies), `wire` and `clusterwire` (the direct command
path every script takes), `queue` (the job streams, their jobs and acknowledgements),
`streamids` (stream ids: read, compared, stepped), `cache` (decoded history per process), `hub`
(wake-ups and this process's events), `bus` (the sharded pub/sub between processes) and
`shardsub` (its subscriptions), `outbox` (reading events), `hooks` (event webhook subscriptions
and where an owner's sessions deliver to), `deliveries` (the delivery relay's leases, cursors,
jobs and dead letters), `quotas` (rate-limit buckets and their script), `client` (the
connection and error translation).
"""

from harness.store.catalog import cursor_of
from harness.store.client import Client, connect, is_cluster_node, reachable
from harness.store.deliveries import GONE, Deliveries, DeliveryState, Failing, relay_queue
from harness.store.hooks import Subscriptions, new_subscription
from harness.store.hub import EventHub, Watch
from harness.store.outbox import Outbox
from harness.store.queue import JobId, JobQueue, JobShards
from harness.store.quotas import RateBuckets
from harness.store.sessions import Store
from harness.store.types import (
    AlreadyAnswered,
    AwaitingAnswers,
    BeginOutcome,
    Begun,
    Busy,
    CancelAsked,
    Cancelling,
    CancelPending,
    Commit,
    CommitMode,
    Ended,
    NothingToCancel,
    NoWork,
    Recorded,
    Responded,
    SessionMeta,
    Stepped,
    Submitted,
    UsageRecord,
    Withheld,
)

__all__ = [
    "GONE",
    "PAGE_MAX",
    "AlreadyAnswered",
    "AwaitingAnswers",
    "BeginOutcome",
    "Begun",
    "Busy",
    "CancelAsked",
    "CancelPending",
    "Cancelling",
    "Client",
    "Commit",
    "CommitMode",
    "Deliveries",
    "DeliveryState",
    "Ended",
    "EventHub",
    "Failing",
    "JobId",
    "JobQueue",
    "JobShards",
    "NoWork",
    "NothingToCancel",
    "Outbox",
    "Page",
    "RateBuckets",
    "Recorded",
    "Responded",
    "SessionMeta",
    "Stepped",
    "Store",
    "Submitted",
    "Subscriptions",
    "UsageRecord",
    "Watch",
    "Withheld",
    "connect",
    "cursor_of",
    "is_cluster_node",
    "new_subscription",
    "reachable",
    "relay_queue",
]
