"""A real Redis Cluster on localhost for tests: N primaries (and replicas), free ports."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.ports import free_ports

__all__ = ["LocalCluster", "free_ports"]


@dataclass
class LocalCluster:
    """``redis-server --cluster-enabled yes`` processes joined by ``redis-cli --cluster create``."""

    state_dir: Path
    primaries: int = 3
    replicas: int = 0
    node_timeout_ms: int = 1000
    ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        self.ports = free_ports(self.primaries * (1 + self.replicas))
        for port in self.ports:
            self.start_node(port)
        for index, port in enumerate(self.ports):
            self.ports[index] = self._started(port)
        command = ["redis-cli", "--cluster", "create"]
        command += [f"127.0.0.1:{p}" for p in self.ports]
        command += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        subprocess.run(command, check=True, capture_output=True, timeout=60)
        self.wait_ok()

    def start_node(self, port: int) -> None:
        node_dir = self.state_dir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(node_dir),
            "--logfile", str(node_dir / "redis.log"),
        ]  # fmt: skip
        self.processes[port] = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _started(self, port: int, tries: int = 3) -> int:
        """The node's port once it answers; a node that exits at start (its
        port taken between the check and the bind) starts again elsewhere."""
        for attempt in range(1, tries + 1):
            if _wait_ping(port, self.processes[port]):
                return port
            log = _tail(self.state_dir / str(port) / "redis.log")
            del self.processes[port]
            if attempt == tries:
                raise TimeoutError(f"redis-server on {port} did not start: {log}")
            (port,) = free_ports(1, exclude=self.ports)
            self.start_node(port)
        raise AssertionError("unreachable")

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Until every live node says cluster_state:ok and agrees on all slots."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._node_ok(p) for p, proc in self.processes.items() if proc.poll() is None):
                return
            time.sleep(0.1)
        raise TimeoutError("cluster did not become ok")

    def _node_ok(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError):
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
            info: Any = client.execute_command("CLUSTER INFO")
            return str(info.get("cluster_state")) == "ok" and int(info["cluster_slots_ok"]) == 16384
        return False

    def primary_of(self, key: str) -> int:
        client = redis.Redis(host="127.0.0.1", port=self.live_port(), socket_timeout=5)
        slot = int(client.execute_command("CLUSTER KEYSLOT", key))
        for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise LookupError(key)

    def live_port(self) -> int:
        return next(p for p, proc in self.processes.items() if proc.poll() is None)

    def kill(self, port: int) -> None:
        self.processes[port].kill()
        self.processes[port].wait()

    def wait_failover(self, dead: int, timeout_s: float = 30) -> None:
        """Until a live node reports the slots of ``dead`` served by another primary."""
        live = self.live_port()
        client = redis.Redis(host="127.0.0.1", port=live, socket_timeout=2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                slots: Any = client.execute_command("CLUSTER SLOTS")
                owners = {int(primary[1]) for _, _, primary, *_ in slots}
                if dead not in owners and self._node_ok(live):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"no replica took over from {dead}")

    def admin(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)

    def node_id(self, port: int) -> str:
        return str(self.admin(port).execute_command("CLUSTER MYID").decode())

    def primaries_now(self) -> list[int]:
        """Ports of the live nodes that are primaries now (failovers move them)."""
        return [p for p in self.processes if self._role(p) == "master"]

    def _role(self, port: int) -> str:
        with contextlib.suppress(redis.RedisError):
            return str(self.admin(port).execute_command("ROLE")[0].decode())
        return "down"

    def migrate_slot(self, slot: int, source: int, target: int, key_pause_s: float = 0) -> None:
        """Move ``slot`` from primary ``source`` to primary ``target`` the way
        ``redis-cli --cluster reshard`` does, one key at a time with
        ``key_pause_s`` between keys (a slow migration: clients meet ASK and
        TRYAGAIN for that long)."""
        src, dst = self.admin(source), self.admin(target)
        src_id, dst_id = self.node_id(source), self.node_id(target)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        while names := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 1):
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *names)
            time.sleep(key_pause_s)
        # The target first, so that it owns the slot before the source lets go.
        for port in [target, source, *self.primaries_now()]:
            self.admin(port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()

    def manual_failover(self, primary: int, timeout_s: float = 30) -> int:
        """``CLUSTER FAILOVER`` on a replica of ``primary`` (no write is lost:
        the replica catches up first); the port of the new primary."""
        _, _, replicas = self.admin(primary).execute_command("ROLE")  # [[host, port, offset]]
        port = int(replicas[0][1])
        self.admin(port).execute_command("CLUSTER FAILOVER")
        deadline = time.monotonic() + timeout_s
        while self._role(port) != "master" or self._role(primary) != "slave":
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {port} did not take over from {primary}")
            time.sleep(0.1)
        self.wait_ok()
        return port

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.state_dir, ignore_errors=True)


def _wait_ping(port: int, process: subprocess.Popen[bytes], timeout_s: float = 10) -> bool:
    """Whether the server on ``port`` answered before it exited or time ran out."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return True
        time.sleep(0.05)
    process.kill()
    process.wait()
    return False


def _tail(log: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(log.read_text().splitlines()[-lines:])
    return "(no log)"


# --- fixtures: a module imports these to run its tests on a cluster ----------

needs_cluster_tools = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="needs redis-server and redis-cli",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """3 primaries, each with a replica (failover needs one), for a whole module."""
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="wsinfer-cluster-")), replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_url(cluster: LocalCluster) -> str:
    """The cluster, emptied: every test starts from no keys."""
    cluster.wait_ok()
    for port, process in cluster.processes.items():
        if process.poll() is not None:
            continue
        client = redis.Redis(host="127.0.0.1", port=port)
        if client.execute_command("ROLE")[0] == b"master":
            client.flushall()
        client.close()
    return cluster.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    from wsinfer.sessions.connect import sync_client

    client = sync_client(redis_url)
    yield client
    client.close()
