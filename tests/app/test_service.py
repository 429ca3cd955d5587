"""`python -m app` as a user runs it: embedded Valkey, kill -9, restart, start-up errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port
from tests.service import Service


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    yield svc
    svc.stop()


def valkey_pid(data_dir: Path) -> int:
    return int((data_dir / "valkey.pid").read_text().strip())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status").read_text()
    return "State:\tZ" not in status


@pytest.mark.slow
def test_kill_9_then_restart_keeps_every_committed_session(service: Service) -> None:
    service.start()
    with httpx.Client(base_url=service.base, timeout=10) as c:
        sids = []
        for n in range(3):
            sid = c.post("/v1/sessions", json={"metadata": {"n": n}}).json()["session_id"]
            r = c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"hello {n}", "context": "page"})
            assert r.json()["status"] == "completed"
            sids.append(sid)
        before = {sid: c.get(f"/v1/sessions/{sid}/history").json() for sid in sids}
    vk = valkey_pid(service.data_dir)
    service.kill9()
    deadline = time.monotonic() + 10
    while alive(vk) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(vk), "the embedded Valkey outlived the service"

    service.start()
    with httpx.Client(base_url=service.base, timeout=10) as c:
        for n, sid in enumerate(sids):
            assert c.get(f"/v1/sessions/{sid}/history").json() == before[sid]
            info = c.get(f"/v1/sessions/{sid}").json()
            assert info["metadata"] == {"n": n} and info["status"] == "idle"
        r = c.post(f"/v1/sessions/{sids[0]}/messages?wait=true", json={"text": "after restart"})
        assert r.json()["status"] == "completed"


@pytest.mark.slow
def test_a_second_service_on_the_same_data_dir_is_refused(service: Service, tmp_path: Path) -> None:
    service.start()
    other = subprocess.run(
        [sys.executable, "-m", "app"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**service.env, "KEEL_PORT": str(free_port())},
    )
    assert other.returncode == 1
    assert other.stderr.strip().endswith(f"another keel process is using {service.data_dir.resolve()}")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"REDIS_URL": "redis://127.0.0.1:1"}, "keel: REDIS_URL is not reachable"),
        ({"KEEL_HOST": "0.0.0.0"}, "keel: KEEL_API_KEYS is unset: keel serves without auth only on loopback"),
        ({"KEEL_PORT": "eighty"}, "keel: KEEL_PORT must be a whole number"),
        (
            {"KEEL_MODEL": "anthropic:claude-x", "ANTHROPIC_API_KEY": ""},
            "keel: KEEL_MODEL: model 'anthropic:claude-x' needs ANTHROPIC_API_KEY",
        ),
        ({"KEEL_MODEL": "gemini:pro"}, "keel: KEEL_MODEL: model 'gemini:pro': the provider is one of"),
        ({"SLACK_SIGNING_SECRET": "s"}, "keel: the Slack channel needs both SLACK_SIGNING_SECRET and SLACK_BOT_TOKEN"),
        ({"SLACK_BOT_TOKEN": "xoxb-1"}, "keel: the Slack channel needs both SLACK_SIGNING_SECRET and SLACK_BOT_TOKEN"),
        ({"KEEL_SLACK_API_URL": "slack.local"}, "keel: KEEL_SLACK_API_URL must be an http(s) URL"),
        ({"KEEL_RATE_LIMIT": "60 per minute"}, "keel: KEEL_RATE_LIMIT: a rate looks like 60/min"),
        ({"KEEL_RATE_LIMIT": "0/min"}, "keel: KEEL_RATE_LIMIT: a rate looks like 60/min"),
        (
            {"LINEAR_API_KEY": "lin_api_x"},
            "keel: the Linear channel needs both LINEAR_WEBHOOK_SECRET and LINEAR_API_KEY",
        ),
    ],
)
def test_start_up_errors_are_one_line(tmp_path: Path, env: dict[str, str], message: str) -> None:
    svc = Service(tmp_path, free_port(), **env)
    r = subprocess.run(
        [sys.executable, "-m", "app"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=30, env=svc.env
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(("WARNING", "INFO")) and " WARNING " not in ln]
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
