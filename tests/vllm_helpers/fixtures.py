"""Fixtures of the vLLM plugin tests (import them into a test module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ServerProcess


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory) -> Path:
    """FP8 table (layer 1) and BF16 table (layer 3) shaped like the tiny Qwen4Exp
    config of ``tests.vllm_helpers.model``, over 3 files (one holds shards only)."""
    from tests.vllm_helpers.model import write_test_checkpoint

    path = tmp_path_factory.mktemp("vllm-ckpt")
    write_test_checkpoint(str(path))
    return path


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory) -> Path:
    """Same geometry as ``vllm_checkpoint``, other rows: another fingerprint."""
    from tests.vllm_helpers.model import write_test_checkpoint

    path = tmp_path_factory.mktemp("vllm-ckpt-other")
    write_test_checkpoint(str(path), seed=1)
    return path


@pytest.fixture(scope="module")
def vllm_server(vllm_checkpoint, tmp_path_factory):
    """A ple-server serving ``vllm_checkpoint`` for a whole test module."""
    server = ServerProcess(vllm_checkpoint, tmp_path_factory.mktemp("vllm-server"))
    yield server
    server.stop()


def shm_env(server: ServerProcess, checkpoint: Path, **extra: str) -> dict[str, str]:
    """The environment of a vLLM worker using ``server``."""
    return {"VLLM_PLE_BACKEND": "shm", "VLLM_PLE_SHM_SOCKET": server.socket,
            "VLLM_PLE_SHM_CHECKPOINT": str(checkpoint), **extra}
