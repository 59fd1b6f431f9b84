#!/usr/bin/env python3
"""A random-weight Qwen4Exp checkpoint that vLLM 0.33's GPU kernels take.

Real vLLM on the H200 needs a checkpoint its CUDA, Triton and CuTe DSL kernels
accept; the tiny model of the CPU tests (hidden 64) was made for vLLM's CPU
path and is refused there. This writes one with the real model's per-layer
dims (transformers 5.20.2's ``Qwen4ExpTextConfig``; the numbers that were
run on the H200):

- hidden 2560; 16 attention heads × 256, 2 KV heads, ``partial_rotary_factor``
  0.25 (a rotary dim of 64);
- GatedDeltaNet 16 key / 32 value heads × 128;
- hyper-connections ``hc_count`` 4, ``hc_lowrank`` 320;
- 32 experts, top 8, expert and shared expert 512 wide;
- PLE tables of ``ple_embed_dim`` 2560 over 16 n-gram heads: 160 columns, as
  Qwen3.8-Flash-Next's rows;
- vocab 512 with a byte-level tokenizer (id = the byte; 256 is
  ``<|endoftext|>``, 257–511 are reserved specials), so real English text is
  a real prompt without a downloaded tokenizer.

Trunks (``--layers``): every fourth layer is attention, the others are
GatedDeltaNet, as in the real model; PLE sits on linear-attention layers only.

  4 layers:  PLE on layers 2, 3 (one-indexed; decoder layers 1 and 2): the
             least compute in front of a PLE layer to hide a read behind
  16 layers: PLE on layers 2, 6, 10, 14: four tables, deeper in the trunk

transformers builds the QSA indexer into every ``indexed_attention`` layer and
refuses a config whose ``indexer_head_dim`` is below the rotary dim; vLLM
builds the sparse indexer only when ``indexer_n_heads`` is set. So the model
is built with an indexer (head dim 64) and the checkpoint is written without
it: its tensors are dropped and its config keys removed, and vLLM runs those
layers as plain full attention, as the CPU tests' tiny model does without any
attention layer at all.

Tables: ``--ngram-vocab-base`` sets each n-gram head's vocabulary (primes
after it, rounded up to a multiple of 128), so a table holds about
16 × base rows of 160 columns:

  100 000      ≈ 1.6 M rows, 0.51 GB a BF16 table: fits any memory (mmap)
  1 100 000    ≈ 17.6 M rows, 5.6 GB a table; two of them make 10.5 GiB on
               the 4-layer trunk (the ``--io direct`` cells: ≥ 10 GiB, a row
               cache of 1 GiB is under a tenth of it)
  550 000      four tables of 2.8 GB on the 16-layer trunk: 10.5 GiB

Every BF16 row is an FP8 E4M3 value times a power-of-two scale
(``tests/vllm_helpers/qwen4_model.py``'s rule), so the FP8 checkpoint
(``--dtype fp8``, or ``--twin-of`` an existing BF16 one) holds the same numbers:
vLLM's dequantization of it gives back the BF16 rows bit for bit, and a BF16
stock run is a reference for an FP8 one. ``--dtype nvfp4 --twin-of`` writes
the NVFP4 copy (packed E2M1 values, E4M3 block scales, a ``weight_scale_2``
a table): rounded, so it is its own family, judged against its own stock
runs. The PLE layers' norms and short conv,
which transformers initializes to zero, get random weights so that every part
of a PLE layer counts in its output.

Built on ``--device cuda`` (seconds for 12 GB) or ``cpu`` (``--tiny``: the
test's hidden-64 dims with the same layout, for the CPU test of this script).
The directory gets ``bench-checkpoint.json`` (the arguments and sizes) last, so
a directory holding it is complete, and a later run with the same arguments
reuses it (``--reuse``).

    python -m bench.real_vllm.checkpoint --out ckpt/small-bf16 --device cuda
    python -m bench.real_vllm.checkpoint --out ckpt/small-fp8 --twin-of ckpt/small-bf16
    python -m bench.real_vllm.checkpoint --out ckpt/small-nvfp4 \
        --twin-of ckpt/small-bf16 --dtype nvfp4
    python -m bench.real_vllm.checkpoint --out ckpt/large-bf16 --ngram-vocab-base 1100000
    python -m bench.real_vllm.checkpoint --out ckpt/tiny --tiny --device cpu
    python -m bench.real_vllm.checkpoint --out ckpt/dsv41 --model deepseek-v41

``--model deepseek-v41`` writes ``pleserver.devkit.deepseek_v41``'s whole
16-layer DeepSeek-V4.1 instead (Engram on decoder layers 1 and 14; only the
Engram tables are in its safetensors: vLLM draws the rest under
``load_format="dummy"``, and ``bench/real_vllm/engram_tables.py`` gives a stock
engine the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.harness.checkout import installed_first

log = logging.getLogger("bench.real_vllm.checkpoint")

REPO = Path(__file__).resolve().parents[2]
MARKER = "bench-checkpoint.json"
MARKER_FORMAT = "qwen4-checkpoint/1"
VOCAB = 512
EOS = 256  # <|endoftext|>: the first id after the 256 bytes
MODELS = ("qwen4exp", "deepseek-v41")
PLE_LAYER_IDS = {4: [2, 3], 16: [2, 6, 10, 14]}  # one-indexed, as in the config
ROWS_CHUNK = 1 << 20  # rows filled at a time (bounds the FP32 temporary on the device)

# The real model's per-layer dims (the shape vLLM's GPU kernels were run with).
REAL_DIMS: dict[str, Any] = {
    "hidden_size": 2560,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "hc_count": 4,
    "hc_lowrank": 320,
    "ple_embed_dim": 2560,
    "heads_per_ngram": 8,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 512,
    "indexer_n_heads": 4,
    "indexer_head_dim": 64,  # at least the rotary dim: 256 × 0.25
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "rope_theta": 10_000_000.0,
}
# The CPU tests' tiny dims (tests/vllm_helpers/qwen4_model.py), same layout.
TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "hc_count": 2,
    "hc_lowrank": 14,
    "ple_embed_dim": 64,
    "heads_per_ngram": 2,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 5,
    "indexer_n_heads": 2,
    "indexer_head_dim": 16,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
    "rope_theta": 10_000.0,
}
INDEXER_KEYS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


class CheckpointBuildError(RuntimeError):
    """The checkpoint could not be written as asked; the message says why."""


# ------------------------------------------------------------------ the config
def layer_types(layers: int) -> list[str]:
    """Every fourth layer attention (the real model's ``full_attention_interval``)."""
    return ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def text_config(layers: int = 4, ngram_vocab_base: int = 100_000, *, tiny: bool = False):
    """transformers' ``Qwen4ExpTextConfig`` of the checkpoint, indexer included
    (transformers needs it to build the model; ``strip_indexer`` drops it)."""
    from transformers import Qwen4ExpTextConfig

    if layers not in PLE_LAYER_IDS:
        raise CheckpointBuildError(
            f"--layers {layers}: this script knows the 4- and 16-layer trunks "
            f"({sorted(PLE_LAYER_IDS)}); pick one of them"
        )
    dims = dict(TINY_DIMS if tiny else REAL_DIMS)
    rope_theta = dims.pop("rope_theta")
    return Qwen4ExpTextConfig(
        vocab_size=VOCAB,
        num_hidden_layers=layers,
        layer_types=layer_types(layers),
        ple_layer_ids=list(PLE_LAYER_IDS[layers]),
        ngram_size=3,
        ngram_vocab_size_base=ngram_vocab_base,
        indexer_kv_heads=1,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=None,
        max_position_embeddings=8192,
        output_gate_type="silu",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "partial_rotary_factor": 0.25,
        },
        **dims,
    )


