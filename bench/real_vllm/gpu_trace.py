"""What the GPU did in each decode step: read from a torch profiler trace of
vLLM's worker (``profiler_config``, the ``prof`` cell word).

vLLM's worker marks each step's ``execute_model`` with a profiler annotation
naming its requests (``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``).
Every GPU activity of the trace (kernel, memcpy, memset) carries the
correlation id of the host call that launched it, and under a CUDA graph every
activity of a replay carries its ``cudaGraphLaunch``'s. So a step's GPU work is
the activities whose launching call came after its annotation began and
before the next step's did: the forward inside the annotation, and the
sampling and the sampled tokens' copy to the host that ``sample_tokens``
launches after it. Per step:

* ``span``: from its first GPU activity's start to its last one's end;
* ``busy``: the union of its activities; ``idle`` = span − busy: where the
  stream waited (a ``cuStreamWaitValue32`` on a lookup's done word, a stream
  memory operation's own latency, a launch gap) — stream memory operations
  leave no activity of their own;
* kernels and memcpys (by direction): how many, and their time;
* ``idle_before_htod``: the idle time just before each host-to-device memcpy,
  where the GPU-driven route's wait for a lookup's rows ends (its rows' copy
  follows the wait);
* ``period``: from its annotation's start to the next step's; ``host``: the
  annotation's own length, the host's ``execute_model`` (with a CUDA graph,
  its launch, not its run);
* ``graph_*``: the same figures over the activities of the step's largest
  launch alone (the forward's CUDA graph replay): its idle is the GPU's own
  (stream waits, stream memory operations, the gaps between a graph's
  nodes), never the host's, which a profiler slows; the step's idle beyond
  it is launch gaps around the graph (input copies, sampling); and
  ``graph_wait_max``, its longest gap before a host-to-device copy (the
  PLE layer that waited longest).

``decode_figures`` gives their medians and means over the steps that decode
every request and fill no prompt; ``compact`` keeps what ``steps`` reads, so a
trace travels back small. Pure Python: the CPU test reads a trace written the
same way.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from pathlib import Path

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load(path: Path) -> list[dict]:
    """A trace's events (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def memcpy_direction(name: str) -> str:
    for d in ("HtoD", "DtoH", "DtoD"):
        if d in name:
            return d
    return "other"


def steps(events: list[dict]) -> list[dict]:
    """Each annotated step's GPU figures (module docstring), in step order."""
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and STEP.fullmatch(e["name"])
    )
    if not spans:
        return []
    starts = [s[0] for s in spans]
    launched: dict[int, float] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launched[e["args"]["correlation"]] = e["ts"]
    work: list[list[dict]] = [[] for _ in spans]
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        at = launched.get(e.get("args", {}).get("correlation"))
        if at is None:
            continue
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0:  # (launched before the first step: not a step's)
            work[i].append(e)
    out = []
    for i, ((begin, end, name), acts) in enumerate(zip(spans, work, strict=True)):
        ctx, ctx_tokens, gen, gen_tokens = (int(x) for x in STEP.fullmatch(name).groups())
        step = {
            "context": ctx,
            "context_tokens": ctx_tokens,
            "generation": gen,
            "generation_tokens": gen_tokens,
            "period_us": spans[i + 1][0] - begin if i + 1 < len(spans) else None,
            "host_us": end - begin,
            **activity_figures(acts),
        }
        out.append(step)
    return out


def _kind(e: dict) -> str:
    return "memcpy_" + memcpy_direction(e["name"]) if e["cat"] == "gpu_memcpy" else e["cat"]


def timeline(acts: list[dict]) -> dict:
    """Span, busy, idle, the idle before host-to-device copies (summed, and
    the longest) of activities sorted by start (µs)."""
    busy = idle = before_htod = longest_before_htod = 0.0
    reach = acts[0]["ts"]
    for e in acts:
        begin, end = e["ts"], e["ts"] + e.get("dur", 0)
        gap = max(0.0, begin - reach)
        idle += gap
        if _kind(e) == "memcpy_HtoD":
            before_htod += gap
            longest_before_htod = max(longest_before_htod, gap)
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    return {
        "span_us": reach - acts[0]["ts"],
        "busy_us": busy,
        "idle_us": idle,
        "idle_before_htod_us": before_htod,
        "wait_max_us": longest_before_htod,
    }


def activity_figures(acts: list[dict]) -> dict:
    """Span, busy, idle and the kinds of one step's GPU activities, and the
    same of its largest launch (``graph_*``), µs."""
    if not acts:
        return {"activities": 0}
    acts = sorted(acts, key=lambda e: e["ts"])
    whole = timeline(acts)
    figures: dict = {"activities": len(acts), **whole}
    del figures["wait_max_us"]
    kinds: dict[str, list[float]] = {}
    launches: dict[object, list[dict]] = {}
    for e in acts:
        kinds.setdefault(_kind(e), []).append(e.get("dur", 0))
        launches.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    for kind, durs in kinds.items():
        figures[f"{kind}_n"] = len(durs)
        figures[f"{kind}_us"] = sum(durs)
    graph = max(launches.values(), key=len)  # (sorted: a group keeps the order)
    figures["graph_activities"] = len(graph)
    figures.update({f"graph_{k}": v for k, v in timeline(graph).items()})
    return figures


FIGURES = (
    "period_us",
    "host_us",
    "span_us",
    "busy_us",
    "idle_us",
    "idle_before_htod_us",
    "graph_span_us",
    "graph_idle_us",
    "graph_idle_before_htod_us",
    "graph_wait_max_us",
    "kernel_n",
    "kernel_us",
    "memcpy_HtoD_n",
    "memcpy_HtoD_us",
    "memcpy_DtoH_n",
    "memcpy_DtoH_us",
)


