"""API-key authentication: the front door's last step (`channels.front`).

With keys configured, every `/v1` request needs `Authorization: Bearer <key>` (a frontend
protocol's route takes a session's token there too, checked by its handler); the caller's
identity (`owner`) is a digest of its key, so sessions are visible only to the key that made
them and no key is ever stored. With no keys, everyone is the same anonymous owner (the
service then refuses to listen beyond loopback)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from channels.cors import frontend
from channels.errors import error_body

ANONYMOUS = "anon"


def protected(path: str) -> bool:
    """Whether a path needs the API key (when keys are set): the API under `/v1/`."""
    return path.startswith("/v1/")


def owner_of(key: str) -> str:
    return hashlib.sha256(b"keel-owner:" + key.encode()).hexdigest()[:32]


class ApiKeyAuth:
    """The keys as pure ASGI middleware (no BaseHTTPMiddleware: it breaks contextvars): the
    front door's last step (`channels.front`), and the metrics port's app on its own."""

    def __init__(
        self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str] = (), guarded: Iterable[str] = ()
    ) -> None:
        self.app = app
        self._guarded = frozenset(guarded)  # paths outside /v1 that need a key too (/metrics)
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self._open = frozenset(open_paths)  # webhook routes: the provider's signature is their credential

    def identify(self, header: bytes | None) -> str | None:
        """The owner for an Authorization header, or None. Compares against every key in
        constant time, whatever matches first."""
        if not self._digests:
            return ANONYMOUS
        if header is None or header[:7].lower() != b"bearer ":
            return None
        given = header[7:].strip()
        digest = hashlib.sha256(given).digest()
        found = False
        for d in self._digests:
            found |= hmac.compare_digest(d, digest)
        return owner_of(given.decode("utf-8", "replace")) if found else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._admit(scope):
            await _refuse(send)
            return
        await self.app(scope, receive, send)

    def _admit(self, scope: Scope) -> bool:
        """Whether the request (or websocket) may go on to its route: its owner, or a session
        token to check, put in its state."""
        path = scope.get("path", "")
        if not (protected(path) or path in self._guarded) or path in self._open:
            return True
        header = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                header = v
                break
        owner = self.identify(header)
        if owner is None and scope["type"] == "websocket":
            # The socket handler accepts, then checks a ?token= or closes with 4401: a browser
            # sees a close code only on an accepted socket (and cannot send this header at all).
            return True
        if owner is None and frontend(path) and header is not None and header[:7].lower() == b"bearer ":
            # A frontend protocol's route may be opened with a session token instead of a key:
            # its handler checks it against the session it names (`session_owner`).
            scope.setdefault("state", {})["bearer"] = header[7:].strip().decode("utf-8", "replace")
            return True
        if owner is None:
            return False
        scope.setdefault("state", {})["owner"] = owner
        return True


async def _refuse(send: Send) -> None:
    """401 `unauthorized`: no key, or a wrong one."""
    body = error_body("unauthorized", "missing or wrong API key (Authorization: Bearer <key>)")
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b"Bearer"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
