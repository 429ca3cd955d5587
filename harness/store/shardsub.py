"""Sharded pub/sub subscriptions (SSUBSCRIBE), one connection per node.

Sharded pub/sub subscriptions (SSUBSCRIBE): each channel on the node that owns its slot, a
connection and a listener per node. On one server that is one connection; on a Redis Cluster a
session's channel lives with its keys, so a commit's notice and its readers meet on one node.

A subscription is in place once Redis confirmed it (`subscribe` waits for that; `add` does not).
Each confirmation, the first or one after a gap (the connection was lost and made again, or the
slot moved to another node and it followed), is passed on (`resubscribed`): messages sent before
it were not heard, and the caller reads what it may have missed. Redis tells subscribers when a channel's slot leaves
a node (an SUNSUBSCRIBE it did not ask for); a node that cannot be reached makes the slot map be
read again; either way the channel is subscribed on its owner now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

from harness.aio import cancel_and_wait
from harness.store.client import Client
from harness.telemetry.metrics import count_redis_error

log = logging.getLogger("keel.live")
RETRY_S = 1.0  # a node's listener that failed waits this long before it subscribes again
CONFIRM_S = 1.0  # `subscribe` waits at most this long for Redis to confirm
IDLE_S = 1.0  # a listener looks for channels to leave at least this often
LINGER_S = 10.0  # a channel no reader wants is left this long after (a session's next turn soon
# needs it again: no SSUBSCRIBE and no wait for its confirmation on every `?wait=true`)


class _Node:
    """One node's subscriber connection and its listener."""

    def __init__(self, name: str, pubsub: PubSub) -> None:
        self.name = name
        self.pubsub = pubsub
        self.channels: set[str] = set()
        self.leaving: set[str] = set()  # channels we unsubscribe from (their SUNSUBSCRIBE is ours)
        self.sent = asyncio.Event()  # set when a subscription was sent: there is something to read
        # one (un)subscribe at a time: redis-py's PubSub makes its connection on the first, and
        # two first ones at once would make two (the messages of one of them never read)
        self.lock = asyncio.Lock()
        self.listener: asyncio.Task[None] | None = None


