#!/usr/bin/env python3
"""How fast ``pleclient.ngram`` hashes a prompt into every PLE layer's row ids.

Prompt-ahead hashes a whole prompt, for every PLE layer, in a process that has
no model (the server, or vLLM's engine core). This measures it at
Qwen3.8-Flash-Next geometry (16 ids per token, the primes after 20 M, one PLE
layer; ``--layers`` builds more, each with its own constants) on a prompt of
``--tokens`` tokens (default 32 768):

- **prompt**: ``layer.row_ids(prompt)`` for every layer, the prompt from the
  start of its request;
- **chunks**: the same prompt as chunks of ``--chunk`` tokens, each continuing
  the previous one's context (``row_ids(chunk, context=prompt[:start])``);
- **batch**: the prompt as ``--requests`` requests of one step in vLLM's layout
  (``batch_ids(input_ids, query_start_loc, ngram_context)``);
- **floor**: the part no hash can skip, one int64 modulo per id into the
  output (``np.remainder`` head by head), per layer;
- **vllm**: vLLM 0.33's ``compute_ngram_ids`` CPU path (torch, one thread and
  the default threads) on the same tokens, when vLLM is installed; its ids are
  checked equal to ours.

Tokens are random over the vocabulary with 1 in 500 an EOS, or a real-text
trace's tokens (``--trace``, from ``bench/sim/text_trace.py``). Each figure is the
median of ``--repeat`` runs (vLLM's: ``--vllm-repeat``), with the best run
beside it; ratios are against the floor and against vLLM. The CPU other
processes used meanwhile and the load average are reported.

    python -m bench.micro.ngram_hash --json ngram.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from bench.harness.provenance import OthersMeter, loadavg, machine, source
from bench.harness.scaffold import add_json, parser, save_json
from pleclient.ngram import NgramConfig, NgramLayer

EOS = 248_044  # <|endoftext|>, Qwen3.5/3.6 vocabulary
FLASH_PLE_LAYERS = 1  # Qwen3.8-Flash-Next: one PLE layer (one ≈ 320 M-row table)


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median and least seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def prompt_tokens(args) -> np.ndarray:
    if args.trace:
        with np.load(args.trace, allow_pickle=False) as z:
            tokens = z["tokens"].astype(np.int64)
        if len(tokens) < args.tokens:
            raise SystemExit(f"{args.trace}: {len(tokens)} tokens, fewer than --tokens")
        return tokens[: args.tokens]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 248_320, args.tokens)
    tokens[rng.random(args.tokens) < 1 / 500] = EOS
    return tokens


def vllm_module(layer: NgramLayer):
    """vLLM's module with ``layer``'s constants, without its table (at this
    geometry its constructor would allocate 320 M rows); None without vLLM."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        from torch import nn
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    except ImportError:
        return None
    module = Qwen4ExpNGramEmbedding.__new__(Qwen4ExpNGramEmbedding)
    nn.Module.__init__(module)
    module.ngram_size = layer.config.ngram_size
    module.heads_per_ngram = layer.config.heads_per_ngram
    module.ngram_heads = layer.heads
    module.eos_token_id = layer.eos_token_id
    for name, value in (
        ("layer_multipliers", layer.multipliers),
        ("ngram_heads_vocab_sizes", layer.vocab_sizes),
        ("ngram_heads_offsets", layer.offsets),
    ):
        module.register_buffer(name, torch.from_numpy(value.copy()))
    return module