# ------------------------------------------------------------------ the model
def _fp8_helpers() -> ModuleType:
    """``tests/vllm_helpers/qwen4_model.py``, loaded from its file: the FP8 twin
    and its scale are the CPU tests' own. Loaded by path, not through
    ``sys.path``, so that this checkout's ``pleserver`` (without its native
    modules on the GPU host) never shadows the installed one; the module's
    ``VLLM_TARGET_DEVICE`` default is taken back out of this process."""
    path = REPO / "tests" / "vllm_helpers" / "qwen4_model.py"
    spec = importlib.util.spec_from_file_location("bench_qwen4_model", path)
    if spec is None or spec.loader is None:
        raise CheckpointBuildError(f"{path} is missing: run from a full checkout of the repository")
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    before = os.environ.get("VLLM_TARGET_DEVICE")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            os.environ.pop("VLLM_TARGET_DEVICE", None)
        else:
            os.environ["VLLM_TARGET_DEVICE"] = before
    return module


def fill_fp8_exact(table, scale: float, generator) -> None:
    """Fill a BF16 table with FP8 E4M3 values times ``scale`` (a power of two),
    the rule of ``qwen4_model.fp8_exact_rows``, on the table's own device and a
    chunk of rows at a time."""
    import torch

    rows = table.shape[0]
    for start in range(0, rows, ROWS_CHUNK):
        part = table[start : start + ROWS_CHUNK]
        noise = torch.randn(part.shape, generator=generator, device=table.device)
        fp8 = (2.0 * noise).to(torch.float8_e4m3fn)
        part.copy_((fp8.float() * scale).to(torch.bfloat16))


