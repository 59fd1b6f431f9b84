"""vLLM's Triton kernels as the plugin's row decoders launch them, compiled for
GPUs on a machine without one; run in a scenario process.

``python -m tests.vllm_helpers.kernel_scenarios compile_row_decoders '<json args>'``
builds each decoder's ``KernelCall`` over CPU tensors of the dtypes and shapes
a GPU launch gets, for each row count in ``rows``, and compiles it with
Triton's NVIDIA backend for each compute capability in ``archs``
(``pleclient.vllm_plugin.kernel_call``). The
caller runs it with ``CUDA_VISIBLE_DEVICES=`` and without ``TRITON_INTERPRET``:
the point is the compiler, which builds every branch whose condition is not a
``tl.constexpr``, where the interpreter runs only the branch taken.

The result names each (decoder, arch, rows) ``ok`` or the compiler's error, and the
same for a control launch that passes ``None`` for the Engram kernel's
``sorted_dst``, as a launch that compiles only under the interpreter does.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch


def _error(action) -> str:
    try:
        action()
    except Exception as e:  # the compiler's own error, reported as text
        return f"{type(e).__name__}: {e}".splitlines()[-1][:300]
    return "ok"


def compile_row_decoders(args: dict) -> dict:
    from pleclient.vllm_plugin import mxfp8, nvfp4

    cols = args.get("cols", 256)
    result: dict[str, dict[str, str]] = {}
    for n in args["rows"]:  # 1 is made a constant, 16 divisible: other variants
        engram = mxfp8.kernel_call(
            torch.zeros((n, cols), dtype=torch.uint8),
            torch.zeros((n, cols // 32), dtype=torch.uint8),
            torch.empty((n, cols), dtype=torch.bfloat16),
        )
        ple = nvfp4.kernel_call(
            torch.zeros((n, cols // 2), dtype=torch.uint8),
            torch.zeros((n, cols // 16), dtype=torch.uint8),
            torch.ones((), dtype=torch.float32),
            torch.empty((n, cols), dtype=torch.bfloat16),
        )
        no_sorted_dst = replace(engram, args=(*engram.args[:3], None, *engram.args[4:]))
        calls = {"mxfp8": engram, "nvfp4": ple, "mxfp8 with sorted_dst None": no_sorted_dst}
        for name, call in calls.items():
            for arch in args["archs"]:
                result.setdefault(name, {})[f"sm_{arch}, {n} rows"] = _error(
                    lambda c=call, a=arch: c.compile_for(a)
                )
    return result


SCENARIOS = {"compile_row_decoders": compile_row_decoders}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
