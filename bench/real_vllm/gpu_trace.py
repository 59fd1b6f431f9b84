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
* ``period``: from its annotation's start to the next step's.

``decode_figures`` gives their medians over the steps that decode every
request and fill no prompt. Pure Python: the CPU test reads a trace written
the same way.
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
    for i, ((begin, _, name), acts) in enumerate(zip(spans, work, strict=True)):
        ctx, ctx_tokens, gen, gen_tokens = (int(x) for x in STEP.fullmatch(name).groups())
        step = {
            "context": ctx,
            "context_tokens": ctx_tokens,
            "generation": gen,
            "generation_tokens": gen_tokens,
            "period_us": spans[i + 1][0] - begin if i + 1 < len(spans) else None,
            **activity_figures(acts),
        }
        out.append(step)
    return out


def activity_figures(acts: list[dict]) -> dict:
    """Span, busy, idle and the kinds of one step's GPU activities (µs)."""
    if not acts:
        return {"activities": 0}
    acts = sorted(acts, key=lambda e: e["ts"])
    busy = idle = idle_before_htod = 0.0
    reach = acts[0]["ts"]
    kinds: dict[str, list[float]] = {}
    for e in acts:
        begin, end = e["ts"], e["ts"] + e.get("dur", 0)
        gap = max(0.0, begin - reach)
        idle += gap
        if e["cat"] == "gpu_memcpy":
            kind = "memcpy_" + memcpy_direction(e["name"])
            if kind == "memcpy_HtoD":
                idle_before_htod += gap
        else:
            kind = e["cat"]
        kinds.setdefault(kind, []).append(e.get("dur", 0))
        busy += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
    figures = {
        "activities": len(acts),
        "span_us": reach - acts[0]["ts"],
        "busy_us": busy,
        "idle_us": idle,
        "idle_before_htod_us": idle_before_htod,
    }
    for kind, durs in kinds.items():
        figures[f"{kind}_n"] = len(durs)
        figures[f"{kind}_us"] = sum(durs)
    return figures


FIGURES = (
    "period_us",
    "span_us",
    "busy_us",
    "idle_us",
    "idle_before_htod_us",
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
    return out


def summary_lines(cells: list[dict]) -> list[str]:
    """The ``prof`` cells' decode steps, and each shm cell's difference from the
    stock cell of its reference at the same concurrency."""
    rows = [(c, int(conc), f) for c in cells for conc, f in (c.get("profile") or {}).items()]
    rows = [(c, conc, f) for c, conc, f in rows if f.get("steps")]
    if not rows:
        return []
    stock = {
        (c["cell"]["reference_key"], conc): f
        for c, conc, f in rows
        if c["cell"]["backend"] == "stock"
    }
    lines = [
        "",
        "== GPU per decode step (torch profiler, medians, µs): span, busy, idle (stream waits "
        "and gaps), idle just before host-to-device copies, kernels and memcpys; "
        "'Δ' rows: shm or offload minus stock",
        f"{'cell':<34} {'c':>3} {'steps':>5} {'period':>7} {'span':>7} {'busy':>7} {'idle':>7} "
        f"{'idle>HtoD':>9} {'kernels':>12} {'HtoD':>11} {'DtoH':>11}",
    ]

    def row(label: str, conc: int, n, f: dict) -> str:
        def v(key: str) -> str:
            x = f.get(key)
            return "-" if x is None else f"{x:.0f}"

        return (
            f"{label:<34} {conc:>3} {n:>5} {v('period_us'):>7} {v('span_us'):>7} "
            f"{v('busy_us'):>7} {v('idle_us'):>7} {v('idle_before_htod_us'):>9} "
            f"{v('kernel_n') + '/' + v('kernel_us'):>12} "
            f"{v('memcpy_HtoD_n') + '/' + v('memcpy_HtoD_us'):>11} "
            f"{v('memcpy_DtoH_n') + '/' + v('memcpy_DtoH_us'):>11}"
        )

    for c, conc, f in rows:
        lines.append(row(c["name"], conc, f["steps"], f))
        base = stock.get((c["cell"]["reference_key"], conc))
        if base is not None and c["cell"]["backend"] != "stock":
            delta = {
                k: (f[k] - base[k]) if f.get(k) is not None and base.get(k) is not None else None
                for k in FIGURES
            }
            lines.append(row("  Δ against stock", conc, "", delta))
    return lines
