#!/usr/bin/env python3
"""The documentation's figures, made from the recorded results.

    python docs/figures/make.py              # (re)write docs/figures/*.svg
    python docs/figures/make.py --check      # exit 1 if a committed figure differs
    make figures                             # the same as the first

Reads ``docs/figures/data/`` (``--data``) and writes into ``docs/figures/``
(``--out``):

- ``architecture.svg``: vLLM workers, their shared-memory channels, the
  control socket, and ple-server's serving loop, row cache and miss engine
  over the checkpoint on NVMe (drawn here; no data);
- ``memory.svg``: a 121 GiB unified-memory host with the PLE table resident
  in vLLM and with ple-server (``memory.json``: sizes, each citing its
  source);
- ``lookup-latency.svg``: latency against rows per request, p50 and p99, for
  the in-process floor, the seed and pleserver (``lookup.json``: the shape
  ``bench/micro/lookup.py --json`` writes);
- ``northstar-steps.svg``: decode step times of the target case (PLE layer
  16, batch 32) with the table resident, in pinned host memory, and served
  from disk; ``northstar-ratios.svg``: every case's time against resident
  (``northstar-1.json``: ``bench/evals/northstar.py --json`` as written;
  ``sources.json`` corrects its commit).

``data/README.md`` says which command, commit and machine each data file
came from. Output is deterministic (``svg.py``): the same data give the same
bytes, and ``tests/test_figures.py`` checks that the committed figures are
what this script makes of the committed data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from svg import (  # noqa: E402
    BLUE,
    GREEN,
    GREY,
    INK,
    MUTED,
    ORANGE,
    SKY,
    VERMILION,
    YELLOW,
    Axis,
    Svg,
    duration_label,
    frame,
    text_width,
)


def load(data: Path, name: str) -> dict:
    with open(data / name, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------- architecture
def _box(
    svg: Svg,
    x: float,
    y: float,
    w: float,
    h: float,
    title: str,
    rows: list[str],
    fill: str = "#f6f8fa",
    stroke: str = INK,
) -> None:
    svg.rect(x, y, w, h, fill=fill, stroke=stroke, rx=6)
    svg.text(x + 10, y + 20, title, bold=True)
    svg.lines(x + 10, y + 38, rows, size=11.5, fill=MUTED)


def _channel(svg: Svg, x: float, y: float, extra: str | None) -> None:
    """A session's channel: a ring of slots, each ids then rows."""
    svg.rect(x, y, 220, 90, fill="#ffffff", stroke=INK, rx=6)
    svg.text(x + 10, y + 18, "channel: a ring of slots", size=12, bold=True)
    for i in range(4):
        sx = x + 12 + i * 52
        svg.rect(sx, y + 28, 12, 26, fill=ORANGE, stroke=INK)
        svg.rect(sx + 12, y + 28, 32, 26, fill=SKY, stroke=INK)
    svg.text(x + 12, y + 70, "ids | rows (page-aligned), in place", size=11, fill=MUTED)
    if extra:
        svg.text(x + 12, y + 84, extra, size=11, fill=MUTED)


