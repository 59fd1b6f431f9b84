"""A whole tiny Qwen4Exp model: written by transformers, built by vLLM's loader on CPU.

``write_checkpoints`` has transformers build a tiny ``Qwen4ExpForCausalLM`` and
``save_pretrained`` it (BF16 PLE tables, split into ``split_ngram_parts``
shards by transformers' own conversion mapping), then writes its FP8 twin the
way a real FP8 checkpoint is laid out: F8_E4M3 shards, one F32
``weight_scale`` per table, ``ple_embedding_dtype`` in the config. transformers
cannot write FP8 PLE tables itself. The BF16 rows are chosen as FP8 values
times a power-of-two scale, so both checkpoints hold the same numbers: vLLM's
dequantization of the FP8 twin gives back the BF16 rows exactly, and one
transformers reference serves both.

``load_vllm_model`` builds the model with vLLM's ``DefaultModelLoader``
(``create_model`` + ``load_weights``, which checks that every parameter was
loaded). vLLM's ``process_weights_after_loading`` needs vLLM's CUDA/C++ kernels
for the GatedDeltaNet conv; it runs here for the PLE layers only, which is
what their forward needs on CPU.

``ple_gate`` and ``ple_conv`` are Triton kernels (no Triton on CPU):
``torch_ple_gate`` and ``torch_ple_conv`` are torch implementations written
from the kernels' code (``vllm/models/qwen4_exp/common/ops/ple.py``), with the
same rounding points; ``prefill_metadata`` is the short conv's attention
metadata for a batch of new prefill requests.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from dataclasses import dataclass

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch

HIDDEN = 64
LAYERS = 3
PLE_LAYER_IDS = (2, 3)  # one-indexed, as in the config: decoder layers 1 and 2
PLE_DECODER_LAYERS = tuple(i - 1 for i in PLE_LAYER_IDS)
HC_COUNT = 2
UNIGRAM_VOCAB = 512
NGRAM_SIZE = 3
HEADS_PER_NGRAM = 2
NGRAM_VOCAB_BASE = 300
DIVISOR = 8
# 5 parts: 1248 and 1368 rows are not multiples of 5, so the last shard of
# each table is a partial one (transformers splits with torch.chunk).
PARTS = 5
EOS = 7
FP8_SCALE = 0.0625  # a power of two: FP8 value × scale is exact in BF16


def text_config(**extra):
    """The tiny config. All layers are linear attention: transformers builds the
    sparse-attention (QSA) indexer into every attention layer, and vLLM's CPU
    platform refuses sparse attention; PLE lives on linear-attention layers."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=UNIGRAM_VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        layer_types=["linear_attention"] * LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=HC_COUNT,
        # vLLM pads its fused hyper-connection projection to a multiple of 16
        # rows with uninitialized memory; 14 + hc_count leaves no padding, so
        # every row of every tensor is a loaded one and builds compare bit for bit.
        hc_lowrank=14,
        ple_layer_ids=list(PLE_LAYER_IDS),
        ple_embed_dim=HIDDEN,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        ngram_vocab_size_base=NGRAM_VOCAB_BASE,
        make_ngram_vocab_size_divisible_by=DIVISOR,
        split_ngram_parts=PARTS,
        eos_token_id=EOS,
        max_position_embeddings=256,
        output_gate_type="silu",
        **extra,
    )


# ------------------------------------------------------------------ checkpoints
@dataclass(frozen=True)
class Checkpoints:
    bf16: str  # as transformers' save_pretrained wrote it
    fp8: str  # the same model with FP8 PLE tables


def write_checkpoints(root: str, *, seed: int = 0) -> Checkpoints:
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(text_config()).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in PLE_DECODER_LAYERS:
            ple = model.model.layers[layer].ple
            table = ple.ple_embedding.ngram_embedding.weight
            table.copy_(fp8_exact_rows(table.shape, g))
            # transformers initializes the norms and the conv to zero; random
            # values make every part of the layer count in its output.
            for param in (ple.norm_key.weight, ple.norm_query.weight, ple.norm_conv.weight):
                param.copy_(0.5 * torch.randn(param.shape, generator=g))
            ple.conv1d.weight.copy_(0.5 * torch.randn(ple.conv1d.weight.shape, generator=g))
    bf16 = os.path.join(root, "bf16")
    model.save_pretrained(bf16)
    return Checkpoints(bf16=bf16, fp8=write_fp8_twin(bf16, os.path.join(root, "fp8")))


