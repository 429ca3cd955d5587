"""The ASGI service: `create_app()` wires settings, Redis, the harness and the channels."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from app.metrics import PATH as METRICS_PATH
from app.metrics import Metrics, Sources
from app.settings import Settings
from channels.drain import Drain
from channels.errors import http_error_handler, keel_error_handler
from channels.front import Front
from channels.limits import Occupancy
from channels.mcp import PATH as MCP_PATH
from channels.mcp import McpChannel
from channels.routes import routes
from channels.sse import SseStats
from channels.tokens import TokenSigner
from channels.tracing import TraceRequests
from channels.webhooks.base import WebhookChannel
from channels.webhooks.outbound import OutboundWebhooks
from channels.websocket import WsConfig, WsStats
from harness import Agent, Harness
from harness.errors import KeelError
from harness.telemetry import tracing

log = logging.getLogger("keel")
OPENING_AT_ONCE = 64  # sockets doing their opening work (owner check, replay read) at the same time


def load_agent(spec: str) -> Agent:
    """`module:attribute` -> the Agent it names (an Agent, or a function returning one)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"KEEL_AGENT must look like module:attribute, not {spec!r}")
    obj = getattr(importlib.import_module(module_name), attr)
    if callable(obj) and not isinstance(obj, Agent):
        obj = obj()
    if not isinstance(obj, Agent):
        raise ValueError(f"KEEL_AGENT={spec} is a {type(obj).__name__}, not a harness.Agent")
    return obj


def build_harness(
    settings: Settings, url: str, agent: Agent | None = None, *, run_turns: bool | None = None
) -> Harness:
    """The Harness a keel process runs, from its settings, on a Redis client of its own (closed
    by `Harness.stop`): the web process, the worker (which always runs turns) and the
    benchmarks all start keel this way."""
    the_agent = agent or load_agent(settings.agent)
    if settings.model is not None:
        the_agent = the_agent.with_model(settings.model)
    if settings.mcp_servers:
        the_agent = the_agent.with_mcp(settings.mcp_servers)
    return Harness.connect(
        url,
        the_agent,
        run_turns=settings.run_turns if run_turns is None else run_turns,
        retention=settings.event_retention,
        lease_ms=settings.lease_ms,
        concurrency=settings.runner_concurrency,
        rate_limit=settings.rate_limit,
        token_rate=settings.token_rate,
        max_queued=settings.max_queued,
        job_shards=settings.job_shards,
        replicas=1 if settings.durability == "replica" else 0,
        session_ttl_ms=settings.session_ttl_ms,
        event_retention_ms=settings.event_retention_ms,
        idempotency_ms=settings.idempotency_ms,
    )


def webhook_channels(settings: Settings) -> list[WebhookChannel]:
    """The webhook channels whose settings are present."""
    channels: list[WebhookChannel] = []
    if settings.slack_signing_secret and settings.slack_bot_token:
        from channels.webhooks.slack import SlackChannel, SlackConfig  # (slack_sdk, aiohttp: only when on)

        config = SlackConfig(
            settings.slack_signing_secret, settings.slack_bot_token, settings.slack_api_url, settings.slack_approvers
        )
        channels.append(SlackChannel(config))
    if settings.linear_webhook_secret and settings.linear_api_key:
        from channels.webhooks.linear import LinearChannel, LinearConfig

        linear = LinearConfig(settings.linear_webhook_secret, settings.linear_api_key, settings.linear_api_url)
        channels.append(LinearChannel(linear))
    return channels


def create_app(
    settings: Settings | None = None, *, redis_url: str | None = None, agent: Agent | None = None
) -> Starlette:
    settings = settings or Settings.from_env()
    url = redis_url or settings.redis_url
    if url is None:
        raise ValueError("create_app needs a Redis URL (python -m app starts the embedded one)")
    the_agent = agent or load_agent(settings.agent)
    hooks = webhook_channels(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        harness = build_harness(settings, url, the_agent)
        await harness.start()
        app.state.harness = harness
        secret = settings.token_secret.encode() if settings.token_secret else await harness.shared_secret()
        app.state.tokens = TokenSigner(secret, settings.token_ttl)
        for channel in hooks:
            await channel.start()
        outbound = OutboundWebhooks(
            harness,
            allow_private=settings.webhook_allow_private,
            timeout=settings.webhook_timeout,
            retry_hours=settings.webhook_retry_hours,
        )
        await outbound.start()
        await harness.start_relay([channel.destination for channel in hooks], resolve=outbound.resolve)
        try:
            yield
        finally:
            await mcp.stop()
            await harness.stop()
            for channel in hooks:
                await channel.stop()
            await outbound.stop()

    ws_stats, sse_stats, drain = WsStats(), SseStats(), Drain()
    mcp = McpChannel(
        open_to_all_hosts=bool(settings.api_keys),
        host=settings.host,
        max_body=settings.max_body,
        wait_timeout=settings.wait_timeout,
    )
    metrics = Metrics(Sources(lambda: getattr(app.state, "harness", None), ws=ws_stats, sse=sse_stats))
    app = Starlette(
        routes=[
            *routes(
                demo_folder=Path(__file__).parent / "static" if settings.demo_page else None, webhooks=hooks, mcp=mcp
            ),
            metrics.route(),  # (last: every request matched before it is spared a miss)
        ],
        middleware=[
            *([Middleware(TraceRequests)] if tracing.enabled() else []),  # (tracing on: the request's span)
            Middleware(
                Front,  # (request ids, the drain, the frontend routes' CORS, the API keys)
                drain=drain,
                origins=settings.allowed_origins,
                keys=settings.api_keys,
                open_paths=[p for c in hooks for p, _ in c.routes()],
                guarded=[METRICS_PATH, MCP_PATH],
            ),
        ],
        exception_handlers={
            KeelError: keel_error_handler,
            HTTPException: http_error_handler,
        },
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # (its redirect's Location is the request's Host: a 404 instead)
    app.state.max_body = settings.max_body
    app.state.body_timeout = settings.body_timeout
    app.state.webhook_allow_private = settings.webhook_allow_private
    app.state.wait_timeout = settings.wait_timeout
    app.state.sse_heartbeat = settings.sse_heartbeat
    app.state.ws_stats = ws_stats
    app.state.drain = drain
    app.state.sse_stats = sse_stats
    app.state.ws_gate = asyncio.Semaphore(OPENING_AT_ONCE)
    app.state.readers = Occupancy(settings.max_readers, "readers of this session", "too_many_readers")
    app.state.token_sockets = Occupancy(settings.max_token_sockets, "websockets with this token", "too_many_sockets")
    app.state.ws = WsConfig(
        max_frame=settings.ws_max_frame,
        heartbeat=settings.ws_heartbeat,
        send_queue=settings.ws_send_queue,
        slow_s=settings.ws_slow_s,
        origins=settings.allowed_origins,
    )
    return app
