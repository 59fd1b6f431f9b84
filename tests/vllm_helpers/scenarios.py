"""Scenarios for the vLLM plugin tests, each run in its own process.

``python -m tests.vllm_helpers.scenarios <name> '<json args>'`` runs one and
prints ``RESULT <json>`` last; a failed check raises (non-zero exit). The
plugin is switched on by the caller's environment (``VLLM_PLE_BACKEND=shm``)
and activated the way vLLM does it: ``register()`` or vLLM's own
``load_general_plugins()``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np
import torch

from tests.vllm_helpers import cpu_kernels
from tests.vllm_helpers import model as m

cpu_kernels.prepare()

SCENARIOS: dict[str, Callable[[dict], dict]] = {}


def scenario(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def register_plugin() -> None:
    from pleclient.vllm_plugin import register

    register()


def shm_storage_type() -> type:
    from pleclient.vllm_plugin.storage import Qwen4ExpPLEShmEmbedding

    return Qwen4ExpPLEShmEmbedding


def batches() -> list[m.Batch]:
    return [
        m.mixed_batch(0),
        m.mixed_batch(1, prefills=0, decodes=4),
        m.mixed_batch(2, prefills=3, decodes=0, prefill_len=6),
        m.big_batch(70),
    ]


def outputs(modules: dict, *, prefetch: bool) -> dict[str, list[torch.Tensor]]:
    """Raw and dequantized rows per layer per batch, driving the layers the way
    Qwen4ExpModel does: every layer's prefetch is started before the first
    layer's forward, so two requests are in flight at once."""
    result: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    for batch in batches():
        if prefetch:
            for module in modules.values():
                module.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        for name, module in modules.items():
            hidden = torch.zeros(batch.input_ids.shape[0], 8, dtype=torch.bfloat16)
            rows = module(hidden, batch.input_ids, batch.query_start_loc, batch.ngram_context)
            result[name] += [rows, m.dequantized(module, rows)]
    return result


GLOBAL_SCALE = {
    "F8_E4M3": "ngram_embedding.weight_scale",
    "NVFP4": "ngram_embedding.weight_scale_2",
}


def build_loaded(model_dir: str, layers=m.LAYERS, **kwargs) -> dict:
    modules = {}
    for layer in layers:
        module = m.build_ngram_embedding(layer, **kwargs)
        loaded = module.load_weights(m.checkpoint_weights(model_dir, layer))
        check(
            layer.dtype not in GLOBAL_SCALE or GLOBAL_SCALE[layer.dtype] in loaded,
            f"{GLOBAL_SCALE.get(layer.dtype)} not loaded: {loaded}",
        )
        modules[layer.dtype] = module
    return modules


def compare(stock: dict, shm: dict, *, signed_zeros: bool = False) -> dict:
    """Outputs whose bits differ. With ``signed_zeros``, a +0.0 against a -0.0 is
    no difference: stock TP sums BF16 rows over ranks (owner's row + zeros),
    which turns a -0.0 in the checkpoint into +0.0; FP8 is summed as bytes."""
    diffs = {}
    for name in stock:
        for i, (a, b) in enumerate(zip(stock[name], shm[name], strict=True)):
            if (
                signed_zeros
                and a.dtype == b.dtype
                and a.is_floating_point()
                and a.element_size() > 1
            ):
                a, b = _plus_zero(a), _plus_zero(b)
            if not same_bits(a, b):
                diffs[f"{name}[{i}]"] = (
                    f"stock {a.dtype} {tuple(a.shape)} vs shm {b.dtype} {tuple(b.shape)}"
                )
    return diffs


def _plus_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t == 0, torch.zeros_like(t), t)


def signed_zero_flips(stock: dict, shm: dict) -> int:
    """How many elements differ in bits only by the sign of a zero."""
    flips = 0
    for name in stock:
        for a, b in zip(stock[name], shm[name], strict=True):
            if a.dtype == b.dtype and a.shape == b.shape and a.element_size() > 1:
                bits = a.view(torch.int16) != b.view(torch.int16)
                flips += int((bits & (a == 0) & (b == 0)).sum())
    return flips


# --------------------------------------------------------------------- scenarios
@scenario
def bit_identical(args: dict) -> dict:
    """Stock storage (vLLM's own load_weights) vs shm storage, same process."""
    with m.vllm_context():
        stock = build_loaded(args["model"])
        expected_fwd = outputs(stock, prefetch=False)
        expected_pre = outputs(stock, prefetch=True)
        register_plugin()
        shm = build_loaded(args["model"])
        storage = {k: v.ngram_embedding for k, v in shm.items()}
        check(
            all(isinstance(s, shm_storage_type()) for s in storage.values()),
            f"storage not swapped: {[type(s) for s in storage.values()]}",
        )
        got_pre = outputs(shm, prefetch=True)
        for s in storage.values():
            s.supports_prefetch = False  # what VLLM_PLE_SHM_PREFETCH=0 sets
        got_fwd = outputs(shm, prefetch=False)
        fp8 = storage["F8_E4M3"]
        reference = _reference_rows(args["model"], stock["F8_E4M3"], batches()[0])
        return {
            "forward_diffs": compare(expected_fwd, got_fwd),
            "prefetch_diffs": compare(expected_pre, got_pre),
            "stock_paths_agree": not compare(expected_fwd, expected_pre),
            "outputs_nonzero": all(
                bool(t.float().abs().sum() > 0) for ts in got_pre.values() for t in ts
            ),
            "matches_file_reference": same_bits(got_fwd["F8_E4M3"][0], reference),
            "shm_parameters": sorted(n for n, _ in shm["F8_E4M3"].named_parameters()),
            "shm_weight_numel": {k: v.weight.numel() for k, v in storage.items()},
            "shm_scale": float(fp8.weight_scale.item()),
            "stock_weight_rows": stock["BF16"].ngram_embedding.weight.shape[0],
            "server_requests": _server_requests(),
            "row_path": _row_path(),
        }


def _row_path() -> str:
    from pleclient.vllm_plugin.routes import Routes

    return Routes.shared().path