def architecture(data: Path) -> Svg:
    svg = Svg(
        980,
        560,
        "pleserver's architecture",
        "vLLM workers put row ids into shared-memory rings; ple-server's serving loop answers "
        "from its row cache, or reads misses from NVMe through the miss engine, and writes the "
        "rows back into the same slots.",
    )
    svg.text(20, 40, "vLLM workers (every TP rank,", bold=True)
    svg.text(20, 56, "DP replica and instance)", bold=True)
    svg.text(300, 40, "shared memory: one sealed", bold=True)
    svg.text(300, 56, "memfd per session, no name", bold=True)

    workers = [
        ("vLLM worker, TP rank 0", ["pleclient, host path:", "submit ids, wait, rows"], None),
        (
            "vLLM worker, TP rank 1",
            ["a CUDA stream drives it: rings", "a doorbell, waits on done,", "inside CUDA graphs"],
            "+ doorbell, done and rung words",
        ),
        ("another vLLM instance", ["pleclient: same daemon,", "its own channel"], None),
    ]
    tops = [70, 190, 310]
    for (title, rows, extra), top in zip(workers, tops, strict=True):
        _box(svg, 20, top, 230, 90, title, rows)
        _channel(svg, 300, top, extra)
        svg.line(250, top + 30, 298, top + 30, arrow=True)
        svg.text(256, top + 24, "ids", size=11)
        svg.line(300, top + 62, 252, top + 62, arrow=True)
        svg.text(256, top + 76, "rows", size=11)
        svg.line(520, top + 45, 550, top + 45)
    # One serving loop over every channel.
    svg.line(550, tops[0] + 45, 550, tops[-1] + 45)
    svg.line(550, 130, 598, 130, arrow=True)

    svg.rect(580, 60, 380, 360, fill="#eef6fc", stroke=BLUE, stroke_width=1.5, rx=8)
    svg.text(594, 84, "ple-server: one daemon per host", bold=True, fill=BLUE)
    _box(
        svg,
        600,
        98,
        340,
        66,
        "serving loop: one thread, every channel",
        ["copies ids out, validates, answers hits inline;", "futex_waitv when idle; fair by rows"],
        fill="#ffffff",
    )
    _box(
        svg,
        600,
        200,
        160,
        80,
        "row cache",
        ["fixed budget, SIEVE;", "a hit: one native copy"],
        fill="#ffffff",
    )
    _box(
        svg,
        780,
        200,
        160,
        80,
        "miss engine",
        ["gather workers; io_uring,", "QD 128, O_DIRECT"],
        fill="#ffffff",
    )
    _box(svg, 600, 310, 160, 46, "hot set", ["its keys, refilled at start"], fill="#ffffff")
    _box(svg, 600, 364, 160, 46, "metrics port", ["/metrics /healthz /readyz"], fill="#ffffff")
    svg.line(680, 164, 680, 198, arrow=True)
    svg.text(688, 186, "hits", size=11)
    svg.line(860, 164, 860, 198, arrow=True)
    svg.text(868, 186, "misses", size=11)
    svg.line(780, 240, 762, 240, arrow=True)
    svg.line(680, 280, 680, 308, dash="3 3")
    svg.line(860, 280, 860, 448, arrow=True)
    svg.lines(868, 310, ["4 KiB reads,", "many in flight,", "deduplicated"], size=11, fill=MUTED)

    _box(
        svg,
        670,
        450,
        290,
        80,
        "NVMe: the checkpoint's PLE shards",
        ["44 GiB FP8, 95 GiB BF16, ≈ 25 GiB NVFP4;", "safetensors, read only"],
        fill="#fdf3e7",
        stroke=ORANGE,
    )

    _box(
        svg,
        20,
        450,
        500,
        80,
        "control: a Unix socket (ple.sock), msgpack frames",
        [
            "hello, catalog, open channel (its memfd passed over the socket), stats;",
            "who may connect: the peer's uid and gids (SO_PEERCRED)",
        ],
    )
    svg.line(135, 400, 135, 448, dash="4 3", arrow=True)
    svg.polyline([(520, 490), (640, 490), (640, 422)], stroke=INK, width=1, dash="4 3", arrow=True)
    return svg


# ---------------------------------------------------------------------- memory
KINDS = {
    # kind: fill, text colour, short name for inside the bar
    "system": (GREY, INK, "OS"),
    "vllm": (BLUE, "#ffffff", "weights + KV cache"),
    "table": (VERMILION, "#ffffff", "PLE table"),
    "row_cache": (GREEN, "#ffffff", "row cache"),
    "channels": (YELLOW, INK, "channels"),
    "page_cache": (SKY, INK, "page cache"),
    "reserve": ("#ffffff", MUTED, "reserve"),
}


def _gib(v: float) -> str:
    return f"{v:.0f} GiB" if v >= 10 else f"{v:g} GiB"


