"""`python -m app`: serve keel with the settings from the environment (docs/configuration.md)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import uvicorn

from app import create_app, heap, load_agent
from app import traces as app_tracing
from app.embedded import EmbeddedError, EmbeddedValkey
from app.lifecycle import KeelServer
from app.logs import configure as configure_logs
from app.settings import Settings, SettingsError
from app.wsproto import KeelWebSocketProtocol
from harness import Agent, Harness
from harness.errors import KeelError, Unavailable

log = logging.getLogger("keel")


def prepare(settings: Settings, *, runs_turns: bool | None = None) -> tuple[str, EmbeddedValkey | None]:
    """The Redis URL to use, starting the embedded server when REDIS_URL is unset; and, where
    this process runs turns, a look at each MCP server (SettingsError, naming one that cannot
    be started or reached)."""
    if settings.mcp_servers and (settings.run_turns if runs_turns is None else runs_turns):
        try:
            asyncio.run(Harness.check_mcp(settings.mcp_servers))
        except KeelError as exc:
            raise SettingsError(exc.message) from None
    if settings.redis_url is None:
        embedded = EmbeddedValkey(settings.data_dir)
        return embedded.start(), embedded
    try:
        cluster = asyncio.run(Harness.probe(settings.redis_url))
    except Unavailable as exc:
        raise SettingsError(f"REDIS_URL is not reachable: {exc.message}") from None
    if cluster:
        log.info("REDIS_URL is a node of a Redis Cluster: cluster mode")
    return settings.redis_url, None


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """How uvicorn serves keel. Websockets: the sans-I/O implementation (flow control on send,
    keepalive pings, 1012 on shutdown), frames refused past the size limit (1009)."""
    return {
        "log_config": None,  # uvicorn's lines go through keel's handler (format, redaction): app/logs.py
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": 5,  # (after a drain: what is left of KEEL_DRAIN_S)
        "ws": KeelWebSocketProtocol,  # websockets-sansio, closing refused messages and handshakes properly
        "ws_max_size": settings.ws_max_frame,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
        "ws_per_message_deflate": False,  # memory per idle connection, and CPU
    }


def listen(settings: Settings) -> socket.socket:
    """The listening socket at KEEL_HOST:KEEL_PORT (SettingsError, naming KEEL_PORT, when the
    port is taken), made before anything else starts, so that a busy port costs nothing."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SettingsError(
                f"port {settings.port} on {settings.host} is in use: stop what holds it, or set KEEL_PORT to another"
            ) from None
        raise SettingsError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def start_line(settings: Settings, url: str, embedded: EmbeddedValkey | None, agent: Agent) -> str:
    """keel's first line: where to go, what is served there, the model and the Redis in use."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    served = "the demo page at /, the API at /v1" if settings.demo_page else "the API at /v1"
    auth = "API keys required" if settings.api_keys else "no auth (KEEL_API_KEYS unset: loopback only)"
    model = settings.model or f"{type(agent.model).__name__} of {settings.agent}"
    redis = f"embedded Valkey, data in {embedded.data_dir}" if embedded is not None else _without_password(url)
    return f"keel on http://{host}:{settings.port}/ serving {served}; {auth}; model {model}; Redis {redis}"


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 2
    configure_logs(settings, dict(os.environ))
    try:
        app_tracing.start(settings, os.environ)
    except ImportError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 1
    try:
        sock = listen(settings)
    except SettingsError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 1
    try:
        url, embedded = prepare(settings)
    except (SettingsError, EmbeddedError) as exc:
        sock.close()
        print(f"keel: {exc}", file=sys.stderr)
        return 1
    try:
        agent = load_agent(settings.agent)
        app = create_app(settings, redis_url=url, agent=agent)
        log.info(
            "%s", start_line(settings, url, embedded, agent.with_model(settings.model) if settings.model else agent)
        )
        config = uvicorn.Config(app, host=settings.host, port=settings.port, **uvicorn_options(settings))
        heap.settle(settings.gc_threshold)  # (all imported and built: what is left to collect is the turns')
        KeelServer(config, app, settings.drain_s).run(sockets=[sock])
    finally:
        app_tracing.stop()
        sock.close()
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
