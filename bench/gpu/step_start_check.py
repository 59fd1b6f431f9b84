#!/usr/bin/env python3
"""Every PLE layer's lookup starts with the step: the vLLM plugin's step start on a GPU.

Needs torch with CUDA (no vLLM). Writes a small synthetic checkpoint of three
FP8 PLE tables, starts ``pleserver serve`` on it, and drives a toy model built
the way vLLM's ``Qwen4ExpModel`` is (layers 0..5, PLE on layers 1, 3 and 4; its
forward starts layer *i + 1*'s lookup before layer *i* runs, through its
``_start_layer_ple_prefetch``) with the plugin's own parts: the session
(``RowService``), its ``Routes``, each PLE layer's ``LayerLookups`` and the
step start (``step.adopt`` and ``step.starting_with_the_step``, as the Qwen4Exp
adapter wires them). Layer 0 sleeps on the device before anything else runs;
meanwhile a probe thread reads the server's stats and counts the PLE layers
whose lookup the server has answered:

  eager        the GPU-driven route, eager, under
               torch.cuda.set_sync_debug_mode("error"): rows bit-exact, the
               lookups of all 3 PLE layers answered while layer 0 sleeps
  graph        the forward captured in one CUDA graph, replayed --steps times
               with new input ids copied into its static input, under
               set_sync_debug_mode("error"): no host synchronization, every
               replay's rows bit-exact, one request per PLE layer per replay,
               all 3 answered while layer 0 sleeps
  compiled     the forward under torch.compile (default backend, graph breaks
               allowed), a few steps with new ids: rows bit-exact, all 3
               answered while layer 0 sleeps
  host         the host route (VLLM_PLE_SHM_GPU_PATH=off), eager: rows
               bit-exact, all 3 answered while layer 0 sleeps
  one_ahead    the toy model without the step start (vLLM's own order, the
               GPU-driven route), for contrast: only layer 1's lookup is
               answered while layer 0 sleeps, so the probe can tell

    python3 -m bench.gpu.step_start_check [--json out.json] [--steps 50]
    python3 -m bench.gpu.step_start_check --device cpu   # the GPU-driven route's CPU stand-in

Build the native modules first (``python3 setup.py -q build_ext --inplace``).
The exit status is 0 when every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import torch

from bench.harness.scaffold import save_json
from pleclient import PleClient
from pleclient.vllm_plugin import step
from pleclient.vllm_plugin.identity import Expected
from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows
from pleclient.vllm_plugin.routes import Routes
from pleclient.vllm_plugin.rows import RowService
from pleclient.vllm_plugin.settings import ShmSettings
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint

LAYERS = 6
PLE_LAYERS = (1, 3, 4)
HEADS = 16  # n-gram heads: ids per token and PLE layer
TOKENS = 64  # a decode step of 64 sequences
TABLES = [
    SyntheticTable(layer=i, rows=200_003, cols=160, dtype="F8_E4M3", parts=8) for i in PLE_LAYERS
]
HIDDEN = 256


# ------------------------------------------------------------- the toy model
class Clock:
    """Layer 0's sleep, and a word in host memory that says it is over: the
    device writes it after the sleep (in a graph too), the probe thread reads
    it."""

    def __init__(self, device: torch.device, sleep_ms: float) -> None:
        self.device = device
        self.sleep_ms = sleep_ms
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._one = torch.ones(1, dtype=torch.int32, device=device)
        self._word = self.flag.numpy()
        self._cycles = int(_cycles_per_ms() * sleep_ms) if device.type == "cuda" else 0

    # Instrumentation, not model: kept out of torch.compile, whose graph would
    # turn the device-to-pinned copy of a constant into a host write made at
    # trace order, before the sleep has run on the device.
    @torch.compiler.disable
    def layer0(self) -> None:
        if self.device.type == "cuda":
            torch.cuda._sleep(self._cycles)
        else:
            time.sleep(self.sleep_ms / 1e3)
        self.flag.copy_(self._one, non_blocking=True)

    def over(self) -> bool:
        return bool(self._word[0])

    def reset(self) -> None:
        self._word[0] = 0


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond, measured with torch.cuda._sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


class ToyPle(torch.nn.Module):
    """A PLE layer as the plugin sees it: hashes its ids into its own buffer
    (vLLM's ``_prefetch_ids``), starts its lookup, finishes it at its layer."""

    def __init__(self, table: SyntheticTable, lookups: LayerLookups, device: torch.device) -> None:
        super().__init__()
        self.table = table
        self.lookups = lookups
        self.multiplier = 7919 * (table.layer + 1)
        self.offsets = torch.arange(HEADS, device=device) * 104_729
        self.ids = torch.zeros(TOKENS, HEADS, dtype=torch.int64, device=device)
        self.rows = torch.zeros(
            TOKENS * HEADS, table.cols, dtype=torch.float8_e4m3fn, device=device
        )

    def hash(self, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        torch.remainder(
            input_ids[:, None] * self.multiplier + self.offsets, self.table.rows, out=out
        )

    def start_prefetch(self, input_ids, query_start_loc, ngram_context) -> None:
        del query_start_loc, ngram_context  # the toy hash reads the tokens only
        self.hash(input_ids, self.ids[: input_ids.shape[0]])
        self.lookups.start(self.ids[: input_ids.shape[0]])

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows[: input_ids.shape[0] * HEADS]
        self.lookups.finish(rows)
        return hidden + rows.float().view(input_ids.shape[0], -1)[:, :HIDDEN]


class ToyLayer(torch.nn.Module):
    def __init__(self, index: int, ple: ToyPle | None, clock: Clock, device: torch.device):
        super().__init__()
        self.index = index
        self.ple = ple
        self.clock = clock
        g = torch.Generator().manual_seed(index)
        self.weight = torch.nn.Parameter(
            (torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5).to(device),
            requires_grad=False,
        )

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            self.clock.layer0()
        if self.ple is not None:
            hidden = self.ple(hidden, input_ids)
        return torch.tanh(hidden @ self.weight)


class ToyModel(torch.nn.Module):
    """Qwen4ExpModel's order of lookups: the first layer's before the loop,
    then layer i + 1's before layer i runs."""

    def __init__(self, layers: list[ToyLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.start_layer, self.end_layer = 0, len(layers)

    @staticmethod
    def _start_layer_ple_prefetch(layer, input_ids, query_start_loc, ngram_context) -> None:
        """Start a layer's PLE lookup when it has one (vLLM's, as it is)."""
        ple = getattr(layer, "ple", None)
        if ple is None:
            return
        ple.start_prefetch(input_ids, query_start_loc, ngram_context)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.start_layer < self.end_layer:
            self._start_layer_ple_prefetch(self.layers[self.start_layer], input_ids, None, None)
        for i in range(self.start_layer, self.end_layer):
            if i + 1 < self.end_layer:
                self._start_layer_ple_prefetch(self.layers[i + 1], input_ids, None, None)
            hidden = self.layers[i](hidden, input_ids)
        return hidden


class StepToyModel(ToyModel):
    """The toy model as the plugin makes vLLM's: every PLE layer's lookup
    starts with the step."""

    _start_layer_ple_prefetch = staticmethod(  # type: ignore[assignment]
        step.starting_with_the_step(ToyModel._start_layer_ple_prefetch)
    )


# --------------------------------------------------------------------- setup
def adopt_step(model: torch.nn.Module) -> None:
    """Every PLE layer's lookup of ``model`` starts with the step (step.adopt)."""
    step.adopt(
        model.layers,
        model.start_layer,
        model.end_layer,
        ToyModel._start_layer_ple_prefetch,
        lambda layer: layer.ple.lookups.binding if layer.ple is not None else None,
    )


class Rig:
    """A server over the checkpoint, one session per route setting, the
    reference tables on the device."""

    def __init__(self, workdir: str, device: torch.device, sleep_ms: float) -> None:
        self.device = device
        self.ckpt = os.path.join(workdir, "ckpt")
        write_checkpoint(self.ckpt, TABLES, files=2)
        self.server = ServerLauncher(self.ckpt, "--prewarm", "full", die_with_parent=True).start()
        self.reference = {
            t.layer: torch.from_numpy(read_reference(self.ckpt, t.name)).to(device) for t in TABLES
        }
        self.clock = Clock(device, sleep_ms)
        self.routes: list[Routes] = []

    def layer_lookups(self, gpu_path: str) -> dict[int, LayerLookups]:
        """Each PLE table's lookups over a new session of the server, by layer."""
        service = RowService(
            ShmSettings(socket=self.server.socket, checkpoint=self.ckpt, gpu_path=gpu_path)
        )
        routes = Routes(service)
        self.routes.append(routes)
        lookups = {}
        for table in TABLES:
            binding = service.bind(
                Expected(
                    prefix=table.name.removesuffix(".ngram_embedding"),
                    rows=table.rows,
                    cols=table.cols,
                    dtypes=(table.dtype,),
                    parts=table.parts,
                ),
                max_ids=TOKENS * HEADS,
            )
            lookups[table.layer] = LayerLookups(binding, routes, StoredRows(binding))
        return lookups

    def model(self, gpu_path: str, *, with_step: bool = True) -> ToyModel:
        lookups = self.layer_lookups(gpu_path)
        ples = {t.layer: ToyPle(t, lookups[t.layer], self.device) for t in TABLES}
        layers = [ToyLayer(i, ples.get(i), self.clock, self.device) for i in range(LAYERS)]
        model = (StepToyModel if with_step else ToyModel)(layers)
        if with_step:
            adopt_step(model)
        return model

    def requests(self) -> list[int]:
        stats = PleClient.query_stats(self.server.socket)
        by_layer = {int(t["layer"]): int(t["requests"]) for t in stats["tables"]}
        return [by_layer[layer] for layer in PLE_LAYERS]

    def exact(self, model: ToyModel, input_ids: torch.Tensor) -> bool:
        for layer in model.layers:
            if layer.ple is None:
                continue
            ids = torch.empty_like(layer.ple.ids)
            layer.ple.hash(input_ids, ids)
            want = self.reference[layer.index][ids.reshape(-1)]
            if not torch.equal(layer.ple.rows.view(torch.uint8), want):
                return False
        return True

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for routes in self.routes:
            routes.close()
        self.server.close()


def answered_while_layer0_ran(rig: Rig, run: Callable[[], object], *, no_syncs: bool) -> int:
    """How many PLE layers' lookups the server answered before layer 0's sleep
    ended, during ``run`` (one step). ``no_syncs``: ``run`` under
    ``torch.cuda.set_sync_debug_mode("error")``."""
    before = rig.requests()
    seen = [0]
    stop = threading.Event()
    rig.clock.reset()

    def probe() -> None:
        while not stop.is_set():
            counts = rig.requests()
            if rig.clock.over():
                return
            seen[0] = sum(after > was for after, was in zip(counts, before, strict=True))
            time.sleep(0.002)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        with sync_check(no_syncs):
            run()
        if rig.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        stop.set()
        thread.join()
    return seen[0]


@contextlib.contextmanager
def sync_check(on: bool):
    """Inside: any host synchronization raises (``torch.cuda.synchronize()``
    included, so the caller synchronizes after)."""
    if on:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if on:
            torch.cuda.set_sync_debug_mode(0)


def new_ids(gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A step's token ids, drawn on the device (no copy from the host)."""
    return torch.randint(0, 1 << 20, (TOKENS,), generator=gen, device=device)


# -------------------------------------------------------------------- checks
def check_eager(rig: Rig, gpu_path: str, *, with_step: bool = True) -> dict:
    model = rig.model(gpu_path, with_step=with_step)
    gen = torch.Generator(device=rig.device).manual_seed(1)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    ids = new_ids(gen, rig.device)
    model(ids, hidden)  # the first step opens the route
    if rig.device.type == "cuda":
        torch.cuda.synchronize()
    result: dict = {"route": _route_name(model)}
    ids = new_ids(gen, rig.device)
    no_syncs = rig.device.type == "cuda" and gpu_path != "off"  # the host route syncs
    result["answered_while_layer0_ran"] = answered_while_layer0_ran(
        rig, lambda: model(ids, hidden), no_syncs=no_syncs
    )
    result["exact"] = rig.exact(model, ids)
    if no_syncs:
        result["no_host_sync"] = True  # set_sync_debug_mode("error") raised nothing
    return result


def check_graph(rig: Rig, steps: int) -> dict:
    model = rig.model("auto")
    gen = torch.Generator(device=rig.device).manual_seed(2)
    static_ids = new_ids(gen, rig.device)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        model(static_ids, hidden)  # warm-up: opens the route outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = model(static_ids, hidden)
    torch.cuda.synchronize()
    del out
    result: dict = {"route": _route_name(model)}
    before = rig.requests()
    bad = 0
    for _ in range(steps):
        with sync_check(True):
            static_ids.copy_(new_ids(gen, rig.device))
            graph.replay()
        torch.cuda.synchronize()
        bad += not rig.exact(model, static_ids)
    after = rig.requests()
    result["replays"] = steps
    result["replays_not_exact"] = bad
    result["requests_per_layer"] = [a - b for a, b in zip(after, before, strict=True)]
    result["no_host_sync"] = True  # set_sync_debug_mode("error") raised nothing
    static_ids.copy_(new_ids(gen, rig.device))
    result["answered_while_layer0_ran"] = answered_while_layer0_ran(
        rig, graph.replay, no_syncs=True
    )
    result["exact_after_probe"] = rig.exact(model, static_ids)
    return result


def check_compiled(rig: Rig, steps: int = 5) -> dict:
    model = rig.model("auto")
    compiled = torch.compile(model)
    gen = torch.Generator(device=rig.device).manual_seed(3)
    hidden = torch.zeros(TOKENS, HIDDEN, device=rig.device)
    exact = 0
    for _ in range(steps):
        ids = new_ids(gen, rig.device)
        compiled(ids, hidden)
        torch.cuda.synchronize()
        exact += rig.exact(model, ids)
    ids = new_ids(gen, rig.device)
    seen = answered_while_layer0_ran(rig, lambda: compiled(ids, hidden), no_syncs=False)
    return {
        "route": _route_name(model),
        "steps_exact": f"{exact}/{steps}",
        "exact": exact == steps and rig.exact(model, ids),
        "answered_while_layer0_ran": seen,
    }


def _route_name(model: ToyModel) -> list[str]:
    names = {layer.ple.lookups.route.name for layer in model.layers if layer.ple is not None}
    return sorted(names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: the stand-in")
    parser.add_argument("--steps", type=int, default=50, help="graph replays (default 50)")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="layer 0's sleep")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    device = torch.device(args.device)
    report: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ple_layers": list(PLE_LAYERS),
        "tokens": TOKENS,
    }
    gpu = "auto" if device.type == "cuda" else "standin"
    checks: dict[str, Callable[[Rig], dict]] = {
        "eager": lambda rig: check_eager(rig, gpu),
        "host": lambda rig: check_eager(rig, "off"),
        "one_ahead": lambda rig: check_eager(rig, gpu, with_step=False),
    }
    if device.type == "cuda":
        checks["graph"] = lambda rig: check_graph(rig, args.steps)
        checks["compiled"] = check_compiled
    with tempfile.TemporaryDirectory(prefix="ple-step-check-") as workdir:
        rig = Rig(workdir, device, args.sleep_ms)
        try:
            for name, check in checks.items():
                try:
                    report[name] = check(rig)
                except Exception as exc:  # report it, go on with the next check
                    report[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
        finally:
            rig.close()
    everything = len(PLE_LAYERS)
    ok = {
        "eager": _passed(report.get("eager"), everything),
        "host": _passed(report.get("host"), everything),
        "one_ahead": _passed(report.get("one_ahead"), 1),
    }
    if device.type == "cuda":
        graph = report.get("graph", {})
        ok["graph"] = (
            graph.get("replays_not_exact") == 0
            and graph.get("requests_per_layer") == [args.steps] * everything
            and graph.get("answered_while_layer0_ran") == everything
            and bool(graph.get("exact_after_probe"))
        )
        ok["compiled"] = _passed(report.get("compiled"), everything)
    report["passed"] = ok
    print(json.dumps(report, indent=1))
    save_json(report, args.json, indent=1)
    return 0 if all(ok.values()) else 1


def _passed(result: dict | None, answered: int) -> bool:
    return bool(
        result and result.get("exact") and result.get("answered_while_layer0_ran") == answered
    )


if __name__ == "__main__":
    sys.exit(main())
