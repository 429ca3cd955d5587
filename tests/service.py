"""keel as a user runs it, for tests that kill it: `python -m app` in a subprocess, and an SSE
client that follows a session across restarts the way a browser's EventSource does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from harness.store.keys import JOBS, JOBS_GROUP

ROOT = Path(__file__).resolve().parents[1]


class _Process:
    """A keel process a test started: waited for, or stopped with SIGTERM (SIGKILL after 15 s)."""

    proc: subprocess.Popen[bytes] | None = None

    def wait_exit(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Service(_Process):
    def __init__(self, workdir: Path, port: int, **env: str) -> None:
        self.port = port
        self.workdir = workdir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
        self.env.update({"KEEL_PORT": str(port), "KEEL_DATA_DIR": str(workdir / "data"), "KEEL_LOG_LEVEL": "warning"})
        self.env.update(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{port}"
        self.log = workdir / "keel.log"

    @property
    def data_dir(self) -> Path:
        return Path(self.env["KEEL_DATA_DIR"])

    def start(self, timeout: float = 20.0, **env: str) -> None:
        """Start (again), with `env` on top of the service's environment for this run only."""
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app"], cwd=ROOT, env={**self.env, **env}, stdout=subprocess.DEVNULL, stderr=err
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"keel exited: {self.log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/readyz", timeout=0.5).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError("keel did not become ready")


class Worker(_Process):
    """`python -m app.worker` in a subprocess: ready once it reads the turn job stream (its
    consumer, named for its host and pid, is in the group)."""

    def __init__(self, workdir: Path, redis_url: str, **env: str) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
        self.env.update({"REDIS_URL": redis_url, "KEEL_LOG_LEVEL": "warning", **env})
        self.redis_url = redis_url
        self.log = workdir / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app.worker"], cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=err
            )
        name = f"{socket.gethostname()}-{self.proc.pid}"
        deadline = time.monotonic() + timeout
        with redis.Redis.from_url(self.redis_url) as r:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"the worker exited: {self.log.read_text()}")
                with contextlib.suppress(redis.ResponseError):
                    if any(c["name"].decode() == name for c in r.xinfo_consumers(JOBS, JOBS_GROUP)):
                        return
                time.sleep(0.05)
        raise AssertionError("the worker did not start reading jobs")


class EventTail:
    """Reads a session's SSE stream into `events`, reconnecting with Last-Event-ID whenever the
    connection drops (as EventSource does), until stopped; to `base` as it is then (a test may
    point it at another process). `endings`: how each connection ended ("end": the server
    ended the stream cleanly, else the error's name)."""

    def __init__(self, base: str, sid: str) -> None:
        self.base, self.sid = base, sid
        self.events: list[dict[str, Any]] = []
        self.endings: list[str] = []
        self.connections = 0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_for(self, etype: str, count: int = 1, timeout: float = 30.0) -> dict[str, Any]:
        """The `count`-th event of type `etype`, once it has arrived."""
        async with asyncio.timeout(timeout):
            while True:
                seen = [e for e in self.events if e["type"] == etype]
                if len(seen) >= count:
                    return seen[count - 1]
                self._changed.clear()
                await self._changed.wait()

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=None)) as client:
            while True:
                headers = {"Last-Event-ID": self.events[-1]["id"]} if self.events else {}
                try:
                    async with client.stream("GET", f"{self.base}/v1/sessions/{self.sid}/events", headers=headers) as r:
                        self.connections += 1
                        data = None
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                data = line[6:]
                            elif line == "" and data is not None:
                                self.events.append(json.loads(data))
                                data = None
                                self._changed.set()
                    self.endings.append("end")
                except (httpx.HTTPError, OSError) as exc:
                    self.endings.append(type(exc).__name__)
                self._changed.set()
                await asyncio.sleep(0.05)  # reconnect delay (EventSource waits `retry` ms)
