"""`python -m app` as a user runs it: embedded Valkey, kill -9, restart, start-up errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app import load_agent
from tests.conftest import ROOT, ValkeyServer, free_port
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


def first_line(svc: Service, **env: str) -> tuple[subprocess.Popen[str], str]:
    """`python -m app` started, and its first line on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app"],
        cwd=ROOT,
        env={**svc.env, "KEEL_LOG_LEVEL": "info", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    return proc, proc.stderr.readline()


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_the_first_line_says_where_to_go_and_what_runs(tmp_path: Path, valkey: ValkeyServer) -> None:
    svc = Service(tmp_path, free_port())
    proc, line = first_line(svc)
    try:
        assert f"keel on http://127.0.0.1:{svc.port}/ serving the demo page at /, the API at /v1" in line
        assert "no auth (KEEL_API_KEYS unset: loopback only)" in line
        assert f"model {type(load_agent('app.demo:agent').model).__name__} of app.demo:agent" in line
        assert f"Redis embedded Valkey, data in {svc.data_dir.resolve()}" in line
    finally:
        stop(proc)
    # a Redis of one's own, its password kept out; keys on, no demo page
    host, port = valkey.url.removeprefix("redis://").split(":")
    url = f"redis://:not-for-logs@{host}:{port.strip('/')}"
    proc, line = first_line(svc, REDIS_URL=url, KEEL_API_KEYS="k1", KEEL_PORT=str(free_port()))
    try:
        assert "serving the API at /v1; API keys required" in line, line
        assert f"Redis redis://:***@{host}:{port.strip('/')}" in line and "not-for-logs" not in line
    finally:
        stop(proc)


def test_a_port_in_use_is_one_line_naming_keel_port(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        svc = Service(tmp_path, port)
        r = subprocess.run(
            [sys.executable, "-m", "app"],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env=svc.env,
        )
    finally:
        holder.close()
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"keel: port {port} on 127.0.0.1 is in use: stop what holds it, or set KEEL_PORT to another"
    ]
    assert not (tmp_path / "data").exists()  # nothing was started


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_nothing_is_left_in_the_temp_dir_after_a_stop(tmp_path: Path, sig: int) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    svc = Service(tmp_path, free_port(), TMPDIR=str(tmp))
    svc.start()
    assert svc.proc is not None
    assert os.listdir(tmp)  # (the embedded Valkey's socket folder, while it runs)
    svc.proc.send_signal(sig)
    assert svc.wait_exit() == 0
    assert os.listdir(tmp) == []