def run(args) -> dict:
    config = NgramConfig(eos_token_id=EOS)
    layers = [NgramLayer.from_config(config, d) for d in range(args.layers)]
    tokens = prompt_tokens(args)
    n = len(tokens)
    ids_total = n * config.heads * len(layers)
    starts = list(range(0, n, args.chunk))
    per_request = -(-n // args.requests)
    qsl = np.minimum(np.arange(0, n + per_request, per_request), n)[: args.requests + 1]
    context = np.full((args.requests, config.ngram_size - 1), EOS, dtype=np.int64)
    out = np.empty((n, config.heads), dtype=np.int64)
    mixed = tokens * layers[0].multipliers[0]

    def prompt():
        for layer in layers:
            layer.row_ids(tokens, out=out)

    def chunks():
        for layer in layers:
            for start in starts:
                layer.row_ids(tokens[start : start + args.chunk], context=tokens[:start])

    def batch():
        for layer in layers:
            layer.batch_ids(tokens, qsl, context)

    def floor():
        for layer in layers:
            for head, size in enumerate(layer.vocab_sizes.tolist()):
                np.remainder(mixed, size, out=out[:, head])

    result: dict = {
        "machine": machine(),
        "source": source(),
        "geometry": {
            "model": "Qwen3.8-Flash-Next",
            "ple_layers": len(layers),
            "ids_per_token": config.heads,
            "rows_per_layer": layers[0].rows,
        },
        "tokens": n,
        "token_source": args.trace or "random (1 in 500 EOS)",
        "ids": ids_total,
        "repeat": args.repeat,
        "loadavg_start": loadavg(),
        "seconds": {},
        "least_seconds": {},
        "others_cpu": {},
    }
    cases = {"prompt": prompt, "chunks": chunks, "batch": batch, "floor": floor}
    module = vllm_module(layers[0]) if not args.no_vllm else None
    if module is not None:
        import torch

        t_ids = torch.from_numpy(tokens)
        t_qsl = torch.tensor([0, n])
        t_ctx = torch.full((1, config.ngram_size - 1), EOS)
        modules = [vllm_module(layer) for layer in layers]

        def vllm():
            with torch.no_grad():
                for m in modules:
                    m.compute_ngram_ids(t_ids, t_qsl, t_ctx)

        with torch.no_grad():
            want = module.compute_ngram_ids(t_ids, t_qsl, t_ctx).numpy()
        result["vllm_equal"] = bool(np.array_equal(want, layers[0].row_ids(tokens)))
        threads = torch.get_num_threads()
        cases["vllm"] = vllm
        result["torch_threads"] = threads

        def vllm_one_thread():
            torch.set_num_threads(1)
            try:
                vllm()
            finally:
                torch.set_num_threads(threads)

        cases["vllm_1_thread"] = vllm_one_thread
    for name, fn in cases.items():
        meter = OthersMeter([])
        meter.start()
        repeat = args.vllm_repeat if name.startswith("vllm") else args.repeat
        result["seconds"][name], result["least_seconds"][name] = timed(fn, repeat)
        result["others_cpu"][name] = meter.stop()
    seconds = result["seconds"]
    result["mids_per_s"] = {k: round(ids_total / v / 1e6, 2) for k, v in seconds.items()}
    result["mids_per_s_best"] = {
        k: round(ids_total / v / 1e6, 2) for k, v in result["least_seconds"].items()
    }
    result["over_floor"] = {k: round(v / seconds["floor"], 2) for k, v in seconds.items()}
    if "vllm" in seconds:
        result["vllm_over_prompt"] = round(seconds["vllm"] / seconds["prompt"], 1)
        result["vllm_1_thread_over_prompt"] = round(seconds["vllm_1_thread"] / seconds["prompt"], 1)
    result["loadavg_end"] = loadavg()
    return result


def report(result: dict) -> str:
    g = result["geometry"]
    lines = [
        f"pleclient.ngram at {g['model']} geometry: {result['tokens']} tokens × "
        f"{g['ple_layers']} PLE layer(s) × {g['ids_per_token']} ids = {result['ids']:,} ids "
        f"({result['token_source']}), median of {result['repeat']} runs",
        f"commit {result['source']['commit']}, {result['machine'].get('model_name', '?')}, "
        f"{result['machine']['cores']} cores, load {result['loadavg_start']} → "
        f"{result['loadavg_end']}",
        "",
        f"{'case':<14} {'ms':>9} {'M ids/s':>9} {'× floor':>8} {'best M ids/s':>13} "
        f"{'others CPU':>11}",
    ]
    for name, seconds in result["seconds"].items():
        lines.append(
            f"{name:<14} {seconds * 1e3:>9.2f} {result['mids_per_s'][name]:>9.1f} "
            f"{result['over_floor'][name]:>8.2f} {result['mids_per_s_best'][name]:>13.1f} "
            f"{result['others_cpu'][name]:>11.0%}"
        )
    if "vllm_equal" in result:
        lines.append(
            f"\nvLLM's CPU path / ours (prompt): {result['vllm_over_prompt']} "
            f"({result['torch_threads']} torch threads), {result['vllm_1_thread_over_prompt']} "
            f"(1 thread); ids equal: {result['vllm_equal']}"
        )
    if max(result["others_cpu"].values()) > 0.10:
        lines.append("WARNING: other processes kept the CPUs busy: figures are not representative")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--tokens", type=int, default=32_768, help="prompt tokens (default 32 768)")
    ap.add_argument(
        "--layers",
        type=int,
        default=FLASH_PLE_LAYERS,
        help=f"PLE layers (default {FLASH_PLE_LAYERS}, Qwen3.8-Flash-Next's)",
    )
    ap.add_argument("--chunk", type=int, default=2048, help="chunk tokens (default 2048)")
    ap.add_argument("--requests", type=int, default=16, help="requests of the batch case")
    ap.add_argument("--repeat", type=int, default=20, help="runs per case (median)")
    ap.add_argument("--vllm-repeat", type=int, default=3, help="runs of vLLM's path (median)")
    ap.add_argument("--trace", help="take the tokens of a bench/sim/text_trace.py trace")
    ap.add_argument("--no-vllm", action="store_true", help="leave out vLLM's CPU path")
    add_json(ap)
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.layers < 1 or args.chunk < 1 or args.requests < 1:
        ap.error("--tokens, --layers, --chunk and --requests must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    save_json(result, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
