"""The plugin follows vLLM's rules: its variables pass vLLM's environment check,
it stops ``shm`` on a vLLM whose classes it cannot patch, and the deploy
example uses the discovery the docs recommend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

from pleclient.vllm_plugin import settings
from tests.vllm_helpers import REPO, fake_vllm, run_scenario

PLUGIN = REPO / "pleclient" / "vllm_plugin"
ENV_FILE = REPO / "deploy" / "vllm" / "ple-shm.env"
SERVE = REPO / "deploy" / "vllm" / "serve.sh"


def every_variable(checkpoint: Path, socket_dir: Path) -> dict[str, str]:
    """A valid value for each of the plugin's variables."""
    values = {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": str(socket_dir / "ple.sock"),
        "VLLM_PLE_SHM_SOCKET_DIR": str(socket_dir),
        "VLLM_PLE_SHM_CONNECT_TIMEOUT": "5",
        "VLLM_PLE_SHM_LOOKUP_TIMEOUT": "20",
        "VLLM_PLE_SHM_RECONNECT_S": "10",
        "VLLM_PLE_SHM_FALLBACK_S": "0.5",
        "VLLM_PLE_SHM_DEPTH": "6",
        "VLLM_PLE_SHM_CAPACITY": "8192",
        "VLLM_PLE_SHM_PREFETCH": "0",
        "VLLM_PLE_SHM_CHECKPOINT": str(checkpoint),
        "VLLM_PLE_SHM_GPU_PATH": "off",
        "VLLM_PLE_SHM_GPU_OPS": "memops",
        "VLLM_PLE_SHM_ALLOW_DUMMY": "0",
        "VLLM_PLE_SHM_PROMPT_AHEAD": "arrival",
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


# ------------------------------------------------------- a vLLM it cannot patch
def fake_layout(tmp_path: Path, layout: str, imports: list[str] | None = None) -> dict:
    root = fake_vllm.write_tree(str(tmp_path / layout), layout)
    return run_scenario(
        "fake_vllm_layout",
        {"root": root, "imports": imports or []},
        env={"VLLM_PLE_BACKEND": "shm", "PYTHONPATH": root},
    )


def assert_names_the_way_out(message: str, result: dict) -> None:
    assert message.startswith("VLLM_PLE_BACKEND=shm: ")
    assert f"This vLLM is {fake_vllm.VERSION} ({result['path']})" in message
    assert "supports vLLM 0.33.x" in message and "qwen38-flash-next" in message
    assert "unset VLLM_PLE_BACKEND" in message


def test_a_moved_module_stops_startup_naming_it_and_the_supported_versions(tmp_path):
    result = fake_layout(tmp_path, "moved")
    error = result["register"]
    assert error["error"] == "UnsupportedVllm"
    assert (
        "this vLLM lacks the module(s) vllm.models.qwen4_exp.nvidia.ngram_embedding, "
        "whose classes the plugin patches" in error["message"]
    )
    assert_names_the_way_out(error["message"], result)


def test_a_vllm_without_any_ple_model_stops_startup(tmp_path):
    result = fake_layout(tmp_path, "no_ple_model")
    error = result["register"]
    assert error["error"] == "UnsupportedVllm"
    assert "none of the model packages whose PLE layers the plugin serves" in error["message"]
    assert "vllm.models.qwen4_exp" in error["message"]
    assert_names_the_way_out(error["message"], result)


def test_a_renamed_class_stops_the_import_that_would_build_it(tmp_path):
    target = "vllm.models.qwen4_exp.nvidia.ngram_embedding"
    result = fake_layout(tmp_path, "renamed_storage", [target])
    assert result["register"] is None  # every module is there
    error = result["imports"][target]
    assert error["error"] == "UnsupportedVllm"
    assert (
        f"{target} has no Qwen4ExpPLEPinnedHostEmbedding, which the plugin patches"
        in (error["message"])
    )
    assert_names_the_way_out(error["message"], result)


def test_a_model_built_from_other_classes_stops_when_it_loads(tmp_path):
    model = "vllm.models.qwen4_exp.nvidia.model"
    result = fake_layout(tmp_path, "replaced", [model])
    assert result["register"] is None  # the old module is still on disk
    error = result["imports"][model]
    assert error["error"] == "UnsupportedVllm"
    assert (
        f"{model} loaded without importing vllm.models.qwen4_exp.nvidia.ngram_embedding"
        in error["message"]
    )
    assert_names_the_way_out(error["message"], result)


def test_another_version_with_every_target_goes_on_with_one_warning(tmp_path):
    result = fake_layout(tmp_path, "as_0_33")
    assert result["register"] is None
    assert len(result["warnings"]) == 1
    assert (
        f"vLLM {fake_vllm.VERSION} is not a version the plugin was tested with"
        in (result["warnings"][0])
    )
    assert result["declared"] == sorted(settings.VARIABLES)


def test_a_storage_the_plugin_did_not_replace_stops_the_build(vllm_checkpoint, tmp_path):
    result = run_scenario(
        "storage_not_swapped",
        env={
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": str(tmp_path / "absent.sock"),
            "VLLM_PLE_SHM_CHECKPOINT": str(vllm_checkpoint),
        },
    )
    error = result["build"]
    # Not "no ple-server": the check comes before the storage asks a server.
    assert error["error"] == "UnsupportedVllm"
    assert (
        "vLLM built the PLE row storage model.layers.3.ple.ple_embedding.ngram_embedding as "
        "vllm.models.qwen4_exp.common.ngram_embedding.Qwen4ExpPLEDeviceEmbedding, not as the "
        "plugin's Qwen4ExpPLEShmEmbedding"
    ) in error["message"]
    assert "supports vLLM 0.33.x" in error["message"]


def test_vllm_0_33_passes_every_check_and_is_patched():
    result = run_scenario("entry_point_hook", env={"VLLM_PLE_BACKEND": "shm"})
    assert result["vllm_version"].startswith("0.33.")
    assert not result["untested_warning"]
    assert result["registered"] and result["patched"]
    assert result["model_classes"]["Qwen4ExpForCausalLM"]


# ------------------------------------------------------- the deploy example
def env_file_settings() -> dict[str, str]:
    values = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def test_the_env_file_leaves_the_socket_to_discovery_and_its_values_are_valid(monkeypatch):
    values = env_file_settings()
    assert values["VLLM_PLE_BACKEND"] == "shm"
    assert "VLLM_PLE_SHM_SOCKET" not in values and "PLE_SERVER_SOCKET" not in values
    assert set(values) <= set(settings.VARIABLES)
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PLE_SERVER_SOCKET", raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert settings.ShmSettings.from_env().socket is None  # found by the checkpoint


def test_the_container_examples_leave_the_socket_to_discovery():
    compose = yaml.safe_load((REPO / "deploy" / "container" / "compose.yaml").read_text())
    environment = compose["services"]["vllm"]["environment"]
    assert environment["VLLM_PLE_BACKEND"] == "shm"
    assert not {"VLLM_PLE_SHM_SOCKET", "PLE_SERVER_SOCKET"} & set(environment)
    readme = (REPO / "deploy" / "README.md").read_text()
    docker_run = readme[readme.index("docker run --rm --gpus all") :].split("\n\n")[0]
    assert "VLLM_PLE_BACKEND=shm" in docker_run and "SOCKET" not in docker_run


@pytest.fixture
def serve_env(tmp_path) -> dict[str, str]:
    """serve.sh's environment: a ``vllm`` on PATH that records how it was run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(
        "#!/bin/sh\n"
        '{ printf "arg %s\\n" "$@"; env | grep -E "^(VLLM_PLE_|PLE_SERVER_SOCKET=)" | sort; }'
        ' > "$VLLM_RECORD"\n'
    )
    fake.chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_PLE_") and k != "PLE_SERVER_SOCKET"
    }
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        VLLM_RECORD=str(tmp_path / "vllm.record"),
        VLLM_PLE_SHM_SOCKET_DIR=str(tmp_path / "run"),
    )
    (tmp_path / "run").mkdir()
    return env


def test_serve_sh_finds_the_server_of_its_checkpoint_and_starts_vllm(
    start_server, checkpoint, serve_env
):
    server = start_server(checkpoint, socket_path=f"{serve_env['VLLM_PLE_SHM_SOCKET_DIR']}/a.sock")
    proc = subprocess.run(
        ["bash", str(SERVE), "--max-model-len", "64"],
        env={**serve_env, "MODEL": str(checkpoint), "TP": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"from ple-server at {server.socket}" in proc.stderr
    record = Path(serve_env["VLLM_RECORD"]).read_text().splitlines()
    assert record[:6] == [
        "arg serve",
        f"arg {checkpoint}",
        "arg --tensor-parallel-size",
        "arg 2",
        "arg --max-model-len",
        "arg 64",
    ]
    assert "VLLM_PLE_BACKEND=shm" in record
    pinned = ("VLLM_PLE_SHM_SOCKET=", "PLE_SERVER_SOCKET=")
    assert not [line for line in record if line.startswith(pinned)]


def test_serve_sh_without_a_server_stops_in_the_plugins_words(checkpoint, serve_env):
    proc = subprocess.run(
        ["bash", str(SERVE)],
        env={**serve_env, "MODEL": str(checkpoint)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "serve.sh: VLLM_PLE_BACKEND=shm: no ple-server socket in" in proc.stderr
    assert "systemctl start ple-server" in proc.stderr
    assert not Path(serve_env["VLLM_RECORD"]).exists()