def build_model(config, device: str, seed: int, scale: float):
    """transformers' ``Qwen4ExpForCausalLM`` with random weights, in BF16 on
    ``device``; PLE tables FP8-exact, PLE norms and conv random."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        raise CheckpointBuildError("--device cuda: torch sees no CUDA device; use --device cpu")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the tables are never held in FP32
    try:
        with torch.device(device):
            model = Qwen4ExpForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for layer_id in config.ple_layer_ids:
            ple = model.model.layers[layer_id - 1].ple
            fill_fp8_exact(ple.ple_embedding.ngram_embedding.weight, scale, generator)
            for param in (
                ple.norm_key.weight,
                ple.norm_query.weight,
                ple.norm_conv.weight,
                ple.conv1d.weight,
            ):
                noise = torch.randn(param.shape, generator=generator, device=param.device)
                param.copy_(0.5 * noise)
    return model


def drop_indexer(model) -> int:
    """Remove the QSA indexer modules, so that their tensors are never written
    (a 12 GB file is not written twice); ``strip_indexer`` then finds none."""
    dropped = 0
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None and getattr(attn, "indexer", None) is not None:
            del attn.indexer
            dropped += 1
    return dropped


# --------------------------------------------------------------- the files
def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def strip_indexer(model_dir: Path) -> int:
    """Drop the QSA indexer: its tensors from every file (and the index), its
    keys from config.json. Returns how many tensors were dropped."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dropped = 0
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            if not any(".indexer." in n for n in names):
                continue
            kept = {n: f.get_tensor(n) for n in names if ".indexer." not in n}
            metadata = f.metadata() or {"format": "pt"}
        dropped += len(names) - len(kept)
        save_file(kept, str(path), metadata=metadata)
    _edit_index(model_dir, lambda wm: {k: v for k, v in wm.items() if ".indexer." not in k})
    _edit_config(model_dir, lambda c: {k: v for k, v in c.items() if k not in INDEXER_KEYS})
    return dropped


def _edit_index(model_dir: Path, change) -> None:
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        return
    data = json.loads(index.read_text())
    data["weight_map"] = change(data["weight_map"])
    index.write_text(json.dumps(data, indent=2, sort_keys=True))


def _edit_config(model_dir: Path, change) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=2, sort_keys=True))


def write_tokenizer(model_dir: Path) -> None:
    """A byte-level tokenizer of 512 ids: id b is byte b (GPT-2's byte-to-
    character map, no merges), 256 is ``<|endoftext|>``, 257–511 reserved
    specials; so ``tokenizer.encode(text) == list(text.encode())``, and every id
    the model may sample decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] + [f"<|reserved_{i}|>" for i in range(EOS + 1, VOCAB)]
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in specials])
    if tokenizer.get_vocab_size() != VOCAB:
        raise CheckpointBuildError(
            f"the tokenizer has {tokenizer.get_vocab_size()} ids, not {VOCAB}: "
            "tokenizers added or merged tokens unexpectedly"
        )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "model_max_length": 8192,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )


def fp8_twin(bf16_dir: Path, fp8_dir: Path) -> None:
    """The FP8 copy of a BF16 checkpoint of this script (``write_fp8_twin`` of
    the CPU tests, which checks every row), with the index, where there is
    one, naming each table's new ``weight_scale``."""
    from safetensors import safe_open

    from pleclient.families.qwen4_exp import SHARD_RE

    helpers = _fp8_helpers()
    if fp8_dir.exists():
        shutil.rmtree(fp8_dir)
    helpers.write_fp8_twin(str(bf16_dir), str(fp8_dir))
    (fp8_dir / MARKER).unlink(missing_ok=True)
    scales: dict[str, str] = {}
    for path in _safetensors_files(fp8_dir):
        with safe_open(str(path), "pt") as f:
            names = f.keys()
            for name in names:
                if m := SHARD_RE.match(name):
                    scales[f"{m['table']}.weight_scale"] = path.name
    _edit_index(fp8_dir, lambda wm: {**wm, **scales})


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between 0, .5, 1, 1.5, 2, 3, 4, 6
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK = 16