def memory(data: Path) -> Svg:
    d = load(data, "memory.json")
    host = float(d["host_gib"])
    scenarios = d["scenarios"]
    left, right, top, pitch, bar = 250, 900, 84, 70, 32
    height = top + pitch * len(scenarios) + 90
    svg = Svg(
        960,
        height,
        f"Memory of a {host:g} GiB unified-memory host",
        "Stacked bars of what uses the host's memory: vLLM with the PLE table resident, and "
        "vLLM with ple-server (row cache or budgeted prewarm, the table on NVMe).",
    )
    svg.text(
        20,
        30,
        f"A {host:g} GiB unified-memory host (DGX Spark, GX10): where the memory goes",
        size=15,
        bold=True,
    )
    x = Axis(0, host, left, right)
    axis_y = top + pitch * len(scenarios) - 20
    for v in x.steps(20):
        svg.line(x(v), top - 10, x(v), axis_y, stroke="#eaeef2")
        svg.text(x(v), axis_y + 18, f"{v:g}", size=12, anchor="middle", fill=MUTED)
    svg.line(x(host), top - 10, x(host), axis_y, stroke=INK, dash="4 3")
    svg.text(x(host), top - 16, f"{host:g} GiB", size=12, anchor="middle")
    svg.line(left, axis_y, right, axis_y, stroke=INK)
    svg.text((left + right) / 2, axis_y + 38, "GiB", anchor="middle")

    used_kinds: list[str] = []
    for i, sc in enumerate(scenarios):
        y = top + i * pitch
        svg.text(20, y + 14, sc["label"], bold=True)
        if sc.get("note"):
            svg.text(20, y + 30, sc["note"], size=11.5, fill=MUTED)
        fixed = sum(float(p["gib"]) for p in sc["parts"] if p["gib"] != "rest")
        if fixed > host:
            raise ValueError(
                f"{sc['label']}: its parts add up to {fixed:g} GiB, more than the host's "
                f"{host:g} GiB (docs/figures/data/memory.json)"
            )
        at = 0.0
        for part in sc["parts"]:
            kind = part["kind"]
            gib = host - fixed if part["gib"] == "rest" else float(part["gib"])
            fill, ink, short = KINDS[kind]
            x0, x1 = x(at), x(at + gib)
            dash = "3 2" if kind == "reserve" else None
            svg.rect(
                x0, y, x1 - x0, bar, fill=fill, stroke="#ffffff" if not dash else MUTED, dash=dash
            )
            for label in (f"{short} {_gib(gib)}", _gib(gib), f"{gib:.0f}"):
                if text_width(label, 12) + 8 <= x1 - x0:
                    svg.text((x0 + x1) / 2, y + 21, label, size=12, anchor="middle", fill=ink)
                    break
            if kind not in used_kinds:
                used_kinds.append(kind)
            at += gib

    # The legend: every kind the bars use, with its full name.
    ly = axis_y + 64
    lx = 20.0
    for kind in used_kinds:
        fill, _, _ = KINDS[kind]
        name = d["kinds"][kind]
        w = 18 + text_width(name, 12) + 22
        if lx + w > 940:
            lx, ly = 20.0, ly + 22
        svg.rect(lx, ly - 11, 12, 12, fill=fill, stroke=MUTED)
        svg.text(lx + 18, ly, name, size=12)
        lx += w
    return svg


# -------------------------------------------------------------- lookup latency
LOOKUP_SERIES = [
    # labels in the result file (first found wins), legend, colour
    (("floor",), "floor: numpy.take in the process", GREY),
    (("seed",), "seed: MmapPleTable.gather", VERMILION),
    (("pleserver-1f", "pleserver"), "pleserver: lookup (rows copied out)", BLUE),
    (("pleserver-view-1f", "pleserver-view"), "pleserver: zero-copy view of the slot", GREEN),
]


def rows(n: int) -> str:
    """A count with thin groups, as the docs write it: 131 072."""
    return f"{n:,}".replace(",", " ")


def short_duration(us: float) -> str:
    """A measured duration to three significant figures: 26.9 µs, 20.4 ms."""
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} µs"


