#!/usr/bin/env python3
"""Per-call cost of the native bindings: the stable ABI (abi3) against the
interpreter's full C API, in one process, interleaved.

Builds the two native modules twice from this tree (``setup.py build_ext`` with
``PLESERVER_LIMITED_API=1`` and ``=0``, into a temporary directory), loads both
builds side by side (each .so has its own module state), and times, for each
build, calls that do little work besides crossing the binding:

- ``gather16``: ``TableSource.gather`` of 16 rows of 320 bytes from a mapped
  table (mmap mode: a copy from the page cache, no cache, no I/O);
- ``gather16-cache``: the same 16 rows from a ``RowCache`` (hits);
- ``load``, ``publish``: ``Words.load`` and ``Words.publish`` with no sleeper (no
  system call);
- ``wait``: ``Words.wait_while`` on a word that already differs (returns at
  once, GIL released and taken back).

Each round runs every (build, call) for ``--calls`` calls in a row, builds in
alternating order; the figure per call is the median over ``--rounds`` rounds,
and the ratio abi3 / full is the median of the rounds' ratios (load from other
processes hits both builds of a round alike). ``python-loop`` is the empty
loop's cost per iteration, included in every figure.

Timings on a busy machine cannot resolve a few percent, so the two builds'
machine code is compared too (``objdump -d``, addresses and call targets
normalized): for each binding function on these paths, whether abi3 and the
full API compiled to the same instructions, which no load can disturb. ``--build NAME=DIR`` adds
a prebuilt tree's modules (``DIR/pleserver/_native*.so``, ``DIR/pleclient/_sync*.so``).

    python -m bench.micro.abi3_overhead                     # ~1 min
    python -m bench.micro.abi3_overhead --rounds 40 --json out.json
"""

from __future__ import annotations

import glob
import importlib.util
import mmap
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.provenance import OthersMeter, loadavg, machine, source
from bench.harness.scaffold import add_json, parser, save_json

ROWS, ROW_BYTES, IDS = 4096, 320, 16
CALLS = ("gather16", "gather16-cache", "load", "publish", "wait")


def build(name: str, limited: bool, workdir: str) -> str:
    """The two modules built from this tree into ``workdir/name``."""
    out = os.path.join(workdir, name)
    env = dict(os.environ, PLESERVER_LIMITED_API="1" if limited else "0")
    subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--force",
            "--build-lib",
            out,
            "--build-temp",
            os.path.join(workdir, name + "-obj"),
        ],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    return out