def nvfp4_rows(rows, global_scale: float) -> tuple[Any, Any]:
    """BF16 rows ``[n, cols]`` as vLLM's NVFP4 layout: packed E2M1 values ``[n,
    cols/2]`` (U8, the even column in the low nibble) and E4M3 block scales
    ``[n, cols/16]``, so that a value is ``e2m1 × block scale × global_scale``
    (``weight_scale_2``). Each value is rounded to the nearest E2M1 step of
    its block's scale: lossy, so an NVFP4 checkpoint is its own reference."""
    import torch

    n, cols = rows.shape
    x = rows.float().reshape(n, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = x.abs().amax(dim=-1, keepdim=True)
    block = (amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block.float() * global_scale
    scaled = torch.where(step > 0, x / torch.where(step > 0, step, 1.0), 0.0)
    mids = torch.tensor(E2M1_MIDPOINTS, device=x.device)
    codes = torch.bucketize(scaled.abs(), mids).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    codes = codes.reshape(n, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), block.reshape(n, cols // NVFP4_BLOCK).contiguous()


def nvfp4_twin(bf16_dir: Path, out_dir: Path, device: str) -> None:
    """The NVFP4 copy of a BF16 checkpoint of this script: every PLE shard as
    ``shard_<i>.weight`` (packed values) and ``shard_<i>.weight_scale`` (block
    scales), a ``weight_scale_2`` a table, ``ple_embedding_dtype = "nvfp4"``.
    The global scale puts the table's largest block at E4M3's largest scale."""
    import torch
    from safetensors.torch import load_file, save_file

    from pleclient.families.qwen4_exp import SHARD_RE

    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(bf16_dir, out_dir)
    (out_dir / MARKER).unlink(missing_ok=True)
    files = _safetensors_files(out_dir)
    amax: dict[str, float] = {}
    for path in files:  # first pass: each table's largest value, over its files
        for key, rows in load_file(str(path)).items():
            if m := SHARD_RE.match(key):
                amax[m["table"]] = max(amax.get(m["table"], 0.0), rows.float().abs().max().item())
    global_scale = {t: (a or 1.0) / (E2M1_MAX * E4M3_MAX) for t, a in amax.items()}
    names: dict[str, str] = {}
    for path in files:
        tensors = load_file(str(path))
        tables = set()
        for key in list(tensors):
            if not (m := SHARD_RE.match(key)):
                continue
            rows, table = tensors[key], m["table"]
            packed, blocks = [], []
            for start in range(0, rows.shape[0], ROWS_CHUNK):
                p, b = nvfp4_rows(rows[start : start + ROWS_CHUNK].to(device), global_scale[table])
                packed.append(p.cpu())
                blocks.append(b.cpu())
            tensors[key] = torch.cat(packed)
            scale_key = key[: -len("weight")] + "weight_scale"
            tensors[scale_key] = torch.cat(blocks)
            names[scale_key] = path.name
            tables.add(table)
        for table in tables:
            tensors[f"{table}.weight_scale_2"] = torch.tensor(
                global_scale[table], dtype=torch.float32
            )
            names[f"{table}.weight_scale_2"] = path.name
        save_file(tensors, str(path), metadata={"format": "pt"})
    _edit_index(out_dir, lambda wm: {**wm, **names})
    _edit_config(out_dir, lambda c: {**c, "ple_embedding_dtype": "nvfp4"})


def table_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of each PLE table, as ple-server sees them."""
    from pleclient.checkpoint import discover_tables

    return {t.name: t.nbytes for t in discover_tables(str(model_dir), fingerprint=False)}


def marker_of(args: argparse.Namespace) -> dict:
    return {
        "format": MARKER_FORMAT,
        "model": args.model,
        "layers": args.layers,
        "ngram_vocab_base": args.ngram_vocab_base,
        "dtype": args.dtype,
        "seed": args.seed,
        "tiny": args.tiny,
        "twin_of": str(args.twin_of) if args.twin_of else None,
    }


def reusable(out: Path, wanted: dict) -> bool:
    """``out`` holds a complete checkpoint written with the same arguments."""
    try:
        found = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in wanted.items())


def write_checkpoint(args: argparse.Namespace) -> dict:
    """Write the checkpoint ``args`` ask for; the marker's content."""
    out: Path = args.out
    source = Path(args.twin_of) if args.twin_of else None
    if source is not None:
        try:
            built = json.loads((source / MARKER).read_text())
        except (OSError, ValueError):
            raise CheckpointBuildError(
                f"--twin-of {source}: no readable {MARKER} there; write the BF16 checkpoint "
                "with this script first"
            ) from None
        for key in ("layers", "ngram_vocab_base", "seed", "tiny"):
            setattr(args, key, built[key])
    wanted = marker_of(args)
    if args.reuse and reusable(out, wanted):
        log.info("%s already holds this checkpoint (%s): reused", out, MARKER)
        return json.loads((out / MARKER).read_text())
    t0 = time.monotonic()
    if args.model == "deepseek-v41":
        from pleserver.devkit.deepseek_v41 import write_whole_deepseek_v41

        if out.exists():
            shutil.rmtree(out)
        write_whole_deepseek_v41(str(out), seed=args.seed)
    elif source is not None and args.dtype == "nvfp4":
        nvfp4_twin(source, out, args.device)
    elif source is not None:
        fp8_twin(source, out)
    else:
        config = text_config(args.layers, args.ngram_vocab_base, tiny=args.tiny)
        model = build_model(config, args.device, args.seed, _fp8_helpers().FP8_SCALE)
        bf16_dir = out if args.dtype == "bf16" else out.with_name(out.name + ".bf16-tmp")
        for d in {out, bf16_dir}:
            if d.exists():
                shutil.rmtree(d)
        drop_indexer(model)
        model.save_pretrained(str(bf16_dir))
        del model
        strip_indexer(bf16_dir)
        write_tokenizer(bf16_dir)
        if args.dtype == "fp8":
            fp8_twin(bf16_dir, out)
            shutil.rmtree(bf16_dir)
    tables = table_bytes(out)
    marker = {
        **wanted,
        "tables": tables,
        "table_bytes": sum(tables.values()),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2))
    return marker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="qwen4exp",
        help="qwen4exp (this script's trunks) or deepseek-v41: pleserver.devkit.deepseek_v41's "
        "whole 16-layer model, Engram tables only in its safetensors (its engines load "
        'with load_format="dummy"; --layers, --ngram-vocab-base and --dtype do not apply)',
    )
    parser.add_argument("--layers", type=int, choices=sorted(PLE_LAYER_IDS), default=4)
    parser.add_argument(
        "--ngram-vocab-base",
        type=int,
        default=100_000,
        help="each n-gram head's vocabulary: ≈ 16 × this many rows a table "
        "(100 000: 0.5 GB a BF16 table; 1 100 000: 5.6 GB)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp8", "nvfp4"),
        help="the PLE tables' dtype (default: bf16; with --twin-of, fp8); nvfp4 only "
        "with --twin-of",
    )
    parser.add_argument(
        "--twin-of",
        type=Path,
        help="write the FP8 twin (same numbers) or the NVFP4 copy (rounded to NVFP4) of "
        "this BF16 checkpoint instead of a new model",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny", action="store_true", help="the CPU tests' hidden-64 dims (a test of this script)"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep --out when it holds a complete checkpoint of the same arguments",
    )
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("fp8" if args.twin_of else "bf16")
    if args.model == "deepseek-v41" and (args.twin_of or args.tiny or args.dtype != "bf16"):
        parser.error(
            "--model deepseek-v41 writes its own FP8 model: no --twin-of, --tiny or --dtype"
        )
    if args.model == "deepseek-v41":
        # its 16 layers, its Engram tables (E4M3 values, UE8M0 scales), no PLE vocabulary
        args.layers, args.dtype, args.ngram_vocab_base = 16, "fp8", None
    if args.twin_of and args.dtype == "bf16":
        parser.error("--twin-of writes an fp8 or nvfp4 copy: --dtype bf16 is the source's")
    if args.dtype == "nvfp4" and not args.twin_of:
        parser.error("--dtype nvfp4 needs --twin-of: the NVFP4 copy of a BF16 checkpoint")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        marker = write_checkpoint(args)
    except CheckpointBuildError as exc:
        print(f"bench.real_vllm.checkpoint: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps({"checkpoint": str(args.out), **marker}))
    return 0


if __name__ == "__main__":
    installed_first()
    sys.exit(main())
