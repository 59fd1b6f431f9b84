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


def decode_engram_rows(args: dict) -> dict:
    """A table's rows looked up by vLLM's ``_engram_lookup_kernel`` as stock's
    ``ParallelEngramEmbedding.lookup`` calls it (every head on one rank,
    ``[tokens, heads]`` ids, BF16 out), against the same rows served (values
    then scales) and decoded by ``pleclient.vllm_plugin.mxfp8``: through torch
    and through the kernel. Returns whether each is bit-equal, and how many
    values were compared."""
    from vllm.models.deepseek_v41.common import engram

    from pleclient.vllm_plugin import mxfp8

    rows, cols, heads, tokens = args["rows"], args["cols"], args["heads"], args["tokens"]
    gen = torch.Generator().manual_seed(args["seed"])
    values = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    values[(values & 0x7F) == 0x7F] ^= 0x01  # no NaN
    # Exponent bytes whose products stay in FP32's normal range, and 0 (a zero
    # row block): Triton's interpreter rounds FP32 subnormals to BF16 unlike
    # CUDA and torch (on CUDA the plugin decodes with the kernel itself).
    scales = torch.randint(20, 255, (rows, cols // 32), dtype=torch.uint8, generator=gen)
    scales[: rows // 4] = torch.tensor([0, 20, 127, 200, 254], dtype=torch.uint8).repeat(
        rows // 4, cols // 32 // 5 + 1
    )[:, : cols // 32]  # the edges: zero, small, one, large
    ids = torch.randint(0, rows, (tokens, heads), dtype=torch.int64, generator=gen)
    stock = torch.empty((tokens, heads, cols), dtype=torch.bfloat16)
    n = tokens * heads
    engram._engram_lookup_kernel[(triton_cdiv(n, 16),)](
        values.view(torch.float8_e4m3fn),
        scales,
        ids,
        ids,  # sorted_dst, as vLLM passes its indices unsorted
        stock,
        0,
        rows,
        n,
        ids.stride(0),
        ids.stride(1),
        HEAD_START=0,
        LOCAL_HEADS=heads,
        TOTAL_HEADS=heads,
        DIM=cols,
        QUANT_BLOCK=32,
        BLOCK_R=16,
        GRID=triton_cdiv(n, 16),
        SORTED=False,
        PACKED=False,
        OUT_STRIDE=stock.stride(0),
    )
    served = torch.cat([values, scales], dim=1)[ids.flatten()]  # as ple-server answers
    equal = {}
    # (buffers made for more rows than decoded: the decode takes a prefix)
    buffers = mxfp8.DecodeBuffers(n + 7, cols, torch.device("cpu"))
    for path in ("torch", "kernel", "kernel, buffers"):
        out = torch.empty((tokens, heads, cols), dtype=torch.bfloat16)
        mxfp8.decode_into(
            served,
            out,
            kernel=path.startswith("kernel"),
            buffers=buffers if path.endswith("buffers") else None,
        )
        equal[path] = bool(torch.equal(out.view(torch.int16), stock.view(torch.int16)))
    return {"equal": equal, "values": stock.numel(), "zeros": int((stock == 0).sum())}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def engram_layers(args: dict) -> dict:
    """vLLM's real ``Engram`` layers of the tiny checkpoint, built by their own
    constructor (stock, or patched when the caller's environment asks for the
    plugin), driven as ``DeepseekV4Model.forward`` drives them: every layer's
    ``prepare_embeddings`` at the step's start, then each layer's ``embed`` and
    ``forward``. Stock's tables are loaded from the checkpoint by their own
    weight loader; the rest of each layer (``wkv``, ``q_weight``, ``k_weight``)
    is seeded alike in both. With ``world`` > 1 it is one rank (``rank``,
    rendezvous ``init_file``) of a tensor-parallel group, with or without
    ``sequence_parallel``. Writes every layer's rows (what ``embed`` gave its
    ``forward``) and output of each batch to ``args["out"]`` (torch.save);
    returns what it ran."""
    import os

    from safetensors import safe_open
    from vllm.config.engram import EngramConfig as VllmEngramConfig
    from vllm.models.deepseek_v41.common import engram

    from pleclient.engram import EngramHasher
    from tests.vllm_helpers.model import vllm_context

    _cpu_standins()
    if os.environ.get("VLLM_PLE_BACKEND") == "shm":
        from pleclient.vllm_plugin import register

        register()
    model = args["model"]
    with open(f"{model}/config.json") as f:
        text = json.load(f)["text_config"]
    config = SimpleNamespace(**text, rms_norm_eps=1e-6)
    hasher = EngramHasher.from_checkpoint(model)
    outputs: dict[str, torch.Tensor] = {}
    world, rank = args.get("world", 1), args.get("rank", 0)
    sequence_parallel = bool(args.get("sequence_parallel"))
    with vllm_context(world, rank, args.get("init_file")) as vllm_config:
        vllm_config.engram_config = VllmEngramConfig(cpu_offload=False)
        layout = engram.EngramLayout(config)
        layers = []
        torch.set_default_dtype(torch.bfloat16)  # (vLLM builds a model in its dtype)
        for index, layer_id in enumerate(layout.layer_ids):
            try:
                layer = engram.Engram(
                    config, None, layout, index, sequence_parallel, f"layers.{layer_id}.engram"
                )
            except Exception as exc:  # (asked for: reported to the test)
                if not args.get("expect_error"):
                    raise
                return {"error": type(exc).__name__, "message": str(exc)}
            _load(layer, model, layer_id, safe_open)
            layers.append(layer)
        torch.set_default_dtype(torch.float32)
        storages = sorted({type(layer.embed_tokens).__name__ for layer in layers})
        gen = torch.Generator().manual_seed(7)
        for b, tokens in enumerate(args["batches"]):
            hashes = torch.stack(
                [torch.from_numpy(h.row_ids(tokens)).to(torch.int32) for h in hasher.layers], 1
            )  # [T, layers, heads], as vLLM's hash gives it
            for i, layer in enumerate(layers):  # the step's start
                layer.prepare_embeddings(hashes[:, i])
            chunk = -(-len(tokens) // world) if sequence_parallel else len(tokens)
            hidden = torch.randn(
                (chunk * world, config.hc_mult, config.hidden_size), generator=gen
            ).to(torch.bfloat16)
            if sequence_parallel:  # this rank's chunk of the tokens
                hidden = hidden[rank * chunk : (rank + 1) * chunk]
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[::5] = False  # (image positions: the gate shut)
            for i, layer in enumerate(layers):
                embed = layer.embed
                layer.embed = lambda ids, b=b, i=i, embed=embed: outputs.setdefault(
                    f"{b}/{i}/rows", embed(ids).clone()
                )
                outputs[f"{b}/{i}/out"] = layer(hidden, hashes[:, i], mask)
                del layer.embed
    torch.save(outputs, args["out"])
    return {"storages": storages, "tensors": len(outputs)}


def _load(layer, model: str, layer_id: int, safe_open) -> None:
    """Stock's table through its own weight loader (the shm storage has no
    table); the rest of the layer seeded by its layer id, the same in both."""
    storage = layer.embed_tokens
    if hasattr(storage, "weight_scale_inv"):
        with open(f"{model}/model.safetensors.index.json") as f:
            files = json.load(f)["weight_map"]
        for param, suffix in ((storage.weight, "weight"), (storage.weight_scale_inv, "scale")):
            name = f"layers.{layer_id}.engram.embed.{suffix}"
            with safe_open(f"{model}/{files[name]}", "pt") as f:
                param.weight_loader(param, f.get_tensor(name))
    gen = torch.Generator().manual_seed(layer_id)
    for param in (layer.wkv.weight, layer.q_weight, layer.k_weight):
        param.data.copy_(torch.randn(param.shape, generator=gen).to(param.dtype) * 0.05)
    layer.wkv.quant_method.process_weights_after_loading(layer.wkv)


def _cpu_standins() -> None:
    """What vLLM's Engram asks of a GPU that a CPU run must answer: the SM
    count (its lookup's grid) and the current device."""
    import types

    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(  # type: ignore[assignment]
        multi_processor_count=8
    )
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]


SCENARIOS = {
    "vllm_engram_ids": vllm_engram_ids,
    "decode_engram_rows": decode_engram_rows,
    "engram_layers": engram_layers,
}


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