@scenario
def nvfp4_bit_identical(args: dict) -> dict:
    """NVFP4: stock storage (vLLM's own load_weights: values, block scales and
    weight_scale_2 in the module) vs shm storage (rows from ple-server, decoded
    here), same process, forward and prefetch."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_to_dtype,
    )

    from pleserver.devkit.synthetic import read_reference

    layers = (m.NVFP4_LAYER,)
    with m.vllm_context():
        stock = build_loaded(args["model"], layers)
        method = type(stock["NVFP4"].ngram_embedding.embedding_method).__name__
        expected_fwd = outputs(stock, prefetch=False)
        expected_pre = outputs(stock, prefetch=True)
        register_plugin()
        shm = build_loaded(args["model"], layers)
        storage = shm["NVFP4"].ngram_embedding
        check(isinstance(storage, shm_storage_type()), f"storage not swapped: {type(storage)}")
        loaded = sorted(
            shm["NVFP4"].load_weights(m.checkpoint_weights(args["model"], m.NVFP4_LAYER))
        )
        got_pre = outputs(shm, prefetch=True)
        storage.supports_prefetch = False  # what VLLM_PLE_SHM_PREFETCH=0 sets
        got_fwd = outputs(shm, prefetch=False)
        # vLLM's own decode of the file's bytes (not through the server).
        module, batch = stock["NVFP4"], batches()[0]
        table = torch.from_numpy(
            read_reference(args["model"], f"{m.NVFP4_LAYER.prefix}.ngram_embedding")
        )
        ids = module.compute_ngram_ids(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        raw = table[ids.reshape(-1)]
        reference = dequantize_to_dtype(
            raw[:, : m.COLS // 2].contiguous(),
            raw[:, m.COLS // 2 :].contiguous().view(torch.float8_e4m3fn),
            module.ngram_embedding.weight_scale_2,
            torch.bfloat16,
            swizzle=False,
        ).reshape(ids.shape[0], -1)
        return {
            "row_path": _row_path(),
            "stock_method": method,
            "forward_diffs": compare(expected_fwd, got_fwd),
            "prefetch_diffs": compare(expected_pre, got_pre),
            "stock_paths_agree": not compare(expected_fwd, expected_pre),
            "outputs_nonzero": all(
                bool(t.float().abs().sum() > 0) for ts in got_pre.values() for t in ts
            ),
            "row_dtype": str(got_fwd["NVFP4"][0].dtype),
            "matches_file_reference": same_bits(got_fwd["NVFP4"][0], reference),
            "shm_loaded": loaded,
            "shm_parameters": sorted(n for n, _ in shm["NVFP4"].named_parameters()),
            "shm_table_numel": {
                "weight": storage.weight.numel(),
                "weight_scale": storage.weight_scale.numel(),
            },
            "shm_global_scale": float(storage.weight_scale_2.item()),
            "stock_weight_shapes": [
                list(module.ngram_embedding.weight.shape),
                list(module.ngram_embedding.weight_scale.shape),
            ],
            "server_requests": _server_requests(),
        }


def _reference_rows(model_dir: str, module, batch: m.Batch) -> torch.Tensor:
    from pleserver.devkit.synthetic import read_reference

    table = read_reference(model_dir, f"{m.FP8_LAYER.prefix}.ngram_embedding")
    ids = module.compute_ngram_ids(batch.input_ids, batch.query_start_loc, batch.ngram_context)
    rows = torch.from_numpy(table[ids.reshape(-1).numpy()])
    return rows.view(torch.float8_e4m3fn).reshape(ids.shape[0], -1)


def _server_requests() -> int:
    from pleclient import PleClient

    stats = PleClient.query_stats(os.environ["VLLM_PLE_SHM_SOCKET"])
    return sum(int(table["requests"]) for table in stats["tables"])


@scenario
def tensor_parallel(args: dict) -> dict:
    """One rank of TP=2 (gloo): stock vs shm, without and with sequence parallel."""
    world, rank = args["world"], args["rank"]
    with m.vllm_context(world, rank, args["init_file"]):
        from vllm.distributed import get_etp_group

        result: dict = {"rank": rank, "etp": get_etp_group().world_size}
        stock = {sp: build_loaded(args["model"], sequence_parallel=sp) for sp in (False, True)}
        expected = {sp: outputs(stock[sp], prefetch=True) for sp in (False, True)}
        result["stock_weight_rows"] = stock[False]["BF16"].ngram_embedding.weight.shape[0]
        register_plugin()
        shm = {sp: build_loaded(args["model"], sequence_parallel=sp) for sp in (False, True)}
        for sp in (False, True):
            got = outputs(shm[sp], prefetch=True)
            result[f"diffs_sp{int(sp)}"] = compare(expected[sp], got, signed_zeros=True)
            result[f"strict_diffs_sp{int(sp)}"] = compare(expected[sp], got)
            result[f"signed_zero_flips_sp{int(sp)}"] = signed_zero_flips(expected[sp], got)
            result[f"reduce_scatter_sp{int(sp)}"] = {
                "stock": stock[sp]["BF16"].use_reduce_scatter,
                "shm": shm[sp]["BF16"].use_reduce_scatter,
            }
            result[f"rows_sp{int(sp)}"] = [tuple(t.shape) for t in got["BF16"][:2]]
        return result


@scenario
def amd_storage(args: dict) -> dict:
    """The AMD Qwen4ExpNGramEmbedding: patched too; its storage calls (the ones
    its custom ops make) give stock's rows."""
    with m.vllm_context():
        layer = m.FP8_LAYER
        hasher = m.build_ngram_embedding(layer)  # the AMD class hashes on GPU only
        stock = m.build_ngram_embedding(layer, platform="amd")
        stock.load_weights(m.checkpoint_weights(args["model"], layer))
        register_plugin()
        shm = m.build_ngram_embedding(layer, platform="amd")
        shm.load_weights(m.checkpoint_weights(args["model"], layer))
        batch = m.mixed_batch(5)
        ids = hasher.compute_ngram_ids(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        want = stock.ngram_embedding(ids)
        return {
            "storage": type(shm.ngram_embedding).__name__,
            "forward_equal": same_bits(want, shm.ngram_embedding(ids)),
            "sync_lookup_equal": same_bits(want, shm.ngram_embedding.sync_lookup(ids)),
            "dequant_equal": same_bits(
                stock.ngram_embedding.dequantize(want, torch.bfloat16),
                shm.ngram_embedding.dequantize(shm.ngram_embedding(ids), torch.bfloat16),
            ),
            "use_reduce_scatter": shm.use_reduce_scatter,
        }


@scenario
def plugin_off(args: dict) -> dict:
    """VLLM_PLE_BACKEND unset or vllm: vLLM's plugin loading changes nothing."""
    import importlib

    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from pleclient.vllm_plugin import compat, registration

    modules = {}
    for name, target in registration.TARGETS.items():
        if target.platform not in (None, compat.platform()):
            continue  # (vLLM here never imports another platform's: ROCm's need a GPU)
        try:
            modules[name] = importlib.import_module(name)
        except ImportError:
            continue
    touched = [name for name, mod in modules.items() if "_ple_shm_patched_by" in vars(mod)]
    classes = []
    for mod in modules.values():
        for obj in vars(mod).values():
            if isinstance(obj, type) and any(k.startswith("_ple_shm") for k in vars(obj)):
                classes.append(obj.__qualname__)
    import vllm.envs
    from vllm.model_executor.model_loader import weight_utils

    with m.vllm_context():
        module = m.build_ngram_embedding(m.BF16_LAYER)
    return {
        "declared": sorted(n for n in vllm.envs.environment_variables if n.startswith("VLLM_PLE")),
        "splitting_ops": _piecewise_splitting_ops(),
        "imported": sorted(modules),
        "touched_modules": touched,
        "touched_classes": classes,
        "import_hooks": [
            type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("pleclient")
        ],
        "registered": registration.is_registered(),
        "should_skip_weight_module": weight_utils.should_skip_weight.__module__,
        "storage": type(module.ngram_embedding).__name__,
        "init_module": type(module).__init__.__module__,
    }


@scenario
def bad_backend(args: dict) -> dict:
    from vllm.plugins import load_general_plugins

    try:
        load_general_plugins()
    except Exception as exc:  # reported to the test
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@scenario
def entry_point_hook(args: dict) -> dict:
    """vLLM's own plugin loading runs register(); modules imported afterwards are
    patched as they load; register() again changes nothing."""
    from vllm.plugins import load_general_plugins

    check(
        "vllm.models.qwen4_exp.nvidia.ngram_embedding" not in sys.modules,
        "target imported too early",
    )
    load_general_plugins()
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as ne
    from vllm.model_executor.model_loader import weight_utils

    from pleclient.vllm_plugin import registration

    init_before = ne.Qwen4ExpNGramEmbedding.__init__
    register_plugin()
    register_plugin()
    finders = [f for f in sys.meta_path if type(f).__name__ == "_PatchOnImport"]
    model_classes = {}
    try:
        import vllm.models.qwen4_exp.nvidia.model as nm

        for cls_name in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"):
            cls = getattr(nm, cls_name)
            model_classes[cls_name] = cls.is_unused_checkpoint_weight(
                None, "model.layers.3.ple.ple_embedding.ngram_embedding.shard_11.weight"
            )
        model_classes["scale_unused"] = nm.Qwen4ExpForCausalLM.is_unused_checkpoint_weight(
            None, "model.layers.3.ple.ple_embedding.ngram_embedding.weight_scale"
        )
    except ImportError as exc:
        model_classes["import_error"] = str(exc)
    from pleclient.vllm_plugin import compat

    compat.check_layout(registration.TARGETS)  # raises on a vLLM it cannot patch
    return {
        "plugin_log": _plugin_log_through_vllms_handlers(),
        "vllm_version": compat.vllm_version(),
        "untested_warning": compat._warned,
        "splitting_ops": _piecewise_splitting_ops(),
        "explicit_splitting_ops": _piecewise_splitting_ops(["vllm::my_attention"]),
        "registered": registration.is_registered(),
        "patched": bool(ne.Qwen4ExpNGramEmbedding.__dict__.get("_ple_shm_patched")),
        "init_stable": ne.Qwen4ExpNGramEmbedding.__init__ is init_before,
        "finders": len(finders),
        "skips_shards": weight_utils.should_skip_weight(
            "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight", None
        ),
        "keeps_scale": not weight_utils.should_skip_weight(
            "model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale", None
        ),
        "model_classes": model_classes,
    }


def _plugin_log_through_vllms_handlers() -> str:
    """What one INFO line of the plugin's logger writes once vLLM has configured
    its logging, as its engine core and workers do at their start (here twice:
    the second configuration replaces the first one's handlers)."""
    import io
    import logging

    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    for level in ("WARNING", "INFO"):
        configure_logging(LoggingConfig(log_level=level, configure_logging=True))
    text = io.StringIO()
    handlers = logging.getLogger("vllm").handlers
    streams = [h.setStream(text) for h in handlers]
    try:
        logging.getLogger("pleclient.vllm_plugin").info("PLE backend shm: a line for the log")
    finally:
        for handler, stream in zip(handlers, streams, strict=True):
            handler.setStream(stream)
    return text.getvalue()


def _piecewise_splitting_ops(explicit: list[str] | None = None) -> list[str]:
    """The splitting ops vLLM settles on for a piecewise-compiled model."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=explicit)
    config.set_splitting_ops_for_v1("allgather_reducescatter")
    return list(config.splitting_ops)


@scenario
def compilation_settings(args: dict) -> dict:
    """Every ``-cc.cudagraph_mode`` with vLLM's default, an empty and an explicit
    splitting-ops list, settled by vLLM's own ``CompilationConfig`` (mode
    VLLM_COMPILE) with the plugin loaded as vLLM loads it; then the graph mode
    the worker's routes read from vLLM's config in effect."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.plugins import load_general_plugins

    from pleclient.vllm_plugin import compilation

    load_general_plugins()
    settled: dict[str, dict] = {}
    for mode, (ops_name, ops) in itertools.product(
        [graph_mode.name for graph_mode in CUDAGraphMode],
        [("default", None), ("empty", []), ("explicit", ["vllm::my_attention"])],
    ):
        config = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode, splitting_ops=ops
        )
        outcome: dict = {}
        try:
            config.set_splitting_ops_for_v1("allgather_reducescatter")
        except Exception as exc:  # reported to the test
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        outcome["settled"] = config.cudagraph_mode.name
        outcome["ple_split"] = "vllm::ple_shm_lookup" in (config.splitting_ops or [])
        settled[f"{mode}/{ops_name}"] = outcome
    in_effect = {}
    for mode in CUDAGraphMode:
        vllm_config = VllmConfig()
        vllm_config.compilation_config.cudagraph_mode = mode
        with set_current_vllm_config(vllm_config):
            in_effect[mode.name] = compilation.full_graph_mode()
    return {"settled": settled, "in_effect": in_effect, "outside": compilation.full_graph_mode()}


