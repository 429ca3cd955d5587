"""A webhook receiver that verifies every delivery with the `standardwebhooks` package, in a
thread of its own (it outlives keel processes a crash test kills). Each subscription posts to a
path of its own; a path can be told to fail, to be slow, or to answer 410."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.conftest import free_port


@dataclass
class Delivery:
    path: str
    webhook_id: str
    body: bytes
    status: int
    at: float


@dataclass
class Behaviour:
    secret: str
    fail_every: int = 0  # every n-th request gets a 500 (1: all of them)
    fail_once_every: int = 0  # every n-th new webhook-id's first request gets a 500 (2: half the ids)
    slow_first: int = 0  # the first n requests take `slow_s` seconds
    slow_s: float = 30.0
    gone: bool = False  # answer 410
    busy_first: int = 0  # the first n requests get a 503 with Retry-After: `busy_after`
    busy_after: str = "6"
    requests: int = 0
    ids: set[str] = field(default_factory=set)  # the webhook-ids seen so far


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    deliveries: list[Delivery] = field(default_factory=list)
    traceparents: list[str] = field(default_factory=list)  # the deliveries' traceparent headers (keel tracing)
    paths: dict[str, Behaviour] = field(default_factory=dict)
    invalid: int = 0  # requests whose signature did not verify

    def __post_init__(self) -> None:
        self.lock = threading.Condition()
        routes = [Route("/{path}", self._handle, methods=["POST"])]
        self.server = uvicorn.Server(
            uvicorn.Config(
                Starlette(routes=routes),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def start(self) -> Receiver:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise AssertionError("the receiver did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def expect(self, path: str, secret: str, **behaviour: Any) -> None:
        with self.lock:
            self.paths[path] = Behaviour(secret, **behaviour)

    def delivered(self, path: str) -> list[Delivery]:
        """The deliveries the receiver accepted (2xx) on `path`, in the order they came."""
        with self.lock:
            return [d for d in self.deliveries if d.path == path and d.status == 200]

    def attempts(self, path: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.deliveries if d.path == path]

    def wait_until(self, check: Callable[[Receiver], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not check(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out; {len(self.deliveries)} deliveries")
                self.lock.wait(left)

    async def until(self, check: Callable[[Receiver], bool], timeout: float = 20.0) -> None:
        await asyncio.to_thread(self.wait_until, check, timeout)

    async def _handle(self, request: Request) -> Response:
        path = request.path_params["path"]
        body = await request.body()
        with self.lock:
            behaviour = self.paths.get(path)
            if behaviour is None:
                return Response(status_code=404)
            behaviour.requests += 1
            n = behaviour.requests
            webhook_id = request.headers.get("webhook-id", "")
            new = webhook_id not in behaviour.ids
            behaviour.ids.add(webhook_id)
            fail_once = new and behaviour.fail_once_every > 0 and len(behaviour.ids) % behaviour.fail_once_every == 0
        try:
            Webhook(behaviour.secret).verify(body, dict(request.headers))
        except Exception:
            with self.lock:
                self.invalid += 1
                self.lock.notify_all()
            return Response(status_code=400)
        if n <= behaviour.slow_first:
            await asyncio.sleep(behaviour.slow_s)
        failing = (behaviour.fail_every and n % behaviour.fail_every == 0) or fail_once
        status = 410 if behaviour.gone else 500 if failing else 200
        headers = {}
        if n <= behaviour.busy_first:
            status, headers = 503, {"Retry-After": behaviour.busy_after}
        with self.lock:
            self.deliveries.append(Delivery(path, request.headers["webhook-id"], body, status, time.time()))
            if "traceparent" in request.headers:  # (keel's tracing on: each delivery names its span)
                self.traceparents.append(request.headers["traceparent"])
            self.lock.notify_all()
        return Response(status_code=status, headers=headers)
