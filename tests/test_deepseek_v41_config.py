"""The whole DeepSeek-V4.1 model of ``pleserver.devkit.deepseek_v41``
(``--whole-model``), which a GPU host is to run in vLLM 0.33 with
``load_format="dummy"``, checked as far as vLLM's own classes go without a GPU:
its config class, ``EngineArgs`` up to a ``VllmConfig``, the model registry, the
Engram layout and hash state, the RoPE of each kind of layer, the quantization
config CUDA resolves; and the project's own discovery of its two tables.

vLLM runs in a scenario process (``python -m tests.test_deepseek_v41_config
vllm_view '<json args>'``, through ``tests.vllm_helpers.run_scenario``), as the
project's other vLLM tests do.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pleclient.checkpoint import discover_tables, read_header
from pleclient.engram import EngramHasher
from pleserver.devkit.deepseek_v41 import check_sparse_topology, write_whole_deepseek_v41

ENGRAM_VOCAB = 100
"""Small tables for the test: 2 × 24 primes above 100, 2.8 MB."""
SCENARIO_MODULE = "tests.test_deepseek_v41_config"


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dsv41-whole")
    return Path(write_whole_deepseek_v41(str(path), engram_vocab_size=ENGRAM_VOCAB))


@pytest.fixture(scope="module")
def config(whole) -> dict:
    return json.loads((whole / "config.json").read_text())


@pytest.fixture(scope="module")
def vllm_view(whole) -> dict:
    pytest.importorskip("vllm")
    from tests.vllm_helpers import run_scenario

    return run_scenario("vllm_view", {"model": str(whole)}, module=SCENARIO_MODULE)


def test_vllms_config_class_keeps_every_key_written(config, vllm_view):
    text = {k: v for k, v in config["text_config"].items() if k != "rope_scaling"}
    assert vllm_view["config_class"] == "DeepseekV41Config"
    assert vllm_view["flattened"] == text  # text_config onto the top, none lost or replaced
    assert vllm_view["rope_parameters"]["rope_type"] == "yarn"  # rope_scaling, moved there
    assert vllm_view["rope_parameters"]["factor"] == config["text_config"]["rope_scaling"]["factor"]
    vision = config["vision_config"]
    assert vllm_view["vision"] == {
        "vision_n_layers": vision["num_hidden_layers"],
        "vision_dim": vision["hidden_size"],
        "vision_n_heads": vision["num_attention_heads"],
        "vision_inter_dim": vision["intermediate_size"],
        "vision_patch_size": vision["patch_size"],
        "vision_rope_theta": vision["rope_theta"],
        "vision_downsample_ratio": vision["downsample_ratio"],
        "vision_max_n_token": vision["max_image_tokens"],
        "vision_min_pixels": vision["min_pixels"],
        "vision_max_wh_ratio": vision["max_wh_ratio"],
    }


def test_the_architecture_resolves_to_the_registered_vision_wrapper_text_only(vllm_view):
    assert vllm_view["architecture"] == "DeepseekV41ForCausalLM"
    assert (
        vllm_view["model_class"]
        == "vllm.models.deepseek_v41.nvidia.vl_model.DeepseekV41ForCausalLM"
    )
    # The wrapper asserts a multimodal config (vl_model.py:153); image 0 stubs the tower.
    assert vllm_view["is_multimodal_model"] and vllm_view["image_limit"] == 0
    assert not vllm_view["supports_multimodal_inputs"]
    assert vllm_view["tokenizer_mode"] == "deepseek_v41"
    assert vllm_view["tokenizer_len"] == vllm_view["flattened"]["vocab_size"]
    assert vllm_view["is_deepseek_mla"] and vllm_view["head_size"] == 512
    assert vllm_view["dtype"] == "torch.bfloat16" and vllm_view["max_model_len"] == 4096


def test_the_geometry_the_kernels_fix_is_real_and_the_rest_small(config):
    text = config["text_config"]
    real = ("head_dim", "qk_rope_head_dim", "hc_mult", "index_n_heads", "index_head_dim")
    assert [text[k] for k in real] == [512, 64, 4, 32, 128]
    assert text["num_attention_heads"] // text["o_groups"] == 8  # heads per output group
    small = ("num_hidden_layers", "hidden_size", "num_attention_heads", "n_routed_experts")
    assert [text[k] for k in small] == [16, 1024, 16, 8]
    assert text["engram_layer_ids"] == [1, 14]
    ratios = text["compress_ratios"]
    assert len(ratios) == 16 and {0, 1, 2} == set(ratios)
    # The Engram layer 14 owns a compressor, as in the real model.
    assert 14 in text["kv_source_layer_ids"]
    check_sparse_topology(
        tuple(ratios),
        tuple(text["kv_source_layer_ids"]),
        tuple(text["index_source_layer_ids"]),
        text["num_hidden_layers"],
    )


def test_vllms_engram_layout_gives_layers_1_and_14_the_checkpoints_rows(whole, config, vllm_view):
    engram = vllm_view["engram"]
    assert engram["has_engram_layers"] and engram["config"].startswith("EngramConfig(")
    assert engram["layer_ids"] == [1, 14]
    assert engram["n_hash_cols"] == 24  # 3 n-gram orders × 8 heads, as the real model
    assert engram["rows"] == config["text_config"]["engram_num_embeddings"]
    assert engram["num_embeddings"] == engram["rows"]
    tables = {t.name: t for t in discover_tables(str(whole))}
    assert [tables[f"layers.{layer}.engram.embed"].rows for layer in (1, 14)] == engram["rows"]
    # NgramHashState built its token map from the tokenizer: the compressed
    # size matched the config's (vLLM refuses a mismatch, engram.py:456).
    assert engram["token_map_len"] == vllm_view["tokenizer_len"]
    assert engram["lookback_depth"] == 3


def test_pleclient_discovery_finds_the_two_engram_tables_and_nothing_else(whole):
    tables = discover_tables(str(whole))
    assert [(t.name, t.layer, t.dtype, t.cols, t.parts) for t in tables] == [
        ("layers.1.engram.embed", 1, "MXFP8", 256, 1),
        ("layers.14.engram.embed", 14, "MXFP8", 256, 1),
    ]
    assert all(t.row_bytes == 264 for t in tables)  # 256 FP8 values, 8 UE8M0 scales
    hasher = EngramHasher.from_checkpoint(str(whole))
    assert [(layer.layer_id, layer.rows) for layer in hasher.layers] == [
        (t.layer, t.rows) for t in tables
    ]
    names = {n for f in sorted(whole.glob("*.safetensors")) for n in read_header(str(f))[0]}
    assert names == {
        f"layers.{layer}.engram.embed.{kind}" for layer in (1, 14) for kind in ("weight", "scale")
    }


def test_the_harness_cells_start_dummy_engines_and_stock_gets_the_tables_by_name(vllm_view):
    """bench/real_vllm's dsv41 cells: vLLM takes their arguments (dummy weights,
    no image), a stock engine has the worker extension that copies the tables
    in, and vLLM's own mapper sends the checkpoint's Engram tensors to each
    layer's ``engram.embed_tokens`` values and scales."""
    harness = vllm_view["harness"]
    for name, cell in harness["cells"].items():
        assert cell["load_format"] == "dummy" and cell["image_limit"] == 0, name
        assert bool(cell["extension"]) is (not name.startswith("shm")), name
        assert cell["offload"] is name.startswith("offload"), name
    assert harness["tensors"] == [
        f"layers.{layer}.engram.embed.{kind}" for layer in (1, 14) for kind in ("scale", "weight")
    ]
    assert harness["mapped"] == [
        f"language_model.model.layers.{layer}.engram.embed_tokens.{param}"
        for layer in (1, 14)
        for param in ("weight_scale_inv", "weight")
    ]
    assert harness["ours"] == harness["mapped"]  # the names the copy then checks