class ShardSubscriber:
    def __init__(
        self,
        client: Client,
        on_message: Callable[[str, bytes], None],
        resubscribed: Callable[[str], None],
        wanted: Callable[[str], bool],
        *,
        left: Callable[[str], None] = lambda channel: None,
    ) -> None:
        self._client = client
        self._left = left  # a channel left (no reader wanted it for LINGER_S)
        self._on_message = on_message
        self._resubscribed = resubscribed  # a channel confirmed again: messages may have been missed
        self._wanted = wanted  # whether a channel dropped meanwhile is still wanted (then kept)
        self._nodes: dict[str, _Node] = {}
        self._where: dict[str, str] = {}  # channel -> the node it is subscribed on
        self._confirmed: set[str] = set()
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._dropped: dict[str, float] = {}  # channel -> when its last reader went
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    async def stop(self) -> None:
        self._stopped = True
        await cancel_and_wait([t for n in self._nodes.values() if (t := n.listener) is not None] + list(self._tasks))
        for node in self._nodes.values():
            with contextlib.suppress(Exception):
                await node.pubsub.aclose()
        self._nodes.clear()

    async def subscribe(self, channels: list[str]) -> None:
        """Subscribe where each channel lives, and wait (CONFIRM_S at most) for Redis to confirm.
        While Redis is away, subscribing goes on in the background until it is back."""
        waits = self.add(channels)
        if waits:  # (asyncio.wait: wait_for on 3.11 can swallow a cancellation of the reader)
            _, late = await asyncio.wait(waits, timeout=CONFIRM_S)
            if late:
                log.warning("live events: %d subscriptions not confirmed within %ss", len(late), CONFIRM_S)

    def add(self, channels: list[str]) -> list[asyncio.Future[None]]:
        """Start subscribing (where not subscribed yet); what confirms each."""
        loop = asyncio.get_running_loop()
        waits = []
        for channel in channels:
            self._dropped.pop(channel, None)
            if channel in self._confirmed:
                continue
            fut = self._waiting.get(channel)
            if fut is None:
                fut = self._waiting[channel] = loop.create_future()
                self._spawn(self._send(channel))
            waits.append(fut)
        return waits

    def drop(self, channel: str) -> None:
        """Leave `channel` after LINGER_S (its node's listener does, if it is still not `wanted`
        then): no Redis call here, in a reader's clean-up that may be cancelled."""
        self._dropped[channel] = asyncio.get_running_loop().time()

    async def _send(self, channel: str) -> None:
        """SSUBSCRIBE on the channel's owner; tried again every RETRY_S while it fails and the
        channel is wanted. (The confirmation comes to the node's listener.)"""
        while not self._stopped:
            try:
                node = await self._node_for(channel)
                node.channels.add(channel)  # (if being left too, its SUNSUBSCRIBE's reply comes first)
                self._where[channel] = node.name
                async with node.lock:
                    await node.pubsub.ssubscribe(channel)
                node.sent.set()
                return
            except Exception as exc:
                count_redis_error()
                log.warning("live events: subscribing failed: %s; again in %ss", type(exc).__name__, RETRY_S)
                await asyncio.sleep(RETRY_S)
                if not self._wanted(channel):
                    self._waiting.pop(channel, None)
                    return

    async def _node_for(self, channel: str) -> _Node:
        if isinstance(self._client, RedisCluster):
            await self._client.initialize()
            owner = self._client.get_node_from_key(channel)
            assert owner is not None  # (get_node_from_key raises for a slot no node serves)
            name = owner.name
            if name not in self._nodes:
                kwargs = {**owner.connection_kwargs, "host": owner.host, "port": owner.port}
                pool = ConnectionPool(connection_class=owner.connection_class, **kwargs)
                self._start(name, Redis.from_pool(pool).pubsub())
        else:
            name = "server"
            if name not in self._nodes:
                self._start(name, self._client.pubsub())
        return self._nodes[name]

    def _start(self, name: str, pubsub: PubSub) -> None:
        node = self._nodes[name] = _Node(name, pubsub)
        node.listener = asyncio.create_task(self._listen(node), name=f"keel-live-{name}")

    # ---- a node's listener -----------------------------------------------------------------

    async def _listen(self, node: _Node) -> None:
        while True:
            try:
                await self._leave(node)
                if (not node.channels and not node.leaving) or node.pubsub.connection is None:  # (nothing to read yet)
                    node.sent.clear()
                    await node.sent.wait()
                    continue
                message = await node.pubsub.get_message(timeout=IDLE_S)
                if message is not None:
                    await self._handle(node, message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                count_redis_error()
                log.warning("live events: %s on %s; subscribing again in %ss", type(exc).__name__, node.name, RETRY_S)
                await asyncio.sleep(RETRY_S)
                await self._lost(node)
                return

    async def _handle(self, node: _Node, message: dict[str, Any]) -> None:
        kind = message["type"]
        channel = message["channel"].decode()
        if kind == "smessage":
            self._on_message(channel, message["data"])
        elif kind == "ssubscribe":
            fut = self._waiting.pop(channel, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
            self._confirmed.add(channel)
            self._resubscribed(channel)  # (first or again: what came before it is read)
        elif kind == "sunsubscribe":
            if channel in node.leaving:
                node.leaving.discard(channel)
                return
            # Redis moved the channel's slot away from this node: subscribe where it lives now
            node.channels.discard(channel)
            self._where.pop(channel, None)
            if isinstance(self._client, RedisCluster):
                with contextlib.suppress(Exception):
                    await self._client.nodes_manager.initialize()
            self._spawn(self._send(channel))

    async def _leave(self, node: _Node) -> None:
        if not self._dropped:
            return
        now = asyncio.get_running_loop().time()
        old = [c for c, at in self._dropped.items() if now - at >= LINGER_S and c in node.channels]
        for channel in old:
            self._dropped.pop(channel, None)
        gone = [c for c in old if not self._wanted(c)]
        if not gone:
            return
        node.channels.difference_update(gone)
        node.leaving.update(gone)
        for channel in gone:
            self._where.pop(channel, None)
            self._confirmed.discard(channel)
        async with node.lock:
            await node.pubsub.sunsubscribe(*gone)
        for channel in gone:
            self._left(channel)

    async def _lost(self, node: _Node) -> None:
        """The node's connection failed (Redis restarted, the node died and a replica took its
        slots): a new connection, on whichever node owns each channel now."""
        self._nodes.pop(node.name, None)
        with contextlib.suppress(Exception):
            await node.pubsub.aclose()
        if self._stopped:
            return
        if isinstance(self._client, RedisCluster):
            with contextlib.suppress(Exception):
                await self._client.nodes_manager.initialize()
        for channel in node.channels:
            if self._where.get(channel) == node.name:
                self._spawn(self._send(channel))

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
