"""Static files keel serves: the browser widget (always) and, in the keyless local default, the
demo page. Read once at start-up; served from memory."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from channels.spec import Answer, operation

HERE = Path(__file__).parent / "static"
TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The demo page loads only its own files and talks only to this origin (websocket included).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def file_route(path: str, file: Path) -> Route:
    body = file.read_bytes()
    headers = {**PAGE_HEADERS, "Content-Type": TYPES[file.suffix]}

    async def serve(request: Request) -> Response:
        return Response(body, headers=headers)

    return Route(path, serve, methods=["GET", "HEAD"])


def widget_routes() -> list[Route]:
    widget = file_route("/widget.js", HERE / "widget.js")
    answer = Answer(200, str, "The browser widget (see the README)", media="text/javascript")
    operation("The embeddable widget's script", answer, storage=False, tag="static")(widget.endpoint)
    return [widget]


def demo_routes(folder: Path) -> list[Route]:
    """The demo page at `/` with its script and style, from `folder`."""
    return [
        file_route("/", folder / "demo.html"),
        file_route("/demo.js", folder / "demo.js"),
        file_route("/demo.css", folder / "demo.css"),
        file_route("/favicon.svg", folder / "favicon.svg"),
    ]