@scenario
def loader_reads(args: dict) -> dict:
    """vLLM's DefaultModelLoader over the checkpoint with the real model class:
    which files it opens for tensors and which tensors it materializes."""
    from types import SimpleNamespace

    import torch.nn as nn

    register_plugin()
    import vllm.models.qwen4_exp.nvidia.model as nm
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import weight_utils
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    reads: dict[str, list[str]] = {}
    real_safe_open = weight_utils.safe_open

    class CountingSafeOpen:
        def __init__(self, path, *a, **kw):
            self._path = os.path.basename(path)
            self._inner = real_safe_open(path, *a, **kw)

        def __enter__(self):
            self._f = self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            reads.setdefault(self._path, []).append(name)
            return self._f.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._f, name)

    weight_utils.safe_open = CountingSafeOpen
    model = nm.Qwen4ExpForCausalLM.__new__(nm.Qwen4ExpForCausalLM)
    nn.Module.__init__(model)
    loader = DefaultModelLoader(LoadConfig(load_format=args.get("load_format", "auto")))
    with m.vllm_context():
        names = [
            name
            for name, _ in loader.get_all_weights(
                SimpleNamespace(model=args["model"], revision=None), model
            )
        ]
    return {"yielded": names, "reads": reads}


@scenario
def startup_checks(args: dict) -> dict:
    """Building the patched layer: what startup does for the given environment."""
    register_plugin()
    with m.vllm_context(load_format=args.get("load_format")):
        started = time.monotonic()
        try:
            module = m.build_ngram_embedding(m.FP8_LAYER)
        except Exception as exc:  # reported to the test
            return {
                "error": type(exc).__name__,
                "message": str(exc),
                "seconds": time.monotonic() - started,
            }
        batch = m.mixed_batch(3)
        rows = m.run_forward(module, batch, prefetch=True)
        return {
            "error": None,
            "rows_all_zero": bool((rows.float() == 0).all()),
            "rows_shape": list(rows.shape),
        }


