"""Commands on the turn's path, sent without redis-py's per-command machinery.

`Redis.execute_command` and `Pipeline.execute` wrap every call in a retry helper, events for
observability, argument checks and a lookup of the pool's name; measured here, that is about 20
µs of CPU for one command and 60 µs for a pipeline of two, against 87 µs for the round trip
itself. A turn sends two or three such round trips, so the store sends its hot scripts here:
one write, every reply read, the connection back to the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError


async def call(redis: Redis, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send `commands` in one write on a pooled connection and read all their replies, as a
    pipeline without a transaction does. An error reply comes back in its place as the
    exception, not raised. Anything else that goes wrong (a connection error, a cancellation)
    drops the connection, whose replies may be unread, and is raised."""
    pool = redis.connection_pool
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    finally:
        await pool.release(conn)


async def script(redis: Redis, sha: str, source: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """EVALSHA; a Redis that does not know the script (restarted, or SCRIPT FLUSH) did not run
    it: load it and run it once more. Error replies are raised."""
    for attempt in range(2):
        (reply,) = await call(redis, [("EVALSHA", sha, len(keys), *keys, *args)])
        if isinstance(reply, NoScriptError) and attempt == 0:
            await redis.script_load(source)
            continue
        if isinstance(reply, Exception):
            raise reply
        return reply
    raise AssertionError("unreachable")
