"""The vLLM plugin's side of DeepSeek-V4.1's Engram tables: served MXFP8 rows
decoded to BF16 bit for bit as vLLM's own Engram lookup decodes its table
(``_engram_lookup_kernel``, run by Triton's interpreter on CPU, in a scenario
process: ``tests/vllm_helpers/engram_scenarios.py``)."""

from __future__ import annotations

import pytest
import torch

from pleclient.vllm_plugin import mxfp8
from tests.vllm_helpers import run_scenario

TRITON_ON_CPU = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def test_served_rows_decode_as_vllms_engram_lookup_through_torch_and_its_kernel():
    result = run_scenario(
        "decode_engram_rows",
        {"rows": 997, "cols": 256, "heads": 24, "tokens": 40, "seed": 3},
        module="tests.vllm_helpers.engram_scenarios",
        env=TRITON_ON_CPU,
        timeout=600,
    )
    assert result["equal"] == {"torch": True, "kernel": True}, result
    assert result["values"] == 40 * 24 * 256 and result["zeros"] > 0  # (scale byte 0)


def test_a_wrong_output_is_refused_naming_the_shapes():
    raw = torch.zeros((3, mxfp8.row_bytes(64)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"decode into 3 x 64 contiguous BF16 elements"):
        mxfp8.decode_into(raw, torch.empty((3, 65), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"the output is torch\.float16"):
        mxfp8.decode_into(raw, torch.empty((3, 64), dtype=torch.float16))
