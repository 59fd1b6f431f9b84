"""vLLM 0.33's own Engram row ids, for ``tests/test_engram.py``; run in a scenario process.

``python -m tests.vllm_helpers.engram_scenarios vllm_engram_ids '<json args>'``
builds vLLM's ``NgramHashState`` through its real constructor (its token map
from the checkpoint's tokenizer, its layout, its multipliers) over a tiny
DeepSeek-V4.1 checkpoint and runs its ``forward`` (the ``_hash_ids_kernel``
Triton kernel, as the V2 model runner calls it: lookback windows, no slot
cache) on batches of request chunks. Triton has no CPU backend: the caller
runs this with ``CUDA_VISIBLE_DEVICES=`` (vLLM keeps Triton on) and
``TRITON_INTERPRET=1`` (Triton's interpreter runs the kernel on CPU tensors).

Each batch is a list of chunks ``{"tokens": the request's tokens so far,
"start": the chunk's first position, "length": its tokens}``; the result has
vLLM's ids per batch ``[tokens, layers, hash columns]`` and its constants.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch


def vllm_engram_ids(args: dict) -> dict:
    from vllm.models.deepseek_v41.common import engram
    from vllm.models.deepseek_v41.common.mm_preprocess import image_sentinel_mask

    with open(f"{args['model']}/config.json") as f:
        text = json.load(f)["text_config"]
    layout = engram.EngramLayout(SimpleNamespace(**text))
    vllm_config = SimpleNamespace(
        use_v2_model_runner=True,
        model_config=SimpleNamespace(
            tokenizer=args["model"], trust_remote_code=False, revision=None
        ),
    )
    state = engram.NgramHashState(vllm_config, layout, SimpleNamespace(block_size=16))
    depth = state.lookback_depth
    batches = []
    for chunks in args["batches"]:
        input_ids, positions, starts, lookback = [], [], [0], []
        for chunk in chunks:
            tokens, start, length = chunk["tokens"], chunk["start"], chunk["length"]
            input_ids += tokens[start : start + length]
            positions += range(start, start + length)
            starts.append(starts[-1] + length)
            lookback.append(
                [tokens[start - 1 - c] if start - 1 - c >= 0 else -1 for c in range(depth)]
            )
        ids = torch.tensor(input_ids, dtype=torch.int32)
        window = torch.tensor(lookback, dtype=torch.int32)
        out = state(
            ids,
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int32),
            image_sentinel_mask(ids),
            window,
            image_sentinel_mask(window),
            None,
            None,
        )
        batches.append(out.tolist())
    return {
        "ids": batches,
        "token_map": state.token_map.tolist(),
        "pad_id": state.pad_id,
        "primes": layout.primes,
        "offsets": layout.offsets.tolist(),
        "multipliers": state.multipliers.tolist(),
    }


SCENARIOS = {"vllm_engram_ids": vllm_engram_ids}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
