"""Every Redis key keel uses.

Every Redis key keel uses. All keys of one session share the hash tag `{<session_id>}`, so an
atomic operation on a session touches one cluster slot."""

from __future__ import annotations

from functools import cache, lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

PREFIX = "keel"
JOBS = f"{PREFIX}:{{jobs}}:stream"  # turn jobs: "session <id> has work"; consumer group below
JOBS_GROUP = "runners"
TOKEN_SECRET = f"{PREFIX}:{{config}}:token-secret"  # string: made once, shared by every process
CANCELS = f"{PREFIX}:{{control}}:cancels"  # pub/sub channel: "<session> <turn>" a cancel was asked for
RELAY_JOBS = f"{PREFIX}:{{relay}}:stream"  # relay jobs: "<session> <destination> [<event id>]"
RELAY_GROUP = "relays"
RELAY_LATER = f"{PREFIX}:{{relay}}:later"  # sorted set: "<session> <destination>" by when to try again (ms)


@cache
def job_streams(shards: int) -> tuple[str, ...]:
    """The turn job streams: `JOBS` alone, or `shards` streams, each in its own slot and the
    slots spread evenly over the slot range (shard n's hash tag is the first `jobs:<n>.<k>` whose
    slot lies in the n-th of `shards` equal parts), so that on a cluster whose primaries hold
    even ranges of slots the shards spread over them."""
    if shards <= 1:
        return (JOBS,)
    streams = []
    for n in range(shards):
        low, high = n * REDIS_CLUSTER_HASH_SLOTS // shards, (n + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        k = 0
        while not low <= key_slot(f"jobs:{n}.{k}".encode()) < high:
            k += 1
        streams.append(f"{PREFIX}:{{jobs:{n}.{k}}}:stream")
    return tuple(streams)


@lru_cache(maxsize=50_000)  # (a slot's CRC16 twice a turn, for the sessions used lately)
def job_shard(sid: str, shards: int) -> int:
    """The shard of a session's jobs: always the same one, so that its jobs' ids compare; the one
    whose part of the slot range (`job_streams`) holds the session's slot, so that on a cluster
    whose primaries hold even ranges of slots the job stream lives on the session's node (but
    where a node's range ends inside a part) and a message's job rides in its SUBMIT's write.
    (0.1.0 took the session id's CRC32 modulo `shards`; a job is acknowledged on the stream it
    came from, so jobs written by either rule are run and acknowledged alike.)"""
    if shards <= 1:
        return 0
    slot = key_slot(f"{{{sid}}}".encode())  # (its keys' hash tag)
    return ((slot + 1) * shards - 1) // REDIS_CLUSTER_HASH_SLOTS  # (the n with n * H // shards <= slot)


class RelayKeys:
    """The relay's own keys (one slot, `{relay}`), for its scripts."""

    __slots__ = ("jobs", "later")

    def __init__(self) -> None:
        self.jobs = RELAY_JOBS
        self.later = RELAY_LATER


def dead_letters(destination: str) -> str:
    """Hash: "<session> <event id>" -> what could not be delivered to `destination`, and why."""
    return f"{PREFIX}:{{relay}}:dead:{destination}"


class SessionKeys:
    """The keys of one session, built once per use."""

    __slots__ = (
        "decisions",
        "history",
        "inbox",
        "lease",
        "live",
        "meta",
        "mids",
        "noted",
        "outbox",
        "pending",
        "readers",
        "relays",
        "sid",
        "steer",
        "sticky",
    )

    def __init__(self, sid: str) -> None:
        base = f"{PREFIX}:{{{sid}}}:"
        self.sid = sid
        self.meta = base + "meta"  # hash: status, version, seq, fence, usage, turn state
        self.history = base + "history"  # list of encoded Items (durable, append-only)
        self.sticky = base + "sticky"  # hash: context key -> text (keyed page context)
        self.inbox = base + "inbox"  # list of encoded InboxMessages, oldest first
        self.steer = base + "steer"  # list of encoded InboxMessages steered into the running turn
        self.mids = base + "mids"  # hash: message_id -> "turn_id received_id" (idempotency)
        self.noted = base + "noted"  # hash, its fields expiring: refused messages a channel told of
        self.outbox = base + "outbox"  # stream of events
        self.lease = base + "lease"  # string: fencing token of the runner that owns the session
        self.pending = base + "pending"  # hash: request_id -> the approval request (never rewritten)
        self.decisions = base + "decisions"  # hash: request_id -> the answer to it
        self.relays = base + "relays"  # set: the destinations whose delivery keys (below) it has
        self.live = base + "live"  # pub/sub channel: transient events (message.delta), never stored
        # hash: process origin -> until when (ms, server time) it has readers of the session, so
        # a commit's script tells of it (on `live`) only if another process listens
        self.readers = base + "readers"


def session_of(key: str) -> str:
    """The session id inside one of its keys (the hash tag)."""
    return key.split("{", 1)[1].rsplit("}", 1)[0]


class OwnerKeys:
    """One owner's list of sessions (its own hash tag: another slot than its sessions')."""

    __slots__ = ("sessions",)

    def __init__(self, owner: str) -> None:
        self.sessions = f"{PREFIX}:{{owner:{owner}}}:sessions"  # sorted set: session id by latest activity (ms)


class QuotaKeys:
    """One API key's rate-limit bucket (its own hash tag: owners spread over a cluster)."""

    __slots__ = ("bucket",)

    def __init__(self, owner: str) -> None:
        self.bucket = f"{PREFIX}:{{quota:{owner}}}:bucket"  # hash: tokens, at (ms, server time)


class DeliveryKeys:
    """The keys of one session's deliveries to one destination (same hash tag as the session)."""

    __slots__ = ("inbox", "lease", "meta", "outbox", "relays", "state")

    def __init__(self, sid: str, destination: str) -> None:
        base = f"{PREFIX}:{{{sid}}}:"
        self.meta = base + "meta"
        self.inbox = base + "inbox"
        self.outbox = base + "outbox"
        self.relays = base + "relays"
        # hash: cursor (last event delivered), doubt (refs whose posts may have been made),
        # last (the destination's handle of the newest post), r:<ref> (handles kept for later)
        self.state = base + "relay:" + destination
        self.lease = base + "relay:" + destination + ":lease"  # string: the relay that delivers now