def test_cuda_resolves_the_fp8_config_to_deepseeks_own_with_mxfp4_experts(config, vllm_view):
    quant = vllm_view["quantization"]
    assert quant["override"] == "deepseek_v4_fp8"  # DeepseekV4FP8Config claims it (CUDA, ROCm)
    assert quant["weight_block_size"] == config["quantization_config"]["weight_block_size"]
    assert quant["expert_dtype"] == "fp4"
    assert quant["hf_quant_method"] == "deepseek_v4_fp8"  # ModelConfig's DeepSeek-V4 hook


def test_rope_builds_for_each_kind_of_layer(vllm_view):
    # Window-only layers take plain RoPE, compressed ones YaRN (common/rope.py).
    assert vllm_view["rope"] == {
        "0": [65536, 64],
        "1": [65536, 64],
        "2": [65536, 64],
    }


@pytest.mark.parametrize(
    "ratios, kv, index, reason",
    [
        ((0, 4, 4, 0), (1,), (1,), "compress ratios [4, 4]"),
        ((0, 0, 2, 2), (1,), (2,), "KV source 1 is not a ratio-1 or ratio-2 layer"),
        ((0, 2, 2, 0), (2,), (1,), "layer 1 has no KV source at or below it"),
        ((0, 2, 1, 1), (1,), (1, 2), "layer 2 (ratio 1) reads KV source 1 of ratio 2"),
        ((0, 2, 2), (1,), (1,), "3 compress ratios for 4 layers"),
        ((0, 2, 2, 0), (1,), (1, 3), "index source 3 is not a compressed layer"),
    ],
)
def test_a_bad_sparse_layout_is_refused_when_written_with_the_reason(ratios, kv, index, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        check_sparse_topology(ratios, kv, index, 4)


def vllm_view_scenario(args: dict) -> dict:
    """What vLLM 0.33 makes of the checkpoint on the CPU, as JSON."""
    from vllm.config import set_current_vllm_config
    from vllm.config.engram import model_has_engram_layers
    from vllm.engine.arg_utils import EngineArgs
    from vllm.models.deepseek_v41.common.engram import EngramLayout, NgramHashState
    from vllm.models.deepseek_v41.common.rope import build_deepseek_v4_rope
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config
    from vllm.tokenizers import get_tokenizer
    from vllm.transformers_utils.config import get_config

    model = args["model"]
    with open(f"{model}/config.json") as f:
        written = json.load(f)
    hf = get_config(model, trust_remote_code=False)
    engine = EngineArgs(
        model=model,
        load_format="dummy",
        limit_mm_per_prompt={"image": 0},
        max_model_len=4096,
        max_num_batched_tokens=512,
        max_num_seqs=8,
    ).create_engine_config()
    model_config = engine.model_config
    cls, _ = model_config.registry.resolve_model_cls(
        model_config.architectures, model_config=model_config
    )
    layout = EngramLayout.from_config(model_config.hf_config)
    assert layout is not None
    state = NgramHashState(engine, layout, SimpleNamespace(block_size=32))
    with set_current_vllm_config(engine):
        rope = {
            str(ratio): list(
                build_deepseek_v4_rope(
                    hf,
                    head_dim=hf.head_dim,
                    rope_head_dim=hf.qk_rope_head_dim,
                    max_position_embeddings=hf.max_position_embeddings,
                    compress_ratio=ratio,
                ).cos_sin_cache.shape
            )
            for ratio in sorted(set(hf.compress_ratios))
        }
    quant = dict(written["quantization_config"])
    override = DeepseekV4FP8Config.override_quantization_method(dict(quant), None, hf_config=hf)
    fp8 = DeepseekV4FP8Config.from_config(dict(quant))
    tokenizer = get_tokenizer(model, tokenizer_mode=model_config.tokenizer_mode)
    text_keys = [k for k in written["text_config"] if k != "rope_scaling"]
    return {
        "config_class": type(hf).__name__,
        "flattened": {k: getattr(hf, k, "<missing>") for k in text_keys},
        "rope_parameters": dict(hf.rope_parameters),
        "vision": {
            k: getattr(hf, k)
            for k in (
                "vision_n_layers",
                "vision_dim",
                "vision_n_heads",
                "vision_inter_dim",
                "vision_patch_size",
                "vision_rope_theta",
                "vision_downsample_ratio",
                "vision_max_n_token",
                "vision_min_pixels",
                "vision_max_wh_ratio",
            )
        },
        "architecture": model_config.architecture,
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "is_multimodal_model": model_config.is_multimodal_model,
        "image_limit": model_config.multimodal_config.get_limit_per_prompt("image"),
        "supports_multimodal_inputs": model_config.supports_multimodal_inputs,
        "tokenizer_mode": model_config.tokenizer_mode,
        "tokenizer_len": len(tokenizer),
        "is_deepseek_mla": model_config.is_deepseek_mla,
        "head_size": model_config.get_head_size(),
        "dtype": str(model_config.dtype),
        "max_model_len": model_config.max_model_len,
        "engram": {
            "has_engram_layers": model_has_engram_layers(model_config),
            "config": repr(engine.engram_config),
            "layer_ids": list(layout.layer_ids),
            "n_hash_cols": layout.n_hash_cols,
            "rows": [sum(p for order in primes for p in order) for primes in layout.primes],
            "num_embeddings": list(layout.num_embeddings),
            "token_map_len": int(state.token_map.shape[0]),
            "lookback_depth": state.lookback_depth,
        },
        "rope": rope,
        "quantization": {
            "override": override,
            "weight_block_size": fp8.weight_block_size,
            "expert_dtype": hf.expert_dtype,
            "hf_quant_method": model_config.hf_config.quantization_config["quant_method"],
        },
        "harness": harness_view(model),
    }


def harness_view(model: str) -> dict:
    """What vLLM makes of the real-vLLM harness's dsv41 cells (bench/real_vllm):
    each cell's ``LLM`` arguments up to a ``VllmConfig``, and the names vLLM's
    own weight mapper gives the Engram tensors that a stock engine's
    ``load_engram_tables`` feeds to the model's ``load_weights``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.models.deepseek_v41.nvidia.model import _linear_scale_param_name
    from vllm.models.deepseek_v41.nvidia.vl_model import _make_deepseek_v4_vl_weights_mapper

    from bench.real_vllm import coordinator, engram_tables
    from bench.real_vllm.cells import parse_cell

    cells = {}
    for name in ("stock-eager-dsv41-mp0", "shm-default-dsv41-mp0", "offload-eager-dsv41"):
        config = EngineArgs(
            model=model, **coordinator.engine_kwargs(parse_cell(name))
        ).create_engine_config()
        cells[name] = {
            "load_format": str(config.load_config.load_format),
            "extension": config.parallel_config.worker_extension_cls,
            "offload": config.engram_config.cpu_offload,
            "image_limit": config.model_config.multimodal_config.get_limit_per_prompt("image"),
        }
    hf = config.model_config.hf_config
    mapper = _make_deepseek_v4_vl_weights_mapper(
        hf.expert_dtype, _linear_scale_param_name(config, hf.expert_dtype)
    )
    files = engram_tables.engram_tensor_files(Path(model))
    mapped = [n for n, _ in mapper.apply((name, None) for name in sorted(files))]
    ours = [engram_tables.param_name(name) for name in sorted(files)]
    return {"cells": cells, "tensors": sorted(files), "mapped": mapped, "ours": ours}


SCENARIOS = {"vllm_view": vllm_view_scenario}

if __name__ == "__main__":
    print("RESULT " + json.dumps(SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))), flush=True)
