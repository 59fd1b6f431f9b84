#!/usr/bin/env python3
"""The GPU-driven route under torch.compile and vLLM's CUDA-graph modes, on a GPU.

Needs torch with CUDA, not vLLM (the script hides vLLM from itself, so a host
that has it runs the same code as the GPU host, which has not). Starts ``pleserver
serve`` on the synthetic checkpoint of ``bench/gpu/step_start_check.py`` (three
FP8 PLE tables) and builds a toy model the way vLLM 0.33 builds and compiles
one: layers 0..5, PLE on layers 1, 3 and 4, the lookups of every PLE layer
started at the first layer (the plugin's step start: ``step.adopt`` and
``step.starting_with_the_step``, through the model's own
``_start_layer_ple_prefetch``), each PLE layer's rows finished at its layer and
combined with the hidden state through a matmul. The lookups are the plugin's
own (``RowService``, ``Routes``, ``LayerLookups``, the GPU-driven route), called
from two custom ops, as vLLM calls a PLE layer from a model it compiles:
``ple_compile_check::start`` (ring the layer's slots) and
``ple_compile_check::finish`` (collect its rows into the layer's buffer).

The forward is compiled as vLLM 0.33 compiles a model
(``CompilationMode.VLLM_COMPILE``): ``torch.compile(fullgraph=True,
dynamic=False)`` with inductor and the inductor options vLLM's
``CompilationConfig`` sets (``INDUCTOR_OPTIONS``), then captured in the two
CUDA-graph forms vLLM's ``-cc.cudagraph_mode`` values are made of:

  full       FULL (and the decode graphs of FULL_AND_PIECEWISE, FULL_DECODE_ONLY):
             the whole compiled forward captured in one torch.cuda.CUDAGraph
             (vLLM's CUDAGraphWrapper around the model); the lookups' stream
             operations are inside the graph
  piecewise  PIECEWISE (and the prefill graphs of FULL_AND_PIECEWISE): dynamo's
             graph split at the splitting ops, as vLLM's ``split_graph`` does,
             each piece compiled by inductor and captured in a CUDA graph of
             its own from a shared pool, the PLE ops between the pieces run
             eagerly (the plugin lists its lookup ops as splitting ops:
             ``pleclient/vllm_plugin/compilation.py``)
  breakable  PIECEWISE as vLLM 0.33 runs Qwen4Exp on CUDA (breakable CUDA
             graphs, no torch.compile): the eager forward captured in graph
             segments broken at an eager op standing in for attention; the
             GPU-driven route's lookups are captured inside the segments

Each is warmed up, captured, then replayed --steps times with new ids copied
into its static input under ``torch.cuda.set_sync_debug_mode("error")`` (any
host synchronization raises), and every replay's rows are compared bit for bit
with the rows of a resident copy of each table on the GPU. Also checked: the
server answered one request per PLE layer per replay (the rows are fresh, not
the capture's), the replay call returns to the host while a 20 ms device sleep
enqueued before it still runs (nothing in the graph path waits for the GPU),
and, for piecewise, that every PLE op ran outside the graph pieces.

    python3 -m bench.gpu.compile_check [--json out.json] [--steps 20]
    python3 -m bench.gpu.compile_check --device cpu   # compiled, no graphs: the CPU stand-in

Build the native modules first (``python3 setup.py -q build_ext --inplace``).
``--device cpu`` compiles the same forward with inductor for the CPU and runs
full and piecewise without CUDA graphs on the GPU-driven route's CPU stand-in.
``--dry-run`` only checks the imports and the arguments. The exit status is 0
when every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import json
import operator
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.fx


class _NoVllm(importlib.abc.MetaPathFinder):
    """vLLM is not importable here, as on the GPU host (where it is not
    installed): the plugin's parts that ask vLLM for its config take their
    no-vLLM path in every run, wherever it runs."""

    def find_spec(self, fullname, path, target=None):  # importlib API
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden)", name=fullname)
        return None


sys.meta_path.insert(0, _NoVllm())


from bench.gpu.step_start_check import (  # noqa: E402
    HEADS,
    HIDDEN,
    LAYERS,
    PLE_LAYERS,
    TABLES,
    TOKENS,
    Rig,
    ToyModel,
    _cycles_per_ms,
    adopt_step,
    new_ids,
    sync_check,
)
from bench.harness.scaffold import save_json  # noqa: E402
from pleclient.vllm_plugin import step  # noqa: E402
from pleclient.vllm_plugin.lookups import LayerLookups  # noqa: E402
from pleserver.devkit.synthetic import SyntheticTable  # noqa: E402

NAMESPACE = "ple_compile_check"
START_OP = f"{NAMESPACE}::start"
FINISH_OP = f"{NAMESPACE}::finish"
SPLITTING_OPS = (START_OP, FINISH_OP)

INDUCTOR_OPTIONS: dict[str, Any] = {
    # vLLM 0.33's CompilationConfig.__post_init__ (custom passes need v1)
    "enable_auto_functionalized_v2": False,
    # its compiler interface: the local FX graph cache, no remote one
    "fx_graph_cache": True,
    "fx_graph_remote_cache": False,
}
"""The inductor options vLLM 0.33 compiles with (``-cc.inductor_compile_config``
defaults); on CUDA also ``combo_kernels`` and ``benchmark_combo_kernel`` (its
CompilationConfig sets them for every platform but the CPU)."""

SLEEP_MS = 20.0
"""The device sleep enqueued before a replay: the replay must return to the
host while it runs."""


# ------------------------------------------------------------------ the ops
_LOOKUPS: dict[int, LayerLookups] = {}
"""Each PLE layer's lookups, by decoder layer index: what the ops call. Custom
ops take tensors and numbers; the layer's index is a constant of the graph (as
vLLM's ops take a layer's name)."""


@torch.library.custom_op(START_OP, mutates_args=("ticket",))
def start_op(ids: torch.Tensor, ticket: torch.Tensor, layer: int) -> None:
    """Start ``layer``'s lookup of ``ids``. ``ticket`` (a one-element buffer of
    the layer, declared mutated and never written) orders the start before the
    layer's finish, which reads it, and keeps the op from being dropped as dead
    code."""
    _LOOKUPS[layer].start(ids)


@start_op.register_fake
def _(ids: torch.Tensor, ticket: torch.Tensor, layer: int) -> None:
    return None


@torch.library.custom_op(FINISH_OP, mutates_args=("out",))
def finish_op(ticket: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    """``layer``'s started lookup's rows into ``out``."""
    _LOOKUPS[layer].finish(out)


@finish_op.register_fake
def _(ticket: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    return None


# ------------------------------------------------------------ the toy model
class Attention:
    """An eager op standing in for attention: the break point of breakable
    CUDA graphs (vLLM's ``eager_break_during_capture``). Outside a breakable
    capture it runs as it is."""

    capture: Breakable | None = None

    @classmethod
    def run(cls, hidden: torch.Tensor) -> None:
        def op() -> None:
            hidden.mul_(0.5)  # in place: later segments read the same address

        if cls.capture is None:
            op()
        else:
            cls.capture.eager(op)


class CompilePle(torch.nn.Module):
    """A PLE layer as vLLM's compiled models run one: its ids hashed in the
    graph, its lookup started and finished by custom ops, its rows projected
    onto the hidden state."""

    def __init__(self, table: SyntheticTable, lookups: LayerLookups, device: torch.device):
        super().__init__()
        self.table = table
        self.layer = table.layer
        self.multiplier = 7919 * (table.layer + 1)
        self.register_buffer("offsets", torch.arange(HEADS, device=device) * 104_729)
        self.register_buffer("ticket", torch.zeros(1, dtype=torch.int32, device=device))
        self.register_buffer(
            "rows",
            torch.zeros(TOKENS * HEADS, table.cols, dtype=torch.float8_e4m3fn, device=device),
        )
        g = torch.Generator().manual_seed(100 + table.layer)
        proj = torch.randn(HEADS * table.cols, HIDDEN, generator=g) / (HEADS * table.cols) ** 0.5
        self.proj = torch.nn.Parameter(proj.to(device), requires_grad=False)
        _LOOKUPS[self.layer] = lookups
        self.lookups = lookups

    def hash(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.remainder(input_ids[:, None] * self.multiplier + self.offsets, self.table.rows)

    def start_prefetch(self, input_ids, query_start_loc, ngram_context) -> None:
        del query_start_loc, ngram_context  # the toy hash reads the tokens only
        torch.ops.ple_compile_check.start(self.hash(input_ids), self.ticket, self.layer)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        torch.ops.ple_compile_check.finish(self.ticket, self.rows, self.layer)
        rows = self.rows.float().view(TOKENS, HEADS * self.table.cols)
        return hidden + rows @ self.proj


class CompileLayer(torch.nn.Module):
    def __init__(self, index: int, ple: CompilePle | None, device: torch.device) -> None:
        super().__init__()
        self.index = index
        self.ple = ple
        g = torch.Generator().manual_seed(index)
        self.weight = torch.nn.Parameter(
            (torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5).to(device),
            requires_grad=False,
        )

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        del input_ids  # the PLE lookups were started with the step
        if self.ple is not None:
            hidden = self.ple(hidden)
        return torch.tanh(hidden @ self.weight)


class CompileModel(ToyModel):
    """``Qwen4ExpModel``'s order (``ToyModel``), with every PLE layer's lookup
    started at the first layer, as the plugin patches it."""

    _start_layer_ple_prefetch = staticmethod(  # type: ignore[assignment]
        step.starting_with_the_step(ToyModel._start_layer_ple_prefetch)
    )


class BreakableModel(CompileModel):
    """The same, with an attention stand-in (an eager break) in every layer."""

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        self._start_layer_ple_prefetch(self.layers[self.start_layer], input_ids, None, None)
        for i in range(self.start_layer, self.end_layer):
            if i + 1 < self.end_layer:
                self._start_layer_ple_prefetch(self.layers[i + 1], input_ids, None, None)
            hidden = self.layers[i](hidden, input_ids)
            Attention.run(hidden)
        return hidden


def build(rig: Rig, cls: type[CompileModel] = CompileModel) -> CompileModel:
    """A model over a new session of the rig's server (the GPU-driven route on
    CUDA, its CPU stand-in on CPU), stamped for the step start."""
    gpu_path = "auto" if rig.device.type == "cuda" else "standin"
    lookups = rig.layer_lookups(gpu_path)
    ples = {t.layer: CompilePle(t, lookups[t.layer], rig.device) for t in TABLES}
    layers = [CompileLayer(i, ples.get(i), rig.device) for i in range(LAYERS)]
    model = cls(layers)  # type: ignore[arg-type]
    adopt_step(model)
    return model


def ple_layers(model: CompileModel) -> list[CompilePle]:
    return [layer.ple for layer in model.layers if layer.ple is not None]


def route_names(model: CompileModel) -> list[str]:
    return sorted({ple.lookups.route.name for ple in ple_layers(model) if ple.lookups.route})


def exact(rig: Rig, model: CompileModel, input_ids: torch.Tensor) -> bool:
    """Every PLE layer's rows equal the resident table's rows of its ids."""
    for ple in ple_layers(model):
        want = rig.reference[ple.layer][ple.hash(input_ids).reshape(-1)]
        if not torch.equal(ple.rows.view(torch.uint8), want):
            return False
    return True


# ------------------------------------------------- vLLM's compile, emulated
def inductor_options(device: torch.device) -> dict[str, Any]:
    options = dict(INDUCTOR_OPTIONS)
    if device.type == "cuda":
        options.update(combo_kernels=True, benchmark_combo_kernel=True)
    return options


def compile_full(model: torch.nn.Module, device: torch.device) -> Callable[..., Any]:
    """vLLM's compile of a model: one dynamo graph (no graph break allowed),
    static shapes, inductor with vLLM's options. The PLE ops stay in it."""
    return torch.compile(
        model,
        fullgraph=True,
        dynamic=False,
        backend="inductor",
        options=inductor_options(device),
    )


