"""A local server that speaks Slack's Web API as keel uses it (`auth.test`, `chat.postMessage`,
`chat.update`, `chat.postEphemeral`, `conversations.replies` with `include_all_metadata`), with
rate limits (429 + Retry-After) and `ok: false` errors on demand, and helpers to sign Events
API and interactivity requests with slack_sdk's SignatureVerifier.

It runs uvicorn in a thread of its own, so it outlives the keel processes a crash test kills
and serves them all."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, urlencode

import uvicorn
from slack_sdk.signature import SignatureVerifier
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.conftest import free_port

TOKEN = "xoxb-test-token"
SECRET = "test-signing-secret"
TEAM = "T0TEAM"
BOT = "U0BOT"


@dataclass
class Message:
    ts: str
    channel: str
    thread_ts: str | None
    text: str
    blocks: list[Any] | None = None
    metadata: dict[str, Any] | None = None
    updates: int = 0


@dataclass
class Fault:
    method: str
    status: int = 429
    error: str = ""
    retry_after: str = "1"
    times: int = 1


@dataclass
class FakeSlack:
    port: int = field(default_factory=free_port)
    messages: list[Message] = field(default_factory=list)
    ephemerals: list[dict[str, Any]] = field(default_factory=list)
    calls: list[tuple[str, float]] = field(default_factory=list)
    traceparents: list[str] = field(default_factory=list)  # the calls' traceparent headers (keel tracing)
    faults: list[Fault] = field(default_factory=list)
    delay: float = 0.0  # seconds every call takes

    def __post_init__(self) -> None:
        self.lock = threading.Condition()
        self._clock = 0.0
        self._refuse: list[tuple[str, str]] = []
        routes = [Route("/api/{method}", self._handle, methods=["GET", "POST"])]
        self.server = uvicorn.Server(
            uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/"

    def start(self) -> FakeSlack:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError("the fake Slack server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    # ---- what tests look at ------------------------------------------------------------

    def posts(self, thread_ts: str | None = None) -> list[Message]:
        """Copies of the messages (in the thread), as they are now."""
        with self.lock:
            return [replace(m) for m in self.messages if thread_ts is None or m.thread_ts == thread_ts]

    def count(self, method: str) -> int:
        with self.lock:
            return sum(1 for m, _ in self.calls if m == method)

    def fail(self, method: str, *, status: int = 429, error: str = "", retry_after: str = "1", times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(method, status, error, retry_after, times))

    def refuse_text(self, prefix: str, error: str) -> None:
        """The next chat.postMessage whose text starts with `prefix` gets `ok: false`."""
        with self.lock:
            self._refuse.append((prefix, error))

    def wait_until(self, check: Callable[[FakeSlack], bool], timeout: float = 15.0) -> None:
        """Block until `check(self)` holds (it is re-checked on every call the server takes)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not check(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; posts: {[m.text for m in self.messages]}")
                self.lock.wait(left)

    async def until(self, check: Callable[[FakeSlack], bool], timeout: float = 15.0) -> None:
        await asyncio.to_thread(self.wait_until, check, timeout)

    # ---- the Web API -------------------------------------------------------------------

    async def _handle(self, request: Request) -> JSONResponse:
        method = request.path_params["method"]
        args = await _args(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        with self.lock:
            self.calls.append((method, time.monotonic()))
            if "traceparent" in request.headers:  # (keel's tracing on: each call names its span)
                self.traceparents.append(request.headers["traceparent"])
            try:
                if request.headers.get("authorization") != f"Bearer {TOKEN}":
                    return JSONResponse({"ok": False, "error": "invalid_auth"})
                fault = next((f for f in self.faults if f.method == method and f.times > 0), None)
                if fault is not None:
                    fault.times -= 1
                    if fault.status == 429:
                        return JSONResponse(
                            {"ok": False, "error": "ratelimited"}, 429, headers={"Retry-After": fault.retry_after}
                        )
                    return JSONResponse({"ok": False, "error": fault.error or "internal_error"}, fault.status)
                return JSONResponse(self._answer(method, args))
            finally:
                self.lock.notify_all()

    def _answer(self, method: str, a: dict[str, Any]) -> dict[str, Any]:
        if method == "auth.test":
            return {"ok": True, "user_id": BOT, "team_id": TEAM, "bot_id": "B0BOT"}
        if method == "chat.postMessage":
            refused = next((r for r in self._refuse if str(a.get("text", "")).startswith(r[0])), None)
            if refused is not None:
                self._refuse.remove(refused)
                return {"ok": False, "error": refused[1]}
            if not a.get("channel") or not a.get("text"):
                return {"ok": False, "error": "no_text" if a.get("channel") else "channel_not_found"}
            if a["channel"] == "C0GONE":
                return {"ok": False, "error": "channel_not_found"}
            self._clock = max(time.time(), self._clock + 0.000100)  # like Slack's: after the thread's root
            ts = f"{self._clock:.6f}"
            metadata = _json_or(a.get("metadata"))
            blocks = _json_or(a.get("blocks"))
            self.messages.append(Message(ts, a["channel"], a.get("thread_ts"), a["text"], blocks, metadata))
            return {"ok": True, "channel": a["channel"], "ts": ts}
        if method == "chat.update":
            found = next((m for m in self.messages if m.ts == a.get("ts") and m.channel == a.get("channel")), None)
            if found is None:
                return {"ok": False, "error": "message_not_found"}
            found.text, found.blocks = a.get("text", found.text), _json_or(a.get("blocks"))
            if a.get("metadata"):
                found.metadata = _json_or(a["metadata"])
            found.updates += 1
            return {"ok": True, "channel": found.channel, "ts": found.ts}
        if method == "chat.postEphemeral":
            self.ephemerals.append(dict(a))
            return {"ok": True, "message_ts": "1.0"}
        if method == "conversations.replies":
            return self._replies(a)
        return {"ok": False, "error": "unknown_method"}

    def _replies(self, a: dict[str, Any]) -> dict[str, Any]:
        root, oldest = a.get("ts"), float(a.get("oldest") or 0)
        include = str(a.get("include_all_metadata", "")).lower() in ("1", "true")
        thread = [m for m in self.messages if m.channel == a.get("channel") and m.thread_ts == root]
        thread = [m for m in thread if float(m.ts) >= oldest]
        start = int(a.get("cursor") or 0)
        limit = int(a.get("limit") or 100)
        page = thread[start : start + limit]
        out = []
        for m in page:
            item: dict[str, Any] = {"type": "message", "ts": m.ts, "text": m.text, "thread_ts": m.thread_ts}
            if include and m.metadata:
                item["metadata"] = m.metadata
            out.append(item)
        more = start + limit < len(thread)
        return {
            "ok": True,
            "messages": out,
            "has_more": more,
            "response_metadata": {"next_cursor": str(start + limit) if more else ""},
        }


async def _args(request: Request) -> dict[str, Any]:
    args: dict[str, Any] = dict(request.query_params)
    body = await request.body()
    if not body:
        return args
    if request.headers.get("content-type", "").startswith("application/json"):
        args.update(json.loads(body))
    else:
        args.update({k: v[0] for k, v in parse_qs(body.decode()).items()})
    return args


def _json_or(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


# ---- requests as Slack signs them ----------------------------------------------------------


def signed(body: bytes, *, secret: str = SECRET, at: float | None = None, **headers: str) -> dict[str, str]:
    timestamp = str(int(at if at is not None else time.time()))
    signature = SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body)
    assert signature is not None
    return {"X-Slack-Request-Timestamp": timestamp, "X-Slack-Signature": signature, **headers}


def event_body(
    text: str,
    *,
    ts: str,
    kind: str = "app_mention",
    user: str = "U0ALICE",
    channel: str = "C0GENERAL",
    thread_ts: str | None = None,
    team: str = TEAM,
    event_id: str | None = None,
    **extra: Any,
) -> bytes:
    event: dict[str, Any] = {"type": kind, "user": user, "text": text, "ts": ts, "channel": channel, "event_ts": ts}
    if thread_ts:
        event["thread_ts"] = thread_ts
    event.update(extra)
    envelope = {
        "token": "legacy",
        "team_id": team,
        "api_app_id": "A0APP",
        "type": "event_callback",
        "event_id": event_id or f"Ev{ts.replace('.', '')}{kind[:3]}",
        "event_time": int(float(ts)),
        "authorizations": [{"team_id": team, "user_id": BOT, "is_bot": True}],
        "event": event,
    }
    return json.dumps(envelope).encode()


def click_body(
    message: Message, action: str, *, user: str = "U0ALICE", team: str = TEAM, value: str | None = None
) -> bytes:
    """A block_actions payload for a click on `message`'s button `action` (approve or deny)."""
    assert message.blocks is not None
    buttons = next(b for b in message.blocks if b["type"] == "actions")["elements"]
    button = next(b for b in buttons if b["action_id"] == f"keel_{action}")
    payload = {
        "type": "block_actions",
        "team": {"id": team, "domain": "test"},
        "user": {"id": user, "team_id": team},
        "api_app_id": "A0APP",
        "container": {"type": "message", "message_ts": message.ts, "channel_id": message.channel},
        "channel": {"id": message.channel},
        "message": {"ts": message.ts, "thread_ts": message.thread_ts, "text": message.text},
        "trigger_id": "1.2.3",
        "response_url": "http://127.0.0.1:9/unused",
        "actions": [
            {
                "action_id": button["action_id"],
                "block_id": "b",
                "value": value if value is not None else button["value"],
                "type": "button",
                "action_ts": str(time.time()),
            }
        ],
    }
    return urlencode({"payload": json.dumps(payload)}).encode()
