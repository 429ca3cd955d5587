"""keel's storage on Redis (or Valkey): the only code that imports `redis`, knows key names,
Lua or RESP.

What it promises:
- every change to a session is one atomic script, fenced by the session lease's token where a
  runner writes (a stale owner's commit changes nothing but its usage: I4, I5);
- every key of a session shares one hash tag, so each script touches one cluster slot;
- a session ends whole: deleted in one script, or (with a session TTL) every key but the lease
  expiring at the same moment; nothing is written into a session that has ended;
- events are written to the session's outbox stream by the same script as the state they
  describe, and read back byte for byte (I2);
- a Redis failure leaves the package as `harness.errors.Unavailable`, never a Redis error.

Modules, one noun each: `keys` (every key), `lua`, `lua_turn`, `lua_relay`, `protocol` and
`protocol_relay` (the scripts and their typed arguments and replies), `wire` (the turn's
direct command path), `sessions` (the session store's commands), `turns` (its turn operations:
begin, commit, usage), `queue` (the job stream), `cache` (decoded history per process), `hub`
(wake-ups and this process's events), `outbox` (reading events), `deliveries` (the delivery
relay's leases, cursors, jobs and dead letters), `client` (the connection and error
translation), `types` (what the commands hand back).
"""

from redis.asyncio import Redis

from harness.store.client import Client, connect, reachable, redis_errors
from harness.store.deliveries import DeadLetter, Deliveries, DeliveryState, Failing, relay_queue
from harness.store.hooks import Subscription, Subscriptions, new_subscription
from harness.store.hub import EventHub, Watch
from harness.store.outbox import Outbox
from harness.store.queue import Depth, JobQueue, JobShards
from harness.store.quotas import RateBuckets
from harness.store.sessions import CommitMode, Store
from harness.store.types import Begun, Busy, Committed, Responded, Submitted, UsageRecord

__all__ = [
    "Begun",
    "Busy",
    "Client",
    "CommitMode",
    "Committed",
    "DeadLetter",
    "Deliveries",
    "DeliveryState",
    "Depth",
    "EventHub",
    "Failing",
    "JobQueue",
    "JobShards",
    "Outbox",
    "RateBuckets",
    "Redis",
    "Responded",
    "Store",
    "Submitted",
    "Subscription",
    "Subscriptions",
    "UsageRecord",
    "Watch",
    "connect",
    "new_subscription",
    "reachable",
    "redis_errors",
    "relay_queue",
]
