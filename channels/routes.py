"""The route table: every path keel serves and the handler behind it, in one place that imports
the channel modules (none of which imports another's routes)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp

from channels import agui, aisdk, http
from channels.mcp import PATH as MCP_PATH
from channels.openapi import serve_openapi
from channels.sse import stream_events
from channels.static import demo_routes, widget_routes
from channels.webhooks import subscriptions
from channels.webhooks.base import WebhookChannel, endpoint
from channels.websocket import session_socket


def routes(
    *, demo_folder: Path | None = None, webhooks: Sequence[WebhookChannel] = (), mcp: ASGIApp | None = None
) -> list[BaseRoute]:
    """The API, the webhook channels' routes, `/mcp` when given its app (`channels.mcp`, which
    answers MCP's JSON-RPC itself, every method), the widget script, and the demo page from
    `demo_folder` when given."""
    hooks: list[BaseRoute] = [
        Route(path, endpoint(channel, name), methods=["POST"])
        for channel in webhooks
        for path, name in channel.routes()
    ]
    # (Starlette tries the routes in this order, and a route passed over costs a regex match
    # and its checks: a turn's own routes come first, then the webhook channels')
    return [
        Route("/v1/sessions/{sid}/messages", http.send_message, methods=["POST"]),
        Route("/v1/sessions/{sid}/responses", http.respond, methods=["POST"]),
        Route("/v1/sessions/{sid}/events", stream_events, methods=["GET"]),
        *hooks,
        Route("/healthz", http.healthz, methods=["GET"]),
        Route("/readyz", http.readyz, methods=["GET"]),
        Route("/openapi.json", serve_openapi, methods=["GET"]),
        Route("/v1/sessions", http.create_session, methods=["POST"]),
        Route("/v1/sessions", http.list_sessions, methods=["GET"]),
        Route("/v1/sessions/{sid}", http.get_session, methods=["GET"]),
        Route("/v1/sessions/{sid}", http.update_session, methods=["PATCH"]),
        Route("/v1/sessions/{sid}", http.delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{sid}/fork", http.fork_session, methods=["POST"]),
        Route("/v1/sessions/{sid}/history", http.get_history, methods=["GET"]),
        Route("/v1/sessions/{sid}/cancel", http.cancel, methods=["POST"]),
        Route("/v1/sessions/{sid}/compact", http.compact, methods=["POST"]),
        Route("/v1/sessions/{sid}/clear", http.clear, methods=["POST"]),
        Route("/v1/sessions/{sid}/tokens", http.mint_token, methods=["POST"]),
        Route("/v1/chat", aisdk.chat, methods=["POST"]),
        Route("/v1/chat/{sid}/stream", aisdk.chat_stream, methods=["GET"]),
        Route("/v1/agui", agui.run, methods=["POST"]),
        Route("/v1/webhooks", subscriptions.create, methods=["POST"]),
        Route("/v1/webhooks", subscriptions.listing, methods=["GET"]),
        Route("/v1/webhooks/{wid}", subscriptions.show, methods=["GET"]),
        Route("/v1/webhooks/{wid}", subscriptions.delete, methods=["DELETE"]),
        Route("/v1/webhooks/{wid}/failures", subscriptions.failures, methods=["GET"]),
        Route("/v1/webhooks/{wid}/failures/retry", subscriptions.retry, methods=["POST"]),
        WebSocketRoute("/v1/sessions/{sid}/ws", session_socket),
        *([Route(MCP_PATH, mcp)] if mcp is not None else []),
        *widget_routes(),
        *(demo_routes(demo_folder) if demo_folder is not None else []),
    ]
