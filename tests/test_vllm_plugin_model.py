"""The whole Qwen4Exp model, built by vLLM's own loader, with and without the plugin.

transformers writes a tiny ``Qwen4ExpForCausalLM`` with ``save_pretrained``
(PLE on two decoder layers, BF16 tables in transformers' shard layout) and an
FP8 twin holding the same numbers (``tests/vllm_helpers/qwen4_model.py``).
For each, one scenario process builds the model with vLLM 0.33's
``DefaultModelLoader`` on CPU twice — stock, then with ``VLLM_PLE_BACKEND=shm``
against a real ple-server serving that directory — and runs every PLE layer's
full forward (n-gram lookup, dequantization, projections, gate, short conv;
the Triton gate and conv as torch code written from the kernels) over a
prefill batch. The outputs are compared with each other and with transformers'
own ``Qwen4ExpTextPLELayer`` loaded from the BF16 checkpoint.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from pleclient.checkpoint import discover_tables
from tests.harness import server_launcher, shm_env
from tests.vllm_helpers import qwen4_model as qm
from tests.vllm_helpers import run_scenario

TABLES = [
    f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
    for layer in qm.PLE_DECODER_LAYERS
]


@pytest.fixture(scope="module", params=["bf16", "fp8", "fp8-gpu-driven"])
def built(request, qwen4_checkpoints) -> dict:
    dtype, _, route = request.param.partition("-")
    model = getattr(qwen4_checkpoints, dtype)
    # gpu-driven: the GPU-driven route (its CPU stand-in) in place of the host path.
    extra = {"VLLM_PLE_SHM_GPU_PATH": "standin"} if route else {}
    with server_launcher(model).start() as server:
        result = run_scenario(
            "whole_model",
            {"model": model, "reference": qwen4_checkpoints.bf16},
            env=shm_env(server, model, **extra),
            timeout=400,
        )
    result["dtype"] = dtype
    result["gpu_driven"] = bool(route)
    return result


def test_ple_server_serves_the_shard_layout_transformers_wrote(qwen4_checkpoints):
    # transformers splits each table with torch.chunk: ceil(rows / parts) rows
    # per shard, the last one partial — the layout ple-server and vLLM expect.
    for model, dtype in ((qwen4_checkpoints.bf16, "BF16"), (qwen4_checkpoints.fp8, "F8_E4M3")):
        tables = discover_tables(model)
        assert [t.name + ".weight" for t in tables] == TABLES
        for table in tables:
            assert table.dtype == dtype and table.parts == qm.PARTS and table.cols == 16
            assert table.rows % qm.PARTS != 0  # a partial last shard
            assert table.scale == (qm.FP8_SCALE if dtype != "BF16" else None)


def test_vllm_loader_loads_every_weight_and_the_shm_build_differs_only_by_the_tables(built):
    assert built["unloaded_parameters"] == {"stock": [], "shm": []}
    assert built["stock_only"] == TABLES  # the shm build holds no table
    assert built["shm_only"] == []
    assert built["weights_differ"] == []  # every other tensor bit for bit
    assert built["weights_compared"] > 90
    assert built["loaded_stock_only"] == TABLES
    assert built["loaded_shm_only"] == []


def test_vllm_takes_the_cpu_gemm_path_the_host_calls_for(built):
    # With AMX visible, vLLM packs small weights for its sgl kernels, which the
    # CUDA wheel lacks: the stand-ins (tests/vllm_helpers/cpu_kernels.py) must
    # have run. Without AMX, vLLM's portable fallback runs and they must not.
    gemm = built["cpu_gemm"]
    calls = gemm["standin_calls"]
    if gemm["amx_visible"]:
        assert calls["convert_weight_packed"] > 0 and calls["weight_packed_linear"] > 0, gemm
    else:
        assert calls == {"convert_weight_packed": 0, "weight_packed_linear": 0}, gemm


def test_the_builds_use_the_checkpoint_table_format(built):
    assert built["storage"] == ["Qwen4ExpPLEShmEmbedding"]
    assert built["row_path"] == ("gpu-driven (CPU stand-in)" if built["gpu_driven"] else "host")
    dtype = "torch.float8_e4m3fn" if built["dtype"] == "fp8" else "torch.bfloat16"
    assert {t: d for t, (_, d) in built["stock_tables"].items()} == dict.fromkeys(TABLES, dtype)
    if built["dtype"] == "fp8":
        assert list(built["shm_scales"].values()) == [qm.FP8_SCALE] * 2
    assert built["server_requests"] > 0


def test_ple_layer_output_is_bit_identical_to_the_stock_build(built):
    for layer in built["layers"].values():
        assert layer["shm_prefetch_equal"] and layer["shm_sync_equal"]
        assert layer["conv_state_equal"]


def test_ple_layer_output_is_bit_identical_to_transformers(built):
    # Same math at the same rounding points (BF16 tensors, FP32 inside the
    # norms and the conv), and FP8 × a power-of-two scale is exact: no tolerance.
    for name, layer in built["layers"].items():
        assert layer["transformers_equal"], (name, layer["transformers_max_abs_diff"])


def test_ple_output_is_not_trivial_and_a_wrong_row_shows(built):
    for layer in built["layers"].values():
        assert layer["tokens_changed_by_ple"] == layer["tokens"]
        assert layer["conv_state_nonzero"]
        # One row changed in transformers' table: the comparison sees it from
        # the first token that reads it, and only where the conv carries it.
        assert layer["wrong_row_first_changed_token"] == layer["wrong_row_first_reader"]
        assert 0 < layer["wrong_row_changed_tokens"] < layer["tokens"]


def test_every_ple_layer_lookup_starts_with_the_step(built):
    """Qwen4ExpModel.forward's own calls, with the plugin: before decoder layer
    0 runs, both PLE layers (decoder layers 1 and 2) have their lookup in flight,
    each sent once for the step; layer 2's stays in flight until layer 2."""
    step = built["step"]
    assert step["stamped_layers"] == qm.LAYERS
    assert step["routes"] == (
        ["gpu-driven (CPU stand-in)"] if built["gpu_driven"] else ["host"]
    )  # the GPU-driven route: no host work, nothing on the host route
    assert step["in_flight"]["0"] == {"1": True, "2": True}
    assert step["in_flight"]["1"] == {"1": True, "2": True}
    assert step["in_flight"]["2"] == {"1": False, "2": True}
    assert step["requests"] == {table.removesuffix(".weight"): 1 for table in TABLES}
    assert step["outputs_equal"]  # bit-identical to the stock build's forward


def test_without_the_step_start_vllm_starts_one_layer_ahead(built):
    """The same forward with the plugin's step start undone: at decoder layer 0
    only layer 1's lookup is out (so the check above can fail)."""
    assert built["step"]["in_flight_one_ahead"]["0"] == {"1": True, "2": False}
    assert built["step"]["in_flight_one_ahead"]["1"] == {"1": True, "2": True}
