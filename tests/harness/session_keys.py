"""What the tests of a session's end look at: its keys, and when they expire."""

from __future__ import annotations

from redis.asyncio import Redis


async def keys_of(redis: Redis, sid: str) -> set[str]:
    """Every key of the session (its hash tag), as Redis has it now."""
    return {k.decode() async for k in redis.scan_iter(match=f"keel:{{{sid}}}:*", count=1000)}


async def deadlines(redis: Redis, sid: str) -> dict[str, int]:
    """Each key of the session (but the lease and the readers, which have deadlines of their
    own) and when it expires (ms since the epoch; -1: never), read at one moment (a transaction)."""
    keys = sorted(k for k in await keys_of(redis, sid) if not k.endswith((":lease", ":readers")))
    async with redis.pipeline(transaction=True) as pipe:
        for k in keys:
            pipe.pexpiretime(k)
        return {k: int(at) for k, at in zip(keys, await pipe.execute(), strict=True) if at != -2}