class Server:
    """A `pleserver serve` process on a fixed socket, killed and started again."""

    def __init__(self, model: str, socket_path: str, log_path: str) -> None:
        from pleserver.devkit.launcher import ServerLauncher

        # One log over every start; no PR_SET_PDEATHSIG: restarts come from timer threads.
        self.launcher = ServerLauncher(model, socket_path=socket_path, log_path=log_path)
        self.running = None
        self.started_at = 0.0  # when the last start began

    def start(self) -> Server:
        self.started_at = time.monotonic()
        self.running = self.launcher.start()
        return self

    def restart_after(self, seconds: float) -> threading.Timer:
        """Start it again ``seconds`` from now, in a timer thread: the time the
        server is away is part of what the scenario tests."""
        timer = threading.Timer(seconds, self.start)
        timer.start()
        return timer

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running is not None:
            self.running.stop(sig)
            self.running.close()
            self.running = None


@scenario
def server_restarts(args: dict) -> dict:
    """Server killed mid-run: back within the window ⇒ same rows; gone for good
    ⇒ a clear error after the bounded window; never zeros."""
    import dataclasses

    from pleclient.vllm_plugin import PleBackendError
    from pleclient.vllm_plugin.routes import Routes

    socket_path = os.environ["VLLM_PLE_SHM_SOCKET"]
    window = args["window"]
    server = Server(args["model"], socket_path, args["log"]).start()
    result: dict = {}
    try:
        register_plugin()
        with m.vllm_context():
            module = m.build_ngram_embedding(m.BF16_LAYER)
            module.load_weights(m.checkpoint_weights(args["model"], m.BF16_LAYER))
            batch = m.mixed_batch(4)
            first = m.run_forward(module, batch, prefetch=True)

            # 1. killed between steps, restarted 0.5 s later
            server.kill()
            restarter = server.restart_after(0.5)
            asked_at = time.monotonic()
            second = m.run_forward(module, batch, prefetch=True)
            restarter.join()
            result["after_restart_equal"] = same_bits(first, second)
            result["asked_while_away"] = [asked_at < server.started_at]

            # 2. killed while a prefetch is in flight, restarted
            module.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
            server.kill()
            restarter = server.restart_after(0.3)
            asked_at = time.monotonic()
            hidden = torch.zeros(batch.input_ids.shape[0], 8, dtype=torch.bfloat16)
            third = module(hidden, batch.input_ids, batch.query_start_loc, batch.ngram_context)
            restarter.join()
            result["prefetch_resubmitted_equal"] = same_bits(first, third)
            result["asked_while_away"].append(asked_at < server.started_at)

            # 3. killed for good (a short window from here on; the restarts above
            #    had the environment's, long enough for a slow server start)
            rows = Routes.shared().service
            rows.settings = dataclasses.replace(rows.settings, reconnect_window=window)
            server.kill()
            started = time.monotonic()
            try:
                m.run_forward(module, batch, prefetch=True)
                result["error"] = None
            except PleBackendError as exc:
                result["error"] = str(exc)
            result["seconds"] = time.monotonic() - started
            result["window"] = window

            # 4. the next step, once the server is back, works again
            server.start()
            fourth = m.run_forward(module, batch, prefetch=True)
            result["recovered_equal"] = same_bits(first, fourth)
    finally:
        server.kill(signal.SIGTERM)
    return result


