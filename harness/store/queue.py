"""The job streams: jobs, their ids, their acknowledgements.

The job streams. A turn job says only "session X has work": the session inbox is the truth,
so a duplicate job is harmless and a job is acknowledged once its session's inbox was drained
(or handed to a live lease holder). Jobs are `JobId`s, ordered as the stream orders them (a
session's jobs are all on one stream, so its jobs compare), each acknowledged on the stream it
came from; acknowledgements are batched here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from harness.store.client import Client, translated
from harness.store.clusterwire import AnyWire
from harness.store.keys import JOBS, JOBS_GROUP, job_shard, job_streams
from harness.store.streamids import StreamId
from harness.store.wire import raised
from harness.types import Depth

log = logging.getLogger("keel.runner")
CLUSTER_SHARDS = 8  # job streams on a cluster by default: spread over up to 8 primaries
ACK_BATCH = 256  # acknowledge at once when this many jobs wait ...
ACK_DELAY_S = 0.05  # ... else after this long, together


class JobId(NamedTuple):
    """A job: its place in its stream, ordered as Redis orders them (a session's jobs compare),
    and which of the job streams holds it (`JobShards`: where it is acknowledged, whatever the
    session's shard is now; a job written before an upgrade moved it, say). str() is its id."""

    ms: int
    seq: int
    shard: int = 0

    @classmethod
    def parse(cls, text: str, shard: int = 0) -> JobId:
        return cls(*StreamId.parse(text), shard)

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"

    def seen_by(self, mark: JobId) -> bool:
        """Whether this job was added no later than `mark` (a drain that began after `mark` was
        added sees its work). Known only for jobs of one stream: ids of two streams (a session's
        jobs around an upgrade that moved its shard) do not order their writes, so a job of
        another stream is never taken as seen."""
        return self.shard == mark.shard and self <= mark


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class JobQueue:
    """A job stream read by a consumer group: the turn jobs by default; the delivery relay's
    jobs ("session X has events for destination D") are a second one."""

    def __init__(
        self,
        redis: Client,
        *,
        consumer: str | None = None,
        stream: str = JOBS,
        group: str = JOBS_GROUP,
        wire: AnyWire | None = None,
        shard: int = 0,
    ) -> None:
        self.redis = redis
        self.wire = wire  # (if given, reads and acknowledgements go this way: see `wire`)
        self.consumer = consumer or consumer_name()
        self.stream = stream
        self.shard = shard  # (its place among `JobShards`: its jobs say so)
        self.group = group
        self._claim_from = "0-0"

    @translated
    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @translated
    async def take(self, count: int, block_ms: int) -> list[tuple[JobId, str]]:
        """New jobs for this consumer: (job id, what the job says: a session id for a turn
        job). A stream or group that is gone (Redis restarted without persistence, or flushed)
        is made again, from its start."""
        try:
            if self.wire is not None:
                block_ms = min(block_ms, int(self.wire.timeout * 500))  # (well within a call's deadline)
                read = ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block_ms)
                (res,) = raised(await self.wire.call([(*read, "STREAMS", self.stream, ">")]))
                # (as RESP has it: [[stream, [[id, [field, value, ...]], ...]]], or nil)
                jobs = [(jid, kv) for _, entries in res or () for jid, kv in entries]
                return [(JobId.parse(jid.decode(), self.shard), _field(kv, b"s")) for jid, kv in jobs]
            got: Any = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if not _stream_gone(exc):
                raise
            await self.ensure_group()
            return []
        found = [(jid, fields) for _, entries in got for jid, fields in entries]
        return [(JobId.parse(jid.decode(), self.shard), fields[b"s"].decode()) for jid, fields in found]

    @translated
    async def reclaim(self, min_idle_ms: int, count: int = 100) -> list[tuple[JobId, str]]:
        """Jobs another consumer took and has not finished for `min_idle_ms` (it may be dead)."""
        try:
            claimed: Any = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_ms, start_id=self._claim_from, count=count
            )
        except ResponseError as exc:
            if not _stream_gone(exc):
                raise
            await self.ensure_group()
            self._claim_from = "0-0"
            return []
        self._claim_from = claimed[0].decode()  # next call goes on from here ("0-0": round again)
        entries = claimed[1]
        return [(JobId.parse(jid.decode(), self.shard), fields[b"s"].decode()) for jid, fields in entries if fields]

    @translated
    async def depth(self) -> Depth:
        """Read at scrape time (a job is deleted when done, so the stream holds the rest)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(self.stream)
            pipe.xrange(self.stream, count=1)
            length, first = await pipe.execute()
        if not first:
            return Depth(int(length), 0.0)
        ms = StreamId.parse(first[0][0].decode()).ms
        return Depth(int(length), max(0.0, time.time() - ms / 1000))

    @translated
    async def done(self, *job_ids: JobId | str) -> None:
        ids = [str(j) for j in job_ids]
        if self.wire is not None:
            raised(await self.wire.call([("XACK", self.stream, self.group, *ids), ("XDEL", self.stream, *ids)]))
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream, self.group, *ids)
            pipe.xdel(self.stream, *ids)
            await pipe.execute()


class JobShards:
    """The turn job streams (`KEEL_JOB_SHARDS`): each session's jobs always on one of them, so
    no one Redis node carries every job; a runner reads them all, each with a `JobQueue`.
    `shards` 0: one stream on one server, `CLUSTER_SHARDS` on a cluster. Every process of a
    deployment must read the same shards."""

    def __init__(
        self, redis: Client, shards: int = 0, *, consumer: str | None = None, wire: AnyWire | None = None
    ) -> None:
        if shards <= 0:
            shards = CLUSTER_SHARDS if isinstance(redis, RedisCluster) else 1
        self.queues = [
            JobQueue(redis, consumer=consumer, stream=s, wire=wire, shard=n) for n, s in enumerate(job_streams(shards))
        ]
        self._acks: list[JobId] = []  # done soon, together
        self._acking: asyncio.Task[None] | None = None

    def of(self, sid: str) -> JobQueue:
        return self.queues[job_shard(sid, len(self.queues))]

    def job(self, sid: str) -> tuple[str, ...]:
        """The command that adds the job for `sid` (sent with the write it goes with); `added`
        reads its reply."""
        return ("XADD", self.of(sid).stream, "*", "s", sid)

    def added(self, sid: str, reply: bytes) -> JobId:
        """The job `job(sid)` added, from its reply."""
        return JobId.parse(reply.decode(), self.of(sid).shard)

    async def ensure_groups(self) -> None:
        for queue in self.queues:
            await queue.ensure_group()

    async def done(self, jobs: Sequence[JobId]) -> None:
        """Acknowledge (and delete) these jobs now, each on its stream."""
        for shard, of_shard in sorted(_by_shard(jobs).items()):
            await self.queues[shard].done(*of_shard)

    def ack(self, job: JobId) -> None:
        """Acknowledge the job soon, with others (lost in a crash, it is reclaimed and finds
        nothing to do)."""
        self._acks.append(job)
        if self._acking is None:
            self._acking = asyncio.create_task(self._flush_acks())

    async def _flush_acks(self) -> None:
        try:
            if len(self._acks) < ACK_BATCH:
                await asyncio.sleep(ACK_DELAY_S)
            while self._acks:
                batch, self._acks = self._acks, []
                await self.done(batch)
        except Exception as exc:
            log.warning("runner: acknowledging jobs failed (%s); they will be reclaimed", exc)
        finally:
            self._acking = None

    async def flush(self) -> None:
        """Wait for the acknowledgements in flight (a runner that stops)."""
        if self._acking is not None:
            with contextlib.suppress(Exception):
                await self._acking

    async def depth(self) -> Depth:
        """Jobs not done on every shard; the oldest's age over them all."""
        depths = await asyncio.gather(*(q.depth() for q in self.queues))  # (on a cluster: at once, node by node)
        return Depth(sum(d.jobs for d in depths), max(d.oldest_s for d in depths))


def _by_shard(jobs: Sequence[JobId]) -> dict[int, list[JobId]]:
    by: dict[int, list[JobId]] = {}
    for job in jobs:
        by.setdefault(job.shard, []).append(job)
    return by


def _field(flat: list[bytes], name: bytes) -> str:
    """A stream entry's field, from its flat [field, value, ...] list."""
    for at in range(0, len(flat) - 1, 2):
        if flat[at] == name:
            return flat[at + 1].decode()
    raise KeyError(name)


def _stream_gone(exc: ResponseError) -> bool:
    """The reply Redis gives a read of a job stream or group that no longer exists (NOGROUP), or
    a blocked read whose stream was deleted under it (UNBLOCKED)."""
    return str(exc).startswith(("NOGROUP", "UNBLOCKED"))
