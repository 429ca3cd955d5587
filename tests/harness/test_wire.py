"""The store's direct command path (harness/store/wire.py and its links, link.py): every reply
read, in order; a call cut short never leaves its connection, with a reply still to come, in the
pool; a URL's password and db are spoken on TCP and on a Unix socket; a link Redis closed while
it was idle is not used again."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import ANY

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

from harness.store.link import open_resp
from harness.store.wire import NotSent, Wire, pack


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


@pytest.fixture
def guarded() -> Any:
    """A Valkey of its own that asks for a password, on a port and on a Unix socket."""
    from tests.conftest import ValkeyServer

    server = ValkeyServer()
    server.extra = ("--requirepass", "s3cret", "--unixsocket", f"{server.dir}/vk.sock", "--unixsocketperm", "700")
    server.start()
    yield server
    server.remove()


@pytest.mark.parametrize("where", ["tcp", "unix"])
async def test_a_url_s_password_and_db_are_what_the_wire_speaks_with(guarded: Any, where: str) -> None:
    url = f"redis://:s3cret@127.0.0.1:{guarded.port}/3"
    if where == "unix":
        url = f"unix://:s3cret@{guarded.dir}/vk.sock?db=3"
    client = Redis.from_url(url)
    wire = Wire(client)
    assert wire.pool._resp  # (its own links, not redis-py's connections)
    assert await wire.call([("SET", "where", where), ("CLIENT", "INFO")]) == [b"OK", ANY]
    assert await client.get("where") == where.encode()  # in db 3, where the client looks
    other = Redis.from_url(url.replace("/3", "/0").replace("db=3", "db=0"))
    assert await other.get("where") is None  # (not in db 0)
    await other.aclose()
    await wire.close()
    await client.aclose()


async def test_a_wrong_password_is_a_connection_refused_with_redis_s_reason(guarded: Any) -> None:
    client = Redis.from_url(f"redis://:wrong@127.0.0.1:{guarded.port}")
    wire = Wire(client)
    with pytest.raises(NotSent, match=r"WRONGPASS|invalid"):
        await wire.call([("PING",)])
    await wire.close()
    await client.aclose()


async def test_a_link_whose_connection_went_while_idle_is_not_used_again(redis: Redis) -> None:
    wire = Wire(redis)
    assert await wire.call([("CLIENT", "SETNAME", "keel-wire"), ("PING",)]) == [b"OK", b"PONG"]
    (mine,) = [c["id"] for c in await redis.client_list() if c["name"] == "keel-wire"]
    assert await redis.client_kill_filter(_id=mine) == 1  # (the wire's link, idle now)
    async with asyncio.timeout(5):  # (its end-of-file comes to the idle link soon)
        while wire.pool._shared is not None and wire.pool._shared.reusable:  # noqa: ASYNC110 (no event for it)
            await asyncio.sleep(0.01)
    assert await wire.call([("PING",)]) == [b"PONG"]  # on a new link
    await wire.close()


class TracedConnection(Connection):
    """A connection class of the caller's (as a TLS URL or a credential provider makes)."""


async def test_a_connection_the_link_does_not_speak_goes_through_redis_py(valkey: Any) -> None:
    client = Redis.from_url(valkey.url, connection_class=TracedConnection)
    wire = Wire(client)
    assert not wire.pool._resp
    replies = await wire.call([("SET", "t", "1"), ("LPUSH", "t", "x"), ("INCR", "t")])
    assert replies[0] == b"OK" and isinstance(replies[1], ResponseError) and replies[2] == 2
    assert await wire.call([("GET", "t")]) == [b"2"]  # the same connection, in step
    await wire.close()
    await client.aclose()


