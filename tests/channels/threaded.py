"""keel on uvicorn in a thread with its own event loop, for synchronous clients (schemathesis,
hypothesis) that cannot run in the test loop."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn

from app import create_app
from app.__main__ import uvicorn_options
from app.settings import Settings
from harness import Agent
from tests.conftest import free_port


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.ready.set()


class ThreadedKeel:
    def __init__(self, agent: Agent, redis_url: str, **settings: Any) -> None:
        self.settings = Settings(**settings)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws_base = f"ws://127.0.0.1:{self.port}"
        options = {**uvicorn_options(self.settings), "log_level": "warning"}
        app = create_app(self.settings, redis_url=redis_url, agent=agent)
        self.app = app
        self.server = _Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, lifespan="on", **options))
        self.thread = threading.Thread(target=self.server.run, name="keel", daemon=True)

    def __enter__(self) -> ThreadedKeel:
        self.thread.start()
        if not self.server.ready.wait(20):
            raise TimeoutError("keel did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