@scenario
def seed_interface(args: dict) -> dict:
    """The seed-interface adapter against the stand-in class."""
    from transformers import Qwen4ExpTextConfig

    import tests.seed_standin as standin

    result: dict = {}
    with m.vllm_context():

        def build(layer: m.PleLayer):
            config = m.text_config(layer)
            module = standin.Qwen3_8FlashNextNGramEmbedding(
                config,
                m.HEADS * m.COLS,
                layer.dense_id,
                256,
                8,
                layer.prefix,
                quant_config=None,
                params_dtype=torch.bfloat16,
            )
            module.load_weights(m.checkpoint_weights(args["model"], layer))
            return module

        def run(module) -> list[torch.Tensor]:
            rows = []
            for batch in batches():
                raw = module.forward_impl(
                    None, batch.input_ids, batch.query_start_loc, batch.ngram_context
                )
                rows += [raw, standin.dequantize(module, raw)]
            return rows

        stock = {layer.dtype: build(layer) for layer in m.LAYERS}
        expected = {k: run(v) for k, v in stock.items()}
        from pleclient.vllm_plugin import qwen38_flash_next

        qwen38_flash_next.patch_module(standin)
        qwen38_flash_next.apply(standin.Qwen3_8FlashNextNGramEmbedding)  # idempotent
        shm = {layer.dtype: build(layer) for layer in m.LAYERS}
        got = {k: run(v) for k, v in shm.items()}
        result["diffs"] = compare(expected, got)
        result["storage"] = type(shm["BF16"].ngram_embedding).__name__
        result["has_weight"] = hasattr(shm["BF16"].ngram_embedding, "weight")
        result["offload_scale"] = float(shm["F8_E4M3"]._offload_weight_scale)
        result["op_registered"] = hasattr(torch.ops.vllm, "ple_shm_lookup")

        fp8 = shm["F8_E4M3"]
        batch = batches()[0]

        def step(input_ids, qsl, ctx):
            return fp8.forward_impl(None, input_ids, qsl, ctx).float().sum()

        compiled = torch.compile(step, backend="eager", fullgraph=True)
        result["compiled_equal"] = bool(
            compiled(batch.input_ids, batch.query_start_loc, batch.ngram_context)
            == step(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        )
        del Qwen4ExpTextConfig
    return result


# ------------------------------------------------------------ vLLM's rules
@scenario
def environment_check(args: dict) -> dict:
    """vLLM's own environment check (``Platform.validate_environ``, which
    ``--fail-on-environ-validation`` makes fatal) over the plugin's variables:
    before any plugin loaded, then after vLLM loaded them — through
    ``load_general_plugins`` as the engine core and workers do, or (with
    ``model``) through the ``EngineArgs`` → ``create_engine_config`` path of
    ``vllm serve --fail-on-environ-validation``."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    # VLLM_* names of the test runner's environment that vLLM does not know
    # and that are not the plugin's are no part of this check.
    for name in list(os.environ):
        if (
            name.startswith("VLLM_")
            and not name.startswith("VLLM_PLE_")
            and name not in envs.environment_variables
        ):
            del os.environ[name]
    result: dict = {"before_plugins": _environment_error(current_platform)}
    if args.get("model"):
        from vllm.engine.arg_utils import EngineArgs

        engine_args = EngineArgs(  # __post_init__ loads the plugins, as in vllm serve
            model=args["model"],
            dtype="bfloat16",
            skip_tokenizer_init=True,
            enforce_eager=True,
            fail_on_environ_validation=True,
        )
        try:
            config = engine_args.create_engine_config()
            result["engine_config"] = {"architectures": config.model_config.architectures}
        except Exception as exc:  # reported to the test
            result["engine_config"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    result["after_plugins"] = _environment_error(current_platform)
    declared = sorted(n for n in envs.environment_variables if n.startswith("VLLM_PLE"))
    factors = envs.compile_factors()
    result.update(
        declared=declared,
        values={n: getattr(envs, n) for n in declared},
        compile_factors={n: factors.get(n) for n in declared},
    )
    return result


def _environment_error(platform) -> str | None:
    try:
        platform.validate_environ(hard_fail=True)
    except ValueError as exc:
        return str(exc)
    return None


def _error_of(action: Callable[[], object]) -> dict | None:
    try:
        action()
    except Exception as exc:  # reported to the test
        return {"error": type(exc).__name__, "message": str(exc)}
    return None


@scenario
def fake_vllm_layout(args: dict) -> dict:
    """``register()``, then the imports vLLM would do, with a vLLM-shaped tree
    (``tests.vllm_helpers.fake_vllm``) first on PYTHONPATH as ``vllm``."""
    import importlib
    import logging

    import vllm

    check(
        os.path.realpath(vllm.__file__).startswith(os.path.realpath(args["root"])),
        f"not the fake vLLM: {vllm.__file__}",
    )
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("pleclient.vllm_plugin").addHandler(handler)
    result: dict = {"register": _error_of(register_plugin), "imports": {}}
    for name in args.get("imports", []):
        result["imports"][name] = _error_of(lambda name=name: importlib.import_module(name))
    import vllm.envs

    result.update(
        warnings=warnings,
        declared=sorted(vllm.envs.environment_variables),
        version=vllm.__version__,
        path=os.path.dirname(vllm.__file__),
    )
    return result


@scenario
def storage_not_swapped(args: dict) -> dict:
    """A vLLM 0.33 whose ``Qwen4ExpNGramEmbedding`` gets its storage class from
    somewhere the plugin does not replace it (simulated: the constructor puts
    the stock classes back into its module first). Building the layer fails
    naming the class, before any server is asked."""
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as ne
    from vllm.models.qwen4_exp.common import ngram_embedding as common

    stock_init = ne.Qwen4ExpNGramEmbedding.__init__

    def init_with_other_storage(self, *a, **kw):
        ne.Qwen4ExpPLEDeviceEmbedding = common.Qwen4ExpPLEDeviceEmbedding
        ne.Qwen4ExpPLEPinnedHostEmbedding = common.Qwen4ExpPLEPinnedHostEmbedding
        stock_init(self, *a, **kw)

    ne.Qwen4ExpNGramEmbedding.__init__ = init_with_other_storage
    register_plugin()
    with m.vllm_context():
        error = _error_of(lambda: m.build_ngram_embedding(m.BF16_LAYER))
    return {"build": error}


# ------------------------------------------------------------ whole model
def _prefill_batch(seed: int) -> m.Batch:
    """Two new prefill requests of different lengths, an EOS inside the second
    (the n-grams restart after it), EOS context (nothing before them)."""
    from tests.vllm_helpers import qwen4_model as qm

    g = torch.Generator().manual_seed(seed)
    lengths = [9, 14]
    ids = torch.randint(0, qm.UNIGRAM_VOCAB, (sum(lengths),), generator=g)
    ids[ids == qm.EOS] = qm.EOS + 1
    ids[lengths[0] + 6] = qm.EOS
    qsl = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    context = torch.full((len(lengths), qm.NGRAM_SIZE - 1), qm.EOS, dtype=torch.long)
    return m.Batch(ids, qsl, context)


def _run_ple_layer(loaded, layer: int, batch: m.Batch, hidden: torch.Tensor, *, prefetch: bool):
    """One full ``Qwen4ExpPLELayer.forward`` over a prefill batch, driven as
    ``Qwen4ExpModel`` drives it (prefetch started first), with a fresh conv
    state per request. Returns (output, conv states of the batch's slots)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from tests.vllm_helpers import qwen4_model as qm

    ple = qm.ple_layer(loaded.model, layer)
    slots = [1, 2]  # slot 0 is vLLM's null block
    (state_shape,) = ple.get_state_shape()
    (state_dtype,) = ple.get_state_dtype()
    ple.kv_cache = (torch.zeros(len(slots) + 1, *state_shape, dtype=state_dtype),)
    metadata = qm.prefill_metadata(batch.query_start_loc, slots)
    # vLLM's model runner runs the forward in inference mode.
    with (
        torch.inference_mode(),
        set_current_vllm_config(loaded.config),
        set_forward_context({ple.prefix: metadata}, loaded.config),
    ):
        if prefetch:
            ple.start_prefetch(batch.input_ids, batch.query_start_loc, batch.ngram_context)
        output = ple(hidden, batch.input_ids, batch.query_start_loc, batch.ngram_context)
    return output, ple.kv_cache[0][slots].clone()


def _run_model_step(
    loaded, batch: m.Batch, at_first_layer: Callable[[], None] | None = None
) -> dict:
    """One ``Qwen4ExpModel.forward`` over a prefill batch, as vLLM's model runner
    calls it, with each decoder layer's body reduced to its PLE layer and the
    final hyper-connection mixer to a pass-through (attention, MoE and the mixer
    are CUDA/Triton kernels): the forward's own ``_start_layer_ple_prefetch``
    calls, in its own order, and each PLE layer's full forward. Returns each PLE
    layer's output, and which PLE layers had a lookup in flight (started, not
    yet finished) when each decoder layer began. ``at_first_layer`` runs as
    decoder layer 0 begins: the step's lookups are on their way."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from tests.vllm_helpers import qwen4_model as qm

    model = loaded.model.model
    # One conv-state slot per request; slot 0 is vLLM's null block.
    slots = list(range(1, batch.query_start_loc.shape[0]))
    metadata = {}
    for layer in qm.PLE_DECODER_LAYERS:
        ple = qm.ple_layer(loaded.model, layer)
        (state_shape,) = ple.get_state_shape()
        (state_dtype,) = ple.get_state_dtype()
        ple.kv_cache = (torch.zeros(len(slots) + 1, *state_shape, dtype=state_dtype),)
        metadata[ple.prefix] = qm.prefill_metadata(batch.query_start_loc, slots)
    outputs: dict[int, torch.Tensor] = {}
    in_flight: dict[int, dict[int, bool]] = {}

    def lookups_in_flight() -> dict[int, bool]:
        flights = {}
        for layer in qm.PLE_DECODER_LAYERS:
            storage = qm.ple_layer(loaded.model, layer).ple_embedding.ngram_embedding
            lookups = getattr(storage, "lookups", None)
            flights[layer] = bool(lookups is not None and lookups.in_flight)
        return flights

    def body(index: int, decoder_layer):
        def forward(hidden_states, prev_block_output, prev_injection, positions, **ple_inputs):
            del prev_block_output, prev_injection, positions  # None (see the return); unused
            in_flight[index] = lookups_in_flight()
            if index == 0 and at_first_layer is not None:
                at_first_layer()
            if decoder_layer.ple is not None:
                hidden_states = decoder_layer.ple(hidden_states, **ple_inputs)
                outputs[index] = hidden_states.clone()
            return hidden_states, None, None

        return forward

    class PassThroughMixer(torch.nn.Module):
        def combine_and_mix(self, hidden_states, block_output, injection):
            del block_output, injection
            return hidden_states, hidden_states[:, : qm.HIDDEN], None

    mixer = model.hyper_connection_mixer
    for index, decoder_layer in enumerate(model.layers):
        decoder_layer.forward = body(index, decoder_layer)
    model.hyper_connection_mixer = PassThroughMixer()
    try:
        with (
            torch.inference_mode(),
            set_current_vllm_config(loaded.config),
            set_forward_context(metadata, loaded.config),
        ):
            model(
                batch.input_ids,
                torch.arange(batch.input_ids.shape[0]),
                query_start_loc=batch.query_start_loc,
                ngram_context=batch.ngram_context,
            )
    finally:
        model.hyper_connection_mixer = mixer
        for decoder_layer in model.layers:
            del decoder_layer.forward
    return {"outputs": outputs, "in_flight": in_flight}


def _step_result(stock, shm, batch: m.Batch) -> dict:
    """The model's forward, stock and shm: every PLE layer's output, which
    lookups were in flight as each decoder layer began, the server's requests
    per table for the step; and the same with the step start undone (vLLM's
    own one-layer-ahead order), to show the difference is visible."""
    from pleclient.vllm_plugin import step
    from tests.vllm_helpers import qwen4_model as qm

    want = _run_model_step(stock, batch)
    before = _requests_per_table()
    got = _run_model_step(shm, batch)
    after = _requests_per_table()
    layers = list(shm.model.model.layers)
    stamps = {i: layer.__dict__.pop(step.STEP_ATTR) for i, layer in enumerate(layers)}
    try:
        one_ahead = _run_model_step(shm, batch)
    finally:
        for i, stamp in stamps.items():
            layers[i].__dict__[step.STEP_ATTR] = stamp
    routes = {
        qm.ple_layer(shm.model, i).ple_embedding.ngram_embedding.lookups.route.name
        for i in qm.PLE_DECODER_LAYERS
    }
    return {
        "outputs_equal": all(
            same_bits(want["outputs"][i], got["outputs"][i])
            and same_bits(want["outputs"][i], one_ahead["outputs"][i])
            for i in qm.PLE_DECODER_LAYERS
        ),
        "in_flight": _keyed(got["in_flight"]),
        "in_flight_one_ahead": _keyed(one_ahead["in_flight"]),
        "requests": {name: after[name] - before[name] for name in after},
        "routes": sorted(routes),
        "stamped_layers": len(stamps),
    }


def _keyed(in_flight: dict[int, dict[int, bool]]) -> dict[str, dict[str, bool]]:
    return {str(i): {str(j): v for j, v in f.items()} for i, f in in_flight.items()}


def _requests_per_table() -> dict[str, int]:
    from pleclient import PleClient

    stats = PleClient.query_stats(os.environ["VLLM_PLE_SHM_SOCKET"])
    return {table["name"]: int(table["requests"]) for table in stats["tables"]}


def _transformers_ple(hf_model, layer: int, batch: m.Batch, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' ``Qwen4ExpTextPLELayer`` per request (no cache: a new
    sequence), plus the residual the decoder layer adds; vLLM's PLE layer
    returns hidden + PLE."""
    ple = hf_model.model.layers[layer].ple
    starts = batch.query_start_loc.tolist()
    out = []
    with torch.no_grad():
        for start, end in itertools.pairwise(starts):
            h = hidden[start:end].unsqueeze(0)
            out.append((h + ple(h, batch.input_ids[start:end].unsqueeze(0), None))[0])
    return torch.cat(out)


@scenario
def whole_model(args: dict) -> dict:
    """vLLM's own loader builds the whole tiny Qwen4ExpForCausalLM twice, stock
    and with the plugin; each PLE layer's full forward is compared between the
    two and with transformers' Qwen4ExpTextPLELayer."""
    import vllm.models.qwen4_exp.nvidia.ple_layer as ple_layer_module

    from tests.vllm_helpers import qwen4_model as qm

    # No Triton on CPU: the gate and the short conv run as torch code written
    # from the kernels, in both builds alike.
    ple_layer_module.ple_gate = qm.torch_ple_gate
    ple_layer_module.ple_conv = qm.torch_ple_conv
    batch = _prefill_batch(args.get("seed", 0))
    tokens = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, qm.HC_COUNT * qm.HIDDEN, generator=g).to(torch.bfloat16)
    result: dict = {"layers": {}}
    started = time.monotonic()
    with m.distributed():
        stock = qm.load_vllm_model(args["model"])
        register_plugin()
        shm = qm.load_vllm_model(args["model"])
        result["load_seconds"] = time.monotonic() - started
        result["storage"] = sorted(
            {
                type(qm.ple_layer(shm.model, i).ple_embedding.ngram_embedding).__name__
                for i in qm.PLE_DECODER_LAYERS
            }
        )
        result.update(_compare_weights(stock.model, shm.model))
        result["loaded_stock_only"] = sorted(stock.loaded - shm.loaded)
        result["loaded_shm_only"] = sorted(shm.loaded - stock.loaded)
        result["loaded_count"] = len(shm.loaded)
        result["unloaded_parameters"] = {
            "stock": stock.unloaded_parameters,
            "shm": shm.unloaded_parameters,
        }
        # First the whole forward (it needs prefetch on, which the loop below
        # turns off layer by layer).
        result["step"] = _step_result(stock, shm, batch)
        hf = qm.load_transformers_model(args["reference"])
        for layer in qm.PLE_DECODER_LAYERS:
            want, want_state = _run_ple_layer(stock, layer, batch, hidden, prefetch=True)
            got_pre, state_pre = _run_ple_layer(shm, layer, batch, hidden, prefetch=True)
            storage = qm.ple_layer(shm.model, layer).ple_embedding.ngram_embedding
            storage.supports_prefetch = False  # what VLLM_PLE_SHM_PREFETCH=0 sets
            got_sync, state_sync = _run_ple_layer(shm, layer, batch, hidden, prefetch=False)
            reference = _transformers_ple(hf, layer, batch, hidden)
            result["layers"][str(layer)] = {
                "shm_prefetch_equal": same_bits(want, got_pre),
                "shm_sync_equal": same_bits(want, got_sync),
                "conv_state_equal": same_bits(want_state, state_pre)
                and same_bits(want_state, state_sync),
                "transformers_equal": same_bits(want, reference),
                "transformers_max_abs_diff": float((want.float() - reference.float()).abs().max()),
                "tokens_changed_by_ple": int((want != hidden).any(-1).sum()),
                "tokens": tokens,
                "conv_state_nonzero": bool(want_state.abs().sum() > 0),
                **_wrong_row_effect(stock, hf, layer, batch, hidden, want),
            }
    result["server_requests"] = _server_requests()
    result["row_path"] = _row_path()
    result["cpu_gemm"] = cpu_kernels.gemm_report()
    result["seconds"] = time.monotonic() - started
    return result


def _generation(seed: int, steps: int) -> list[m.Batch]:
    """A prefill of two requests, then one token per request per step."""
    from tests.vllm_helpers import qwen4_model as qm

    first = _prefill_batch(seed)
    bounds = first.query_start_loc[1:-1].long()
    tokens = [list(t) for t in torch.tensor_split(first.input_ids, bounds)]
    g = torch.Generator().manual_seed(seed + 1)
    batches = [first]
    for _ in range(steps - 1):
        new = torch.randint(0, qm.UNIGRAM_VOCAB, (len(tokens),), generator=g)
        context = torch.tensor([[int(t) for t in seq[-(qm.NGRAM_SIZE - 1) :]] for seq in tokens])
        batches.append(
            m.Batch(new, torch.arange(len(tokens) + 1, dtype=torch.int32), context.long())
        )
        for seq, token in zip(tokens, new, strict=True):
            seq.append(token)
    return batches


@scenario
def restart_mid_generation(args: dict) -> dict:
    """The whole tiny model, stock and with the plugin, over the steps of a
    generation; the server is SIGKILLed as a step's lookups are on their way
    (``kill_step``) and, in ``restart`` mode, started again ``restart_after``
    seconds later (and killed once more between two steps); in ``fallback``
    mode it stays away until the last step, so the worker's own reads of the
    checkpoint serve what is between. Every step's PLE outputs are compared
    with the stock build's."""
    import vllm.models.qwen4_exp.nvidia.ple_layer as ple_layer_module

    from pleclient.vllm_plugin.routes import Routes
    from tests.vllm_helpers import qwen4_model as qm

    ple_layer_module.ple_gate = qm.torch_ple_gate
    ple_layer_module.ple_conv = qm.torch_ple_conv
    mode, kill_step, steps = args["mode"], args["kill_step"], args["steps"]
    server = Server(args["model"], os.environ["VLLM_PLE_SHM_SOCKET"], args["log"]).start()
    result: dict = {"steps": [], "stalls": []}
    timers: list[threading.Timer] = []
    try:
        with m.distributed():
            stock = qm.load_vllm_model(args["model"])
            register_plugin()
            shm = qm.load_vllm_model(args["model"])
            for index, batch in enumerate(_generation(args.get("seed", 0), steps)):
                hook = None
                if index == kill_step:
                    # Stopped first, so that the step's lookups wait in its
                    # channel (none answered) when the kill comes.
                    from tests.harness import stop_process

                    stop_process(server.running.pid)

                    def hook() -> None:
                        server.kill()
                        if mode == "restart":
                            timers.append(server.restart_after(args["restart_after"]))

                elif mode == "restart" and index == kill_step + 2:
                    server.kill()  # between two steps, this time
                    timers.append(server.restart_after(args["restart_after"]))
                elif mode == "fallback" and index == steps - 1:
                    server.start()  # back for the last step
                    gpu = Routes.shared()._gpu
                    deadline = time.monotonic() + 10
                    while gpu is not None and gpu.lookups.watchdog.lost_since is not None:
                        check(time.monotonic() < deadline, "the watchdog did not reconnect")
                        time.sleep(0.01)
                want = _run_model_step(stock, batch)
                started = time.monotonic()
                got = _run_model_step(shm, batch, hook)
                result["stalls"].append(time.monotonic() - started)
                for timer in timers:
                    timer.join()
                timers.clear()
                result["steps"].append(
                    all(
                        same_bits(want["outputs"][i], got["outputs"][i])
                        for i in qm.PLE_DECODER_LAYERS
                    )
                )
            routes = Routes.shared()
            gpu = routes._gpu
            result["route"] = routes.path
            # A copy: the server's stop at the end is one more loss.
            result["events"] = [dict(e) for e in gpu.lookups.watchdog.events] if gpu else []
            result["fallback_rows"] = (
                gpu.lookups.watchdog.fallback_rows if gpu is not None else 0
            ) + routes.service.fallback_rows
            result["lost"] = routes.service.lost_since is not None or (
                gpu is not None and gpu.lookups.watchdog.lost_since is not None
            )
            result["last_server_requests"] = _server_requests()
    finally:
        for timer in timers:
            timer.join()
        server.kill(signal.SIGTERM)
    return result


@scenario
def verified_generation(args: dict) -> dict:
    """The whole tiny model with the plugin over the steps of a generation,
    every PLE lookup checked by ``bench/real_vllm/verify.py`` against the
    checkpoint at ``args["expected"]`` (the served one, or a changed copy)."""
    import vllm.models.qwen4_exp.nvidia.ple_layer as ple_layer_module

    from bench.real_vllm import verify as vllm_verify
    from tests.vllm_helpers import qwen4_model as qm

    ple_layer_module.ple_gate = qm.torch_ple_gate
    ple_layer_module.ple_conv = qm.torch_ple_conv
    server = Server(args["model"], os.environ["VLLM_PLE_SHM_SOCKET"], args["log"]).start()
    try:
        with m.distributed():
            register_plugin()
            shm = qm.load_vllm_model(args["model"])
            vllm_verify.install_on_model(shm.model, args["expected"])
            for batch in _generation(0, args["steps"]):
                _run_model_step(shm, batch)
            return vllm_verify.report()
    finally:
        server.kill(signal.SIGTERM)


@scenario
def prompt_ahead(args: dict) -> dict:
    """vLLM's own ``Scheduler`` (CPU, chunked prefill) with the plugin takes a
    prompt of ``args["tokens"]`` tokens in chunks of ``args["chunk"]``; each
    scheduled chunk runs through the whole model, stock and shm
    (``_run_model_step``). Before each chunk the prompt-ahead thread and the
    server's hint reader are let finish (``idle``, the hint counters settled),
    so each chunk's lookups show what the hints did: the server's misses and
    its hits on hinted rows, per chunk. ``VLLM_PLE_SHM_PROMPT_AHEAD`` (the
    environment) picks the stages."""
    import vllm.models.qwen4_exp.nvidia.ple_layer as ple_layer_module

    from pleclient import PleClient
    from pleclient.vllm_plugin import prompt_ahead as pa
    from tests.vllm_helpers import qwen4_model as qm

    ple_layer_module.ple_gate = qm.torch_ple_gate
    ple_layer_module.ple_conv = qm.torch_ple_conv
    socket = os.environ["VLLM_PLE_SHM_SOCKET"]
    g = torch.Generator().manual_seed(args.get("seed", 3))
    tokens = torch.randint(0, qm.UNIGRAM_VOCAB, (args["tokens"],), generator=g)
    tokens[tokens == qm.EOS] = qm.EOS + 1
    prompt = [int(t) for t in tokens]
    result: dict = {"chunks": []}
    with m.distributed(), PleClient.connect(socket) as watcher:

        def hint_counts() -> dict:
            tables = watcher.stats()["tables"]
            return {t["name"]: {**{k: t.get(k) or 0 for k in HINT_KEYS}, **t["io"]} for t in tables}

        def settle() -> dict:
            """Once the thread is idle, the server has received every hinted
            row it sent (a hint still in its channel is counted by nobody yet),
            and each is read, cached already or dropped: the server's counts."""
            ahead = pa.for_scheduler(scheduler)
            if ahead is not None and not ahead.idle(60):
                raise TimeoutError("prompt-ahead did not finish its prompts in 60 s")
            sent = ahead.stats.ids_sent if ahead is not None else 0
            deadline = time.monotonic() + 60
            while True:
                counts = hint_counts()
                if sum(c["hints_received"] for c in counts.values()) >= sent and all(
                    c["hints_read"] + c["hints_cached"] + c["hints_dropped"] == c["hints_received"]
                    for c in counts.values()
                ):
                    return counts
                if time.monotonic() > deadline:
                    raise TimeoutError(f"hints not settled in 60 s: {counts}")
                time.sleep(0.01)

        stock = qm.load_vllm_model(args["model"])
        register_plugin()
        shm = qm.load_vllm_model(args["model"])
        scheduler = qm.cpu_scheduler(args["model"], chunk=args["chunk"])
        result["patched"] = bool(getattr(type(scheduler), "_ple_prompt_ahead_patched", False))
        request = qm.scheduler_request("prompt-0", prompt)
        scheduler.add_request(request)
        before = settle()
        result["after_arrival"] = before
        start = 0
        while start < len(prompt):
            output = scheduler.schedule()
            count = output.num_scheduled_tokens.get(request.request_id, 0)
            if not count:
                raise RuntimeError(f"the scheduler scheduled nothing at token {start}")
            counts = settle()  # the scheduled stage's hints, before the chunk runs
            chunk = torch.tensor(prompt[start : start + count])
            context = ([qm.EOS] * (qm.NGRAM_SIZE - 1) + prompt[:start])[-(qm.NGRAM_SIZE - 1) :]
            batch = m.Batch(
                chunk,
                torch.tensor([0, count], dtype=torch.int32),
                torch.tensor([context], dtype=torch.long),
            )
            want = _run_model_step(stock, batch)["outputs"]
            got = _run_model_step(shm, batch)["outputs"]
            after = hint_counts()
            result["chunks"].append(
                {
                    "start": start,
                    "tokens": count,
                    "new_request": [new.req_id for new in output.scheduled_new_reqs],
                    "outputs_equal": sorted(want) == sorted(got)
                    and all(same_bits(want[i], got[i]) for i in want),
                    "layers_compared": sorted(want),
                    "tables": {
                        name: {
                            key: after[name][key] - counts[name][key]
                            for key in ("misses", "hits", "hints_hits", "hints_received")
                        }
                        for name in after
                    },
                    "hints_before": counts,
                }
            )
            start += count
        ahead = pa.for_scheduler(scheduler)
        result["prompt_ahead"] = None if ahead is None else ahead.stats.as_dict()
        result["final"] = hint_counts()
    return result


HINT_KEYS = ("hints_received", "hints_read", "hints_cached", "hints_hits", "hints_dropped")


def _compare_weights(stock: torch.nn.Module, shm: torch.nn.Module) -> dict:
    """Every tensor of the two builds: which exist on one side only, which differ."""
    a, b = stock.state_dict(), shm.state_dict()
    return {
        "stock_only": sorted(set(a) - set(b)),
        "shm_only": sorted(set(b) - set(a)),
        "weights_differ": sorted(k for k in set(a) & set(b) if not same_bits(a[k], b[k])),
        "weights_compared": len(set(a) & set(b)),
        "stock_tables": {
            k: [int(v.shape[0]), str(v.dtype)]
            for k, v in a.items()
            if k.endswith("ngram_embedding.weight")
        },
        "shm_scales": {k: float(v) for k, v in b.items() if k.endswith("weight_scale")},
    }


def _wrong_row_effect(stock, hf, layer: int, batch: m.Batch, hidden, want) -> dict:
    """Change one row the batch reads in transformers' table: the comparison
    must see it, from the first token that reads the row on."""
    from tests.vllm_helpers import qwen4_model as qm

    ple = qm.ple_layer(stock.model, layer)
    ids = ple.ple_embedding.compute_ngram_ids(
        batch.input_ids, batch.query_start_loc, batch.ngram_context
    )
    token = 4
    row = int(ids[token, 1])
    readers = sorted({int(t) for t in (ids == row).any(-1).nonzero().flatten()})
    table = hf.model.layers[layer].ple.ple_embedding.ngram_embedding.weight
    saved = table.data[row].clone()
    table.data[row] += 1.0
    try:
        wrong = _transformers_ple(hf, layer, batch, hidden)
    finally:
        table.data[row] = saved
    changed = (wrong != want).any(-1).nonzero().flatten().tolist()
    return {
        "wrong_row_first_reader": readers[0],
        "wrong_row_first_changed_token": changed[0] if changed else None,
        "wrong_row_changed_tokens": len(changed),
    }


def main() -> None:
    name, raw = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    result = SCENARIOS[name](json.loads(raw))
    print("RESULT " + json.dumps(result, default=_jsonable), flush=True)


def _jsonable(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


if __name__ == "__main__":
    main()