def lookup_latency(data: Path) -> Svg:
    d = load(data, "lookup.json")
    sizes = sorted(int(s) for s in d["sizes"])
    svg = Svg(
        900,
        500,
        "Lookup latency against rows per request",
        "p50 and p99 latency of a lookup of uniformly random rows, by rows per request, for the "
        "in-process floor, the seed's mapped gather and pleserver over shared memory.",
    )
    svg.text(
        20, 28, "Lookup latency against rows per request (CPU, table in memory)", size=15, bold=True
    )
    x = Axis(sizes[0] / 1.6, sizes[-1] * 1.6, 90, 560, log=True)
    y = Axis(1, 1e6, 410, 70, log=True)
    frame(
        svg,
        x,
        y,
        [(s, rows(s)) for s in sizes],
        [(v, duration_label(v)) for v in y.decades()],
        "rows per request (log scale)",
        "latency (log scale)",
    )
    ly = 80
    for labels, name, color in LOOKUP_SERIES:
        label = next((lb for lb in labels if lb in d["sizes"][str(sizes[0])]), None)
        if label is None:
            continue
        pts = [(s, d["sizes"][str(s)][label]) for s in sizes if label in d["sizes"][str(s)]]
        svg.polyline([(x(s), y(e["p99_us"])) for s, e in pts], color, width=1.2, dash="5 4")
        svg.polyline([(x(s), y(e["p50_us"])) for s, e in pts], color, width=2)
        for s, e in pts:
            svg.circle(x(s), y(e["p50_us"]), 4, color)
        svg.line(585, ly - 4, 615, ly - 4, stroke=color, width=2)
        svg.circle(600, ly - 4, 4, color)
        svg.text(622, ly, name, size=12)
        (s0, first), (s1, last) = pts[0], pts[-1]
        svg.text(
            622,
            ly + 16,
            f"p50 {short_duration(first['p50_us'])} at {rows(s0)} rows, "
            f"{short_duration(last['p50_us'])} at {rows(s1)}",
            size=11,
            fill=MUTED,
        )
        ly += 44
    svg.line(585, ly - 4, 615, ly - 4, stroke=MUTED, width=2)
    svg.text(622, ly, "solid: p50", size=12)
    svg.line(585, ly + 14, 615, ly + 14, stroke=MUTED, width=1.2, dash="5 4")
    svg.text(622, ly + 18, "dashed: p99", size=12)

    t, m = d["table"], d["machine"]
    svg.lines(
        20,
        468,
        [
            f"bench.micro.lookup: {rows(t['rows'])} rows × {t['row_bytes']} B ({t['dtype']}, "
            f"{t['gib']} GiB, one file), uniformly random ids, no pause between requests",
            f"commit {d['source']['commit']}; {m['summary']}; {m['date'][:10]}",
        ],
        size=11,
        fill=MUTED,
    )
    return svg


# ------------------------------------------------------------------ north star
NORTHSTAR_PATHS = {
    "a": ("a: table resident on the GPU", GREY),
    "b": ("b: pinned host table over UVA", ORANGE),
    "e": ("e: pleserver, every PLE layer rung at step start", GREEN),
    "d": ("d: pleserver, rung one layer ahead (as vLLM does)", VERMILION),
}


def northstar_source(data: Path, d: dict) -> str:
    """The commit a north-star report was measured at, as ``sources.json`` corrects it."""
    fixed = load(data, "sources.json").get("northstar-1.json", {})
    if fixed.get("commit"):
        return f"commit {fixed['commit']}"
    src = d["source"]
    return f"commit {src['commit']}" + (" with uncommitted changes" if src.get("modified") else "")