def load(tree: str, package: str, module: str):
    """``package.module`` from the one .so of that name under ``tree``."""
    (path,) = glob.glob(os.path.join(tree, package, f"{module}*.so"))
    spec = importlib.util.spec_from_file_location(f"{package}.{module}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, os.path.basename(path)


class Build:
    """One build's objects and the calls to time."""

    def __init__(self, name: str, tree: str, table_path: str, segment: mmap.mmap) -> None:
        self.name = name
        self.native, native_file = load(tree, "pleserver", "_native")
        self.sync, sync_file = load(tree, "pleclient", "_sync")
        self.files = [native_file, sync_file]
        fd = os.open(table_path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            self.view = np.frombuffer(self.map, np.uint8)
            shard = [(fd, 0, ROWS, table_path, self.view.ctypes.data)]
            self.mapped = self.native.TableSource(1, ROW_BYTES, ROWS, shard, None, None, False)
            self.cache = self.native.RowCache(16 << 20, ROW_BYTES, hugepages=False)
            self.engine = self.native.ReadEngine(queue_depth=16, kind="threads", threads=1)
            self.cached = self.native.TableSource(
                2, ROW_BYTES, ROWS, [(fd, 0, ROWS, table_path, 0)], self.cache, self.engine, False
            )
        finally:
            os.close(fd)
        self.ids = np.random.default_rng(1).integers(0, ROWS, IDS, dtype=np.int64)
        self.out = np.empty((IDS, ROW_BYTES), np.uint8)
        self.cached.fill(self.ids)
        self.words = self.sync.Words(segment)
        self.words.store(0, 1)

    def check(self, reference: np.ndarray) -> None:
        for table in (self.mapped, self.cached):
            self.out.fill(0)
            table.gather(self.ids, self.out)
            assert np.array_equal(self.out, reference[self.ids]), self.name
        assert self.cached.gather_hits(self.ids, self.out) == 0, "rows not cached"

    def loop(self, call: str, n: int) -> float:
        """Nanoseconds per call over ``n`` calls."""
        ids, out, words = self.ids, self.out, self.words
        t0 = time.perf_counter_ns()
        if call == "gather16":
            f = self.mapped.gather
            for _ in range(n):
                f(ids, out)
        elif call == "gather16-cache":
            f = self.cached.gather
            for _ in range(n):
                f(ids, out)
        elif call == "load":
            f = words.load
            for _ in range(n):
                f(0)
        elif call == "publish":
            f = words.publish
            for _ in range(n):
                f(0, 1, 4)
        elif call == "wait":
            f = words.wait_while
            for _ in range(n):
                f(0, 0, 4, 0.0)
        return (time.perf_counter_ns() - t0) / n

    def close(self) -> None:
        self.words.release()
        for obj in (self.mapped, self.cached, self.engine, self.cache):
            obj.close()
        del self.view
        self.map.close()


# The bindings on the timed paths (and futex_waitv, the idle serving loop's).
BINDINGS = {
    "pleserver/_native": ("Source_gather", "Source_gather_hits", "Source_fill", "source_lookup"),
    "pleclient/_sync": (
        "Words_load",
        "Words_store",
        "Words_publish",
        "Words_wait_while",
        "Words_add",
        "word_at",
        "sync_futex_waitv",
    ),
}


def instructions(path: str) -> dict[str, list[str]]:
    """``objdump -d`` of a module: {function: [instruction]}, with addresses,
    offsets and call targets' addresses left out (they move between builds)."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True
    ).stdout
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        if m := re.match(r"^[0-9a-f]+ <([^>]+)>:$", line):
            current = found.setdefault(m.group(1), [])
        elif current is not None and (m := re.match(r"^\s+[0-9a-f]+:\s+(\S+)\s*(.*)$", line)):
            operands = re.sub(r"[0-9a-f]+ <([^>+]+)(\+0x[0-9a-f]+)?>", r"<\1>", m.group(2))
            operands = re.sub(r"-?0x[0-9a-f]+\(%rip\)|# <[^>]*>", "", operands)
            current.append(f"{m.group(1)} {operands}".strip())
    return found


def same_code(abi3: str, full: str) -> dict[str, str]:
    """Per binding function: "identical", or how the abi3 build differs."""
    result = {}
    for module, names in BINDINGS.items():
        (a,) = glob.glob(os.path.join(abi3, f"{module}*.so"))
        (b,) = glob.glob(os.path.join(full, f"{module}*.so"))
        code_a, code_b = instructions(a), instructions(b)
        for name in names:
            if name not in code_a or name not in code_b:
                result[name] = "inlined (not a function of its own)"
            elif code_a[name] == code_b[name]:
                result[name] = f"identical ({len(code_a[name])} instructions)"
            else:
                calls = sorted(
                    {i for i in code_a[name] if i.startswith("call")} - set(code_b[name])
                )
                result[name] = (
                    f"differs: {len(code_a[name])} instructions against {len(code_b[name])}"
                    + (f", abi3 adds {', '.join(calls)}" if calls else "")
                )
    return result


def empty_loop(n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        pass
    return (time.perf_counter_ns() - t0) / n


def main(argv=None) -> int:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=100_000, help="calls in a row per measure")
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR")
    add_json(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ple-abi3-") as work:
        trees = {"abi3": build("abi3", True, work), "full": build("full", False, work)}
        trees.update(dict(b.split("=", 1) for b in args.build))
        machine_code = same_code(trees["abi3"], trees["full"])
        table_path = os.path.join(work, "table.bin")
        reference = np.random.default_rng(0).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
        reference.tofile(table_path)
        segment = mmap.mmap(-1, 4096)
        builds = [Build(name, tree, table_path, segment) for name, tree in trees.items()]
        try:
            for b in builds:
                b.check(reference)
            times: dict[str, dict[str, list[float]]] = {
                b.name: {c: [] for c in CALLS} for b in builds
            }
            floor: list[float] = []
            meter = OthersMeter([])
            meter.start()
            for r in range(args.rounds):
                order = builds if r % 2 == 0 else builds[::-1]
                for call in CALLS:
                    for b in order:
                        times[b.name][call].append(b.loop(call, args.calls))
                floor.append(empty_loop(args.calls))
            others = meter.stop()
        finally:
            for b in builds:
                b.close()
            segment.close()
    result = {
        "machine": machine(),
        "source": source(),
        "loadavg": loadavg(),
        "others_cpu": others,
        "rounds": args.rounds,
        "calls": args.calls,
        "files": {b.name: b.files for b in builds},
        "python_loop_ns": round(statistics.median(floor), 1),
        "ns_per_call": {
            name: {c: round(statistics.median(v), 1) for c, v in per.items()}
            for name, per in times.items()
        },
    }
    ratios = {}
    for name in times:
        if name == "full":
            continue
        ratios[f"{name}/full"] = {
            c: round(
                statistics.median(
                    a / b for a, b in zip(times[name][c], times["full"][c], strict=True)
                ),
                3,
            )
            for c in CALLS
        }
    result["ratios"] = ratios
    result["machine_code"] = machine_code
    width = max(len(n) for n in times)
    print(f"ns per call, median of {args.rounds} rounds × {args.calls} calls")
    print(" " * width + "".join(f"{c:>16}" for c in CALLS))
    for name, per in result["ns_per_call"].items():
        print(f"{name:<{width}}" + "".join(f"{per[c]:>16.1f}" for c in CALLS))
    for name, per in ratios.items():
        print(f"{name}: " + ", ".join(f"{c} {per[c]:.3f}" for c in CALLS))
    print(f"python loop: {result['python_loop_ns']} ns per iteration (in every figure)")
    print("machine code of the bindings, abi3 against the full API:")
    for name, verdict in result["machine_code"].items():
        print(f"  {name}: {verdict}")
    print(f"other processes used {others:.0%} of the CPUs; loadavg {result['loadavg']}")
    save_json(result, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
