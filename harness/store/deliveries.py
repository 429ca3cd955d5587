"""The delivery relay's storage: leases, cursors, doubt, jobs and dead letters.

The delivery relay's storage: per session and destination, a lease (one relay delivers a
session's events to a destination at a time, fenced by its token), a cursor (the last event
delivered), the refs whose posts are in doubt (a post made, the cursor not yet moved) and the
handles a destination keeps for later (a message to update); the relay's job stream; dead
letters an operator lists and retries."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from harness.store import protocol_relay as p
from harness.store.client import Client, translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import (
    RELAY_GROUP,
    RELAY_JOBS,
    RELAY_LATER,
    DeliveryKeys,
    RelayKeys,
    SessionKeys,
    dead_letters,
)
from harness.store.protocol import Script
from harness.store.queue import JobQueue
from harness.store.wire import raised
from harness.types import DeadLetter


class DeliveryState(msgspec.Struct):
    """Where one session's deliveries to one destination stand."""

    cursor: str = "0-0"  # the last event delivered (or judged to need nothing)
    seq: int = -1  # its seq (-1: not known)
    doubt: list[str] = []  # refs whose posts may have been made before a crash
    last: str = ""  # the destination's handle of the newest post ("" before the first)
    refs: dict[str, str] = {}  # ref -> handle, kept for later (a message to update)
    metadata: dict[str, Any] = {}  # the session's metadata (where its destination is)
    exists: bool = True  # the session exists
    failing: Failing | None = None  # the destination refuses the next call for now


class Failing(msgspec.Struct):
    """A destination that keeps failing the session's next call: how often, since when, and
    when to try again (epoch seconds)."""

    fails: int
    since: float
    retry_at: float


# the dead letters named (field, value read, new value), each changed only if it still holds the
# value read: deleted (no new value) or replaced
_SWAP = """
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    if ARGV[i + 2] == '' then redis.call('HDEL', KEYS[1], ARGV[i])
    else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2]) end
  end
end
return 1
"""
GONE = "its event has since left the outbox (its retention, or its session ended): nothing to deliver again"


def relay_job(sid: str, destination: str, event_id: str = "") -> tuple[str, ...]:
    """The command that asks a relay to deliver the session's events to `destination` (sent
    with the write it goes with); with `event_id`, to deliver that one event again."""
    what = f"{sid} {destination} {event_id}".rstrip()
    return ("XADD", RELAY_JOBS, "*", "s", what)


def relay_queue(redis: Client, consumer: str | None = None) -> JobQueue:
    return JobQueue(redis, consumer=consumer, stream=RELAY_JOBS, group=RELAY_GROUP)


