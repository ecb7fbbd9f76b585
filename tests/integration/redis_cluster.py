"""A real Redis Cluster on loopback for tests: N masters started with ``redis-server --cluster-enabled
yes`` (AOF on, one data dir each) and joined with ``redis-cli --cluster create``; a master can be
killed with SIGKILL and restarted on its data dir (its nodes.conf keeps its id and slots)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["LocalRedisCluster"]


def _free_ports(n: int) -> list[int]:
    # Cluster bus port = port + 10000: both must be free.
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535 or p in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        ports.append(p)
    return ports


class LocalRedisCluster:
    def __init__(self, root: Path, masters: int = 3) -> None:
        self.root = Path(root)
        self.ports = _free_ports(masters)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def _spawn(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
             "--dir", str(d), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--daemonize", "no", "--logfile", str(d / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.procs[port].poll() is not None:
                    raise RuntimeError(
                        f"redis-server on {port} did not start; see {d / 'redis.log'}"
                    ) from None
                time.sleep(0.05)

    def start(self) -> LocalRedisCluster:
        for p in self.ports:
            self._spawn(p)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node reports cluster_state:ok and agrees on all 16384 slots."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [redis.Redis(port=p, socket_timeout=1).cluster("info") for p in self.ports]
                if all(i["cluster_state"] == "ok" and int(i["cluster_slots_ok"]) == 16384 for i in infos):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def master_of(self, key: str) -> int:
        """Port of the master that serves ``key``'s slot."""
        r = redis.Redis(port=self.ports[0], socket_timeout=5)
        slot = int(r.execute_command("CLUSTER KEYSLOT", key))
        for lo, hi, master, *_ in r.execute_command("CLUSTER SLOTS"):
            if int(lo) <= slot <= int(hi):
                return int(master[1])
        raise LookupError(f"slot {slot} of {key!r} is not served")

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, port: int) -> None:
        self._spawn(port)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
