"""Browser access to the frontend protocols' routes (`/v1/chat`, `/v1/chat/{id}/stream`,
`/v1/agui`) from pages of other origins: CORS, for the origins `KEEL_ALLOWED_ORIGINS` names
(the ones that may open websockets), on those routes only. A preflight is answered here, before
the API key is asked for (a browser sends none with it); the request itself then needs a key or
a session token (`POST /v1/sessions/{id}/tokens`), as `channels.auth` has it."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

FRONTEND_PREFIXES = ("/v1/chat", "/v1/agui")


def frontend(path: str) -> bool:
    """Whether `path` is a frontend protocol's route (a session token may open it)."""
    return any(path == p or path.startswith(p + "/") for p in FRONTEND_PREFIXES)


class FrontendCors:
    def __init__(self, app: ASGIApp, origins: Sequence[str]) -> None:
        self.app = app
        self.cors: ASGIApp | None = None
        if origins:
            self.cors = CORSMiddleware(
                app,
                allow_origins=list(origins),
                allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"],
                expose_headers=["x-vercel-ai-ui-message-stream", "x-request-id"],
                max_age=600,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cors is not None and scope["type"] == "http" and frontend(scope.get("path", "")):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
