"""The plugin follows vLLM's rules: its variables pass vLLM's environment check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pleclient.vllm_plugin import settings
from tests.vllm_helpers import REPO, run_scenario

PLUGIN = REPO / "pleclient" / "vllm_plugin"


def every_variable(checkpoint: Path, socket_dir: Path) -> dict[str, str]:
    """A valid value for each of the plugin's variables."""
    values = {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": str(socket_dir / "ple.sock"),
        "VLLM_PLE_SHM_SOCKET_DIR": str(socket_dir),
        "VLLM_PLE_SHM_CONNECT_TIMEOUT": "5",
        "VLLM_PLE_SHM_LOOKUP_TIMEOUT": "20",
        "VLLM_PLE_SHM_RECONNECT_S": "10",
        "VLLM_PLE_SHM_DEPTH": "6",
        "VLLM_PLE_SHM_CAPACITY": "8192",
        "VLLM_PLE_SHM_PREFETCH": "0",
        "VLLM_PLE_SHM_CHECKPOINT": str(checkpoint),
        "VLLM_PLE_SHM_GPU_PATH": "off",
        "VLLM_PLE_SHM_ALLOW_DUMMY": "0",
    }
    assert sorted(values) == sorted(settings.VARIABLES)  # a new variable is tested here too
    return values


# ------------------------------------------------------- vLLM's environment check
def test_every_variable_the_plugin_reads_is_declared():
    """Each VLLM_PLE_* name in the plugin's code is in settings.VARIABLES (which
    register() declares to vLLM) and in the docs' settings table."""
    used = set()
    for path in PLUGIN.glob("*.py"):
        used |= set(re.findall(r"VLLM_PLE_[A-Z_]*[A-Z]", path.read_text()))
    assert used == set(settings.VARIABLES)
    table = (REPO / "docs" / "VLLM.md").read_text()
    assert all(f"| `{name}` |" in table for name in settings.VARIABLES)


def test_vllm_serve_with_fail_on_environ_validation_accepts_every_variable(
    qwen4_checkpoints, tmp_path
):
    """The path of ``vllm serve --fail-on-environ-validation`` in the API server:
    EngineArgs loads the plugins, create_engine_config checks the environment
    (hard fail) and builds the whole config of the tiny Qwen4Exp model, with
    every one of the plugin's variables set."""
    env = every_variable(Path(qwen4_checkpoints.bf16), tmp_path)
    result = run_scenario("environment_check", {"model": qwen4_checkpoints.bf16}, env=env)
    # Before vLLM loaded the plugins, its check refuses them: the check is live.
    assert result["before_plugins"].startswith(
        "Unknown vLLM environment variable detected: VLLM_PLE_"
    )
    assert result["engine_config"] == {"architectures": ["Qwen4ExpForCausalLM"]}
    assert result["after_plugins"] is None  # validate_environ(hard_fail=True) passes
    assert result["declared"] == sorted(settings.VARIABLES)
    assert result["values"] == env  # vllm.envs.VLLM_PLE_* read the environment
    # vLLM's compile-cache key: a model compiled without shm is not reused with it.
    assert result["compile_factors"]["VLLM_PLE_BACKEND"] == "shm"


def test_the_plugins_variables_pass_in_every_process_that_loads_plugins(tmp_path):
    """The engine core and the workers load the plugins with
    load_general_plugins(); the off switch with other variables set passes too."""
    env = {"VLLM_PLE_BACKEND": "vllm", "VLLM_PLE_SHM_SOCKET_DIR": str(tmp_path)}
    result = run_scenario("environment_check", env=env)
    assert result["before_plugins"].startswith(
        "Unknown vLLM environment variable detected: VLLM_PLE_"
    )
    assert result["after_plugins"] is None
    assert result["declared"] == sorted(settings.VARIABLES)
