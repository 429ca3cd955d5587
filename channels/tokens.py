"""Short-lived signed tokens for browsers, which cannot set headers on a websocket.

A backend holding an API key mints one for one session (`POST /v1/sessions/{id}/tokens`) and
hands it to the page; the page connects with `?token=`. A token names the session, its owner
(the digest of the key, never the key) and an expiry, signed with HMAC-SHA256; it is checked in
constant time and only when a connection opens. The secret comes from KEEL_TOKEN_SECRET, or is
made once and shared through Redis, so every keel process accepts every other's tokens.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenSigner:
    def __init__(self, secret: bytes, ttl_s: int) -> None:
        self._key = hashlib.sha256(b"keel-ws-token:" + secret).digest()
        self.ttl_s = ttl_s

    def mint(self, sid: str, owner: str, now: float | None = None) -> tuple[str, int]:
        """(token, expires_at in Unix seconds)."""
        expires = int(now if now is not None else time.time()) + self.ttl_s
        payload = f"{sid}|{owner}|{expires}".encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}", expires

    def verify(self, token: str, sid: str, now: float | None = None) -> str | None:
        """The owner a valid, unexpired token for `sid` names; None for anything else."""
        if len(token) > 512 or token.count(".") != 1:
            return None
        body, _, mac = token.partition(".")
        try:
            payload, given = _unb64(body), _unb64(mac)
        except ValueError:
            return None
        if _b64(payload) != body or _b64(given) != mac:  # only the canonical encoding: one string per token
            return None
        if not hmac.compare_digest(self._mac(payload), given):
            return None
        parts = payload.decode("utf-8", "replace").split("|")
        if len(parts) != 3 or parts[0] != sid or not parts[2].isdigit():
            return None
        if int(parts[2]) < (now if now is not None else time.time()):
            return None
        return parts[1]

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()
