"""Shared fixtures: generated checkpoints, real ple-server processes, leak checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pleclient import PleClient, PleError
from pleserver.synthetic import SyntheticTable, write_checkpoint

SMALL_TABLES = (
    SyntheticTable(layer=1, rows=20_011, cols=160, dtype="F8_E4M3", parts=8, scale=0.0125),
    SyntheticTable(layer=3, rows=10_007, cols=160, dtype="BF16", parts=4),
)


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("ple", "sem.ple"))}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_names():
    """The whole suite leaves no shared-memory or semaphore names behind."""
    before = shm_names()
    yield
    leaked = shm_names() - before
    assert not leaked, f"tests leaked /dev/shm entries: {sorted(leaked)}"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A small checkpoint: FP8 table (layer 1) and BF16 table (layer 3), partial
    last shards, shards over two files, a non-PLE tensor in the first file."""
    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(path), SMALL_TABLES, files=2)
    return path


class ServerProcess:
    """A real `pleserver serve` process on a private socket."""

    def __init__(self, model: Path, workdir: Path, *extra: str, env: dict | None = None,
                 wait: bool = True) -> None:
        self.socket = str(workdir / f"ple-{os.getpid()}-{time.monotonic_ns()}.sock")
        self.log_path = workdir / f"server-{time.monotonic_ns()}.log"
        self.args = [sys.executable, "-m", "pleserver.cli", "serve", "--model", str(model),
                     "--socket", self.socket, "--log-level", "DEBUG", *extra]
        self._log = open(self.log_path, "wb")
        # PLE_SERVER_CONFIG: never read a host's /etc/ple-server/config.toml.
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PLE_SERVER_CONFIG": os.devnull,
                                          **(env or {})})
        if wait:
            self.wait_ready()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ple-server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                PleClient.query_stats(self.socket, timeout=1.0)
                return
            except PleError:
                time.sleep(0.05)
        raise RuntimeError(f"ple-server not ready after {timeout} s:\n{self.log()}")

    def client(self, **kwargs) -> PleClient:
        return PleClient.connect(self.socket, **kwargs)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(model, *flags) → ServerProcess, stopped at teardown."""
    servers: list[ServerProcess] = []

    def start(model: Path, *extra: str, **kwargs) -> ServerProcess:
        server = ServerProcess(model, tmp_path, *extra, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server, checkpoint) -> ServerProcess:
    return start_server(checkpoint)