class Deliveries:
    """Leases and state go by the `wire` (the relay's); dead letters need only `redis` (the
    operator's command line)."""

    def __init__(self, redis: Client, wire: AnyWire | None = None) -> None:
        self.redis = redis
        self.wire = wire

    async def _run(self, script: Script[Any], keys: DeliveryKeys, args: msgspec.Struct) -> Any:
        assert self.wire is not None, "leases and cursors go by the relay's wire"
        raw = await self.wire.script(script.sha, script.source, script.keys(keys), script.args(args))
        return script.reply(raw)

    @translated
    async def take(self, sid: str, destination: str, token: str, ttl_ms: int) -> DeliveryState | int:
        """The lease and the state, or how many ms until the lease held by another relay lapses."""
        args = p.RelayTakeArgs(token, ttl_ms, destination)
        res = await self._run(p.RELAY_TAKE, DeliveryKeys(sid, destination), args)
        if isinstance(res, p.RelayBusy):
            return max(int(res.retry_ms), 1)
        raw = dict(res.state)
        return DeliveryState(
            cursor=raw.get("cursor", "0-0"),
            seq=int(raw.get("seq", -1)),
            doubt=raw.get("doubt", "").split(),
            last=raw.get("last", ""),
            refs={k[2:]: v for k, v in raw.items() if k.startswith("r:")},
            metadata=json.loads(res.metadata) if res.metadata else {},
            exists=bool(res.metadata),
            failing=msgspec.json.decode(raw["failing"], type=Failing) if raw.get("failing") else None,
        )

    @translated
    async def mark(
        self,
        sid: str,
        destination: str,
        token: str,
        ttl_ms: int,
        *,
        cursor: str | None = None,
        seq: int | None = None,
        doubt: list[str] | None = None,
        last: str | None = None,
        keep: Mapping[str, str] | None = None,
        forget: list[str] | None = None,
        check: str | None = None,
        release: bool = False,
        failing: Failing | bool | None = False,
    ) -> bool | None:
        """Write what changed (and renew the lease, or give it up with `release`). False: the
        lease is lost, nothing was written. With `check` (the newest event seen): None if the
        session is not quiet (then nothing was written), True if it is."""
        fields: list[tuple[str, str]] = []
        if cursor is not None:
            fields.append(("cursor", cursor))
        if seq is not None:
            fields.append(("seq", str(seq)))
        if doubt is not None:
            fields.append(("doubt", " ".join(doubt)))
        if last is not None:
            fields.append(("last", last))
        fields.extend(("r:" + ref, handle) for ref, handle in (keep or {}).items())
        unset = ["r:" + ref for ref in forget or []]
        if isinstance(failing, Failing):  # (False: unchanged; None: no longer failing)
            fields.append(("failing", msgspec.json.encode(failing).decode()))
        elif failing is None:
            unset.append("failing")
        args = p.RelayMarkArgs(token, ttl_ms, fields, unset, check=check, release=release)
        res = await self._run(p.RELAY_MARK, DeliveryKeys(sid, destination), args)
        if isinstance(res, p.RelayLost):
            return False
        if check is not None and not res.quiet:
            return None
        return True

    @translated
    async def session_seq(self, sid: str) -> int | None:
        """The seq of the session's newest event (None: no such session)."""
        raw = await self.redis.hget(SessionKeys(sid).meta, "seq")
        return int(raw) if raw is not None else None

    # ---- delayed jobs ------------------------------------------------------------------

    @translated
    async def delay(self, sid: str, destination: str, at: float, event_id: str = "") -> None:
        """A relay job for the session and destination (and the dead letter `event_id`), due
        at `at` (epoch seconds)."""
        await self.redis.zadd(RELAY_LATER, {f"{sid} {destination} {event_id}".rstrip(): int(at * 1000)})

    @translated
    async def promote(self) -> int:
        """Move the delayed jobs that are due to the job stream; how many."""
        assert self.wire is not None
        script = p.RELAY_PROMOTE
        raw = await self.wire.script(
            script.sha, script.source, script.keys(RelayKeys()), script.args(p.PromoteArgs(int(time.time() * 1000)))
        )
        return int(script.reply(raw).n)

    # ---- dead letters: the one place they are made, listed and retried -----------------------

    @translated
    async def bury(
        self,
        sid: str,
        event_id: str,
        destination: str,
        error: str,
        attempts: int,
        *,
        lost: tuple[int, int] = (0, 0),
        gone: bool = False,
    ) -> DeadLetter:
        """Record an event that could not be delivered (idempotent per session and event), or
        with `lost` (how many, from which seq) the events after it that left the outbox unread
        (idempotent per session and first seq). `gone`: a retried event that had left the
        outbox (listed again, with nothing to deliver)."""
        now = round(time.time(), 3)
        letter = DeadLetter(sid, event_id, destination, error[:500], attempts, now, lost[0], lost[1], gone)
        await self._write([("HSET", dead_letters(destination), letter.field, msgspec.json.encode(letter))])
        return letter

    async def _write(self, commands: list[tuple[Any, ...]]) -> None:
        """Dead letters' writes. By the wire, they wait for its replicas, if any: the relay moves
        its cursor past a buried event next (on the session's node, maybe another), and a
        letter a failover took back would leave the event neither delivered nor listed."""
        if self.wire is not None:
            raised(await self.wire.call(commands, durable=True))
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute()

    @translated
    async def dead(self, destination: str, *, session: str | None = None, event: str | None = None) -> list[DeadLetter]:
        """The destination's dead letters, oldest first (of one session, or one event, if given)."""
        return [letter for letter, _ in await self._dead(destination, session, event)]

    async def _dead(self, destination: str, session: str | None, event: str | None) -> list[tuple[DeadLetter, bytes]]:
        raw: Any = await self.redis.hgetall(dead_letters(destination))
        letters = [(msgspec.json.decode(v, type=DeadLetter), v) for v in raw.values()]
        return sorted(
            ((d, v) for d, v in letters if session in (None, d.session_id) and event in (None, d.event_id)),
            key=lambda dv: dv[0].at,
        )

    @translated
    async def retry(self, destination: str, *, session: str | None = None, event: str | None = None) -> int:
        """Ask the relays to deliver the destination's dead letters (those `dead` lists) again:
        each one is reconciled with the destination first, so one that did arrive is not posted
        twice. Returns how many. A loss, or a letter whose event has left the outbox (`gone`),
        has nothing to deliver again: the retry clears it; one whose event has left since it was
        listed is listed again as gone (its error saying so), for the next retry to clear."""
        letters = await self._dead(destination, session, event)
        if not letters:
            return 0
        maybe = [d for d, _ in letters if not (d.lost or d.gone)]
        held = await self._held(maybe)
        again = [d for d, h in zip(maybe, held, strict=True) if h]
        gone = {d.field for d, h in zip(maybe, held, strict=True) if not h}
        # the jobs first: a letter goes only once its job is there (stopped between the two, a
        # letter is listed still and its event delivered once all the same: reconciled first)
        if again:
            await self._write([relay_job(d.session_id, destination, d.event_id) for d in again])
        # each as it was read: one its relay listed again meanwhile (failed again) stays
        changes: list[Any] = []
        for d, v in letters:  # (deleted, or a gone one marked so, its first error kept)
            marked = (
                msgspec.structs.replace(d, gone=True, error=f"{d.error[:300]}; {GONE}") if d.field in gone else None
            )
            changes += [d.field, v, msgspec.json.encode(marked) if marked is not None else b""]
        await self._write([("EVAL", _SWAP, 1, dead_letters(destination), *changes)])
        return len(again)

    async def _held(self, letters: list[DeadLetter]) -> list[bool]:
        """Whether each letter's event is still in its session's outbox."""
        if not letters:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in letters:
                pipe.xrange(SessionKeys(d.session_id).outbox, d.event_id, d.event_id, count=1)
            found = await pipe.execute()
        return [bool(f) for f in found]
