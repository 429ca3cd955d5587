"""The container (issue 16): no Docker engine runs here, so the image's recipe is checked piece by
piece. The files the Dockerfile copies are installed with `pip install .` into a directory of
their own; keel then runs from there, outside the repository, as compose.yaml's web and worker
with compose's environment, and the Dockerfile's own HEALTHCHECK command says healthy once a
turn can run. Plus the facts a deployment relies on: non-root, AOF with fsync always, the
settings compose uses all documented."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ValkeyServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
pytestmark = pytest.mark.slow


def instructions(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def env_of(service: str, **values: str) -> dict[str, str]:
    """compose's environment for `service`, `${X:-default}` resolved to its default, then `values`."""
    out = {}
    for name, raw in COMPOSE["services"][service]["environment"].items():
        out[name] = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(raw))
    return {k: v for k, v in out.items() if "${" not in v} | values


def test_the_image_runs_as_a_user_and_checks_readiness() -> None:
    (user,) = instructions("USER")
    assert user.strip() not in ("root", "0")
    assert instructions("FROM") == ["python:3.11-slim"]
    assert any("pip install ." in r for r in instructions("RUN"))
    (check,) = instructions("HEALTHCHECK")
    assert "/readyz" in check
    assert json.loads(instructions("CMD")[-1]) == ["python", "-m", "app"]


def test_compose_is_valkey_with_aof_a_web_and_a_worker() -> None:
    services = COMPOSE["services"]
    assert set(services) == {"valkey", "web", "worker"}
    command = services["valkey"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert services["web"]["environment"]["KEEL_HOST"] == "0.0.0.0"
    assert "?" in services["web"]["environment"]["KEEL_API_KEYS"]  # compose refuses to start without keys
    assert services["worker"]["command"] == ["python", "-m", "app.worker"]
    configuration = (ROOT / "docs" / "configuration.md").read_text()  # the table the README links
    for service in ("web", "worker"):
        for name in services[service]["environment"]:
            assert f"`{name}`" in configuration, f"{name} (compose.yaml) is not in docs/configuration.md"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the image holds: the Dockerfile's COPY sources, installed with pip into a directory."""
    tmp = tmp_path_factory.mktemp("image")
    src = tmp / "src"
    src.mkdir()
    for copy in instructions("COPY"):
        *sources, _ = copy.split()
        for name in sources:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(path, src / name)
    site = tmp / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run([*pip, str(src)], check=True, cwd=tmp, timeout=300, capture_output=True)
    where = subprocess.run(
        [sys.executable, "-c", "import app, channels, harness; print(app.__file__, channels.__file__)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(p.startswith(str(site)) for p in where.split())  # keel runs from there, not the repository
    return site


@pytest.fixture
def processes(installed: Path, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
        proc.wait(timeout=20)


def run_as(installed: Path, home: Path, env: dict[str, str], *command: str) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "REDIS_URL"))}
    full = {**base, **env, "PYTHONPATH": str(installed), "HOME": str(home), "KEEL_DATA_DIR": str(home / "data")}
    with open(home / f"{command[-1]}.log", "wb") as log:  # (the process has its own copy of the file)
        return subprocess.Popen([sys.executable, *command], cwd=home, env=full, stdout=log, stderr=subprocess.STDOUT)


def _run_check(check: list[str], port: int) -> int:
    env = {**os.environ, "KEEL_PORT": str(port)}
    return subprocess.run(check, env=env, timeout=10, check=False, capture_output=True).returncode


async def test_the_installed_package_serves_as_compose_runs_it(
    installed: Path, processes: list[subprocess.Popen[bytes]], valkey: ValkeyServer, tmp_path: Path
) -> None:
    port = free_port()
    web = env_of("web", REDIS_URL=valkey.url, KEEL_API_KEYS="compose-key", KEEL_PORT=str(port))
    processes.append(run_as(installed, tmp_path, web, "-m", "app"))
    processes.append(run_as(installed, tmp_path, env_of("worker", REDIS_URL=valkey.url), "-m", "app.worker"))
    check = json.loads(instructions("HEALTHCHECK")[0].split("CMD", 1)[1])
    deadline = time.monotonic() + 30  # docker's start period: the check fails until keel listens
    while (healthy := _run_check(check, port)) != 0 and time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), (tmp_path / "app.log").read_text(errors="replace")
    assert healthy == 0, (tmp_path / "app.log").read_text(errors="replace")
    headers = {"Authorization": "Bearer compose-key"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as c:
        assert (await c.get("/widget.js")).status_code == 200  # package data made it into the install
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hello"})
        assert r.status_code == 200 and r.json()["status"] == "completed", r.text  # the worker ran it
        assert (await c.post("/v1/sessions", headers={"Authorization": ""})).status_code == 401
