"""`python -m app`: serve keel with the settings from the environment (README: Configuration)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import uvicorn

from app import create_app
from app.embedded import EmbeddedError, EmbeddedValkey
from app.lifecycle import KeelServer
from app.logs import configure as configure_logs
from app.settings import Settings, SettingsError
from app.wsproto import KeelWebSocketProtocol
from harness import Harness
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
        url = embedded.start()
        log.info("embedded Valkey at %s, data in %s", url, embedded.data_dir)
        return url, embedded
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


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 2
    configure_logs(settings, dict(os.environ))
    if not settings.api_keys:
        log.warning("KEEL_API_KEYS is unset: no authentication, serving on loopback only")
    try:
        url, embedded = prepare(settings)
    except (SettingsError, EmbeddedError) as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 1
    try:
        app = create_app(settings, redis_url=url)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, **uvicorn_options(settings))
        KeelServer(config, app, settings.drain_s).run()
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
