"""`python -m app` as a user runs it: embedded Valkey, kill -9, restart, start-up errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, free_port


class Service:
    def __init__(self, data_dir: Path, **env: str) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
        self.env.update(
            {"KEEL_PORT": str(self.port), "KEEL_DATA_DIR": str(data_dir), "KEEL_LOG_LEVEL": "warning", **env}
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        log = self.data_dir.parent / "keel.log"
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app"], cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=err
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"keel exited: {log.read_text()}")
            try:
                if httpx.get(f"{self.base}/readyz", timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("keel did not become ready")

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


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "data")
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
    ],
)
def test_start_up_errors_are_one_line(tmp_path: Path, env: dict[str, str], message: str) -> None:
    svc = Service(tmp_path / "data", **env)
    r = subprocess.run(
        [sys.executable, "-m", "app"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=30, env=svc.env
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith(("WARNING", "INFO")) and " WARNING " not in ln]
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
