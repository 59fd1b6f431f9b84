"""The vLLM compilation settings the plugin supports, and the clear error for
the others (``pleclient/vllm_plugin/compilation.py``), with vLLM 0.33's own
``CompilationConfig`` on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm_helpers import run_scenario

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
OPS = ["default", "empty", "explicit"]
FULL = {"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}


def settled_mode(mode: str, ops: str) -> str:
    """The mode vLLM 0.33 settles on: with no pieces to capture (an empty
    splitting-ops list), PIECEWISE becomes NONE and FULL_AND_PIECEWISE FULL."""
    if ops != "empty":
        return mode
    return {"PIECEWISE": "NONE", "FULL_AND_PIECEWISE": "FULL"}.get(mode, mode)


@pytest.mark.parametrize("gpu_path", ["auto", "off", "standin"])
def test_cudagraph_modes_and_splitting_ops(gpu_path):
    result = run_scenario(
        "compilation_settings",
        env={"VLLM_PLE_BACKEND": "shm", "VLLM_PLE_SHM_GPU_PATH": gpu_path},
    )
    settled = result["settled"]
    assert sorted(settled) == sorted(f"{m}/{o}" for m in MODES for o in OPS)
    for mode in MODES:
        for ops in OPS:
            outcome = settled[f"{mode}/{ops}"]
            want = settled_mode(mode, ops)
            assert outcome["settled"] == want, (mode, ops, outcome)
            if gpu_path == "off" and want in FULL:
                # The host path in full graphs: refused, naming the setting,
                # its value and the ways out.
                assert outcome.get("error") == "UnsupportedCompilation", (mode, ops, outcome)
                message = outcome["message"]
                assert f"-cc.cudagraph_mode={want} " in message
                assert "VLLM_PLE_SHM_GPU_PATH=off" in message
                assert "-cc.cudagraph_mode=PIECEWISE" in message
                assert "VLLM_PLE_SHM_GPU_PATH=auto" in message
            else:
                # The GPU-driven route (auto, and its CPU stand-in) runs in
                # every mode; the host path in NONE and PIECEWISE.
                assert "error" not in outcome, (mode, ops, outcome)
                # The lookup ops are split out wherever vLLM splits the graph.
                assert outcome["ple_split"] == (ops != "empty"), (mode, ops, outcome)


def test_full_graph_mode_is_read_from_the_config_in_effect():
    result = run_scenario("compilation_settings", env={"VLLM_PLE_BACKEND": "shm"})
    assert result["in_effect"] == {
        "NONE": None,
        "PIECEWISE": None,
        "FULL": "FULL",
        "FULL_DECODE_ONLY": "FULL_DECODE_ONLY",
        "FULL_AND_PIECEWISE": "FULL_AND_PIECEWISE",
    }
    assert result["outside"] is None  # no vLLM config: not a vLLM run
