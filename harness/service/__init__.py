"""The Harness: the one object a channel talks to, made of named parts.

The Harness: the one object a channel talks to, made of named parts. Wire-agnostic: takes
validated values, returns msgspec values, raises `harness.errors`.

- `sessions` (`Sessions`): a session's commands, reads, events and the wait for a turn;
- `webhooks` (`Webhooks`): event webhook subscriptions and dead letters;
- `quotas` (`Quotas`): the rate limits a channel checks before it makes work;
- `runner` (`harness.runner.Runner`, or None in a process that runs no turns) and `relay`
  (`harness.relay.Relay`, once `start_relay` made one): the work this process does; `mcp`
  (`harness.tools.mcp.McpTools`), the sessions with the agent's MCP servers, where it has any;
- `store` (`harness.store.Store`) under them all, and `stats`, what this process counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harness.loop.agent import Agent
from harness.relay import Destination, Relay
from harness.runner import Runner
from harness.service.quotas import Quotas, RateLimit
from harness.service.sessions import Sessions
from harness.service.webhooks import Webhooks
from harness.store import Client, Store, connect, reachable
from harness.store.sessions import DAY_MS
from harness.telemetry.metrics import HarnessStats
from harness.tools.mcp import McpTools
from harness.tools.mcpconfig import McpServer
from harness.tools.toolbox import Toolbox
from harness.types import Depth


class Harness:
    def __init__(
        self,
        redis: Client,
        agent: Agent | None,
        *,
        run_turns: bool = True,
        retention: int = 10_000,
        lease_ms: int = 5_000,
        concurrency: int = 256,
        rate_limit: RateLimit | None = None,
        token_rate: RateLimit | None = None,
        max_queued: int = 0,
        job_shards: int = 0,
        replicas: int = 0,
        session_ttl_ms: int = 0,
        event_retention_ms: int = DAY_MS,
        idempotency_ms: int = DAY_MS,
    ) -> None:
        """`agent` runs the turns (None: this process runs none, as a command-line tool's)."""
        self.redis = redis
        self.agent = agent
        self.stats = HarnessStats()  # what this process counts (app/metrics.py exposes it)
        self.store = Store(
            redis,
            retention=retention,
            max_queued=max_queued,
            job_shards=job_shards,
            replicas=replicas,
            ttl_ms=session_ttl_ms,  # (0: never)
            retention_ms=event_retention_ms,  # (0: events kept by count only)
            idempotency_ms=idempotency_ms,
            stats=self.stats,
        )
        self.lease_ms = lease_ms
        self.runner: Runner | None = None
        self.mcp: McpTools | None = None
        if run_turns and agent is not None:
            toolbox = None
            if agent.mcp_servers:  # (sessions with them only where turns run: the calls are made there)
                self.mcp = McpTools(agent.toolbox, agent.mcp_servers, changed=self.stats.mcp_catalogue_changed)
                toolbox = self.mcp.current
            self.runner = Runner(
                self.store, agent, concurrency=concurrency, lease_ms=lease_ms, stats=self.stats, toolbox=toolbox
            )
        self.sessions = Sessions(self.store, self.runner)
        self.webhooks = Webhooks(self.store)
        self.quotas = Quotas(self.store, rate_limit, token_rate)
        self.relay: Relay | None = None
        self._owns_redis = False

    @classmethod
    def connect(cls, url: str, agent: Agent | None, **options: Any) -> Harness:
        """A Harness on a Redis client of its own for `url`, closed by `stop()`."""
        harness = cls(connect(url), agent, **options)
        harness._owns_redis = True
        return harness

    @staticmethod
    async def probe(url: str, timeout: float = 5.0) -> bool:
        """Whether the Redis at `url` is a Redis Cluster node; `Unavailable` (saying why) when
        nothing answers there."""
        return await reachable(url, timeout)

    @staticmethod
    async def check_mcp(servers: Sequence[McpServer]) -> None:
        """Open a session with each MCP server and close it again: McpUnavailable (naming the
        server) for the first that cannot be started or reached (a look before serving)."""
        tools = McpTools(Toolbox(), servers)
        await tools.start()
        await tools.stop()

    async def start(self) -> None:
        """Storage, the MCP servers' sessions (McpUnavailable, naming the server, if one cannot be
        opened), then the runner."""
        await self.store.start()
        if self.mcp is not None:
            await self.mcp.start()
        if self.runner is not None:
            self.runner.start()

    async def start_relay(self, destinations: list[Destination], **options: Any) -> Relay:
        """Deliver committed events to these destinations (webhook channels) from this process
        (every process that serves a channel may: one relay per session at a time)."""
        self.relay = Relay(self.store, destinations, lease_ms=self.lease_ms, **options)
        await self.relay.start()
        return self.relay

    async def hand_over(self, timeout: float) -> int:
        """The process drains: its running turns go to other processes at once (`Runner.hand_over`).
        Returns how many sessions were handed over."""
        handed = await self.runner.hand_over(timeout) if self.runner is not None else 0
        if self.mcp is not None:
            await self.mcp.stop()  # (its stdio servers with it)
        return handed

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.stop()
        if self.runner is not None:
            await self.runner.stop()
        if self.mcp is not None:
            await self.mcp.stop()
        await self.store.close()
        if self._owns_redis:
            await self.redis.aclose()

    async def queue_depth(self) -> Depth:
        """The turn job stream's backlog (jobs not done, the oldest's age), read from Redis now."""
        return await self.store.jobs.depth()

    async def ping(self) -> None:
        """Raises `Unavailable` when storage does not answer (readiness)."""
        await self.store.ping()

    async def shared_secret(self) -> bytes:
        """A secret every process of this deployment shares (for signing browser tokens)."""
        return await self.store.shared_secret()
