"""The row decoders' launches of vLLM's own Triton kernels compile for the GPUs
users run (Hopper: H100, H200, GH200; GB10: DGX Spark), on a machine without
one (``pleclient.vllm_plugin.kernel_call``). Triton's interpreter, which runs
the kernels in the other tests, executes only the branch taken; the compiler
builds every branch of a runtime condition, and a launch that is fine under
the interpreter can fail there (vLLM 0.33's Engram kernel with ``None`` for
``sorted_dst``, which ended the first real DeepSeek-V4.1 engine on an H100)."""

from __future__ import annotations

from tests.vllm_helpers import run_scenario

ARCHS = [90, 121]
ROWS = [1, 5, 16]  # Triton's launcher makes a 1 a constant and marks multiples of 16


def test_the_decoders_kernel_launches_compile_for_hopper_and_gb10(tmp_path):
    result = run_scenario(
        "compile_row_decoders",
        {"archs": ARCHS, "rows": ROWS},
        module="tests.vllm_helpers.kernel_scenarios",
        env={
            "CUDA_VISIBLE_DEVICES": "",
            "TRITON_INTERPRET": "0",
            "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        },
        timeout=600,
    )
    variants = {f"sm_{a}, {n} rows" for a in ARCHS for n in ROWS}
    for decoder in ("mxfp8", "nvfp4"):
        assert result[decoder] == dict.fromkeys(variants, "ok"), result
    # The control: the launch the interpreter accepted fails to compile, so the
    # check above is one the compiler could have failed.
    control = result["mxfp8 with sorted_dst None"]
    assert set(control) == variants and all("NoneType" in e for e in control.values()), control
