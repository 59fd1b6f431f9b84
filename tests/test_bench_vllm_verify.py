"""``bench/real_vllm/verify.py``, the noise-free check of the real-vLLM harness:
every PLE row a generation's steps received, compared with the checkpoint's
bytes, in vLLM 0.33's own classes on CPU with a real ple-server. It finds
nothing wrong where the server serves the checkpoint, and finds the rows
where the checkpoint it is given differs from the one served."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm_helpers import run_scenario

STEPS = 4


def changed_copy(model: str, out: Path) -> Path:
    """The checkpoint with every 7th row of each PLE table negated."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(str(path))
        changed = False
        for name, tensor in tensors.items():
            if "ngram_embedding" in name and tensor.dim() == 2:
                tensor[::7] = -tensor[::7]
                changed = True
        if changed:
            save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("expected", ["served", "changed"])
def test_every_row_a_generation_received_is_checked_against_the_checkpoint(
    qwen4_checkpoints, tmp_path, expected
):
    model = qwen4_checkpoints.bf16
    against = model if expected == "served" else str(changed_copy(model, tmp_path / "changed"))
    result = run_scenario(
        "verified_generation",
        {"model": model, "expected": against, "log": str(tmp_path / "server.log"), "steps": STEPS},
        env={
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": str(tmp_path / "ple.sock"),
            "VLLM_PLE_SHM_CHECKPOINT": model,
            "VLLM_PLE_SHM_GPU_PATH": "off",
        },
        timeout=400,
    )
    assert result["layers"] == 2 and result["skipped_lookups"] == 0, result
    assert result["lookups"] >= 2 * STEPS and result["rows"] > 0, result
    if expected == "served":
        assert result["mismatched_rows"] == 0 and not result["mismatches"], result
    else:
        assert 0 < result["mismatched_rows"] < result["rows"], result
        assert "rows differ from the checkpoint" in result["mismatches"][0], result
