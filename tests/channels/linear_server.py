"""A local server that speaks Linear's GraphQL API as keel uses it (`agentActivityCreate`,
`agentSessionUpdate`), idempotent on an activity's `id` as Linear is (the same id again: an
error saying it already exists), with rate limits and errors on demand; and helpers that sign
`AgentSessionEvent` webhooks the way Linear does (hex HMAC-SHA256 of the raw body).

It runs uvicorn in a thread of its own, so it outlives the keel processes a crash test kills."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.conftest import free_port

API_KEY = "lin_api_test"
SECRET = "linear-webhook-secret"
ORG = "org-1"


@dataclass
class Activity:
    id: str
    session: str
    content: dict[str, Any]
    ephemeral: bool
    signal: str | None
    signal_metadata: Any
    at: float


@dataclass
class FakeLinear:
    port: int = field(default_factory=free_port)
    activities: list[Activity] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    fail_next: list[int] = field(default_factory=list)  # statuses for the next requests

    def __post_init__(self) -> None:
        self.lock = threading.Condition()
        routes = [Route("/graphql", self._handle, methods=["POST"])]
        self.server = uvicorn.Server(
            uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/graphql"

    def start(self) -> FakeLinear:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError("the fake Linear server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def of(self, session: str) -> list[Activity]:
        with self.lock:
            return [a for a in self.activities if a.session == session]

    def kinds(self, session: str) -> list[str]:
        return [a.content["type"] for a in self.of(session)]

    def wait_until(self, check: Callable[[FakeLinear], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not check(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; activities: {[(a.session, a.content) for a in self.activities]}")
                self.lock.wait(left)

    async def until(self, check: Callable[[FakeLinear], bool], timeout: float = 15.0) -> None:
        await asyncio.to_thread(self.wait_until, check, timeout)

    async def _handle(self, request: Request) -> JSONResponse:
        body = await request.json()
        with self.lock:
            self.requests += 1
            try:
                if request.headers.get("authorization") != API_KEY:
                    return JSONResponse({"errors": [{"message": "Authentication required"}]}, 401)
                if self.fail_next:
                    status = self.fail_next.pop(0)
                    return JSONResponse({"errors": [{"message": "try later"}]}, status, headers={"Retry-After": "1"})
                return JSONResponse(self._answer(body.get("query", ""), body.get("variables") or {}))
            finally:
                self.lock.notify_all()

    def _answer(self, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        data = variables.get("input") or {}
        if "agentActivityCreate" in query:
            aid = data.get("id") or str(uuid.uuid4())
            if any(a.id == aid for a in self.activities):
                return {"errors": [{"message": "Entity already exists", "extensions": {"code": "INVALID_INPUT"}}]}
            content = data.get("content")
            if not data.get("agentSessionId") or not isinstance(content, dict) or "type" not in content:
                return {"errors": [{"message": "invalid input", "extensions": {"code": "INVALID_INPUT"}}]}
            self.activities.append(
                Activity(
                    aid,
                    data["agentSessionId"],
                    content,
                    bool(data.get("ephemeral")),
                    data.get("signal"),
                    data.get("signalMetadata"),
                    time.time(),
                )
            )
            return {"data": {"agentActivityCreate": {"success": True, "agentActivity": {"id": aid}}}}
        if "agentSessionUpdate" in query:
            self.updates.append(dict(variables))
            return {"data": {"agentSessionUpdate": {"success": True}}}
        return {"errors": [{"message": "unknown operation"}]}


# ---- webhooks as Linear signs them ---------------------------------------------------------


def signed(body: bytes, *, secret: str = SECRET, delivery: str | None = None) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Linear-Signature": hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
        "Linear-Delivery": delivery or str(uuid.uuid4()),
        "Linear-Event": "AgentSessionEvent",
    }


def created(
    agent_session: str,
    *,
    comment: str | None = "@keel please help",
    context: str = "Issue ENG-1: fix it",
    at_ms: float | None = None,
) -> bytes:
    payload = {
        "type": "AgentSessionEvent",
        "action": "created",
        "organizationId": ORG,
        "oauthClientId": "client-1",
        "appUserId": "app-user-1",
        "webhookId": "wh-1",
        "createdAt": "2026-12-01T00:00:00.000Z",
        "webhookTimestamp": int(at_ms if at_ms is not None else time.time() * 1000),
        "agentSession": {
            "id": agent_session,
            "issue": {"id": "issue-1", "identifier": "ENG-1", "title": "Fix it"},
            "comment": {"id": "c-1", "body": comment} if comment else None,
            "creator": {"id": "user-alice"},
        },
        "promptContext": context,
    }
    return json.dumps(payload).encode()


def prompted(agent_session: str, activity: str, body: str, *, signal: str | None = None) -> bytes:
    payload = {
        "type": "AgentSessionEvent",
        "action": "prompted",
        "organizationId": ORG,
        "webhookTimestamp": int(time.time() * 1000),
        "agentSession": {"id": agent_session},
        "agentActivity": {
            "id": activity,
            "userId": "user-alice",
            "signal": signal,
            "content": {"type": "prompt", "body": body},
        },
    }
    return json.dumps(payload).encode()
