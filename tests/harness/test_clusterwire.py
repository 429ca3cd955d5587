"""A cluster's command path (harness/store/clusterwire.py): the commands that go with a script
and live on its node ride in its write; one that ran before its script (the slot map was stale,
the script refused with MOVED) is sent again once the script has run, so a message's job never
comes before the message."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from harness.store import clusterwire
from harness.store.clusterwire import ClusterWire, together
from harness.store.wire import Pool
from tests.cluster import ValkeyCluster

pytestmark = pytest.mark.slow

SOURCE = "return redis.call('INCR', KEYS[1])"
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


@pytest.fixture
async def wire(cluster: ValkeyCluster) -> AsyncIterator[tuple[ClusterWire, RedisCluster]]:
    client = RedisCluster.from_url(cluster.url)
    await client.initialize()
    await client.flushall(target_nodes=RedisCluster.PRIMARIES)
    w = ClusterWire(client)
    yield w, client
    await w.close()
    await client.aclose()


def keys_on(client: RedisCluster, same: bool) -> tuple[str, str]:
    """A script's key and a job stream's: on one node, or on two."""
    first = "s:{a}"
    node = client.get_node_from_key(first).name
    for n in range(1000):
        other = f"jobs:{{{n}}}"
        if (client.get_node_from_key(other).name == node) == same:
            return first, other
    raise AssertionError("no such key")


def writes(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Every write the wire makes: its commands' names and keys."""
    seen: list[list[Any]] = []
    call = Pool.call

    async def spy(self: Pool, commands: Any, *args: Any, **kw: Any) -> Any:
        seen.append([tuple(c[:2]) for c in commands])
        return await call(self, commands, *args, **kw)

    monkeypatch.setattr(Pool, "call", spy)
    return seen


