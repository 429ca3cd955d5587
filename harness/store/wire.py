"""Commands on the turn's path, sent without redis-py's per-command machinery.

`Redis.execute_command` and `Pipeline.execute` wrap every call in a retry helper, events for
observability, argument checks and a lookup of the pool's name, and, with a socket timeout (5 s
by default), every write in `asyncio.wait_for` (a task of its own) and every read in a timeout
of its own. Measured here: 20 us of CPU for one command and 60 us for a pipeline of two on top of
the 87 us the round trip itself costs; a turn sends two to four. So the store sends its hot
scripts through a `Wire`: connections of their own with no socket timeout, one deadline for the
whole call, one write, every reply read, the connection back to the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeout
from redis.maint_notifications import MaintNotificationsConfig

from harness.store.link import ClientLink, Link, RespLink, open_resp, pack, speaks
from harness.store.streamids import LUA_NEWER

TIMEOUT_S = 5.0  # a whole call, by default (redis-py's default socket timeout is 5 s per read)


IDLE_MAX = 256  # idle connections kept; more are closed on release


class NotSent(ConnectionError):
    """The connection could not be made: nothing was sent, so the call may be tried again."""


# Commands that may hold their connection (a blocking read, WAIT): such a call gets a link of
# its own; every other call shares one (see `link.RespLink`).
BLOCKING = frozenset({"BLPOP", "BRPOP", "BLMOVE", "BRPOPLPUSH", "BLMPOP", "BZPOPMIN", "BZPOPMAX", "BZMPOP"})
BLOCKING_IF = frozenset({"XREAD", "XREADGROUP"})  # (with BLOCK)
WAITS = frozenset({"WAIT", "WAITAOF"})


def blocks(commands: Sequence[Sequence[Any]]) -> bool:
    for command in commands:
        name = command[0]
        if name in BLOCKING or name in WAITS or (name in BLOCKING_IF and "BLOCK" in command):
            return True
    return False


class Pool:
    """Links to one Redis node, of its own (`link`): made from the client's settings. Calls
    that do not block share one link (their commands pipelined, written together when they
    overlap); a blocking one, or any over a `ClientLink`, takes a link of its own, reused
    last-in first-out; one that showed data or end-of-file while idle (Redis restarted, say) is
    replaced before use. At most `limit` open at once."""

    def __init__(self, make: type[AbstractConnection], kwargs: dict[str, Any], limit: int, timeout: float) -> None:
        self.timeout = timeout
        self._kwargs = {
            **kwargs,
            "socket_timeout": None,
            # as client.connect: "auto" skips the liveness check of a pooled connection
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        self._make = make
        self._resp = speaks(make, kwargs)  # (else redis-py's connection carries the calls)
        self._max = limit
        self._idle: list[Link] = []
        self._in_use = 0
        self._shared: RespLink | None = None
        self._opening: asyncio.Future[RespLink] | None = None  # the shared link being made
        self._closed = False

    async def close(self) -> None:
        """Close the idle links and the shared one; one still in use is closed when its call ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        if self._shared is not None:
            idle.append(self._shared)
            self._shared = None
        for link in idle:
            await link.close()

    async def _open(self) -> Link:
        try:
            if self._resp:
                return await open_resp(self._kwargs)
            conn = self._make(**self._kwargs)
            await conn.connect()  # type: ignore[no-untyped-call]
            return ClientLink(conn)
        except (ConnectionError, RedisTimeout, OSError, TimeoutError) as exc:
            raise NotSent(f"cannot connect to Redis: {exc}") from exc

    async def _acquire(self) -> Link:
        while self._idle:
            link = self._idle.pop()
            if await link.usable():
                return link
            await link.close()
        if self._in_use >= self._max:
            raise ConnectionError(f"too many Redis connections in use ({self._max})")
        return await self._open()

    def _open_link(self) -> RespLink | None:
        """The shared link, if it is open."""
        link = self._shared
        return link if link is not None and link.reusable else None

    async def _shared_link(self) -> RespLink:
        """The link every call that does not block goes on (made once, by the first who needs it)."""
        link = self._open_link()
        if link is not None:
            return link
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open_shared())
        try:
            return await asyncio.shield(self._opening)
        finally:
            if self._opening is not None and self._opening.done():
                self._opening = None

    async def _open_shared(self) -> RespLink:
        link = cast(RespLink, await self._open())  # (a pool that shares speaks RESP itself)
        if self._shared is not None:
            await self._shared.close()
        self._shared = link
        return link

    def post(
        self, commands: Sequence[Sequence[Any]], done: Callable[[asyncio.Future[list[Any]]], None]
    ) -> asyncio.Future[list[Any]] | None:
        """`commands` on the shared link without waiting for their replies (`RespLink.post`:
        `done` gets them; so does the future returned); None, and nothing sent, if that link is
        not open (or the commands would block it): the caller then calls."""
        shared = self._open_link()
        if not self._resp or shared is None or blocks(commands):
            return None
        return shared.post(pack(commands), len(commands), done)

    async def call(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send `commands` in one write and read all their replies, as a pipeline without a
        transaction does. An error reply comes back in its place as the exception, not raised.
        A link that cannot be made raises `NotSent`; anything else that goes wrong (a connection
        error, the deadline) is raised: the commands may have run. A caller cancelled on a link
        of its own drops it (its replies may be unread); on the shared link its replies are read
        and let go."""
        data = pack(commands)
        deadline = asyncio.get_running_loop().time() + self.timeout
        if self._resp and not blocks(commands):
            shared = self._open_link() or await self._shared_link()  # (no coroutine when it is open)
            try:
                return await shared.call(data, len(commands), deadline)
            except TimeoutError:
                raise RedisTimeout(f"no reply from Redis within {self.timeout:g}s") from None
        link = await self._acquire()
        self._in_use += 1
        try:
            return await link.call(data, len(commands), deadline)
        except TimeoutError:
            raise RedisTimeout(f"no reply from Redis within {self.timeout:g}s") from None
        except BaseException:
            await link.close()  # (a link of its own: its replies may be unread)
            raise
        finally:
            self._in_use -= 1
            if link.reusable and len(self._idle) < IDLE_MAX and not self._closed:
                self._idle.append(link)
            else:
                await link.close()


QUIET = ("quiet",)  # a script's ARGV[2]: publish no commit notice (`Replicas` sends it)
REPLICATED = "replicated"  # the meta field: the newest event a replica is known to have

# Run after a script, before its WAIT (KEYS: the session's meta and outbox): the newest event
# of the outbox, if readers may not see it yet. It then writes (the same value), so that the
# WAIT after it covers this very moment, every write before it (anyone's) included: replication
# is in order. Nothing for a session that is gone.
SYNC = (
    LUA_NEWER
    + f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
local known = redis.call('HGET', KEYS[1], '{REPLICATED}') or '0-0'
if not last or not newer(last[1], known) then return false end
redis.call('HSET', KEYS[1], '{REPLICATED}', known)
return last[1]
"""
)
# Run once that WAIT had its replicas (ARGV[1]: the id SYNC answered): readers may now see the
# events up to it, and are told (the commit notice). Never moves back.
MARK = (
    LUA_NEWER
    + f"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if newer(ARGV[1], redis.call('HGET', KEYS[1], '{REPLICATED}') or '0-0') then
  redis.call('HSET', KEYS[1], '{REPLICATED}', ARGV[1])
end
redis.call('SPUBLISH', string.sub(KEYS[2], 1, -7) .. 'live', '@' .. ARGV[1])
return 1
"""
)


class NotReplicated(RedisError):
    """Fewer replicas than asked acknowledged a write in time: it is on the primary only."""


class Replicas:
    """`KEEL_DURABILITY=replica`: every script is followed, in the same write, by `WAIT` for
    `count` replicas (at most `timeout_ms`), so nothing is acknowledged (the reply is read after
    WAIT's) before a replica has it. Nor shown: a session's readers read its outbox up to its
    meta's `replicated` event only, which moves (`MARK`, with the commit notice) once a WAIT
    after the events (`SYNC`) had its replicas. The script itself is told to publish nothing."""

    def __init__(self, count: int = 1, timeout_ms: int = 1000) -> None:
        self.count = count
        self.timeout_ms = timeout_ms

    def wait(self) -> tuple[Any, ...]:
        return ("WAIT", self.count, self.timeout_ms)

    def sync(self, keys: Sequence[Any]) -> list[Sequence[Any]]:
        """The commands after a script that named `keys`: SYNC (if a session's outbox is among
        them), then WAIT. `synced` reads their replies."""
        session = _meta_and_outbox(keys)
        return [("EVAL", SYNC, 2, *session), self.wait()] if session else [self.wait()]

    def marking(self, keys: Sequence[Any], synced: Sequence[Any]) -> tuple[Any, ...] | None:
        """From the replies of `sync`'s commands: the MARK to send next, None if there are no
        events to show. An error reply is raised; NotReplicated if the WAIT fell short."""
        raised(synced)
        self.check(synced[-1])
        newest = synced[0] if len(synced) == 2 else None
        if newest is None:
            return None
        return ("EVAL", MARK, 2, *_meta_and_outbox(keys), newest)

    def check(self, acked: Any) -> None:
        if not isinstance(acked, int) or acked < self.count:
            raise NotReplicated(f"{acked} of {self.count} replicas acknowledged the write within {self.timeout_ms} ms")


def raised(replies: Sequence[Any]) -> Sequence[Any]:
    """`replies`, their first error reply raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _meta_and_outbox(keys: Sequence[Any]) -> tuple[Any, Any] | tuple[()]:
    """A session's meta and outbox keys, from a script's keys that name its outbox."""
    for key in keys:
        text = key.decode() if isinstance(key, bytes) else str(key)
        if text.endswith(":outbox"):
            return (text[: -len("outbox")] + "meta", text)
    return ()


class Wire:
    """The hot path to one Redis server: a `Pool` made from the client's settings."""

    def __init__(
        self, redis: Redis, *, timeout: float | None = None, replicas: Replicas | None = None, origin: str = ""
    ) -> None:
        main = redis.connection_pool
        self.redis = redis
        self.replicas = replicas
        # every script's ARGV[2:]: who writes, and the store's windows (`Store`; see `lua._EMIT`)
        self.argv: tuple[str, ...] = (origin,) if origin else ()
        # a whole call's deadline: the one given, else a socket_timeout from the Redis URL
        self.timeout = timeout or main.connection_kwargs.get("socket_timeout") or TIMEOUT_S
        self.pool = Pool(main.connection_class, main.connection_kwargs, main.max_connections, self.timeout)

    async def close(self) -> None:
        await self.pool.close()

    async def call(self, commands: Sequence[Sequence[Any]], *, durable: bool = False) -> list[Any]:
        """`Pool.call` on the server's pool. `durable`: the commands then wait for the replicas
        (`Replicas`), if the wire has any: NotReplicated if they did not answer in time."""
        if not (durable and self.replicas):
            return await self.pool.call(commands)
        got = await self.pool.call([*commands, self.replicas.wait()])
        self.replicas.check(got[-1])
        return got[:-1]

    async def script(self, sha: str, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """EVALSHA, its reply (see `script_with`)."""
        return (await self.script_with(sha, source, keys, args, ()))[0]

    async def read(self, sha: str, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """A script that writes nothing: its reply, not waited for by replicas (a read)."""
        evalsha = ("EVALSHA", sha, len(keys), *keys, *args, *self.argv)
        return (await run_script(self.pool, sha, source, [evalsha]))[0]

    async def script_with(
        self,
        sha: str,
        source: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        also: Sequence[Sequence[Any]],
        *,
        lazy: Sequence[Sequence[Any]] = (),
        post: bool = False,
    ) -> list[Any]:
        """EVALSHA and the commands `also` in one write; every reply (of the script and `also`).
        A Redis that does not know the script (restarted, or SCRIPT FLUSH) did not run it: load
        it and send all again (what `also` did the first time is done twice: keel's `also` is a
        job, harmless twice). Error replies are raised. `lazy`: commands whose loss is repaired
        later (an owner's list of sessions): here in the same write; on a cluster, after the
        script, and with `post` not waited for (`ClusterWire.script_with`)."""
        commands = [*also, *lazy]
        if self.replicas is None:
            evalsha = ("EVALSHA", sha, len(keys), *keys, *args, *self.argv)
            replies = await run_script(self.pool, sha, source, [evalsha, *commands])
            return replies[: len(replies) - len(lazy)]
        evalsha = ("EVALSHA", sha, len(keys), *keys, *args, *QUIET, *self.argv[1:])
        sync = self.replicas.sync(keys)
        replies = await run_script(self.pool, sha, source, [evalsha, *commands, *sync])
        n = len(replies) - len(sync)
        await self._mark(self.replicas, keys, replies[n:])
        return replies[: n - len(lazy)]

    async def settle(self, keys: Sequence[Any]) -> None:
        """With replicas: show readers the session's events that a replica has (its `keys`: a
        script's), were a mark lost (a failover just after it). NotReplicated if none has them."""
        if self.replicas is not None:
            sync = self.replicas.sync(keys)
            await self._mark(self.replicas, keys, await self.pool.call(sync))

    async def _mark(self, replicas: Replicas, keys: Sequence[Any], synced: Sequence[Any]) -> None:
        mark = replicas.marking(keys, synced)
        if mark is not None:
            raised(await self.pool.call([mark]))


async def run_script(pool: Pool, sha: str, source: str, commands: list[Sequence[Any]]) -> list[Any]:
    """`commands` (an EVALSHA first) on `pool`; the script loaded there and all sent again if
    the node did not know it. Error replies are raised."""
    for attempt in range(2):
        replies = await pool.call(commands)
        if isinstance(replies[0], NoScriptError) and attempt == 0:
            await pool.call([("SCRIPT", "LOAD", source)])
            continue
        return list(raised(replies))
    raise AssertionError("unreachable")
