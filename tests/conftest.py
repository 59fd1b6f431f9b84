"""Every fixture of the tests: generated checkpoints, real ple-server processes
(``pleserver.devkit.launcher``), leak checks. Tools that are not fixtures are in
``tests/harness.py``."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from pleserver.config import SETTINGS
from pleserver.devkit.launcher import LaunchedServer
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from tests.harness import server_launcher, shm_entries

SMALL_TABLES = (
    SyntheticTable(layer=1, rows=20_011, cols=160, dtype="F8_E4M3", parts=8, scale=0.0125),
    SyntheticTable(layer=3, rows=10_007, cols=160, dtype="BF16", parts=4),
)


def pytest_report_header(config) -> list[str]:
    """The host facts some tests depend on, in the run's header: a report names
    the CPU it passed on, and whether vLLM's AMX path was shown forced."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    shown = sorted(flags & {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx2"})
    amx = os.environ.get("PLESERVER_TEST_AMX", "host")
    return [
        f"cpu: {model} ({os.cpu_count()} cpus); flags: {' '.join(shown) or 'none of interest'}",
        f"PLESERVER_TEST_AMX={amx} (vLLM's AMX check in scenario processes: "
        f"{'as the host says' if amx == 'host' else 'forced ' + amx})",
    ]


@pytest.fixture(autouse=True)
def no_host_config(monkeypatch):
    """Nothing a test runs reads this host's /etc/ple-server/config.toml, nor
    the settings its shell exported (PLE_SERVER_<KEY>): the launcher sees to
    that for servers; this for every other command."""
    monkeypatch.setenv("PLE_SERVER_CONFIG", os.devnull)
    for s in SETTINGS.values():
        monkeypatch.delenv(s.env, raising=False)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shm_names():
    """The whole suite leaves no shared-memory or semaphore names behind."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"tests leaked /dev/shm entries: {sorted(leaked)}"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A small checkpoint: FP8 table (layer 1) and BF16 table (layer 3), partial
    last shards, shards over two files, a non-PLE tensor in the first file."""
    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(path), SMALL_TABLES, files=2)
    return path


@pytest.fixture(scope="session")
def references(checkpoint) -> dict:
    """``checkpoint``'s tables as read from its files, by layer: rows to compare with."""
    return {t.layer: read_reference(str(checkpoint), t.name) for t in SMALL_TABLES}


@pytest.fixture
def start_server():
    """Factory: ``start_server(model, *flags, wait=True, **server_launcher
    options)`` → a LaunchedServer, ready (it sent READY=1) unless ``wait`` is
    False; reaped and its files removed at teardown."""
    with ExitStack() as servers:  # each closed, even when closing another fails

        def start(model: Path, *extra: str, wait: bool = True, **options) -> LaunchedServer:
            return servers.enter_context(server_launcher(model, *extra, **options).start(wait=wait))

        yield start


@pytest.fixture
def server(start_server, checkpoint) -> LaunchedServer:
    return start_server(checkpoint)


@pytest.fixture(scope="module")
def served(checkpoint):
    """One server for a whole module, warmed up: its gather threads exist, so
    any later growth of its thread count would be a leak. After the module it
    must still run, stop cleanly and have logged no traceback."""
    with server_launcher(checkpoint).start() as server:
        with server.client() as client:
            rng = np.random.default_rng(0)
            for table in client.tables:
                client.lookup(table.layer, rng.integers(0, table.rows, 4 * client.capacity))
        yield server
        assert server.running, server.log_tail()
        assert server.stop() == 0, server.log_tail()
        assert "Traceback" not in server.log(), server.log_tail()


# ------------------------------------------------------------ vLLM plugin
@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory) -> Path:
    """FP8 table (layer 1) and BF16 table (layer 3) shaped like the tiny Qwen4Exp
    config of ``tests.vllm_helpers.model``, over 3 files (one holds shards only)."""
    from tests.vllm_helpers.model import write_test_checkpoint  # needs torch

    path = tmp_path_factory.mktemp("vllm-ckpt")
    write_test_checkpoint(str(path))
    return path


@pytest.fixture(scope="session")
def vllm_other_checkpoint(tmp_path_factory) -> Path:
    """Same geometry as ``vllm_checkpoint``, other rows: another fingerprint."""
    from tests.vllm_helpers.model import write_test_checkpoint

    path = tmp_path_factory.mktemp("vllm-ckpt-other")
    write_test_checkpoint(str(path), seed=1)
    return path


@pytest.fixture(scope="session")
def vllm_nvfp4_checkpoint(tmp_path_factory) -> Path:
    """An NVFP4 table (layer 5: values, block scales, weight_scale_2) shaped like
    the tiny Qwen4Exp config of ``tests.vllm_helpers.model``, over 3 files."""
    from tests.vllm_helpers.model import NVFP4_LAYER, write_test_checkpoint

    path = tmp_path_factory.mktemp("vllm-nvfp4-ckpt")
    write_test_checkpoint(str(path), layers=(NVFP4_LAYER,))
    return path


@pytest.fixture(scope="module")
def vllm_server(vllm_checkpoint):
    """A ple-server serving ``vllm_checkpoint`` for a whole test module."""
    with server_launcher(vllm_checkpoint).start() as server:
        yield server


@pytest.fixture(scope="session")
def qwen4_checkpoints(tmp_path_factory):
    """A whole tiny Qwen4Exp model as transformers' ``save_pretrained`` writes it
    (BF16 PLE tables), and its FP8 twin (``tests.vllm_helpers.qwen4_model``)."""
    from tests.vllm_helpers.qwen4_model import write_checkpoints  # needs transformers

    return write_checkpoints(str(tmp_path_factory.mktemp("qwen4-model")))
