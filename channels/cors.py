"""Browser access to the frontend protocols' routes (`/v1/chat`, `/v1/chat/{id}/stream`,
`/v1/agui`) from pages of other origins: CORS, for the origins `KEEL_ALLOWED_ORIGINS` names
(the ones that may open websockets), on those routes only. A preflight is answered here, before
the API key is asked for (a browser sends none with it); the request itself then needs a key or
a session token (`POST /v1/sessions/{id}/tokens`), as `channels.auth` has it."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

FRONTEND_PREFIXES = ("/v1/chat", "/v1/agui")


def frontend(path: str) -> bool:
    """Whether `path` is a frontend protocol's route (a session token may open it)."""
    return any(path == p or path.startswith(p + "/") for p in FRONTEND_PREFIXES)


def frontend_cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp | None:
    """`app` behind CORS for `origins` (preflights answered, the response's headers added), or
    None without origins. The front door (`channels.front`) sends the frontend routes' requests
    through it."""
    if not origins:
        return None
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type"],
        expose_headers=["x-vercel-ai-ui-message-stream", "x-request-id"],
        max_age=600,
    )