class PieceGraph:
    """One piece of the split graph in a CUDA graph of its own, as vLLM's
    ``CUDAGraphWrapper`` (PIECEWISE) holds it: run as compiled while warming
    up, captured at the call after ``warmups``, replayed after that. The
    inputs of a replay must be at the addresses they had at capture."""

    def __init__(self, runnable: Callable[..., Any], pool: Any, warmups: int = 1) -> None:
        self.runnable = runnable
        self.pool = pool
        self.warmups = warmups
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Any = None
        self.addresses: list[int] = []

    def __call__(self, *args: Any) -> Any:
        addresses = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
        if self.graph is not None:
            if addresses != self.addresses:
                raise RuntimeError("a piece's inputs moved since its capture")
            self.graph.replay()
            return self.output
        self.calls += 1
        if self.calls <= self.warmups:
            return self.runnable(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.runnable(*args)
        self.graph, self.output, self.addresses = graph, output, addresses
        # A capture runs nothing: replay it now, so that the ops after this
        # piece (the PLE lookups, eager) read this call's values.
        graph.replay()
        return output


class Piecewise:
    """A dynamo backend doing what vLLM's ``VllmBackend`` does for PIECEWISE:
    split the graph at the splitting ops (consecutive ones together, the
    original order kept), compile each other piece with inductor at its first
    call, and, on CUDA, run each compiled piece in a ``PieceGraph``. The
    splitting ops' pieces run eagerly."""

    def __init__(self, splitting_ops: tuple[str, ...], device: torch.device) -> None:
        self.splitting_ops = splitting_ops
        self.device = device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.pieces: list[PieceGraph] = []
        self.eager_ops: list[str] = []  # the splitting ops' targets, in order
        self.split: torch.fx.GraphModule | None = None

    def is_split(self, node: torch.fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or not isinstance(
            target, torch._ops.OpOverload | torch._ops.OpOverloadPacket
        ):
            return False
        if isinstance(target, torch._ops.OpOverloadPacket):
            return target._qualified_op_name in self.splitting_ops
        return target.name() in self.splitting_ops

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch.fx.passes.split_module import split_module

        piece_of: dict[torch.fx.Node, int] = {}
        piece = 0
        splitting: set[int] = set()
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            source = node.args[0] if node.target is operator.getitem else None
            if isinstance(source, torch.fx.Node) and source in piece_of:
                piece_of[node] = piece_of[source]  # a tuple's item stays with the tuple
            elif self.is_split(node):
                piece += 1
                piece_of[node] = piece
                splitting.add(piece)
                self.eager_ops.append(str(node.target))
                if self.is_split(node.next):
                    piece -= 1  # consecutive splitting ops share a piece
                else:
                    piece += 1
            else:
                piece_of[node] = piece
        split = split_module(gm, None, lambda node: piece_of[node], keep_original_order=True)
        for name, child in list(split.named_children()):
            index = int(name.removeprefix("submod_"))
            if index in splitting:
                continue  # the PLE ops: eager, between the graphs
            runnable: Callable[..., Any] = _LazyInductor(child, inductor_options(self.device))
            if self.device.type == "cuda":
                runnable = PieceGraph(runnable, self.pool)
                self.pieces.append(runnable)
            setattr(split, name, _Callable(runnable))
        self.split = split
        return split


class _LazyInductor:
    """A piece compiled by inductor at its first call (with that call's
    tensors as its example inputs, as vLLM compiles for a size when it first
    runs it)."""

    def __init__(self, gm: torch.fx.GraphModule, options: dict[str, Any]) -> None:
        self.gm = gm
        self.options = options
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            from torch._inductor.compile_fx import compile_fx

            self.compiled = compile_fx(self.gm, list(args), config_patches=self.options)
        return self.compiled(*args)


class _Callable(torch.nn.Module):
    """A callable as a submodule of the split graph."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class Breakable:
    """vLLM 0.33's breakable CUDA graphs (``BreakableCUDAGraphCapture``), as it
    runs Qwen4Exp on CUDA: one capture drives the whole eager forward; a break
    point ends the current graph segment, runs its op eagerly (and again at
    every replay), and starts the next segment."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.segments: list[Callable[[], Any]] = []
        self.graphs = 0
        self.breaks = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> Breakable:
        Attention.capture = self
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end()
        finally:
            Attention.capture = None

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.capture_end()
            self.segments.append(graph.replay)
            self.graphs += 1

    def eager(self, op: Callable[[], None]) -> None:
        self._end()
        op()
        self.segments.append(op)
        self.breaks += 1
        self._begin()

    def replay(self) -> None:
        for segment in self.segments:
            segment()


# ------------------------------------------------------------------- checks
def replays(
    rig: Rig, model: CompileModel, static_ids: torch.Tensor, run: Callable[[], Any], steps: int
) -> dict:
    """``steps`` replays with new ids under set_sync_debug_mode("error"), each
    checked bit for bit; then one behind a device sleep, timed on the host."""
    cuda = rig.device.type == "cuda"
    gen = torch.Generator(device=rig.device).manual_seed(7)
    before = rig.requests()
    bad = 0
    for _ in range(steps):
        with sync_check(cuda):
            static_ids.copy_(new_ids(gen, rig.device))
            run()
        if cuda:
            torch.cuda.synchronize()
        bad += not exact(rig, model, static_ids)
    after = rig.requests()
    result: dict = {
        "route": route_names(model),
        "replays": steps,
        "replays_not_exact": bad,
        "requests_per_layer": [a - b for a, b in zip(after, before, strict=True)],
    }
    if cuda:
        result["no_host_sync"] = True  # set_sync_debug_mode("error") raised nothing
        static_ids.copy_(new_ids(gen, rig.device))
        cycles = int(_cycles_per_ms() * SLEEP_MS)
        torch.cuda.synchronize()
        with sync_check(True):
            torch.cuda._sleep(cycles)
            started = time.perf_counter()
            run()
            host_ms = (time.perf_counter() - started) * 1e3
        torch.cuda.synchronize()
        result["replay_host_ms_behind_sleep"] = round(host_ms, 3)
        result["device_sleep_ms"] = SLEEP_MS
        result["exact_behind_sleep"] = exact(rig, model, static_ids)
    return result


def check_full(rig: Rig, steps: int) -> dict:
    """FULL: the compiled forward captured whole in one CUDA graph."""
    model = build(rig)
    compiled = compile_full(model, rig.device)
    gen = torch.Generator(device=rig.device).manual_seed(11)
    static_ids = new_ids(gen, rig.device)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    warm_exact = 0
    for _ in range(2):  # compile, then a warm run (vLLM warms up before capture)
        static_ids.copy_(new_ids(gen, rig.device))
        compiled(static_ids, hidden)
        if rig.device.type == "cuda":
            torch.cuda.synchronize()
        warm_exact += exact(rig, model, static_ids)
    if rig.device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(static_ids, hidden)  # warm-up on the capture's stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                compiled(static_ids, hidden)
        torch.cuda.synchronize()
        run: Callable[[], Any] = graph.replay
    else:
        run = lambda: compiled(static_ids, hidden)  # noqa: E731
    result = replays(rig, model, static_ids, run, steps)
    result["compiled_warm_runs_exact"] = f"{warm_exact}/2"
    return result


def check_piecewise(rig: Rig, steps: int) -> dict:
    """PIECEWISE: the graph split at the PLE ops, each piece compiled and
    captured, the PLE ops eager between them."""
    model = build(rig)
    backend = Piecewise(SPLITTING_OPS, rig.device)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    gen = torch.Generator(device=rig.device).manual_seed(13)
    static_ids = new_ids(gen, rig.device)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    warm_exact = 0
    for _ in range(2):  # compile + warm-up, then (CUDA) every piece's capture
        static_ids.copy_(new_ids(gen, rig.device))
        compiled(static_ids, hidden)
        if rig.device.type == "cuda":
            torch.cuda.synchronize()
        warm_exact += exact(rig, model, static_ids)
    result = replays(rig, model, static_ids, lambda: compiled(static_ids, hidden), steps)
    result["compiled_warm_runs_exact"] = f"{warm_exact}/2"
    result["graph_pieces"] = len(backend.pieces)
    result["captured_pieces"] = sum(p.graph is not None for p in backend.pieces)
    result["eager_ple_ops"] = len(backend.eager_ops)
    result["ple_ops_in_graph_pieces"] = _ops_in_pieces(backend)
    return result


def _ops_in_pieces(backend: Piecewise) -> int:
    """PLE ops left inside the compiled pieces (want 0)."""
    if backend.split is None:
        return -1
    count = 0
    for child in backend.split.children():
        fn = getattr(child, "fn", None)
        runnable = getattr(fn, "runnable", fn)
        gm = getattr(runnable, "gm", None)
        if isinstance(gm, torch.fx.GraphModule):
            count += sum(backend.is_split(node) for node in gm.graph.nodes)
    return count


def check_breakable(rig: Rig, steps: int) -> dict:
    """PIECEWISE as vLLM runs Qwen4Exp on CUDA: breakable graphs of the eager
    forward, the GPU-driven lookups inside the segments."""
    model = build(rig, BreakableModel)
    gen = torch.Generator(device=rig.device).manual_seed(17)
    static_ids = new_ids(gen, rig.device)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    model(static_ids, hidden)  # warm-up: opens the route outside the capture
    torch.cuda.synchronize()
    capture = Breakable(torch.cuda.graph_pool_handle())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), capture:
        model(static_ids, hidden)
    torch.cuda.synchronize()

    def replay() -> None:
        hidden.zero_()
        capture.replay()

    result = replays(rig, model, static_ids, replay, steps)
    result["graph_segments"] = capture.graphs
    result["eager_breaks"] = capture.breaks
    return result


def passed(result: dict | None, steps: int, cuda: bool) -> bool:
    if not result or "error" in result:
        return False
    ok = (
        result.get("replays_not_exact") == 0
        and result.get("requests_per_layer") == [steps] * len(PLE_LAYERS)
        and all(name.startswith("gpu-driven") for name in result.get("route", []))
    )
    if cuda:
        ok = ok and bool(result.get("exact_behind_sleep"))
        ok = ok and result.get("replay_host_ms_behind_sleep", SLEEP_MS) < SLEEP_MS / 2
    if "eager_ple_ops" in result:
        ok = ok and result["eager_ple_ops"] == 2 * len(PLE_LAYERS)
        ok = ok and result["ple_ops_in_graph_pieces"] == 0
        if cuda:
            ok = ok and result["captured_pieces"] == result["graph_pieces"] > 0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: the stand-in")
    parser.add_argument("--steps", type=int, default=20, help="replays per mode (default 20)")
    parser.add_argument(
        "--modes",
        default="full,piecewise,breakable",
        help="comma-separated: full, piecewise, breakable (CUDA only)",
    )
    parser.add_argument("--json", help="write the report here")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the imports and arguments, run nothing"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    checks: dict[str, Callable[[Rig, int], dict]] = {
        "full": check_full,
        "piecewise": check_piecewise,
        "breakable": check_breakable,
    }
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in checks]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (of {', '.join(checks)})")
    if device.type == "cpu" and "breakable" in modes:
        modes.remove("breakable")  # CUDA graphs only
    if device.type == "cuda" and not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU host, or --device cpu for the stand-in")
    report: dict = {
        "device": torch.cuda.get_device_name()
        if device.type == "cuda" and torch.cuda.is_available()
        else str(device),
        "torch": torch.__version__,
        "vllm_imported": any(m == "vllm" or m.startswith("vllm.") for m in sys.modules),
        "ple_layers": list(PLE_LAYERS),
        "tokens": TOKENS,
        "modes": modes,
        "inductor_options": inductor_options(device),
    }
    if args.dry_run:
        print(json.dumps(report, indent=1))
        return 0 if not report["vllm_imported"] else 1
    with tempfile.TemporaryDirectory(prefix="ple-compile-check-") as workdir:
        rig = Rig(workdir, device, SLEEP_MS)
        try:
            for name in modes:
                with _report_errors(report, name):
                    report[name] = checks[name](rig, args.steps)
        finally:
            rig.close()
    cuda = device.type == "cuda"
    report["passed"] = {name: passed(report.get(name), args.steps, cuda) for name in modes}
    report["vllm_imported"] = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    print(json.dumps(report, indent=1))
    save_json(report, args.json, indent=1)
    return 0 if all(report["passed"].values()) and not report["vllm_imported"] else 1


@contextlib.contextmanager
def _report_errors(report: dict, name: str):
    """A check that raises is reported, and the next one runs."""
    try:
        yield
    except Exception as exc:
        report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    sys.exit(main())