async def test_a_job_on_the_script_s_node_rides_in_its_write(
    wire: tuple[ClusterWire, RedisCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, client = wire
    await w.call([("GET", "warm")])  # (the slot map read)
    await client.script_load(SOURCE)  # (on every primary: no NOSCRIPT, which sends all again)
    key, stream = keys_on(client, same=True)
    seen = writes(monkeypatch)
    reply, job = await w.script_with(SHA, SOURCE, [key], [], [("XADD", stream, "*", "s", "x")])
    assert reply == 1 and [e[0] for e in await client.xrange(stream)] == [job]
    assert [len(batch) for batch in seen] == [2]  # one write: the script, its job
    # a job on another node waits for the script's reply, and goes in a write of its own
    key, stream = keys_on(client, same=False)
    seen.clear()
    reply, job = await w.script_with(SHA, SOURCE, [key], [], [("XADD", stream, "*", "s", "x")])
    assert reply == 2 and [len(batch) for batch in seen] == [1, 1]  # (the same key, again)


async def test_a_job_that_ran_before_its_refused_script_is_sent_again_after_it(
    wire: tuple[ClusterWire, RedisCluster],
) -> None:
    w, client = wire
    await w.call([("GET", "warm")])
    await client.script_load(SOURCE)
    key, stream = keys_on(client, same=False)
    # the map says the script's slot is on the job's node: the script is refused there (MOVED)
    # while the job, in the same write, runs there, before the script
    nodes = client.nodes_manager.slots_cache
    nodes[key_slot(key.encode())] = list(nodes[key_slot(stream.encode())])
    reply, job = await w.script_with(SHA, SOURCE, [key], [], [("XADD", stream, "*", "s", "x")])
    assert reply == 1
    entries = await client.xrange(stream)
    assert len(entries) == 2  # the early one (harmless: its runner finds nothing yet) and ...
    assert job == entries[1][0]  # ... the one the caller is given, added once the script ran
    assert int(await client.get(key)) == 1  # the script ran once


def key_on(client: RedisCluster, node: str, prefix: str) -> str:
    """A key whose slot `node` owns."""
    for n in range(10_000):
        key = f"{prefix}:{{{n}}}"
        if client.get_node_from_key(key).name == node:
            return key
    raise AssertionError("no such key")


async def test_a_posted_lazy_write_is_not_waited_for_and_a_read_after_it_finds_it(
    wire: tuple[ClusterWire, RedisCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, client = wire
    await client.script_load(SOURCE)
    key, listed = keys_on(client, same=False)
    await w.call([("GET", key), ("GET", listed)])  # (the slot map read, both nodes' links open)
    seen = writes(monkeypatch)
    reply, *_ = await w.script_with(SHA, SOURCE, [key], [], [], lazy=[("ZADD", listed, "GT", 5, "s1")], post=True)
    assert reply == 1
    assert seen == [[("EVALSHA", SHA)]]  # the script's own call; the lazy write went without one
    # sent on its node's shared link before this read, so the read finds it
    assert await w.call([("ZSCORE", listed, "s1")]) == [b"5"]
    # not posted (a new session's first place in its list), it is waited for: another
    # connection's read right after finds it too
    seen.clear()
    await w.script_with(SHA, SOURCE, [key], [], [], lazy=[("ZADD", listed, "GT", 6, "s2")])
    assert seen == [[("EVALSHA", SHA)], [("ZADD", listed)]]
    assert await client.zscore(listed, "s2") == 6


async def test_a_lazy_write_goes_the_long_way_when_its_node_is_new_or_its_slot_moved(
    wire: tuple[ClusterWire, RedisCluster],
) -> None:
    w, client = wire
    await client.script_load(SOURCE)
    nodes = [n.name for n in client.get_primaries()]
    key, fresh, moved = (key_on(client, node, prefix) for node, prefix in zip(nodes, ("s", "a", "b"), strict=True))
    await w.call([("GET", key)])  # only the script's node has a link yet
    # and the map wrongly says `moved`'s slot is on the script's node: refused there (MOVED)
    cache = client.nodes_manager.slots_cache
    cache[key_slot(moved.encode())] = list(cache[key_slot(key.encode())])
    lazy = [("ZADD", fresh, "GT", 7, "s1"), ("ZADD", moved, "GT", 8, "s1")]
    assert (await w.script_with(SHA, SOURCE, [key], [], [], lazy=lazy, post=True))[0] == 1
    await w.close()  # (waits for the lazy writes still on their way)
    assert await client.zscore(fresh, "s1") == 7
    assert await client.zscore(moved, "s1") == 8


async def test_a_call_after_a_lazy_write_that_went_the_long_way_comes_after_it(
    wire: tuple[ClusterWire, RedisCluster],
) -> None:
    """A session's move in its list, posted to a node this process had no link to yet, goes the
    long way (a task that opens the link); a delete's removal from the list right after must not
    overtake it (the deleted session would be listed again)."""
    w, client = wire
    await client.script_load(SOURCE)
    nodes = [n.name for n in client.get_primaries()]
    key, fresh = (key_on(client, node, prefix) for node, prefix in zip(nodes, ("s", "a"), strict=False))
    await w.call([("GET", key)])  # only the script's node has a link yet
    lazy = [("ZADD", fresh, "GT", 7, "s1")]
    assert (await w.script_with(SHA, SOURCE, [key], [], [], lazy=lazy, post=True))[0] == 1
    assert await w.call([("ZREM", fresh, "s1")]) == [1]  # (it found the move: it came after it)
    assert await client.zscore(fresh, "s1") is None


async def test_a_call_after_a_posted_lazy_write_refused_as_moved_comes_after_it(
    wire: tuple[ClusterWire, RedisCluster],
) -> None:
    """The slot map is stale: the posted move and the removal right after it are both refused
    (MOVED) on the same link; the move goes the long way, and the removal goes again only
    after it."""
    w, client = wire
    await client.script_load(SOURCE)
    nodes = [n.name for n in client.get_primaries()]
    key, moved = key_on(client, nodes[0], "s"), key_on(client, nodes[1], "b")
    await w.call([("GET", key), ("GET", moved)])  # (both links open)
    cache = client.nodes_manager.slots_cache
    cache[key_slot(moved.encode())] = list(cache[key_slot(key.encode())])  # (its slot "on" the script's node)
    lazy = [("ZADD", moved, "GT", 8, "s1")]
    assert (await w.script_with(SHA, SOURCE, [key], [], [], lazy=lazy, post=True))[0] == 1
    assert await w.call([("ZREM", moved, "s1")]) == [1]
    assert await client.zscore(moved, "s1") is None


async def test_a_call_waits_for_its_own_slots_lazy_writes_only_and_not_for_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lazy writes gone the long way are one task a slot: a call for one slot does not wait for
    another slot's (its node failing over, say), and waits for its own at most LAZY_WAIT_S."""
    w = ClusterWire(cast(RedisCluster, None))
    a, b = ("ZADD", "owner:{a}", "GT", 1, "s"), ("ZADD", "owner:{b}", "GT", 1, "s")
    held, sent = asyncio.Event(), []

    class Node:  # (every slot's, as far as the wire can tell)
        async def call(self, commands: list[Any]) -> list[Any]:
            if commands[0] == b:  # (b's node failing over)
                await held.wait()
            sent.append(commands[0])
            return [1] * len(commands)

    w._ready = True
    monkeypatch.setattr(w, "_owner", lambda slot: None)
    monkeypatch.setattr(w, "_pool", lambda node: Node())
    monkeypatch.setattr(clusterwire, "LAZY_WAIT_S", 30.0)
    w._lazy_later([a, b])  # (as `_post_gathered` does when no node owns a slot just now)
    async with asyncio.timeout(5):
        await w.call([("ZSCORE", "owner:{a}", "s")])
    assert sent == [a, ("ZSCORE", "owner:{a}", "s")]  # after a's write, not held by b's
    monkeypatch.setattr(clusterwire, "LAZY_WAIT_S", 0.05)
    async with asyncio.timeout(5):
        await w.call([("ZSCORE", "owner:{b}", "s")])
    assert sent[-1] == ("ZSCORE", "owner:{b}", "s") and b not in sent  # went on, b's write still held
    held.set()
    await w.close()
    assert b in sent


async def test_posted_lazy_writes_are_gathered_into_one_command_a_key_until_a_call_names_it(
    wire: tuple[ClusterWire, RedisCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy process moves its sessions in their owner's list at every message and turn's end:
    posted one by one, each cost a command (and its reply) on the list's node."""
    w, client = wire
    await client.script_load(SOURCE)
    key, listed = keys_on(client, same=True)  # (on the script's node: gathered, not riding)
    await w.call([("GET", key)])  # (the slot map read, the link open)
    monkeypatch.setattr(clusterwire, "POST_WAIT_S", 60.0)  # (gathered until a call or the close)
    posted: list[list[tuple[Any, ...]]] = []
    post = Pool.post

    def spy(self: Pool, commands: Any, done: Any) -> Any:
        posted.append([tuple(c) for c in commands])
        return post(self, commands, done)

    monkeypatch.setattr(Pool, "post", spy)
    for n in (1, 2, 3):
        lazy = [("ZADD", listed, "GT", n, f"s{n % 2}"), ("PEXPIRE", listed, 60_000)]
        assert (await w.script_with(SHA, SOURCE, [key], [], [], lazy=lazy, post=True))[0] == n
    await w.call([("GET", "elsewhere")])  # a call that names none of their keys: still gathered
    assert posted == [] and await client.exists(listed) == 0
    # a read of their key: sent ahead of it, as one ZADD (s1 at 1 then 3, s0 at 2) and one PEXPIRE
    (got,) = await w.call([("ZRANGE", listed, 0, -1, "WITHSCORES")])
    assert got == [b"s0", b"2", b"s1", b"3"]
    assert posted == [[("ZADD", listed, "GT", 1, "s1", 2, "s0", 3, "s1"), ("PEXPIRE", listed, 60_000)]]
    assert 0 < await client.pttl(listed) <= 60_000
    # the close sends what is still gathered
    await w.script_with(SHA, SOURCE, [key], [], [], lazy=[("ZADD", listed, "GT", 9, "s0")], post=True)
    await w.close()
    assert await client.zscore(listed, "s0") == 9


def test_lazy_writes_are_merged_only_where_the_effect_is_the_same() -> None:
    adds = [("ZADD", "k", "GT", 1, "a"), ("PEXPIRE", "k", 5), ("ZADD", "j", "GT", 2, "b"), ("ZADD", "k", "GT", 3, "c")]
    assert together(adds) == [("ZADD", "k", "GT", 1, "a", 3, "c"), ("ZADD", "j", "GT", 2, "b"), ("PEXPIRE", "k", 5)]
    for kept in (
        [("ZADD", "k", "GT", 1, "a"), ("ZREM", "k", "a")],  # (another command)
        [("ZADD", "k", "GT", 1, "a"), ("ZADD", "k", "NX", 2, "a"), ("ZADD", "k", "GT", 3, "a")],  # (two flags)
    ):
        assert together(kept) == kept


async def test_gathered_lazy_writes_go_out_by_themselves_within_moments(
    wire: tuple[ClusterWire, RedisCluster],
) -> None:
    """With no call after them, the gathered writes go when their millisecond is up: another
    process's read of the list finds the session moved."""
    w, client = wire
    await client.script_load(SOURCE)
    key, listed = keys_on(client, same=False)
    await w.call([("GET", key), ("GET", listed)])  # (the slot map read, both nodes' links open)
    await w.script_with(SHA, SOURCE, [key], [], [], lazy=[("ZADD", listed, "GT", 4, "s4")], post=True)
    async with asyncio.timeout(5):
        while await client.zscore(listed, "s4") is None:  # noqa: ASYNC110 (another connection's read: no event to wait on)
            await asyncio.sleep(0.001)
