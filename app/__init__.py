"""The ASGI service: `create_app()` wires settings, Redis, the harness and the channels."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from app.settings import Settings
from channels.auth import ApiKeyAuth
from channels.errors import http_error_handler, keel_error_handler, redis_error_handler
from channels.http import routes
from channels.static import demo_routes, widget_routes
from channels.tokens import TokenSigner
from channels.websocket import WsConfig, WsStats
from harness import Agent, Harness
from harness.errors import KeelError

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


def redis_client(url: str) -> Redis:
    """The process's Redis client. The pool may hold up to 4,096 connections: a burst (a
    thousand sockets opening together) gets more connections rather than errors, and a plain
    pool costs a turn about 7% less than a blocking one. Maintenance notifications off: redis-py
    8.1's default ("auto") skips the liveness check of pooled connections, so after a Redis
    restart every old connection failed once, as a 5xx."""
    pool = ConnectionPool.from_url(
        url,
        max_connections=4096,
        health_check_interval=30,
        maint_notifications_config=MaintNotificationsConfig(enabled=False),
    )
    return Redis.from_pool(pool)


def create_app(
    settings: Settings | None = None, *, redis_url: str | None = None, agent: Agent | None = None
) -> Starlette:
    settings = settings or Settings.from_env()
    url = redis_url or settings.redis_url
    if url is None:
        raise ValueError("create_app needs a Redis URL (python -m app starts the embedded one)")
    the_agent = agent or load_agent(settings.agent)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        redis = redis_client(url)
        harness = Harness(
            redis,
            the_agent,
            run_turns=settings.run_turns,
            retention=settings.event_retention,
            lease_ms=settings.lease_ms,
            concurrency=settings.runner_concurrency,
        )
        await harness.start()
        app.state.harness = harness
        secret = settings.token_secret.encode() if settings.token_secret else await harness.shared_secret()
        app.state.tokens = TokenSigner(secret, settings.token_ttl)
        try:
            yield
        finally:
            await harness.stop()
            await redis.aclose()

    pages = widget_routes() + (demo_routes(Path(__file__).parent / "static") if settings.demo_page else [])
    app = Starlette(
        routes=[*routes(), *pages],
        middleware=[Middleware(ApiKeyAuth, keys=settings.api_keys)],
        exception_handlers={
            KeelError: keel_error_handler,
            HTTPException: http_error_handler,
            RedisError: redis_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.max_body = settings.max_body
    app.state.wait_timeout = settings.wait_timeout
    app.state.sse_heartbeat = settings.sse_heartbeat
    app.state.ws_stats = WsStats()
    app.state.ws_gate = asyncio.Semaphore(OPENING_AT_ONCE)
    app.state.ws = WsConfig(
        max_frame=settings.ws_max_frame,
        heartbeat=settings.ws_heartbeat,
        send_queue=settings.ws_send_queue,
        slow_s=settings.ws_slow_s,
        origins=settings.allowed_origins,
    )
    return app