async def test_overlapping_calls_share_one_link_and_each_gets_its_own_replies(redis: Redis) -> None:
    wire = Wire(redis)
    await wire.call([("PING",)])
    reads_before = int((await redis.info("stats"))["total_reads_processed"])
    calls = [[("SET", f"k{n}", n), ("INCRBY", f"k{n}", n), ("LPUSH", f"k{n}", "x")] for n in range(200)]
    replies = await asyncio.gather(*(wire.call(c) for c in calls))
    for n, (ok, total, wrong) in enumerate(replies):
        assert ok == b"OK" and total == 2 * n and isinstance(wrong, ResponseError)
    # one connection, the calls written together: far fewer reads for Redis than calls
    reads = int((await redis.info("stats"))["total_reads_processed"]) - reads_before
    assert reads < 50, reads
    assert wire.pool._idle == [] and wire.pool._shared is not None
    await wire.close()


async def test_a_caller_gone_from_the_shared_link_leaves_the_next_its_own_replies(redis: Redis) -> None:
    wire = Wire(redis)
    slow = "local n = 0 for i = 1, 3000000 do n = n + 1 end return n"
    gone = asyncio.create_task(wire.call([("EVAL", slow, 0)]))
    await asyncio.sleep(0)  # (its commands written)
    after = asyncio.create_task(wire.call([("ECHO", "mine")]))
    gone.cancel()
    assert await after == [b"mine"]  # (not the slow script's 3000000)
    assert await wire.call([("ECHO", "next")]) == [b"next"]
    await wire.close()


async def test_a_blocking_call_takes_a_link_of_its_own(redis: Redis) -> None:
    wire = Wire(redis)
    blocked = asyncio.create_task(wire.call([("BLPOP", "later", 10)]))
    await blocked_clients(redis, 1)
    async with asyncio.timeout(2):  # (on the shared link, not behind the BLPOP)
        assert await wire.call([("ECHO", "free")]) == [b"free"]
    await redis.rpush("later", "v")
    assert await blocked == [[b"later", b"v"]]
    await wire.close()


async def test_each_call_on_a_link_fails_at_its_own_deadline(redis: Redis) -> None:
    kwargs = redis.connection_pool.connection_kwargs
    loop = asyncio.get_running_loop()
    link = await open_resp({"host": kwargs["host"], "port": kwargs["port"]})
    # a call that ended before its deadline leaves the link's timer set for it: a later call
    # with a later deadline is still held to its own, not failed early
    assert await link.call(pack([("PING",)]), 1, loop.time() + 0.1) == [b"PONG"]
    begun = loop.time()
    with pytest.raises(TimeoutError):
        await link.call(pack([("BLPOP", "never", 10)]), 1, begun + 0.4)
    assert 0.4 <= loop.time() - begun < 5  # (at its deadline: neither the earlier one's nor BLPOP's 10 s)
    assert not link.reusable
    # and a call with an earlier deadline than one in flight fails at its own, failing the rest
    link = await open_resp({"host": kwargs["host"], "port": kwargs["port"]})
    blocked = asyncio.create_task(link.call(pack([("BLPOP", "never", 10)]), 1, loop.time() + 30))
    await blocked_clients(redis, 1)
    begun = loop.time()
    with pytest.raises(TimeoutError):
        await link.call(pack([("PING",)]), 1, begun + 0.3)  # (behind the BLPOP: no reply in time)
    assert 0.3 <= loop.time() - begun < 5
    with pytest.raises(RedisConnectionError):  # (the link broke under it)
        await blocked
    await link.close()


async def test_posted_commands_go_out_alone_soon_or_with_the_next_call(redis: Redis) -> None:
    kwargs = redis.connection_pool.connection_kwargs
    link = await open_resp({"host": kwargs["host"], "port": kwargs["port"]})
    replies: asyncio.Queue[list[Any]] = asyncio.Queue()
    link.post(pack([("SET", "posted", "1")]), 1, lambda f: replies.put_nowait(f.result()))
    assert await asyncio.wait_for(replies.get(), 2) == [b"OK"]  # (alone: nothing else came to go with)
    link.post(pack([("INCR", "posted")]), 1, lambda f: replies.put_nowait(f.result()))
    loop = asyncio.get_running_loop()
    assert await link.call(pack([("GET", "posted")]), 1, loop.time() + 2) == [b"2"]  # (it went first)
    assert replies.get_nowait() == [2]
    await link.close()
