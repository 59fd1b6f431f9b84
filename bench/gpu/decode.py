"""A decode step with PLE layers on a GPU: where the rows come from, whole step timed.

Needs torch with CUDA (no vLLM). One process writes a synthetic PLE table
(default 4 M rows × 160 B FP8, as bench/gpu/lookup.py), starts ``pleserver
serve --prewarm full`` on it, loads the same table onto the GPU and into pinned
host memory, and emulates decode steps of a model of ``--layers`` decoder
layers. Each layer is ``x = tanh(x @ W)`` with ``x`` [tokens, H] BF16 and one
square ``W`` [H, H] shared by all layers, H picked at start so that one
layer's matmul at batch 32 takes ``--compute-us`` (measured and reported).
``--ple-layers`` of them, evenly spread, first add PLE rows:
``x += rows.view(tokens, 16 · cols).to(bf16) @ Wp``, the rows of 16 ids per
token. As in vLLM, the lookup of PLE layer j is started before the layer
preceding it runs and collected when layer j needs it; each step's ids are
copied into a static input buffer before the step (vLLM's input buffers),
from ``--id-sets`` sets made on the device at start.

Paths, in the same run:

  compute   no lookup at all (the rows buffer as it stands): the floor
  a         table resident on the GPU: ``index_select`` on a side stream
            (forked at the start, joined at the use); one CUDA graph per step
  b         vLLM's ``cpu_offload``: a Triton kernel reading the pinned host
            table over UVA, on a side stream like a; one CUDA graph per step
  c         the plugin's host route: ``LayerLookups.start`` / ``finish`` (what the
            vLLM plugin runs: ids device → host with a host sync, server round
            trip, pinned DMA) run eagerly between CUDA graphs of the compute
            segments (vLLM's breakable graphs)
  d         the GPU-driven channel (``pleclient.gpu.GpuLookups``: ring /
            collect on the current stream, stream memory operations); one
            CUDA graph per step. ``--d-collect side`` collects on a side stream
            right after the ring instead of at the use. Skipped, with the
            reason, where the device or the driver has no stream memory
            operations.
  e         d with every PLE layer's lookup rung at the start of the step
            (what the vLLM plugin does: ``pleclient.vllm_plugin.step``), each
            collected at its layer; skipped where d is.

Per batch (``--batches``, tokens per decode step) and for one prefill
(``--prefill`` tokens): mean step time over ``--steps`` steps enqueued back to
back (CUDA events, one synchronization at the end), p50/p90 of ``--timed-steps``
steps synchronized one by one, whether the rows of ``--check-steps`` sampled
steps are bit-exact on the device against the table, and two proofs of no
host synchronization per step: the graph paths' steps run under
``torch.cuda.set_sync_debug_mode("error")`` (the timing synchronizations
outside it), and ``ahead`` counts the steps the GPU had still queued when the
host finished enqueueing the back-to-back run (a host synchronization in
every step leaves at most one). Targets at batch 32: d ≤ 1.03 × b and
d ≤ 1.10 × a, rows bit-exact, d free of host synchronizations (the debug
mode passed and more than two steps were queued ahead). The table, the
checkpoint and the server are removed at the end; ``others`` is the CPU
other processes used meanwhile.

  python -m bench.gpu.decode                                  # ≈ 2 min on an H200
  python -m bench.gpu.decode --compute-us 100 --json out.json
  python -m bench.gpu.decode --dtype BF16 --rows 20000000 --batches 32 --paths a,b,d
  bash bench/device_gpu_decode.sh                             # on a bare GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from bench.gpu.lookup import _p90, make_checkpoint, make_plugin, make_uva_kernel, read_table
from bench.harness.checkout import REPO
from bench.harness.provenance import OthersMeter, machine, source
from pleclient import protocol
from pleclient.checkpoint import TableSpec, discover_tables
from pleclient.gpu import DEFAULT_GPU_OPS, GPU_OPS
from pleserver.devkit.launcher import ServerLauncher

LABELS = {
    "compute": "compute only",
    "a": "resident",
    "b": "uva",
    "c": "plugin",
    "d": "gpu-driven",
    "e": "gpu-driven, step start",
}
GPU_DRIVEN = ("d", "e")
PATHS = tuple(LABELS)
IDS_PER_TOKEN = 16
DEVICE = "cuda"  # where the model, the buffers and table a live
TARGET_BATCH, TARGET_VS_B, TARGET_VS_A = 32, 1.03, 1.10


@dataclass
class Result:
    case: str  # decode | prefill
    tokens: int
    path: str
    step_ms: float | None = None  # mean of the back-to-back run (CUDA events)
    wall_ms: float | None = None  # the same run, host clock
    p50_ms: float | None = None  # steps synchronized one by one
    p90_ms: float | None = None
    ahead: int | None = None  # steps still queued on the GPU when enqueueing ended
    steps: int = 0
    exact: bool | None = None
    sync_checked: bool = False  # ran under set_sync_debug_mode("error")
    error: str | None = None


# ----------------------------------------------------------------- the model
class Model:
    """The weights shared by every batch: ``W`` [H, H], ``Wp`` [ids · cols, H].
    ``ple_at``: the PLE layers' indices (default: ``ple`` of them evenly spread);
    ``ids_per_token``: the rows a PLE layer reads a token (16; an Engram layer
    24)."""

    def __init__(
        self,
        hidden: int,
        layers: int,
        ple: int,
        cols: int,
        row_dtype,
        ple_at: list[int] | None = None,
        device: str = DEVICE,
        ids_per_token: int = IDS_PER_TOKEN,
    ) -> None:
        self.hidden, self.layers, self.row_dtype, self.device = hidden, layers, row_dtype, device
        self.ids_per_token = ids_per_token
        self.W = torch.randn(hidden, hidden, device=device, dtype=torch.bfloat16) / hidden**0.5
        k = ids_per_token * cols
        self.Wp = torch.randn(k, hidden, device=device, dtype=torch.bfloat16) / (k**0.5 * 64)
        if ple_at is None:
            ple_at = [(j * layers) // ple + layers // (2 * ple) for j in range(ple)]
        if sorted(set(ple_at)) != sorted(ple_at) or not all(0 <= i < layers for i in ple_at):
            raise ValueError(f"PLE layers {ple_at} must be distinct layers of 0..{layers - 1}")
        # layer index → its lookup j
        self.ple_at = {i: j for j, i in enumerate(sorted(ple_at))}

    def schedule(self, lookups: bool = True, at_step_start: bool = False) -> list[tuple[str, int]]:
        """One step as ops: ("start", j) before the layer preceding PLE layer
        j (vLLM's prefetch), or with ``at_step_start`` every PLE layer's start
        before layer 0 (lookahead: a step's ids are known when it starts);
        ("collect", j) and ("use", j) at it, ("layer", i) the compute."""
        ops: list[tuple[str, int]] = []
        if at_step_start:
            ops += [("start", j) for j in self.ple_at.values()]
        elif 0 in self.ple_at:
            ops.append(("start", self.ple_at[0]))
        for i in range(self.layers):
            if i + 1 in self.ple_at and not at_step_start:
                ops.append(("start", self.ple_at[i + 1]))
            if i in self.ple_at:
                ops += [("collect", self.ple_at[i]), ("use", self.ple_at[i])]
            ops.append(("layer", i))
        return ops if lookups else [op for op in ops if op[0] in ("use", "layer")]


class Batch:
    """A step's static buffers: hidden state, ids and rows per PLE layer.
    ``id_sets`` [steps, PLE layers, tokens · ids a token]: the ids of each step (default:
    ``sets`` steps of random ids); ``feed`` takes them in turn."""

    def __init__(
        self,
        model: Model,
        tokens: int,
        row_bytes: int,
        rows: int,
        sets: int,
        id_sets: torch.Tensor | None = None,
    ) -> None:
        ple, device = len(model.ple_at), model.device
        self.tokens, self.n = tokens, tokens * model.ids_per_token
        gen = torch.Generator(device=device).manual_seed(tokens)
        self.x = torch.randn(tokens, model.hidden, device=device, dtype=torch.bfloat16)
        self.ids = torch.zeros(ple, self.n, device=device, dtype=torch.int64)
        self.rows = torch.zeros(ple, self.n, row_bytes, device=device, dtype=torch.uint8)
        if id_sets is None:
            id_sets = torch.randint(
                0, rows, (sets, ple, self.n), device=device, dtype=torch.int64, generator=gen
            )
        if tuple(id_sets.shape[1:]) != (ple, self.n):
            raise ValueError(f"id_sets {tuple(id_sets.shape)} must be [steps, {ple}, {self.n}]")
        self.id_sets = id_sets

    def feed(self, step: int) -> None:
        """Step ``step``'s ids into the static buffer (stream-ordered, no sync)."""
        self.ids.copy_(self.id_sets[step % self.id_sets.shape[0]])


def run_ops(ops, path, batch: Batch, model: Model) -> None:
    """``ops`` on the current stream: x from ``batch.x`` and back into it."""
    x = batch.x
    for op, k in ops:
        if op == "start":
            path.start(k)
        elif op == "collect":
            path.collect(k)
        elif op == "use":
            rows = batch.rows[k].view(model.row_dtype).view(batch.tokens, -1)
            x = x + rows.to(torch.bfloat16) @ model.Wp
        else:
            x = torch.tanh(x @ model.W)
    if x is not batch.x:
        batch.x.copy_(x)


# ------------------------------------------------------------------- paths
class NoLookup:
    capturable = True
    start = collect = staticmethod(lambda j: None)


class SideGather:
    """a and b: ``gather(ids, out)`` on a side stream forked at the start, joined
    at the use (vLLM's pinned-host prefetch works on a side stream too)."""

    capturable = True

    def __init__(self, batch: Batch, gather) -> None:
        self.batch, self.gather = batch, gather
        self.side = torch.cuda.Stream()
        self.done = [torch.cuda.Event() for _ in range(batch.ids.shape[0])]

    def start(self, j: int) -> None:
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.gather(self.batch.ids[j], self.batch.rows[j])
            self.done[j].record()

    def collect(self, j: int) -> None:
        torch.cuda.current_stream().wait_event(self.done[j])


class Plugin:
    """c: the vLLM plugin's host route, eager (it refuses graph capture)."""

    capturable = False

    def __init__(self, batch: Batch, routes, layer) -> None:
        from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows

        self.batch, self.binding = batch, layer.binding
        # One layer's lookups per PLE layer of the step, on the host route.
        self.layers = [
            LayerLookups(self.binding, routes, StoredRows(self.binding), route=routes.host)
            for _ in range(batch.ids.shape[0])
        ]

    def start(self, j: int) -> None:
        self.layers[j].start(self.batch.ids[j])

    def collect(self, j: int) -> None:
        self.layers[j].finish(self.batch.rows[j].view(self.binding.storage_dtype))


class GpuDriven:
    """d and e: ``GpuLookups`` ring / collect; lookup j uses slots j · per_layer
    + chunk. The ring goes on the current stream; with ``side`` the collect goes
    on the layer's own side stream, forked right after it and joined at the use
    (the wait for the answer and the rows copy then overlap the compute), else
    on the current stream at the use."""

    capturable = True

    def __init__(self, batch: Batch, gl, info, capacity: int, per_layer: int, side: bool) -> None:
        self.batch, self.gl, self.info, self.per_layer = batch, gl, info, per_layer
        self.chunks = [
            (k, a, min(a + capacity, batch.n)) for k, a in enumerate(range(0, batch.n, capacity))
        ]
        if len(self.chunks) > per_layer:
            raise ValueError(
                f"{batch.n} ids need {len(self.chunks)} slots, a layer has {per_layer}"
            )
        layers = batch.ids.shape[0]
        # One side stream per PLE layer: a layer's collect (a wait for its
        # answer, then the copy) never queues behind another layer's.
        self.sides = [torch.cuda.Stream() for _ in range(layers)] if side else []
        self.done = [torch.cuda.Event() for _ in range(layers)] if side else []

    def start(self, j: int) -> None:
        for k, a, b in self.chunks:
            self.gl.ring(j * self.per_layer + k, self.info, self.batch.ids[j][a:b])
        if self.sides:
            self.sides[j].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.sides[j]):
                self._collect(j)
                self.done[j].record()

    def collect(self, j: int) -> None:
        if not self.sides:
            self._collect(j)
        else:
            torch.cuda.current_stream().wait_event(self.done[j])

    def _collect(self, j: int) -> None:
        for k, a, b in self.chunks:
            self.gl.collect(j * self.per_layer + k, self.batch.rows[j][a:b])


def build_step(path, ops, batch: Batch, model: Model):
    """One step as a list of callables for the current stream: one graph
    replay, or (path not capturable) graph replays of the compute segments
    with the lookups run eagerly between them."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compile, autotune, allocate before capture
        for s in range(2):
            batch.feed(s)
            run_ops(ops, path, batch, model)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graphs: list[torch.cuda.CUDAGraph] = []

    def capture(segment) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_ops(segment, path, batch, model)
        graphs.append(graph)
        pieces.append(graph.replay)

    pieces: list = []
    if path.capturable:
        capture(ops)
    else:
        segment: list[tuple[str, int]] = []
        for op, k in [*ops, ("end", -1)]:
            if op in ("use", "layer"):
                segment.append((op, k))
                continue
            if segment:
                capture(segment)
                segment = []
            if op != "end":
                pieces.append(lambda op=op, k=k: getattr(path, op)(k))
    torch.cuda.synchronize()
    return pieces, graphs


@contextlib.contextmanager
def no_host_sync(strict: bool):
    """With ``strict``, any synchronizing torch call in the block raises."""
    if not strict:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def measure(pieces, batch: Batch, res: Result, args, table_gpu: torch.Tensor, strict: bool):
    """Fill ``res``: back-to-back mean, one-by-one p50/p90, bit-exact rows."""
    steps, timed = (
        (args.steps, args.timed_steps) if res.case == "decode" else (args.prefill_steps,) * 2
    )

    def step(s: int) -> None:
        batch.feed(s)
        for piece in pieces:
            piece()

    step(0)  # the first replay uploads the graphs
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    marks = [torch.cuda.Event() for _ in range(steps)]
    t0 = time.perf_counter()
    with no_host_sync(strict):
        begin.record()
        for s in range(steps):
            step(s)
            marks[s].record()
        end.record()
    res.ahead = sum(not m.query() for m in marks)  # right away: what is still queued
    torch.cuda.synchronize()
    res.wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    res.step_ms = begin.elapsed_time(end) / steps
    res.steps = steps
    times = []
    for s in range(timed):
        t = time.perf_counter()
        with no_host_sync(strict):
            step(s)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    res.p50_ms, res.p90_ms = statistics.median(times), _p90(times)
    res.sync_checked = strict
    if res.path == "compute":
        return
    res.exact = True
    for s in range(args.check_steps):
        batch.rows.zero_()  # a path that wrote nothing cannot pass
        step(s * 7 + 3)
        torch.cuda.synchronize()
        want = table_gpu.index_select(0, batch.ids.view(-1)).view_as(batch.rows)
        res.exact = res.exact and bool(torch.equal(batch.rows, want))


# -------------------------------------------------------------- calibration
def matmul_us(hidden: int, tokens: int, iters: int = 40) -> float:
    w = torch.randn(hidden, hidden, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(5):
        x @ w
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        x @ w
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / iters


def calibrate(target_us: float, tokens: int, cap: int = 32768) -> tuple[int, float]:
    """The H (multiple of 256, ≤ ``cap``) whose [tokens, H] @ [H, H] takes about
    ``target_us``: a decode matmul reads W, so its time goes with H²."""
    hidden, took = 8192, matmul_us(8192, tokens)
    for _ in range(4):
        guess = hidden * math.sqrt(target_us / took)
        nxt = min(cap, max(256, round(guess / 256) * 256))
        if nxt == hidden:
            break
        hidden, took = nxt, matmul_us(nxt, tokens)
    return hidden, took


# ---------------------------------------------------------------------- run
@dataclass
class Setup:
    """What every case uses: the model, the table in its three homes, the
    sessions of c and d."""

    model: Model
    table: TableSpec
    table_gpu: torch.Tensor  # a's table, and the reference of the bit-exact checks
    pinned: torch.Tensor  # b's table
    uva: object  # b's kernel, None without Triton
    plugin: tuple  # c: (Routes, LayerLookups)
    lookups: object = None  # d: GpuLookups, None when unavailable
    table_info: object = None  # d: the table's TableInfo
    per_layer: int = 0  # d: slots per PLE layer
    why_not_d: str | None = None


def open_gpu_driven(
    setup: Setup, socket_path: str, capacity: int, largest: int, ops: str = "memops"
) -> None:
    """Open d's (and e's) session into ``setup``, or say in ``why_not_d`` why
    not. ``ops``: how the stream rings and collects (``pleclient.gpu.GPU_OPS``)."""
    try:
        from pleclient.gpu import GpuLookups, stream_memops_supported
    except ImportError as exc:
        setup.why_not_d = f"pleclient.gpu is not available: {exc}"
        return
    device = torch.device("cuda", torch.cuda.current_device())
    ok, why = stream_memops_supported(device)
    if not ok:
        setup.why_not_d = f"no stream memory operations: {why}"
        return
    ple = len(setup.model.ple_at)
    per_layer = math.ceil(largest / capacity)
    if ple * per_layer > protocol.MAX_DEPTH:
        setup.why_not_d = (
            f"{ple} PLE layers × {per_layer} slots ({largest} ids, capacity {capacity}) "
            f"= {ple * per_layer} slots, over {protocol.MAX_DEPTH}: raise --capacity"
        )
        return
    try:
        gl = GpuLookups.open(
            socket_path,
            device=device,
            capacity=capacity,
            depth=ple * per_layer,
            timeout=30.0,
            ops=ops,
        )
    except Exception as exc:
        setup.why_not_d = f"GpuLookups.open failed: {type(exc).__name__}: {exc}"
        return
    setup.lookups, setup.per_layer = gl, per_layer
    if gl.ops != ops:
        setup.why_not_d = f"--gpu-ops {ops} asked, {gl.ops} runs (the log says why)"
    setup.table_info = next((t for t in gl.tables if t.name == setup.table.name), None)
    if setup.table_info is None:
        setup.why_not_d = f"the GPU-driven session lists no table {setup.table.name}"


def make_path(name: str, batch: Batch, setup: Setup, args):
    if name == "compute":
        return NoLookup()
    if name == "a":
        table = setup.table_gpu
        return SideGather(batch, lambda ids, out: torch.index_select(table, 0, ids, out=out))
    if name == "b":
        if setup.uva is None:
            raise RuntimeError("no Triton: the UVA kernel is unavailable")
        uva, pinned = setup.uva, setup.pinned
        return SideGather(batch, lambda ids, out: uva(pinned, ids, out))
    if name == "c":
        return Plugin(batch, *setup.plugin)
    if setup.why_not_d:
        raise RuntimeError(f"unavailable: {setup.why_not_d}")
    return GpuDriven(
        batch,
        setup.lookups,
        setup.table_info,
        args.capacity,
        setup.per_layer,
        side=args.d_collect == "side",
    )


def run_case(case: str, tokens: int, args, setup: Setup) -> list[Result]:
    model, table = setup.model, setup.table
    batch = Batch(model, tokens, table.row_bytes, table.rows, args.id_sets)
    results = []
    for name in args.paths:
        res = Result(case, tokens, name)
        results.append(res)
        try:
            path = make_path(name, batch, setup, args)
            ops = model.schedule(name != "compute", at_step_start=name == "e")
            pieces, graphs = build_step(path, ops, batch, model)
            measure(pieces, batch, res, args, setup.table_gpu, strict=path.capturable)
            del pieces, graphs
        except Exception as exc:  # report it, go on with the next path
            res.error = f"{type(exc).__name__}: {exc}"
            if name in GPU_DRIVEN and not setup.why_not_d:  # do not try it again
                setup.why_not_d = f"failed at {case} {tokens}: {res.error}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        print(
            f"  {case} {tokens:5d} tokens {name:7s} {LABELS[name]:12s} {describe(res)}", flush=True
        )
    del batch
    torch.cuda.empty_cache()
    return results


def describe(r: Result) -> str:
    if r.error:
        return f"failed: {r.error}"
    exact = {None: "", True: ", bit-exact", False: ", ROWS DIFFER"}[r.exact]
    return (
        f"{r.step_ms:.3f} ms/step (p50 {r.p50_ms:.3f}, p90 {r.p90_ms:.3f}; "
        f"{r.ahead}/{r.steps} queued ahead{exact})"
    )


def targets(results: list[Result]) -> dict:
    at = {r.path: r for r in results if r.case == "decode" and r.tokens == TARGET_BATCH}
    d, a, b = at.get("d"), at.get("a"), at.get("b")
    if d is None or d.error or not (a and b) or a.error or b.error:
        return {"evaluated": False}
    e = at.get("e")
    return {
        "evaluated": True,
        "e_over_a": round(e.step_ms / a.step_ms, 4) if e and not e.error else None,
        "d_over_b": round(d.step_ms / b.step_ms, 4),
        "d_over_a": round(d.step_ms / a.step_ms, 4),
        "d_le_1.03_b": d.step_ms <= TARGET_VS_B * b.step_ms,
        "d_le_1.10_a": d.step_ms <= TARGET_VS_A * a.step_ms,
        "d_bit_exact": bool(d.exact),
        "d_no_host_sync": d.sync_checked and d.ahead > 2,
    }


def print_tables(results: list[Result], paths: list[str]) -> None:
    for case in ("decode", "prefill"):
        rows = [r for r in results if r.case == case]
        if not rows:
            continue
        print(f"\n{case}: mean step ms, back to back (p50 / p90 one by one)")
        head = " | ".join(p if p == "compute" else f"{p}: {LABELS[p]}" for p in paths)
        print(f"| tokens | {head} | d/b | d/a | e/a | bit-exact | steps queued ahead |")
        print("|---:|" + "---:|" * len(paths) + "---:|---:|---:|---|---|")
        for tokens in dict.fromkeys(r.tokens for r in rows):
            at = {r.path: r for r in rows if r.tokens == tokens}
            cells = [
                "–"
                if p not in at or at[p].error
                else f"{at[p].step_ms:.3f} ({at[p].p50_ms:.3f} / {at[p].p90_ms:.3f})"
                for p in paths
            ]
            ratios = [
                f"{at[x].step_ms / at[o].step_ms:.3f}"
                if all(p in at and not at[p].error for p in (x, o))
                else "–"
                for x, o in (("d", "b"), ("d", "a"), ("e", "a"))
            ]
            exact = [at[p].exact for p in paths if p in at and at[p].exact is not None]
            ok = "–" if not exact else "yes" if all(exact) else "NO"
            ahead = " ".join(
                f"{p} {at[p].ahead}/{at[p].steps}" for p in paths if p in at and at[p].steps
            )
            line = " | ".join([*cells, *ratios, ok, ahead])
            print(f"| {tokens} | {line} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.rsplit("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rows", type=int, default=4_000_000, help="table rows (default 4 M)")
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument("--dtype", default="F8_E4M3", choices=["F8_E4M3", "BF16"])
    ap.add_argument("--parts", type=int, default=16, help="table shards")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32)")
    ap.add_argument("--ple-layers", type=int, default=8, help="of them PLE layers (default 8)")
    ap.add_argument(
        "--compute-us", type=float, default=200.0, help="one layer's matmul at batch 32 (200)"
    )
    ap.add_argument("--hidden", type=int, help="H directly (no calibration)")
    ap.add_argument("--batches", default="1,8,32,64", help="decode tokens per step")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: none)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    ap.add_argument("--steps", type=int, default=200, help="back-to-back steps (200)")
    ap.add_argument("--timed-steps", type=int, default=100, help="steps timed one by one (100)")
    ap.add_argument("--prefill-steps", type=int, default=5)
    ap.add_argument("--check-steps", type=int, default=4, help="steps whose rows are checked")
    ap.add_argument("--id-sets", type=int, default=16, help="distinct steps of ids (16)")
    ap.add_argument("--capacity", type=int, default=16384, help="rows per request, c and d (16384)")
    ap.add_argument("--d-collect", choices=["main", "side"], default="main", help="see GpuDriven")
    ap.add_argument(
        "--gpu-ops",
        choices=GPU_OPS,
        default=DEFAULT_GPU_OPS,
        help="d and e: the driver's stream memory operations, or pleclient.gpu_kernels' "
        f"kernels (default {DEFAULT_GPU_OPS})",
    )
    ap.add_argument("--workdir", help="where the checkpoint goes (default: a temporary dir)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    if set(args.paths) - set(PATHS):
        ap.error(f"unknown paths {sorted(set(args.paths) - set(PATHS))}; use {PATHS}")
    batches = [int(b) for b in args.batches.split(",") if b]
    if not 0 < args.ple_layers <= args.layers:
        ap.error(f"--ple-layers {args.ple_layers} must lie in [1, --layers {args.layers}]")
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/decode.py needs a CUDA device")

    workdir = tempfile.mkdtemp(prefix="ple-decode-", dir=args.workdir)
    server = setup = None
    try:
        model_dir = make_checkpoint(workdir, args.rows, args.cols, args.dtype, args.parts)
        table = discover_tables(model_dir)[0]
        serve = ("--prewarm", "full", "--max-capacity", str(max(args.capacity, 16384)))
        server = ServerLauncher(
            model_dir,
            *serve,
            log_level="WARNING",
            cwd=REPO,
            die_with_parent=True,
            ready_timeout=120,
        ).start()
        prewarm = server.wait_prewarm(300.0)
        if args.hidden:
            hidden, layer_us = args.hidden, matmul_us(args.hidden, TARGET_BATCH)
        else:
            hidden, layer_us = calibrate(args.compute_us, TARGET_BATCH)
        reference = torch.from_numpy(read_table(table))
        plugin = make_plugin(server.socket, model_dir, table, args.capacity)
        setup = Setup(
            Model(
                hidden, args.layers, args.ple_layers, table.cols, plugin[1].binding.storage_dtype
            ),
            table,
            table_gpu=reference.cuda(),
            pinned=reference.pin_memory(),
            uva=make_uva_kernel(),
            plugin=plugin,
        )
        del reference
        if {"d", "e"} & set(args.paths):
            largest = max([*batches, args.prefill]) * IDS_PER_TOKEN
            open_gpu_driven(setup, server.socket, args.capacity, largest, args.gpu_ops)
            if setup.why_not_d:
                print(f"d unavailable: {setup.why_not_d}", file=sys.stderr)
        print(
            f"table {table.rows} rows × {table.row_bytes} B {table.dtype} (prewarm {prewarm}); "
            f"{args.layers} layers, PLE at {sorted(setup.model.ple_at)}; H = {hidden}: "
            f"{layer_us:.0f} µs per layer matmul at batch {TARGET_BATCH}; "
            f"{torch.cuda.get_device_name()}",
            flush=True,
        )
        meter = OthersMeter([server.pid])
        meter.start()
        results = []
        for tokens in batches:
            results += run_case("decode", tokens, args, setup)
        if args.prefill:
            results += run_case("prefill", args.prefill, args, setup)
        others = meter.stop()
    finally:
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        if setup is not None and setup.lookups is not None:
            setup.lookups.close()
        if setup is not None:
            setup.plugin[0].close()
        if server is not None:
            server.close()
        shutil.rmtree(workdir, ignore_errors=True)

    print_tables(results, args.paths)
    verdict = targets(results)
    checks = [
        f"{k} {v}" if not isinstance(v, bool) else f"{k} {'pass' if v else 'FAIL'}"
        for k, v in verdict.items()
        if k != "evaluated"
    ]
    print(f"\ntargets at batch {TARGET_BATCH}: " + (", ".join(checks) or "not evaluated"))
    print(f"others used {others:.1%} of the CPUs")
    if args.json:
        report = {
            "machine": {
                **machine(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(),
                "driver": _driver(),
            },
            "source": source(),
            "args": vars(args),
            "table": {"rows": table.rows, "row_bytes": table.row_bytes, "dtype": table.dtype},
            "model": {
                "hidden": hidden,
                "layer_matmul_us": round(layer_us, 1),
                "ple_layers": sorted(setup.model.ple_at),
            },
            "d_unavailable": setup.why_not_d,
            "others_cpu": others,
            "targets": verdict,
            "results": [asdict(r) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r.exact is False for r in results) else 0


def _driver() -> str:
    cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    return ""


if __name__ == "__main__":
    sys.exit(main())
