"""The vLLM plugin's switch, loader behaviour, identity check and failure policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from pleclient.vllm_plugin import settings
from tests.harness import shm_env
from tests.vllm_helpers import run_scenario


# ------------------------------------------------------------------- the switch
@pytest.mark.parametrize("value", [None, "vllm"], ids=["unset", "vllm"])
def test_plugin_off_leaves_every_class_untouched(value):
    env = {} if value is None else {"VLLM_PLE_BACKEND": value}
    result = run_scenario("plugin_off", env=env)
    assert "vllm.models.qwen4_exp.nvidia.ngram_embedding" in result["imported"]
    assert result["touched_modules"] == [] and result["touched_classes"] == []
    assert result["import_hooks"] == [] and not result["registered"]
    assert result["should_skip_weight_module"].startswith("vllm.")
    assert result["storage"] == "Qwen4ExpPLEDeviceEmbedding"
    assert result["init_module"].startswith("vllm.")
    assert "vllm::unified_attention_with_output" in result["splitting_ops"]
    assert not [op for op in result["splitting_ops"] if "ple" in op and "conv" not in op]
    # vLLM's environment registry: the plugin's names only where one is set.
    assert result["declared"] == ([] if value is None else sorted(settings.VARIABLES))


def test_unknown_backend_stops_vllm_with_a_clear_error():
    result = run_scenario("bad_backend", env={"VLLM_PLE_BACKEND": "mmap"})
    assert result["error"] == "SettingsError"
    assert "VLLM_PLE_BACKEND='mmap'" in result["message"]
    assert "VLLM_PLE_BACKEND=shm" in result["message"]


def test_bad_setting_is_reported_by_name():
    result = run_scenario("bad_backend", env={"VLLM_PLE_BACKEND": "shm", "VLLM_PLE_SHM_DEPTH": "1"})
    assert result["error"] == "SettingsError"
    assert "VLLM_PLE_SHM_DEPTH=1" in result["message"]


def test_entry_point_patches_modules_as_vllm_imports_them_and_is_reentrant():
    result = run_scenario(
        "entry_point_hook", env={"VLLM_PLE_BACKEND": "shm", "VLLM_LOGGING_LEVEL": "INFO"}
    )
    assert result["registered"] and result["patched"]
    assert result["init_stable"]  # register() again did not wrap twice
    assert result["finders"] == 1
    # The plugin's INFO lines reach vLLM's log once, in vLLM's format
    # ("(MainProcess pid=…) INFO 12-07 21:37:06 [scenarios.py:412] ..."), as
    # its own lines do.
    lines = result["plugin_log"].splitlines()
    assert len(lines) == 1 and lines[0].endswith("] PLE backend shm: a line for the log"), lines
    assert ") INFO " in lines[0] and "[scenarios.py:" in lines[0], lines
    assert result["skips_shards"] and result["keeps_scale"]
    for ops in (result["splitting_ops"], result["explicit_splitting_ops"]):
        assert "vllm::ple_shm_lookup" in ops
        assert "vllm::qwen4_exp_amd_ple_ngram_embedding" in ops
    assert "vllm::unified_attention_with_output" in result["splitting_ops"]
    assert result["explicit_splitting_ops"][0] == "vllm::my_attention"
    assert result["model_classes"] == {
        "Qwen4ExpForCausalLM": True,
        "Qwen4ExpForConditionalGeneration": True,
        "scale_unused": False,
    }


# ------------------------------------------------------------------- the loader
def test_loader_never_reads_shard_tensors(vllm_checkpoint):
    result = run_scenario(
        "loader_reads", {"model": str(vllm_checkpoint)}, env={"VLLM_PLE_BACKEND": "shm"}
    )
    reads = result["reads"]
    # The middle file holds shards only: not opened for any tensor.
    assert "model-00002-of-00003.safetensors" not in reads
    # The mixed files: only their non-shard tensors are read.
    assert reads["model-00001-of-00003.safetensors"] == ["model.embed_tokens.weight"]
    assert reads["model-00003-of-00003.safetensors"] == [
        "model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale"
    ]
    assert sorted(result["yielded"]) == [
        "model.embed_tokens.weight",
        "model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale",
    ]


def test_loader_without_plugin_reads_the_shards(vllm_checkpoint):
    """The counting above is meaningful: stock vLLM reads all 8 shards."""
    result = run_scenario("loader_reads", {"model": str(vllm_checkpoint)})
    read = [name for names in result["reads"].values() for name in names]
    assert sum(".shard_" in name for name in read) == 8


# ------------------------------------------------------------------- startup
def test_missing_server_fails_fast_naming_socket_and_service(vllm_checkpoint, tmp_path):
    socket = str(tmp_path / "absent.sock")
    result = run_scenario(
        "startup_checks",
        env={
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": socket,
            "VLLM_PLE_SHM_CHECKPOINT": str(vllm_checkpoint),
            "VLLM_PLE_SHM_CONNECT_TIMEOUT": "120",
        },
    )
    assert result["error"] == "PleBackendError"
    assert socket in result["message"]
    assert "systemctl start ple-server" in result["message"]
    # No socket file: refused at once, not after the connect timeout (what
    # the layer's build costs besides, on a loaded machine, is far below it).
    assert result["seconds"] < 60


def test_fingerprint_mismatch_stops_startup_naming_both(vllm_server, vllm_other_checkpoint):
    result = run_scenario("startup_checks", env=shm_env(vllm_server, vllm_other_checkpoint))
    assert result["error"] == "IdentityMismatch"
    message = result["message"]
    assert vllm_server.socket in message and str(vllm_other_checkpoint) in message
    assert "fingerprint" in message
    assert "model.layers.1.ple.ple_embedding.ngram_embedding" in message


def test_geometry_mismatch_between_checkpoint_and_model_stops_startup(
    start_server, checkpoint, tmp_path
):
    """The core tests' checkpoint has 160-column rows; the model wants 16."""
    server = start_server(checkpoint)
    result = run_scenario("startup_checks", env=shm_env(server, Path(checkpoint)))
    assert result["error"] == "IdentityMismatch"
    assert "cols: checkpoint 160, model expects 16" in result["message"]


