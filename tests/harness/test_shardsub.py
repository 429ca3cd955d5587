"""Sharded subscriptions (harness/store/shardsub.py) against a real server: in place once
`subscribe` returns, kept through a leave-and-come-back, and made again (with a call saying so)
after the connection is lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from harness.store import shardsub
from harness.store.shardsub import ShardSubscriber


class Heard:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.again: list[str] = []
        self.wanted: set[str] = set()
        self.news = asyncio.Event()

    def on_message(self, channel: str, data: bytes) -> None:
        self.messages.append((channel, data))
        self.news.set()

    def on_again(self, channel: str) -> None:
        self.again.append(channel)
        self.news.set()

    async def until(self, check: Any) -> None:
        async with asyncio.timeout(5):
            while not check():
                self.news.clear()
                await self.news.wait()


def subscriber(redis: Redis, heard: Heard) -> ShardSubscriber:
    return ShardSubscriber(redis, heard.on_message, heard.on_again, lambda c: c in heard.wanted)


async def test_a_message_published_once_subscribe_returns_is_heard(redis: Redis) -> None:
    heard = Heard()
    sub = subscriber(redis, heard)
    try:
        for n in range(20):  # no message sent after `subscribe` returned is ever missed
            channel = f"keel:{{s{n}}}:live"
            heard.wanted.add(channel)
            await sub.subscribe([channel])
            await redis.spublish(channel, b"x")
        await heard.until(lambda: len(heard.messages) == 20)
    finally:
        await sub.stop()


async def test_a_channel_left_and_wanted_again_at_once_stays_subscribed(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shardsub, "LINGER_S", 0.0)
    heard = Heard()
    sub = subscriber(redis, heard)
    channel = "keel:{s}:live"
    try:
        for n in range(10):
            heard.wanted.add(channel)
            await sub.subscribe([channel])
            heard.wanted.discard(channel)
            sub.drop(channel)
            await redis.spublish("keel:{other}:live", b"")  # (wakes nothing: lets the listener run)
            await asyncio.sleep(0)
            heard.wanted.add(channel)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await sub.subscribe([channel])  # (the SUNSUBSCRIBE may be under way)
            assert loop.time() - started < shardsub.CONFIRM_S / 2
            await redis.spublish(channel, str(n).encode())
            await heard.until(lambda n=n: (channel, str(n).encode()) in heard.messages)
    finally:
        await sub.stop()


async def test_a_lost_connection_is_made_again_and_said_so(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shardsub, "RETRY_S", 0.05)
    heard = Heard()
    sub = subscriber(redis, heard)
    channel = "keel:{s}:live"
    heard.wanted.add(channel)
    try:
        await sub.subscribe([channel])
        assert heard.again == [channel]  # (each confirmation is passed on, the first too)
        await redis.client_kill_filter(_type="pubsub")
        await heard.until(lambda: heard.again.count(channel) == 2)  # readers are told to read what they missed
        await redis.spublish(channel, b"after")
        await heard.until(lambda: (channel, b"after") in heard.messages)
    finally:
        await sub.stop()
