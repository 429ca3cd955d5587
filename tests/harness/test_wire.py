"""The store's direct command path (harness/store/wire.py): every reply read, in order, and a call cut
short never leaves its connection, with a reply still to come, in the pool."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

from harness.store.wire import Wire, pack


async def test_error_replies_come_back_in_place_and_the_rest_are_read(redis: Redis) -> None:
    await redis.set("text", "1")
    wire = Wire(redis)
    replies = await wire.call([("INCR", "text"), ("LPUSH", "text", "x"), ("GET", "text")])
    assert replies[0] == 2
    assert isinstance(replies[1], ResponseError) and "WRONGTYPE" in str(replies[1])
    assert replies[2] == b"2"
    assert await wire.call([("GET", "text")]) == [b"2"]  # the connection is in step
    await wire.close()


async def blocked_clients(redis: Redis, n: int) -> None:
    """Until Redis counts `n` blocked clients. Redis announces no event for it: its own count
    is polled, within a timeout."""
    async with asyncio.timeout(5):
        while (await redis.info("clients"))["blocked_clients"] != n:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_cut_short_leaves_no_reply_behind_for_the_next(redis: Redis, how: str) -> None:
    await redis.set("text", "1")
    wire = Wire(redis, timeout=0.5 if how == "timed out" else 30)
    blocked = asyncio.create_task(wire.call([("BLPOP", "later", 10)]))
    if how == "cancelled":
        await blocked_clients(redis, 1)  # the call is on the server
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
    else:
        with pytest.raises(RedisTimeout):
            await blocked
    await blocked_clients(redis, 0)  # the cut connection is closed: the server let it go
    await redis.rpush("later", "x")
    # Had the connection gone back to the pool still blocked, the push would have been popped
    # and its reply read by whichever call got that connection next.
    for _ in range(8):
        assert await wire.call([("GET", "text")]) == [b"1"]
    assert await redis.lrange("later", 0, -1) == [b"x"]
    await wire.close()


async def test_a_script_redis_forgot_is_loaded_and_run_once(redis: Redis) -> None:
    source = "return redis.call('INCR', KEYS[1])"
    sha = await redis.script_load(source)
    await redis.script_flush()
    wire = Wire(redis)
    assert await wire.script(sha, source, ["n"], []) == 1
    assert await redis.get("n") == b"1"
    await redis.set("word", "a")
    with pytest.raises(ResponseError):  # an error the script itself raises is raised
        await wire.script(sha, source, ["word"], [])
    await wire.close()


def test_commands_are_packed_as_redis_py_packs_them(redis: Redis) -> None:
    commands = [
        ("EVALSHA", "abc", 2, "keel:{s}:meta", b"\x00\xffraw", "t\u00e9xt", 0, -5, 1.5, b""),
        ("XADD", "keel:{jobs}:stream", "*", "s", "ses_1"),
    ]
    conn = redis.connection_pool.make_connection()
    assert pack(commands) == b"".join(conn.pack_commands(commands))
    with pytest.raises(TypeError):
        pack([("SET", "k", True)])


async def test_the_deadline_follows_a_socket_timeout_in_the_redis_url(valkey: Any) -> None:
    client = Redis.from_url(valkey.url + "?socket_timeout=0.3")
    wire = Wire(client)
    async with asyncio.timeout(4):  # well before the 5 s default
        with pytest.raises(RedisTimeout):
            await wire.call([("BLPOP", "never", 10)])
    await wire.close()
    await client.aclose()