def test_dummy_load_format_needs_the_explicit_opt_in(vllm_checkpoint, tmp_path):
    env = {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": str(tmp_path / "none.sock"),
        "VLLM_PLE_SHM_CHECKPOINT": str(vllm_checkpoint),
    }
    refused = run_scenario("startup_checks", {"load_format": "dummy"}, env=env)
    assert refused["error"] == "PleBackendError"
    assert "VLLM_PLE_SHM_ALLOW_DUMMY=1" in refused["message"]
    allowed = run_scenario(
        "startup_checks", {"load_format": "dummy"}, env={**env, "VLLM_PLE_SHM_ALLOW_DUMMY": "1"}
    )
    assert allowed["error"] is None and allowed["rows_all_zero"]


# ------------------------------------------------------------------- mid-run
def test_server_killed_mid_run_reconnects_within_the_window_then_fails_clearly(
    vllm_checkpoint, tmp_path
):
    socket = str(tmp_path / "restart.sock")
    result = run_scenario(
        "server_restarts",
        {"model": str(vllm_checkpoint), "log": str(tmp_path / "s.log"), "window": 2.0},
        env={
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": socket,
            "VLLM_PLE_SHM_CHECKPOINT": str(vllm_checkpoint),
            "VLLM_PLE_SHM_RECONNECT_S": "60",
            "VLLM_PLE_SHM_FALLBACK_S": "off",  # the waits for the server are what is tested
        },
    )
    assert result["asked_while_away"] == [True, True]  # both asked of a server away
    assert result["after_restart_equal"]
    assert result["prefetch_resubmitted_equal"]
    assert result["error"] is not None
    assert socket in result["error"] and "within 2 s" in result["error"]
    assert "systemctl start ple-server" in result["error"]
    assert 2.0 <= result["seconds"] < 6.0
    assert result["recovered_equal"]
    assert not os.path.exists(socket)


BROKEN_INSTALL = """
import sys
sys.modules["pleclient._sync"] = None  # a checkout whose native module was never built
import vllm.plugins
try:
    vllm.plugins.load_general_plugins()
    print("RESULT loaded")
except Exception as exc:
    print("RESULT", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("backend", ["shm", None])
def test_a_client_without_its_native_module_stops_vllm_only_when_shm_is_asked(backend):
    """vLLM only logs an entry point that fails to import, and runs on with
    its own table: the plugin's entry point imports without the native module,
    and ``register`` stops vLLM with the fix where ``VLLM_PLE_BACKEND=shm``."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_PLE_")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if backend:
        env["VLLM_PLE_BACKEND"] = backend
    run = subprocess.run(
        [sys.executable, "-c", BROKEN_INSTALL], capture_output=True, text=True, env=env, timeout=120
    )
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    if backend:
        assert line.startswith("RESULT PleBackendError VLLM_PLE_BACKEND=shm"), line
        assert "native module is not built" in line and "pip install" in line, line
    else:
        assert line == "RESULT loaded", run.stdout + run.stderr