def northstar_footnote(svg: Svg, y: float, data: Path, d: dict, what: str) -> None:
    m, t = d["machine"], d["table"]
    svg.lines(
        20,
        y,
        [
            f"bench.evals.northstar --part {d['args']['part']}: {what}; "
            f"{d['args']['layers']} layers, "
            f"≈ {d['cases'][0]['step_ms']:g} ms step; table {t['bytes'] / 2**30:.1f} GiB "
            f"{t['dtype']}, row cache {d['cache_bytes'] / 2**30:g} GiB, --io direct, "
            "each server cold",
            f"{m['device']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB; disk "
            f"{rows(round(d['disk']['128']['reads_per_s']))} reads/s at QD 128; "
            f"{northstar_source(data, d)}; {m['date'][:10]}",
        ],
        size=11,
        fill=MUTED,
    )


def northstar_steps(data: Path) -> Svg:
    d = load(data, "northstar-1.json")
    decode = [c for c in d["cases"] if c["kind"] == "decode"]
    case = next((c for c in decode if c["batch"] == 32 and c["ple_at"] == 16), decode[0])
    runs = {r["path"]: r for r in case["runs"] if r.get("step_ms")}
    steps = len(runs["a"]["step_ms"])
    top_ms = max(max(r["step_ms"]) for r in runs.values())
    svg = Svg(
        960,
        520,
        "North star: decode step times, table on disk against resident",
        "Per-step decode time on a GPU with the PLE table resident, in pinned host memory, and "
        "served by a cold pleserver from disk, rung at step start or one layer ahead.",
    )
    svg.text(
        20,
        28,
        f"Decode step times, PLE layer {case['ple_at']}, batch {case['batch']}: "
        "table on disk (cold ple-server) against resident",
        size=15,
        bold=True,
    )
    x = Axis(0, steps - 1, 70, 600)
    y = Axis(0, 2 * (int(top_ms / 2) + 1), 420, 70)
    frame(
        svg,
        x,
        y,
        [(v, f"{v:g}") for v in x.steps(10 ** len(str(steps // 10)) // 10 or 1)],
        [(v, f"{v:g} ms") for v in y.steps(2)],
        "decode step",
        "step time",
    )
    windows = case_windows(steps)
    for i, (lo, name) in enumerate(windows):
        if lo > 0:
            svg.line(x(lo - 0.5), y.p1, x(lo - 0.5), y.p0, stroke=MUTED, dash="2 3")
        hi = windows[i + 1][0] if i + 1 < len(windows) else steps
        if text_width(name, 11) + 8 <= x(hi) - x(lo):
            svg.text(x(lo) + 4, y.p1 + 14, name, size=11, fill=MUTED)
    a_steady = runs["a"]["windows"]["steady"]["mean"]
    ly = 90
    for path, (name, color) in NORTHSTAR_PATHS.items():
        if path not in runs:
            continue
        r = runs[path]
        svg.polyline(
            [(x(i), y(v)) for i, v in enumerate(r["step_ms"])],
            color,
            width=2.5 if path == "a" else 1,
            dash="5 3" if path == "b" else None,
        )
        steady = r["windows"]["steady"]["mean"]
        whole = r["windows"]["whole"]["mean"]
        dash = "5 3" if path == "b" else None
        svg.line(620, ly - 4, 650, ly - 4, stroke=color, width=2.5, dash=dash)
        svg.text(658, ly, name, size=12)
        svg.text(
            658,
            ly + 16,
            f"steady {steady:.2f} ms ({steady / a_steady:.3f} × a), whole {whole:.2f} ms",
            size=11,
            fill=MUTED,
        )
        ly += 46
    e = runs.get("e", {}).get("server") or {}
    if e:
        svg.lines(
            620,
            ly + 8,
            [
                f"from disk (path e): {e['misses_per_step']:.0f} first-touch misses a step,",
                f"read p50 {e['read_p50_ms']:.2f} ms, p99 {e['read_p99_ms']:.2f} ms",
            ],
            size=11,
            fill=MUTED,
        )
    northstar_footnote(svg, 484, data, d, f"decode, {steps} steps")
    return svg


def case_windows(steps: int) -> list[tuple[int, str]]:
    """bench/evals/northstar.py's decode windows: first 50, warming, steady (the last half)."""
    half = steps // 2
    if half <= 50:
        return [(0, "first 50"), (half, "steady")]
    return [(0, "first 50"), (50, "warming"), (half, "steady (the last half)")]


def case_label(case: dict) -> str:
    if case["kind"] == "decode":
        return f"decode, layer {case['ple_at']}, batch {case['batch']}"
    return f"prefill, layer {case['ple_at']}, {case['steps']} × {rows(case['batch'])} tokens"


def case_ratios(case: dict) -> dict[str, float]:
    """x / a per path: decode over the whole run, prefill the median prompt."""
    runs = {r["path"]: r for r in case["runs"] if r.get("step_ms")}

    def ms(r: dict) -> float:
        if case["kind"] == "decode":
            return r["windows"]["whole"]["mean"]
        return r["prompts"]["median_ms"]

    return {path: ms(r) / ms(runs["a"]) for path, r in runs.items() if path != "a"}


def northstar_ratios(data: Path) -> Svg:
    d = load(data, "northstar-1.json")
    order = {"decode": 0, "prefill": 1}
    cases = sorted(
        d["cases"], key=lambda c: (order[c["kind"]], c["batch"], c["steps"], -c["ple_at"])
    )
    paths = [p for p in ("b", "e", "d") if any(p in case_ratios(c) for c in cases)]
    group = 12 * len(paths) + 14
    top = 100
    height = top + group * len(cases) + 110
    svg = Svg(
        960,
        height,
        "North star: every case, x / a",
        "Each case's time against the resident table: decode over the whole run, prefill the "
        "median prompt, for the pinned host table and pleserver's two schedules.",
    )
    svg.text(
        20, 28, "Every case against the resident table (x / a; 1 = as fast)", size=15, bold=True
    )
    hi = max(v for c in cases for v in case_ratios(c).values())
    x = Axis(0.9, max(2.0, (int(hi * 2) + 1) / 2), 280, 900)
    bottom = top + group * len(cases)
    frame(
        svg,
        x,
        Axis(0, 1, bottom, top - 6),
        [(v, f"{v:g} ×") for v in x.steps(0.5)],
        [],
        "decode: mean step over the whole run; prefill: median prompt (of 3)",
        "",
    )
    svg.line(x(1), top - 6, x(1), bottom, stroke=INK)
    for i, case in enumerate(cases):
        gy = top + i * group + 7
        ratios = case_ratios(case)
        svg.text(20, gy + 6 * len(paths) + 4, case_label(case), size=12)
        for j, path in enumerate(paths):
            if path not in ratios:
                continue
            v = ratios[path]
            _, color = NORTHSTAR_PATHS[path]
            x0, x1 = sorted((x(1), x(v)))
            svg.rect(x0, gy + j * 12, max(x1 - x0, 1), 10, fill=color)
            svg.text(max(x(1), x(v)) + 4, gy + j * 12 + 9, f"{v:.3f}", size=10, fill=MUTED)
    lx, ly = 20.0, 56.0
    for path in paths:
        name, color = NORTHSTAR_PATHS[path]
        w = 18 + text_width(name, 12) + 24
        if lx + w > 940:
            lx, ly = 20.0, ly + 20
        svg.rect(lx, ly - 10, 12, 12, fill=color)
        svg.text(lx + 18, ly, name, size=12)
        lx += w
    northstar_footnote(svg, bottom + 64, data, d, f"{len(cases)} cases")
    return svg


FIGURES: dict[str, Callable[[Path], Svg]] = {
    "architecture.svg": architecture,
    "memory.svg": memory,
    "lookup-latency.svg": lookup_latency,
    "northstar-steps.svg": northstar_steps,
    "northstar-ratios.svg": northstar_ratios,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=HERE / "data", help="the recorded results")
    ap.add_argument("--out", type=Path, default=HERE, help="where the SVG files go")
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a figure in --out differs"
    )
    args = ap.parse_args(argv)
    stale = []
    for name, make in FIGURES.items():
        text = make(args.data).render()
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run `make figures`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
