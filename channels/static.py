"""Static files keel serves: the browser widget (always) and, in the keyless local default, the
demo page. Read once at start-up; served from memory. The widget gets keel's event type names
from the catalogue (`harness.events`) as it is read, so it spells none of its own."""

from __future__ import annotations

from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from channels.spec import Returns, operation
from harness.events import COMMITTED, LIVE

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


EVENTS_SLOT = b"/* keel: events */ {}"  # where the widget takes the event types (Name: type)


def file_route(path: str, file: Path, *, events: bool = False) -> Route:
    body = file.read_bytes()
    if events:
        names = msgspec.json.encode({c.__name__: c.TYPE for c in (*COMMITTED, *LIVE)})
        assert EVENTS_SLOT in body, f"{file.name} has no place for the event types"
        body = body.replace(EVENTS_SLOT, names)
    headers = {**PAGE_HEADERS, "Content-Type": TYPES[file.suffix]}

    async def serve(request: Request) -> Response:
        return Response(body, headers=headers)

    return Route(path, serve, methods=["GET", "HEAD"])


def widget_routes() -> list[Route]:
    widget = file_route("/widget.js", HERE / "widget.js", events=True)
    answer = Returns(200, str, "The browser widget (see docs/websocket-and-widget.md)", media="text/javascript")
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