def decode_figures(all_steps: list[dict], concurrency: int) -> dict:
    """Medians over the steps that decode ``concurrency`` requests and fill no
    prompt (a step's missing kind counts 0)."""
    decode = [
        s
        for s in all_steps
        if s["context"] == 0 and s["generation"] == concurrency and s.get("activities")
    ]
    out: dict = {"steps": len(decode), "all_steps": len(all_steps)}
    for key in FIGURES:
        values = [s.get(key) or 0 for s in decode if key != "period_us" or s.get(key)]
        out[key] = round(statistics.median(values), 1) if values else None
        if key in MEANS:
            out["mean_" + key] = round(statistics.fmean(values), 1) if values else None
    return out


MEANS = (
    "period_us",
    "host_us",
    "span_us",
    "idle_us",
    "graph_span_us",
    "graph_idle_us",
    "graph_wait_max_us",
)
"""The figures whose means ``decode_figures`` gives too: a decode rate is a
mean step, and a few long waits move it where a median does not show them."""


def compact(events: list[dict], path: Path) -> None:
    """Write to ``path`` (gzip JSON) only what ``steps`` reads: the step
    annotations, the launches of GPU work, and the GPU activities, with
    short names and no other arguments. A decode trace's CPU side (every
    Python and aten call) is most of its bytes."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    used = {e.get("args", {}).get("correlation") for e in gpu}
    kept = []
    for e in events:
        cat = e.get("cat")
        step = cat == "user_annotation" and STEP.fullmatch(e["name"])
        launch = cat in LAUNCH_CATEGORIES and e.get("args", {}).get("correlation") in used
        if e.get("ph") != "X" or not (step or launch or cat in GPU_CATEGORIES):
            continue
        slim = {k: e[k] for k in ("ph", "cat", "ts", "dur") if k in e}
        slim["name"] = e["name"][:80]
        if "correlation" in e.get("args", {}):
            slim["args"] = {"correlation": e["args"]["correlation"]}
        kept.append(slim)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": kept}, f, separators=(",", ":"))


def summary_lines(cells: list[dict]) -> list[str]:
    """The ``prof`` cells' decode steps, and each shm cell's difference from the
    stock cell of its reference at the same concurrency: the whole step, then
    the forward's graph alone (the GPU's own idle, which the profiler's host
    overhead does not move)."""
    rows = [(c, int(conc), f) for c in cells for conc, f in (c.get("profile") or {}).items()]
    rows = [(c, conc, f) for c, conc, f in rows if f.get("steps")]
    if not rows:
        return []
    stock = {
        (c["cell"]["reference_key"], conc): f
        for c, conc, f in rows
        if c["cell"]["backend"] == "stock"
    }
    tables = (
        (
            "== GPU per decode step (torch profiler, medians, µs): span, busy, idle (stream "
            "waits and gaps), idle just before host-to-device copies, kernels and memcpys; "
            "'Δ' rows: shm or offload minus stock",
            (
                ("period", 7, ("period_us",)),
                ("span", 7, ("span_us",)),
                ("busy", 7, ("busy_us",)),
                ("idle", 7, ("idle_us",)),
                ("idle>HtoD", 9, ("idle_before_htod_us",)),
                ("kernels", 12, ("kernel_n", "kernel_us")),
                ("HtoD", 11, ("memcpy_HtoD_n", "memcpy_HtoD_us")),
                ("DtoH", 11, ("memcpy_DtoH_n", "memcpy_DtoH_us")),
            ),
        ),
        (
            "== The forward's CUDA graph alone (µs; median/mean): its span, its idle (the GPU's "
            "own: stream waits, stream memory operations, gaps between nodes), the idle before "
            "its host-to-device copies, its longest such wait; the step's mean period and its "
            "host execute_model (median/mean)",
            (
                ("period mean", 11, ("mean_period_us",)),
                ("host", 11, ("host_us", "mean_host_us")),
                ("graph span", 11, ("graph_span_us", "mean_graph_span_us")),
                ("graph idle", 11, ("graph_idle_us", "mean_graph_idle_us")),
                ("idle>HtoD", 9, ("graph_idle_before_htod_us",)),
                ("wait max", 9, ("graph_wait_max_us", "mean_graph_wait_max_us")),
            ),
        ),
    )
    lines: list[str] = []
    for title, columns in tables:

        def row(label: str, conc: int, n, f: dict, columns=columns) -> str:
            def v(key: str) -> str:
                x = f.get(key)
                return "-" if x is None else f"{x:.0f}"

            cols = " ".join(f"{'/'.join(v(k) for k in keys):>{w}}" for _, w, keys in columns)
            return f"{label:<34} {conc:>3} {n:>5} {cols}"

        head = " ".join(f"{name:>{w}}" for name, w, _ in columns)
        lines += ["", title, f"{'cell':<34} {'c':>3} {'steps':>5} {head}"]
        for c, conc, f in rows:
            lines.append(row(c["name"], conc, f["steps"], f))
            base = stock.get((c["cell"]["reference_key"], conc))
            if base is not None and c["cell"]["backend"] != "stock":
                delta = {
                    k: f[k] - base[k] if base.get(k) is not None else None
                    for k in f
                    if isinstance(f.get(k), (int, float))
                }
                lines.append(row("  Δ against stock", conc, "", delta))
    return lines
