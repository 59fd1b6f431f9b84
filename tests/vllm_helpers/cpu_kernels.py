"""vLLM's CPU kernels that the CUDA wheel lacks, and the host's AMX as vLLM sees it.

vLLM 0.33 builds linear layers on CPU through ``dispatch_cpu_unquantized_gemm``.
On a CPU with AMX tiles (``torch.cpu._is_amx_tile_supported()``), small
BF16/FP16 weights take the sgl-kernel path: ``torch.ops._C.convert_weight_packed``
at load, ``torch.ops._C.weight_packed_linear`` at every call. Those are kernels of
vLLM's CPU build; the CUDA wheel the tests install has no ``vllm._C`` at all, so
on such a CPU the whole-model test would fail before any PLE code ran. Elsewhere
vLLM falls back to ``torch.nn.functional.linear``.

``install_sgl_gemm_standins`` defines the two missing kernels as torch code
computing exactly that fallback (the same stand-in spirit as the Triton
kernels of ``qwen4_model``): a GEMM is not what these tests examine, and with
the stand-ins every host computes the same numbers whichever path vLLM picks.
They are registered only when vLLM's own kernels are absent, never touch
pleclient or vLLM's code, and run in scenario processes only.

``PLESERVER_TEST_AMX`` (``host``, the default; ``on``; ``off``) shows both of
vLLM's paths on any CPU: ``on``/``off`` set what ``torch.cpu._is_amx_tile_supported``
answers in the scenario process, so a run on a CPU without AMX takes the AMX
path and the other way round.
"""

from __future__ import annotations

import os

import torch

AMX_SETTING = "PLESERVER_TEST_AMX"
_standins: torch.library.Library | None = None
standin_calls = {"convert_weight_packed": 0, "weight_packed_linear": 0}
"""How often vLLM called each stand-in in this process: proof of the path it took."""


def amx_setting() -> str:
    value = os.environ.get(AMX_SETTING, "host")
    if value not in ("host", "on", "off"):
        raise ValueError(f"{AMX_SETTING}={value!r}: expected host, on or off")
    return value


def apply_amx_setting() -> None:
    """Make ``torch.cpu._is_amx_tile_supported`` answer as ``PLESERVER_TEST_AMX`` says."""
    value = amx_setting()
    if value != "host":
        forced = value == "on"
        torch.cpu._is_amx_tile_supported = lambda: forced  # type: ignore[attr-defined]


def install_sgl_gemm_standins() -> None:
    """Define ``_C::convert_weight_packed`` and ``_C::weight_packed_linear`` as
    torch code, where vLLM's CPU kernels are absent."""
    global _standins
    if _standins is not None or hasattr(torch.ops._C, "convert_weight_packed"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("convert_weight_packed(Tensor weight) -> Tensor")
    lib.define(
        "weight_packed_linear(Tensor(a!) out, Tensor x, Tensor packed_weight, "
        "Tensor? bias, bool is_vnni) -> ()"
    )

    def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
        standin_calls["convert_weight_packed"] += 1
        # The "packed" weight is the weight itself: the stand-in's GEMM reads
        # it as torch.nn.functional.linear does.
        return weight.detach().clone()

    def weight_packed_linear(
        out: torch.Tensor,
        x: torch.Tensor,
        packed_weight: torch.Tensor,
        bias: torch.Tensor | None,
        is_vnni: bool,
    ) -> None:
        standin_calls["weight_packed_linear"] += 1
        # vLLM turns the bias to float32 for its kernel; the fallback adds it
        # in the activations' dtype (bf16 → f32 → bf16 is exact).
        b = None if bias is None else bias.to(x.dtype)
        out.copy_(torch.nn.functional.linear(x, packed_weight.to(x.dtype), b))

    lib.impl("convert_weight_packed", convert_weight_packed, "CPU")
    lib.impl("weight_packed_linear", weight_packed_linear, "CPU")
    _standins = lib


def gemm_report() -> dict:
    """What vLLM saw and did: AMX visible or not, and the stand-ins' calls."""
    return {
        "amx_setting": amx_setting(),
        "amx_visible": bool(torch.cpu._is_amx_tile_supported()),
        "standins_installed": _standins is not None,
        "standin_calls": dict(standin_calls),
    }


def prepare() -> None:
    """Everything a scenario process needs before vLLM builds a layer."""
    apply_amx_setting()
    install_sgl_gemm_standins()
