"""Where a vLLM step waits for its PLE rows: the steps of one measurement, read
from ple-server's lookup trace (``lookup_trace``, ``pleserver.observe.trace``).

On the GPU-driven route every PLE layer's lookup is rung on the stream when
the step starts (``pleclient.vllm_plugin.step``), so the server sees a step as
a burst of requests, one per PLE layer (more for a prefill larger than a
slot), admitted within microseconds of each other; the next step's burst comes
a step later. ``timeline`` cuts the trace of a measurement window into steps
at gaps of more than ``STEP_GAP_NS`` between admissions (once a step has
every table's lookup), and gives, per step:

* ``period``: from this step's first admission to the next step's: the step's
  own length as the server saw it (stock's length is its TPOT), its mean beside
  its quantiles (the decode rate pays the mean);
* per table (PLE layer, in table order), ``ready``: from the step's first
  admission until that layer's rows were in place. The layer waits when this
  passes the time the GPU takes to reach it: at the latest ``period`` itself,
  which is the wait the step cannot hide;
* per request, the server's time split into ``queue`` (admitted → its channel's
  turn: behind other requests), ``inline`` (turn → answered from the row
  cache by the loop) or ``worker`` (turn → handed to a gather worker for a
  miss → answered: the disk and the gather), ``probe`` being the part of a
  miss's time before its hand-off (the loop's look into the cache).

Each is reported as p50 / p99 / max in microseconds, with the share of steps
whose slowest layer was answered from disk. Pure Python and NumPy: the same
code reads the GPU host's traces and the CPU test's.
"""

from __future__ import annotations

import numpy as np

STEP_GAP_NS = 300_000
"""Admissions further apart than this start a new step (0.3 ms: a step's own
lookups are rung within microseconds, and a decode step takes 1.5 ms or more)."""


def _quantiles(values_ns: np.ndarray) -> dict | None:
    if len(values_ns) == 0:
        return None
    us = values_ns.astype(np.float64) / 1e3
    return {
        "n": len(us),
        # the mean beside the median: a step's mean length is what the decode
        # rate pays, and a few stalled steps move it and not the median
        "mean_us": round(float(us.mean()), 1),
        "p50_us": round(float(np.percentile(us, 50, method="inverted_cdf")), 1),
        "p99_us": round(float(np.percentile(us, 99, method="inverted_cdf")), 1),
        "max_us": round(float(us.max()), 1),
    }


def steps_of(records: np.ndarray, gap_ns: int = STEP_GAP_NS) -> list[np.ndarray]:
    """``records`` (one window's) in admission order, cut into steps: at a gap
    of more than ``gap_ns``, once the step so far has a request of every table
    (a loop busy with one layer's rows can admit the next layer's late, and
    that is still the same step)."""
    if len(records) == 0:
        return []
    ordered = records[np.argsort(records["started_ns"], kind="stable")]
    every_table = len(np.unique(ordered["table"]))
    cuts, begin = [], 0
    for at in np.flatnonzero(np.diff(ordered["started_ns"]) > gap_ns) + 1:
        if len(np.unique(ordered["table"][begin:at])) == every_table:
            cuts.append(int(at))
            begin = int(at)
    return np.split(ordered, cuts)


def timeline(records: np.ndarray, window_ns: tuple[int, int]) -> dict:
    """The steps of the requests admitted within ``window_ns`` (the harness's
    ``time.monotonic_ns()`` before and after a measurement)."""
    t0, t1 = window_ns
    inside = records[(records["started_ns"] >= t0) & (records["started_ns"] <= t1)]
    steps = steps_of(inside)
    if not steps:
        return {"steps": 0}
    first = np.array([s["started_ns"][0] for s in steps], dtype=np.int64)
    periods = np.diff(first)  # the last step has no next: no period
    tables = sorted({int(t) for t in inside["table"]})
    ready: dict[int, list[int]] = {t: [] for t in tables}
    slowest_from_disk = 0
    for step, start in zip(steps, first, strict=True):
        if step["handed_ns"][int(np.argmax(step["done_ns"]))] > 0:
            slowest_from_disk += 1
        for t in tables:
            of_table = step[step["table"] == t]
            if len(of_table):
                ready[t].append(int(of_table["done_ns"].max()) - int(start))
    turn = inside["turn_ns"]
    handed = inside["handed_ns"]
    from_disk = handed > 0
    return {
        "steps": len(steps),
        "requests": len(inside),
        "rows": int(inside["rows"].sum()),
        "period": _quantiles(periods),
        "ready": {str(t): _quantiles(np.array(v, dtype=np.int64)) for t, v in ready.items()},
        "step_ready": _quantiles(
            np.array([int(s["done_ns"].max()) - int(f) for s, f in zip(steps, first, strict=True)])
        ),
        "queue": _quantiles(turn - inside["started_ns"]),
        "inline": _quantiles((inside["done_ns"] - turn)[~from_disk]),
        "probe": _quantiles((handed - turn)[from_disk]),
        "worker": _quantiles((inside["done_ns"] - handed)[from_disk]),
        "from_disk_share": round(float(from_disk.mean()), 4),
        "slowest_from_disk_share": round(slowest_from_disk / len(steps), 4),
    }


def _ms(q: dict | None, key: str) -> str:
    return "-" if not q else f"{q[key] / 1e3:.2f}"


def summary_lines(cells: list[dict], stock_step_ms: dict[tuple[str, int], float]) -> list[str]:
    """The steps of every throughput repetition that has a timeline, beside
    stock's decode step of the same reference and concurrency
    (``stock_step_ms``: concurrency over its decode rate): a step's length
    over stock's is the time it lost."""
    rows = [
        (c, rep)
        for c in cells
        for rep in (c.get("throughput") or {}).get("reps", [])
        if (rep.get("steps") or {}).get("steps")
    ]
    if not rows:
        return []
    lines = [
        "",
        "== steps, from the server's lookup trace (ms): the step's length (first admission "
        "to the next step's) against stock's decode step (c over its decode tok/s); when "
        "its last PLE row was ready; "
        "the server's queue, and a miss's time at a gather worker (disk and gather)",
        f"{'cell':<34} {'rep':>3} {'c':>3} {'steps':>6} {'stock':>6} {'period mean/p50/p99':>20} "
        f"{'ready p50/p99/max':>20} {'queue p99':>9} {'worker p50/p99':>15} "
        f"{'disk %':>6} {'slow disk %':>11}",
    ]
    for c, rep in rows:
        s = rep["steps"]
        stock = stock_step_ms.get((c["cell"]["reference_key"], rep["concurrency"]))
        lines.append(
            f"{c['name']:<34} {rep['rep']:>3} {rep['concurrency']:>3} {s['steps']:>6} "
            f"{'-' if stock is None else f'{stock:.2f}':>6} "
            f"{'/'.join(_ms(s['period'], k) for k in ('mean_us', 'p50_us', 'p99_us')):>20} "
            f"{'/'.join(_ms(s['step_ready'], k) for k in ('p50_us', 'p99_us', 'max_us')):>20} "
            f"{_ms(s['queue'], 'p99_us'):>9} "
            f"{_ms(s['worker'], 'p50_us') + '/' + _ms(s['worker'], 'p99_us'):>15} "
            f"{100 * s['from_disk_share']:>6.1f} {100 * s['slowest_from_disk_share']:>11.1f}"
        )
    return lines
