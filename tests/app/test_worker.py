"""Web and worker as separate processes on one Redis: turns run in the worker, events reach the
web process's clients through the outbox stream."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import load_agent
from tests.conftest import ROOT, ValkeyServer


@pytest.fixture
def worker(valkey: ValkeyServer, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(REDIS_URL=valkey.url, KEEL_AGENT="app.demo:agent", KEEL_LOG_LEVEL="warning")
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.worker"], cwd=ROOT, env=env, stdout=log, stderr=log)
    yield proc
    proc.terminate()
    assert proc.wait(timeout=15) == 0, (tmp_path / "worker.log").read_text()


@pytest.mark.slow
async def test_turns_run_in_the_worker_process(serve: Any, worker: subprocess.Popen[bytes]) -> None:
    live = await serve(load_agent("app.demo:agent"), run_turns=False)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=20", json={"text": "add 2 and 40"})
        assert r.json()["status"] == "completed", r.json()
        assert r.json()["reply"] == "The add tool says: 42"
        assert live.app.state.harness.runner is None  # nothing ran in the web process


def test_the_worker_refuses_to_start_without_redis_url(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
    r = subprocess.run(
        [sys.executable, "-m", "app.worker"], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 1
    assert r.stderr.strip() == "keel worker: the worker needs REDIS_URL: the embedded Valkey belongs to one web process"


def test_the_worker_runs_on_uvloop_where_it_is_installed() -> None:
    """As the web process does under uvicorn: a worker's turn costs 6-8% less CPU on it
    (docs/benchmarks.md, "The worker's event loop")."""
    import uvloop

    from app.worker import new_loop

    loop = new_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
