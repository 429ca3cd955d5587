"""`GET /metrics`: this process's numbers in Prometheus' text format (`prometheus-client`).

The harness counts in plain objects (`harness.telemetry.metrics.HarnessStats`, the relay's
`RelayStats`), the channels in theirs (`WsStats`, `SseStats`); `KeelCollector` turns them into
metric families only when a scrape asks, so a turn never touches prometheus_client. The job
queue's depth and oldest job's age are read from Redis (through `Harness.queue_depth`) by the
scrape itself, before the registry is rendered. Each app or worker builds its own
`CollectorRegistry`: many apps in one process (the tests) never collide in the global one.

On the API port the route is behind the API keys when there are any (`ApiKeyAuth`'s guarded
paths); a worker serves it on `KEEL_METRICS_PORT` (`serve_worker_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.settings import Settings
from channels.auth import ApiKeyAuth
from channels.sse import SseStats
from channels.websocket import WsStats
from harness import Harness
from harness.errors import Unavailable
from harness.telemetry.metrics import HarnessStats, Histogram, redis_errors
from harness.types import Depth

log = logging.getLogger("keel.metrics")
PATH = "/metrics"


@dataclass
class Sources:
    """Where a process's numbers live; the channels' are absent in a worker."""

    harness: Callable[[], Harness | None]
    ws: WsStats | None = None
    sse: SseStats | None = None
    depth: Depth | None = None  # the job queue as the current scrape read it (None: unreadable)


def _histogram(name: str, doc: str, histograms: dict[str, Histogram], label: str | None = None) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=[label] if label else None)
    for value, h in histograms.items():
        family.add_metric([value] if label else [], h.cumulative(), h.total)
    return family


def _counter(name: str, doc: str, counts: dict[str, int], label: str) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


class KeelCollector(Collector):
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        src = self.sources
        harness = src.harness()
        if harness is not None:
            yield from self._harness(harness)
        yield CounterMetricFamily("keel_redis_errors", "Redis calls of this process that failed", redis_errors())
        if src.ws is not None:
            yield GaugeMetricFamily("keel_websockets_open", "websockets open on this process", src.ws.open)
        if src.sse is not None:
            yield GaugeMetricFamily("keel_sse_streams_open", "SSE event streams open on this process", src.sse.open)
        if src.depth is not None:
            yield GaugeMetricFamily("keel_job_queue_depth", "turn jobs not done yet (all processes)", src.depth.jobs)
            yield GaugeMetricFamily(
                "keel_job_queue_oldest_age_seconds", "age of the oldest turn job not done", src.depth.oldest_s
            )

    def _harness(self, harness: Harness) -> Iterator[Metric]:
        stats = harness.stats
        turns = {o: stats.turns.get(o, 0) for o in ("completed", "failed", "cancelled", "waiting")}
        yield _counter("keel_turns", "turns that came to an outcome in this process", turns, "outcome")
        yield _histogram(
            "keel_turn_duration_seconds", "a turn's run, from begin to end or pause", {"": stats.turn_seconds}
        )
        yield _histogram("keel_model_call_duration_seconds", "one model attempt", {"": stats.model_seconds})
        yield _counter("keel_model_attempts", "model attempts by outcome (ok, interrupted, handed_over, error code)",
                       stats.model_attempts, "outcome")  # fmt: skip
        yield _histogram("keel_tool_duration_seconds", "one tool run", stats.tool_seconds, "tool")
        yield CounterMetricFamily(
            "keel_lease_takeovers", "turns resumed here after another runner's lease lapsed", stats.lease_takeovers
        )
        yield CounterMetricFamily(
            "keel_sessions_handed_over", "sessions given to other runners when this process drained", stats.handed_over
        )
        yield _counter("keel_events_committed", "events this process committed", stats.events, "type")
        yield _counter("keel_mcp_catalogue_changes", "MCP tool lists that changed (each costs the prompt cache)",
                       stats.mcp_catalogue_changes, "server")  # fmt: skip
        yield from _cache_health(stats)
        relay = harness.relay
        if relay is not None:
            r = relay.stats
            yield CounterMetricFamily("keel_relay_delivered", "events the delivery relay delivered", r.delivered)
            yield CounterMetricFamily("keel_relay_dead_letters", "events the relay gave up on", r.dead)
            yield CounterMetricFamily("keel_relay_retries", "delivery attempts tried again", r.retries)
            yield _histogram("keel_relay_delivery_lag_seconds", "from an event's commit to its delivery",
                             {"": r.lag_seconds})  # fmt: skip


class Metrics:
    """One process's registry and the handler that renders it."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KeelCollector(sources))

    async def render(self) -> bytes:
        harness = self.sources.harness()
        depth: Depth | None = None
        if harness is not None:
            try:
                depth = await harness.queue_depth()
            except Unavailable as exc:  # (counted in keel_redis_errors; the rest still answers)
                log.warning("metrics: the job queue is unreadable: %s", exc.message)
        self.sources.depth = depth
        return generate_latest(self.registry)

    async def endpoint(self, request: Request) -> Response:
        return Response(await self.render(), media_type=CONTENT_TYPE_LATEST)

    def route(self) -> Route:
        return Route(PATH, self.endpoint, methods=["GET"])


async def serve_worker_metrics(harness: Harness, settings: Settings, stop: asyncio.Event) -> None:
    """A worker's /metrics on KEEL_HOST:KEEL_METRICS_PORT until `stop` is set (behind the API
    keys when there are keys, as on the API port)."""
    metrics = Metrics(Sources(lambda: harness))
    app = Starlette(
        routes=[metrics.route()], middleware=[Middleware(ApiKeyAuth, keys=settings.api_keys, guarded=[PATH])]
    )
    config = uvicorn.Config(app, host=settings.host, port=settings.metrics_port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await stop.wait()
    server.should_exit = True
    await task


def _cache_health(stats: HarnessStats) -> Iterator[Metric]:
    """Prompt-cache health by agent and model: input tokens of turn calls, the part read from
    the cache, their share (alert when it drops), and the times a session's cached prefix
    (tools, system prompt) changed between two of its requests."""
    labels = ["agent", "model"]
    tokens = CounterMetricFamily("keel_prompt_input_tokens", "input tokens of turn model calls", labels=labels)
    cached = CounterMetricFamily("keel_prompt_cached_tokens", "input tokens read from the prompt cache", labels=labels)
    share = GaugeMetricFamily(
        "keel_prompt_cache_read_ratio", "share of input tokens read from the cache (this process, since it started)",
        labels=labels,
    )  # fmt: skip
    for key, n in stats.prompt_tokens.items():
        read = stats.cached_tokens.get(key, 0)
        tokens.add_metric(list(key), n)
        cached.add_metric(list(key), read)
        share.add_metric(list(key), read / n if n else 0.0)
    busts = CounterMetricFamily(
        "keel_prompt_cache_busts", "a session's tools or system prompt changed between two of its requests",
        labels=["agent", "model", "part"],
    )  # fmt: skip
    for (agent, model, part), n in stats.cache_busts.items():
        busts.add_metric([agent, model, part], n)
    yield from (tokens, cached, share, busts)