def fp8_exact_rows(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """BF16 rows that are FP8 E4M3 values times FP8_SCALE (random, no NaN)."""
    fp8 = (2.0 * torch.randn(shape, generator=g)).to(torch.float8_e4m3fn)
    return (fp8.float() * FP8_SCALE).to(torch.bfloat16)


def write_fp8_twin(bf16_dir: str, fp8_dir: str) -> str:
    """Copy of ``bf16_dir`` whose PLE shards are F8_E4M3 with a global scale."""
    from safetensors.torch import load_file, save_file

    from pleclient.families.qwen4_exp import SHARD_RE

    shutil.copytree(bf16_dir, fp8_dir)
    for name in os.listdir(fp8_dir):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(fp8_dir, name)
        tensors = load_file(path)
        tables = set()
        for key in list(tensors):
            if m := SHARD_RE.match(key):
                rows = tensors[key]
                fp8 = (rows.float() / FP8_SCALE).to(torch.float8_e4m3fn)
                if not torch.equal((fp8.float() * FP8_SCALE).to(rows.dtype), rows):
                    raise AssertionError(f"{key}: rows are not FP8 values times the scale")
                tensors[key] = fp8
                tables.add(m["table"])
        for table in tables:
            tensors[f"{table}.weight_scale"] = torch.tensor(FP8_SCALE, dtype=torch.float32)
        save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(fp8_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["ple_embedding_dtype"] = "float8_e4m3fn"  # what vLLM reads
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return fp8_dir


# --------------------------------------------------------------------- vLLM side
def vllm_config(model_dir: str):
    """What ``vllm serve model_dir --enforce-eager`` would build, on CPU, with the
    table on the device (the default Engram ``cpu_offload`` pins it: CUDA)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.engram import EngramConfig

    model_config = ModelConfig(
        model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True
    )
    return VllmConfig(model_config=model_config, engram_config=EngramConfig(cpu_offload=False))


def cpu_scheduler(model_dir: str, *, chunk: int, blocks: int = 64):
    """vLLM's own ``Scheduler`` as the engine core builds it for ``model_dir``,
    on CPU, with chunked prefill of ``chunk`` tokens a step and one KV-cache
    group of ``blocks`` blocks (the scheduler's bookkeeping; no cache is
    allocated)."""
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = vllm_config(model_dir)
    config.scheduler_config = SchedulerConfig(
        max_num_batched_tokens=chunk,
        max_num_seqs=4,
        max_model_len=config.model_config.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    config.cache_config = CacheConfig(block_size=16)
    config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    kv = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["x"], spec)]
    )
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=16)


def scheduler_request(request_id: str, prompt: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
    )


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object  # the VllmConfig it was built with
    loaded: set[str]  # what the model's load_weights reported

    @property
    def unloaded_parameters(self) -> list[str]:
        """Parameters no checkpoint tensor was loaded into (vLLM's loader raises
        on these too, where its weight tracking is on)."""
        return sorted({name for name, _ in self.model.named_parameters()} - self.loaded)


def load_vllm_model(model_dir: str) -> LoadedModel:
    """The whole ``Qwen4ExpForCausalLM``, built and loaded by vLLM's default loader."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config(model_dir)
    loader = get_model_loader(config.load_config)
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=config.model_config)
        reported: set[str] = set()
        original = model.load_weights

        def recording_load_weights(weights):
            result = original(weights)
            reported.update(result or ())
            return result

        model.load_weights = recording_load_weights
        # Raises when a parameter was not loaded (vLLM's strict weight tracking).
        loader.load_weights(model, config.model_config)
        del model.load_weights
        for layer in PLE_DECODER_LAYERS:
            process_weights_after_loading(
                ple_layer(model, layer), config.model_config, torch.device("cpu")
            )
    return LoadedModel(model, config, reported)


def ple_layer(model: torch.nn.Module, layer: int):
    return model.model.layers[layer].ple


# ---------------------------------------------------------- Triton stand-ins
def torch_ple_gate(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_w: torch.Tensor,
    norm_query_w: torch.Tensor,
    norm_conv_w: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_ple_gate_kernel`` in torch: one program per (token, stream) of H lanes.
    Every ``.to(dtype)`` below is a rounding point of the kernel."""
    dtype = hidden.dtype
    h = value.shape[-1]
    hc = hidden.shape[-1] // h
    k = key.float().unflatten(-1, (hc, h))
    q = hidden.float().unflatten(-1, (hc, h))
    nk = norm_key_w.float().unflatten(-1, (hc, h))
    nq = norm_query_w.float().unflatten(-1, (hc, h))
    ncw = norm_conv_w.float().unflatten(-1, (hc, h))

    def rms(x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt((x * x).sum(-1, keepdim=True) / h + eps)

    k_n = (k * rms(k) * (1.0 + nk)).to(dtype)
    q_n = (q * rms(q) * (1.0 + nq)).to(dtype)
    products = (k_n.float() * q_n.float()).to(dtype)
    dot = products.float().sum(-1, keepdim=True).to(dtype).float()
    d = (dot / (float(h) ** 0.5)).to(dtype).float()
    magnitude = torch.sqrt(torch.clamp_min(d.abs(), 1e-6)).to(dtype).float()
    g = torch.sigmoid(torch.sign(d) * magnitude).to(dtype).float()
    gated = (g * value.float().unsqueeze(-2)).to(dtype)
    gf = gated.float()
    normed = (gf * rms(gf) * (1.0 + ncw)).to(dtype)
    return gated.flatten(-2), normed.flatten(-2)


def torch_ple_conv(
    inputs: torch.Tensor,
    residual: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weights: torch.Tensor,
    state_indices: torch.Tensor,
    outer_residual: torch.Tensor | None,
    *,
    mode: str,
    dilation: int,
    query_start_loc: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    has_initial_states: torch.Tensor | None = None,
    spec_query_len: int = 1,
    token_indices: torch.Tensor | None = None,
) -> None:
    """``_ple_conv_kernel`` + ``_ple_conv_writeback_kernel`` in torch, prefill
    mode (what a batch of prefills dispatches): per request, tap ``k`` of token
    ``j`` reads the history at ``j + k * dilation`` (state first, then this
    step's inputs), accumulated in FP32; the state keeps the last inputs."""
    if mode != "prefill" or token_indices is not None or num_accepted_tokens is not None:
        raise NotImplementedError(f"torch_ple_conv covers plain prefill, not {mode}")
    assert query_start_loc is not None and has_initial_states is not None
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    dtype = residual.dtype
    kernel_size = conv_weights.shape[1]
    state_len = (kernel_size - 1) * dilation
    weights = conv_weights.float()  # [C, K]
    starts = query_start_loc.tolist()
    for r, (start, end) in enumerate(itertools.pairwise(starts)):
        slot = int(state_indices[r])
        if slot == NULL_BLOCK_ID or end <= start:
            continue  # inactive row: the kernel neither writes output nor state
        state = conv_state[slot]  # [C, window]
        if bool(has_initial_states[r]):
            history = state[:, :state_len].float()
        else:
            history = torch.zeros(inputs.shape[1], state_len)
        # [C, state_len + tokens]: position h of the window is history[h]
        window = torch.cat([history, inputs[start:end].float().t()], dim=1)
        acc = torch.zeros(end - start, inputs.shape[1])
        for k in range(kernel_size):
            taps = window[:, k * dilation : k * dilation + end - start].t()
            acc += weights[:, k] * taps
        conv = acc.to(dtype).float()
        conv_output = (conv * torch.sigmoid(conv)).to(dtype)
        if outer_residual is None:
            residual[start:end] = conv_output
        else:
            ple_output = (residual[start:end] + conv_output).to(dtype)
            residual[start:end] = (outer_residual[start:end].float() + ple_output.float()).to(dtype)
        # Write-back: the state keeps the newest state_len positions of the window.
        state[:, :state_len] = window[:, -state_len:].to(state.dtype)


def prefill_metadata(query_start_loc: torch.Tensor, slots: list[int]):
    """``PleShortConvAttentionMetadata`` for new prefill requests (no decodes,
    no initial state, no speculative tokens), one conv-state slot each."""
    from vllm.v1.attention.backends.short_conv_attn import PleShortConvAttentionMetadata

    requests = query_start_loc.numel() - 1
    tokens = int(query_start_loc[-1])
    qsl = query_start_loc.to(torch.int32)
    state_indices = torch.tensor(slots, dtype=torch.int32)
    return PleShortConvAttentionMetadata(
        num_prefills=requests,
        num_prefill_tokens=tokens,
        num_decodes=0,
        num_decode_tokens=0,
        num_reqs=requests,
        has_initial_states_p=torch.zeros(requests, dtype=torch.bool),
        query_start_loc_p=qsl,
        state_indices_tensor_p=state_indices,
        state_indices_tensor_d=None,
        query_start_loc_d=None,
        num_accepted_tokens=None,
        seq_lens=qsl[1:] - qsl[:-1],
        num_actual_tokens=tokens,
        max_prefill_query_len=int((qsl[1:] - qsl[:-1]).max()),
        query_start_loc=qsl,
        state_indices_tensor=state_indices,
        non_spec_query_start_loc=qsl,
    )


# --------------------------------------------------------------- transformers
def load_transformers_model(model_dir: str):
    from transformers import Qwen4ExpForCausalLM

    return Qwen4ExpForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
