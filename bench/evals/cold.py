#!/usr/bin/env python3
"""Serving from NVMe, cold and warm: every contender on the same trace ids.

One run, in this order:

1. a **memory holder** (a child process that allocates and touches
   ``--hold-gib`` GiB of anonymous memory, as the model and its KV cache do);
2. a **table** about ``--table-factor`` (2) × the memory left after that
   (``--table-gib`` sets it), FP8, 160-byte rows, 128 shards over 16 files,
   written by ``pleserver.devkit.synthetic`` into a temporary directory (``--dir``);
3. the **disk ceiling** on those files: ``pleserver._native.probe_random_reads``
   (4 KiB ``O_DIRECT`` random reads) at queue depths 1 / 64 / 128 / 256;
4. the **contenders**, each twice (decode, then prefill), each time from cold:
   the files' pages evicted (``posix_fadvise(DONTNEED)`` on every file, plus
   ``drop_caches`` with ``--drop-caches`` as root) and a fresh server:

   - ``mmap``: today's path (``pleserver serve --io mmap``, no prewarm);
   - ``seed``: the seed's gather (``bench/micro/seed_gather.py``) in this process;
   - ``direct`` / ``buffered``: the row cache and miss engine
     (``--io direct`` / ``--io buffered``).

   The workload comes from the real-text trace (``bench/sim/text_trace.py``,
   ``--trace``; its ids scaled onto the table's rows): ``--decode-steps``
   decode steps of 32 sequences × 16 ids, or ``--prefill-chunks`` prefill chunks
   of 2 048 tokens × 16 ids, sent by a ``PleClient`` to a real ``pleserver
   serve``. Each is timed cold, then once more untimed (warm-up) and timed
   again (warm);
5. the **hot set** (``--restart-modes``, default direct): ``--restart-steps``
   decode steps fill the cache, and the next as many are timed on the server
   that kept running, on one restarted with the hot set it saved, and on one
   restarted without it.

Reported per contender and phase: step latency (first request, p50 / p99 /
mean), misses per second (server stats; for mmap and the seed, the major page
faults) against the ceiling's QD-128 rate, hit rate, the 4 KiB reads that reached the disk
(``/proc/PID/io``), the daemon's RSS, the page cache's growth (``Cached`` in
``/proc/meminfo``) and the CPU that other processes used meanwhile; and the
ratios: cold decode / prefill speed-up over mmap mode, misses at % of the
ceiling. Everything it starts or writes goes at the end, also on an error,
Ctrl-C or SIGTERM.

    python -m bench.evals.cold --trace bench/traces/qwen-text.npz --hold-gib 12 --json cold.json
    python -m bench.evals.cold --table-gib 2 --hold-gib 1 --decode-steps 300 --prefill-chunks 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np

from bench.harness.checkout import REPO, TRACE
from bench.harness.load import DISK_PROBE
from bench.harness.provenance import OthersMeter, cpu_busy, envelope, loadavg
from bench.harness.scaffold import add_json, add_server_args, parser, save_json, work_dir
from bench.harness.servers import close_client
from bench.micro.seed_gather import SeedTable
from bench.sim.text_trace import HEADS, load_trace
from pleclient import PleClient
from pleclient.checkpoint import discover_tables
from pleserver.devkit.launcher import ServerLauncher, die_with_parent
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

CONTENDERS = ("mmap", "seed", "direct", "buffered")
SERVER_MODES = ("mmap", "direct", "buffered")
PROBE_DEPTHS = (1, 64, 128, 256)
GIB = 2**30
PAGE = 4096
SEQUENCES = 32
PREFILL_TOKENS = 2048
POSIX_FADV_DONTNEED = 4


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ------------------------------------------------------------ /proc readers
def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def proc_counters(pid: int) -> dict[str, int]:
    """Major faults and bytes read from storage by a process (all its threads,
    io_uring workers included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out = {"majflt": int(fields[9])}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, value = line.split(":")
                if key == "read_bytes":
                    out["read_bytes"] = int(value)
    except OSError:
        out["read_bytes"] = 0
    return out


# ------------------------------------------------------------ memory holder
HOLDER = textwrap.dedent("""
    import ctypes, mmap, sys
    import numpy as np
    ctypes.CDLL(None).prctl(1, 15)  # PR_SET_PDEATHSIG: SIGTERM when the bench dies
    size = int(sys.argv[1])
    m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE] = 1  # touch every page
    print("held", flush=True)
    sys.stdin.read()  # until the bench closes the pipe
""")


class MemoryHolder:
    """A child process holding ``size`` bytes of touched anonymous memory."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        line = self.proc.stdout.readline()
        if line.strip() != b"held":
            self.stop()
            raise RuntimeError(
                f"the memory holder could not hold {size / GIB:.1f} GiB "
                f"(exit {self.proc.returncode}); lower --hold-gib"
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ----------------------------------------------------------------- eviction
def evict(paths: list[str], drop_caches: bool) -> None:
    """Drop the files' pages from the page cache (none may be mapped then)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


# ------------------------------------------------------------------- server
def server_flags() -> set[str]:
    """The flags this checkout's ``pleserver serve`` knows."""
    out = subprocess.run(
        [sys.executable, "-m", "pleserver.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    ).stdout
    return {word.rstrip(",") for word in out.split() if word.startswith("--")}


# ------------------------------------------------------------------- runs
def latency(samples_s: list[float]) -> dict:
    a = np.asarray(samples_s) * 1e3
    return {
        "n": int(a.size),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "mean_ms": float(a.mean()),
        "max_ms": float(a.max()),
        "first_ms": float(a[0]),
        "total_s": float(a.sum() / 1e3),
    }


def table_io(stats: dict) -> dict:
    """The first table's native counters from a server's stats (none in mmap mode)."""
    tables = stats.get("tables") or [{}]
    return tables[0].get("io") or {}


class Contender:
    """One contender's lookup function and the process whose counters count."""

    def __init__(
        self,
        name: str,
        args,
        model: str,
        spec,
        workdir: str,
        flags: set[str],
        capacity: int,
        state_dir: str | None = None,
    ) -> None:
        self.name = name
        self.server = None
        self.client = None
        self.seed = None
        if name == "seed":
            self.seed = SeedTable.from_spec(spec, args.seed_workers)
            self.pid = os.getpid()
            self.fn = self.seed.gather
            return
        extra = list(args.server_arg)
        if "--io" in flags:
            extra += ["--io", name]
            if name != "mmap":
                if args.cache_size:
                    extra += ["--cache-size", args.cache_size]
                if args.queue_depth:
                    extra += ["--queue-depth", str(args.queue_depth)]
                if args.read_engine:
                    extra += ["--read-engine", args.read_engine]
        if "--state-dir" in flags:  # by default one that does not exist: no hot set kept
            extra += [
                "--state-dir",
                state_dir or os.path.join(workdir, f"state-{time.monotonic_ns()}"),
            ]
        extra += ["--max-capacity", str(capacity)]
        # A loaded machine may take long to open the tables: a generous wait.
        self.server = ServerLauncher(
            model,
            "--prewarm",
            "none",
            *extra,
            log_level="INFO",
            cwd=REPO,
            die_with_parent=True,
            ready_timeout=600.0,
        ).start()
        self.client = PleClient.connect(
            self.server.socket, timeout=600.0, name="cold", capacity=capacity
        )
        self.info = self.client.table(0)
        self.pid = self.server.pid
        self.fn = lambda ids, c=self.client, i=self.info: c.lookup(i, ids)

    def stats(self) -> dict:
        return self.client.stats() if self.client is not None else {}

    def close(self) -> None:
        close_client(self.client)
        self.client = None
        if self.server is not None:
            self.server.stop(timeout=60)  # a hot set to save
            self.server.close()
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        gc.collect()  # the seed's memmaps go with their last reference


def run_pass(contender: Contender, batches: np.ndarray, check=None) -> list[float]:
    """Every batch once, timed; ``check`` sees the first batch's rows after the
    pass (its file reads would otherwise warm pages the pass has yet to ask for)."""
    clock = time.perf_counter
    samples = []
    fn = contender.fn
    first = None
    for i in range(batches.shape[0]):
        t0 = clock()
        rows = fn(batches[i])
        samples.append(clock() - t0)
        if i == 0:
            first = np.array(rows, copy=True)
    if check is not None and first is not None:
        check(first, batches[0])
    return samples


def measured(contender: Contender, batches: np.ndarray, check=None) -> dict:
    """One timed pass with the counters around it."""
    meter = OthersMeter([] if contender.pid == os.getpid() else [contender.pid])
    c0, s0, m0 = proc_counters(contender.pid), contender.stats(), meminfo()
    meter.start()
    t0 = time.monotonic()
    samples = run_pass(contender, batches, check)
    wall = time.monotonic() - t0
    others = meter.stop()
    c1, s1, m1 = proc_counters(contender.pid), contender.stats(), meminfo()
    # the row cache's counters count misses in direct and buffered modes; in mmap
    # mode (and in the seed) a miss is a major page fault
    cached_modes = contender.name in ("direct", "buffered")
    io0, io1 = (table_io(s0), table_io(s1)) if cached_modes else ({}, {})
    ids = int(batches.size)
    out = {
        "latency": latency(samples),
        "wall_s": wall,
        "ids": ids,
        "others_cpu": others,
        "majflt": c1["majflt"] - c0["majflt"],
        "disk_reads_4k": (c1["read_bytes"] - c0["read_bytes"]) // PAGE,
        "cached_growth_bytes": m1["Cached"] - m0["Cached"],
    }
    if io1:
        hits = io1.get("hits", 0) - io0.get("hits", 0)
        misses = io1.get("misses", 0) - io0.get("misses", 0)
        out.update(
            misses=misses,
            hit_rate=hits / (hits + misses) if hits + misses else None,
            reads=io1.get("reads", 0) - io0.get("reads", 0),
            read_p50_s=io1.get("read_p50_s"),
            read_p99_s=io1.get("read_p99_s"),
            misses_from="server stats",
        )
    else:  # mmap mode and the seed: a miss is a major fault
        out.update(
            misses=out["majflt"],
            hit_rate=max(0.0, 1 - out["majflt"] / ids),
            misses_from="major faults",
        )
    out["misses_per_s"] = out["misses"] / wall if wall else None
    out["disk_reads_per_s"] = out["disk_reads_4k"] / wall if wall else None
    return out


def run_phase(
    name: str,
    batches: np.ndarray,
    args,
    model: str,
    spec,
    paths: list[str],
    workdir: str,
    flags: set[str],
    reference,
) -> dict:
    """Evict, start the contender, time it cold, warm it up, time it warm."""
    evict(paths, args.drop_caches)
    mem0 = meminfo()
    capacity = max(batches.shape[1], SEQUENCES * HEADS)
    contender = Contender(name, args, model, spec, workdir, flags, capacity)
    try:
        rss0 = proc_status(contender.pid)
        result = {"cold": measured(contender, batches, reference)}
        run_pass(contender, batches)  # warm-up
        result["warm"] = measured(contender, batches)
        rss1 = proc_status(contender.pid)
        mem1 = meminfo()
        stats = contender.stats()
        result.update(
            rss_bytes=rss1.get("VmRSS"),
            rss_peak_bytes=rss1.get("VmHWM"),
            rss_growth_bytes=rss1.get("VmRSS", 0) - rss0.get("VmRSS", 0),
            rss_anon_bytes=rss1.get("RssAnon"),
            rss_file_bytes=rss1.get("RssFile"),
            cached_growth_bytes=mem1["Cached"] - mem0["Cached"],
            process="bench (in-process)" if contender.server is None else "server",
        )
        if stats.get("dataplane"):
            plane = stats["dataplane"]
            result["dataplane"] = {k: plane.get(k) for k in ("io", "io_reason", "cache", "engine")}
        return result
    finally:
        contender.close()


def wait_refill(contender: Contender, timeout: float = 900.0) -> dict:
    """Until the server's hot-set refill has ended: its stats snapshot."""
    t0 = time.monotonic()
    while True:
        hot = contender.stats().get("hotset") or {}
        if hot.get("state") not in ("pending", "refilling"):
            return hot
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(
                f"{contender.name}: hot-set refill not over after {timeout:.0f} s: {hot}"
            )
        time.sleep(0.05)


def run_restart(
    name: str,
    steps: np.ndarray,
    args,
    model: str,
    spec,
    paths: list[str],
    workdir: str,
    flags: set[str],
) -> dict:
    """Hot-set persistence. The first half of ``steps`` fills the cache; the
    second half is timed on a server that kept running, on one restarted with
    the hot set it saved at stop, and on one restarted without (all from cold
    files)."""
    half = steps.shape[0] // 2
    fill, after = steps[:half], steps[half : 2 * half]
    capacity = steps.shape[1]
    state = os.path.join(workdir, f"hotset-{name}")
    os.makedirs(state)
    out = {"fill_steps": int(half), "timed_steps": int(after.shape[0])}

    def contender(state_dir=None) -> Contender:
        return Contender(name, args, model, spec, workdir, flags, capacity, state_dir)

    evict(paths, args.drop_caches)
    c = contender()
    try:
        run_pass(c, fill)
        out["continued"] = measured(c, after)
    finally:
        c.close()
    evict(paths, args.drop_caches)
    c = contender(state)
    try:
        run_pass(c, fill)
    finally:
        c.close()  # the server saves its hot set as it stops
    evict(paths, args.drop_caches)
    t0 = time.monotonic()
    c = contender(state)
    try:
        out["hotset"] = wait_refill(c)
        out["start_to_refilled_s"] = time.monotonic() - t0
        out["with_hotset"] = measured(c, after)
    finally:
        c.close()
    evict(paths, args.drop_caches)
    t0 = time.monotonic()
    c = contender()
    try:
        out["start_to_ready_s"] = time.monotonic() - t0
        out["without_hotset"] = measured(c, after)
    finally:
        c.close()
    return out


def native_module():
    """``pleserver._native``, or None when this checkout has not built it."""
    try:
        from pleserver import _native
    except ImportError:
        return None
    return _native


def ceiling(
    paths: list[str], seconds: float, kind: str, depths: tuple[int, ...] = PROBE_DEPTHS
) -> dict:
    """The probe at each of ``depths``, each in a child process with a time limit,
    so that a probe that never returns (it runs with the GIL released, where no
    signal handler runs) cannot wedge the benchmark."""
    if native_module() is None:
        return {
            "error": "pleserver._native is not built: run `python setup.py build_ext --inplace`"
        }
    out = {}
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for qd in depths:
        argv = [sys.executable, "-c", DISK_PROBE, json.dumps([paths, qd, seconds, kind])]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                cwd=REPO,
                env=env,
                timeout=seconds + 60,
                preexec_fn=die_with_parent,
            )
        except subprocess.TimeoutExpired:
            out[str(qd)] = {"error": f"the probe did not return within {seconds + 60:.0f} s"}
            say(f"  QD {qd:>3}: {out[str(qd)]['error']}")
            continue
        if done.returncode != 0:
            out[str(qd)] = {
                "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            }
            say(f"  QD {qd:>3}: probe failed: {out[str(qd)]['error']}")
            continue
        r = json.loads(done.stdout)
        cpu_us = 1e6 * r["cpu_s"] / r["reads"] if r.get("reads") else None
        out[str(qd)] = {
            "reads_per_s": r["reads_per_s"],
            "kind": r.get("kind"),
            "cpu_us_per_read": cpu_us,
        }
        say(
            f"  QD {qd:>3}: {r['reads_per_s']:,.0f} reads/s ({r.get('kind')}), "
            f"{'-' if cpu_us is None else f'{cpu_us:.2f}'} µs of CPU a read"
        )
    return out


# --------------------------------------------------------------------- main
def table_bytes(args) -> tuple[int, int]:
    """(table bytes, memory left after the holder)."""
    left = meminfo()["MemAvailable"]
    size = int(args.table_gib * GIB) if args.table_gib else int(args.table_factor * left)
    return size, left


def read_ahead_kb(path: str) -> int | None:
    """The read-ahead of the block device under ``path`` (what a page fault on
    a mapping without MADV_RANDOM reads around the faulting page)."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for queue in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(queue) as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def run(args, workdir: str) -> dict:
    trace = load_trace(args.trace)
    flags = server_flags()
    native = native_module()
    contenders = args.contenders or [
        c for c in CONTENDERS if c in ("mmap", "seed") or ("--io" in flags and native is not None)
    ]
    if set(contenders) - {"mmap", "seed"}:
        if "--io" not in flags:
            raise SystemExit(
                "this checkout's `pleserver serve` has no --io: only mmap and seed can run"
            )
        if native is None:
            raise SystemExit(
                "pleserver._native is not built: run `python setup.py "
                "build_ext --inplace` (or choose --contenders mmap,seed)"
            )
    result = {
        **envelope("cold"),
        "trace": {
            "path": os.path.basename(args.trace),
            "sha256": trace.sha256,
            "tokens": len(trace.ids),
            "rows": trace.rows,
        },
        "contenders": contenders,
        "read_ahead_kb": read_ahead_kb(workdir),
        "phases": {},
    }
    holder = None
    try:
        if args.hold_gib:
            say(f"holding {args.hold_gib} GiB ...")
            holder = MemoryHolder(int(args.hold_gib * GIB))
        size, left = table_bytes(args)
        row_bytes = 160
        rows = size // row_bytes
        free = shutil.disk_usage(workdir).free
        if size > free - GIB:
            raise SystemExit(
                f"a {size / GIB:.1f} GiB table does not fit in {workdir} "
                f"({free / GIB:.1f} GiB free): use --dir or --table-gib"
            )
        table = SyntheticTable(
            layer=0, rows=rows, cols=row_bytes, dtype="F8_E4M3", parts=args.parts
        )
        result["memory"] = {
            "held_bytes": holder.size if holder else 0,
            "available_after_hold_bytes": left,
            "total_bytes": meminfo()["MemTotal"],
        }
        result["table"] = {
            "rows": rows,
            "row_bytes": row_bytes,
            "dtype": "F8_E4M3",
            "parts": args.parts,
            "files": args.files,
            "bytes": rows * row_bytes,
            "x_memory_left": round(rows * row_bytes / left, 2),
        }
        model = os.path.join(workdir, "model")
        say(
            f"writing a {size / GIB:.2f} GiB table ({rows:,} rows, {args.parts} shards, "
            f"{args.files} files; {left / GIB:.1f} GiB available) ..."
        )
        t0 = time.monotonic()
        write_checkpoint(model, [table], files=args.files)
        result["table"]["write_s"] = round(time.monotonic() - t0, 1)
        spec = discover_tables(model)[0]
        paths = sorted(spec.files)

        say("disk ceiling (4 KiB O_DIRECT random reads) ...")
        result["ceiling"] = ceiling(paths, args.probe_seconds, args.probe_kind)

        decode = trace.decode_steps(SEQUENCES, rows=rows)[: args.decode_steps]
        prefill = trace.prefill_chunks(PREFILL_TOKENS, rows=rows)[: args.prefill_chunks]
        result["workload"] = {
            "decode": {"steps": int(decode.shape[0]), "ids_per_step": int(decode.shape[1])},
            "prefill": {"chunks": int(prefill.shape[0]), "ids_per_chunk": int(prefill.shape[1])},
        }
        reference = _reference(spec)
        for phase, batches in (("decode", decode), ("prefill", prefill)):
            if not batches.shape[0]:
                continue
            for name in contenders:
                say(f"{phase}: {name} ...")
                mine = (
                    batches[: args.seed_batches]
                    if name == "seed" and args.seed_batches
                    else batches
                )
                r = run_phase(name, mine, args, model, spec, paths, workdir, flags, reference)
                r["batches"] = int(mine.shape[0])
                result["phases"].setdefault(phase, {})[name] = r
                c, w = r["cold"], r["warm"]
                say(
                    f"  cold mean {c['latency']['mean_ms']:.2f} ms, misses {c['misses']:,} "
                    f"({c['misses_per_s']:,.0f}/s), warm mean {w['latency']['mean_ms']:.3f} ms"
                )
        restart_steps = trace.decode_steps(SEQUENCES, rows=rows)[: 2 * args.restart_steps]
        for name in [m for m in args.restart_modes if m in contenders]:
            if "--state-dir" not in flags:
                break
            say(f"restart with and without the hot set: {name} ...")
            result.setdefault("restart", {})[name] = run_restart(
                name, restart_steps, args, model, spec, paths, workdir, flags
            )
    finally:
        if holder is not None:
            holder.stop()
    result["loadavg_end"] = loadavg()
    result["cpu_busy_after"] = cpu_busy()
    result["ratios"] = ratios(result)
    return result


def _reference(spec):
    """A check on the first request of each timed pass: the rows equal the
    file's bytes, read with plain preads (not through any contender's path)."""
    shards = sorted((s for s in spec.shards if s.rows), key=lambda s: s.index)

    def check(rows: np.ndarray, ids: np.ndarray) -> None:
        for k in range(0, len(ids), max(1, len(ids) // 64)):
            row = int(ids[k])
            shard = shards[row // spec.shard_size]
            offset = shard.offset + (row - shard.index * spec.shard_size) * spec.row_bytes
            with open(shard.path, "rb") as f:
                want = os.pread(f.fileno(), spec.row_bytes, offset)
            if bytes(rows[k]) != want:
                raise RuntimeError(f"row {row} differs from the file (request index {k})")

    return check


def ceiling_rate(result: dict, qd: str) -> float | None:
    return ((result.get("ceiling") or {}).get(qd) or {}).get("reads_per_s")


def ratios(result: dict) -> dict:
    out = {}
    qd128 = ceiling_rate(result, "128")
    for phase, entries in result["phases"].items():
        base = entries.get("mmap", {}).get("cold", {}).get("latency", {}).get("mean_ms")
        for name, r in entries.items():
            c = r["cold"]
            o = out.setdefault(name, {})
            if base and name != "mmap":
                o[f"cold_{phase}_speedup_vs_mmap"] = round(base / c["latency"]["mean_ms"], 2)
            if qd128 and c.get("misses_per_s") is not None:
                o[f"cold_{phase}_misses_pct_of_qd128"] = round(100 * c["misses_per_s"] / qd128, 1)
    return out


def _gib(v) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def report(result: dict, stream=sys.stdout) -> None:
    w = lambda s="": print(s, file=stream)  # noqa: E731
    m, t, mem = result["machine"], result["table"], result["memory"]
    w(
        f"{m.get('model_name', '?')}, {m['cores']} cores, {m.get('ram_gib', '?')} GiB RAM, "
        f"kernel {m['kernel']}; commit {result['source']['commit']}; {m['date']}"
    )
    w(
        f"held {_gib(mem['held_bytes'])} GiB, {_gib(mem['available_after_hold_bytes'])} GiB "
        f"left; table {t['rows']:,} rows × {t['row_bytes']} B FP8 = {_gib(t['bytes'])} GiB "
        f"({t['x_memory_left']} × the memory left), {t['parts']} shards in {t['files']} files"
    )
    tr = result["trace"]
    w(
        f"trace {tr['path']} (sha256 {tr['sha256'][:12]}…), {tr['tokens']:,} tokens; "
        f"decode {result['workload']['decode']['steps']} steps × "
        f"{result['workload']['decode']['ids_per_step']} ids, prefill "
        f"{result['workload']['prefill']['chunks']} chunks × "
        f"{result['workload']['prefill']['ids_per_chunk']} ids"
    )
    ceil = result.get("ceiling", {})
    if "error" in ceil:
        w(f"disk ceiling: {ceil['error']}")
    else:
        w(
            "disk ceiling, 4 KiB O_DIRECT random reads/s: "
            + ", ".join(
                f"QD {qd} "
                + (
                    f"{v['reads_per_s']:,.0f} ({v['kind']})"
                    if "reads_per_s" in v
                    else f"failed: {v['error']}"
                )
                for qd, v in ceil.items()
            )
        )
    w()
    w(
        f"{'phase':<8} {'contender':<9} {'':<5} {'first ms':>9} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'mean ms':>9} "
        f"{'misses/s':>10} {'% QD128':>7} {'hit rate':>9} {'disk 4K/s':>10} {'others':>6}"
    )
    qd128 = ceiling_rate(result, "128")
    for phase, entries in result["phases"].items():
        for name, r in entries.items():
            for when in ("cold", "warm"):
                s = r[when]
                lat = s["latency"]
                pct = f"{100 * s['misses_per_s'] / qd128:.0f}" if qd128 else "-"
                hit = (
                    "-"
                    if s["hit_rate"] is None
                    else f"{100 * s['hit_rate']:.1f} %"
                    + ("*" if s["misses_from"] == "major faults" else "")
                )
                w(
                    f"{phase:<8} {name:<9} {when:<5} {lat.get('first_ms', float('nan')):>9.3f} "
                    f"{lat['p50_ms']:>9.3f} {lat['p99_ms']:>9.3f} "
                    f"{lat['mean_ms']:>9.3f} {s['misses_per_s']:>10,.0f} {pct:>7} {hit:>9} "
                    f"{s['disk_reads_per_s']:>10,.0f} {s['others_cpu']:>6.0%}"
                )
    w()
    w(
        f"{'phase':<8} {'contender':<9} {'RSS GiB':>8} {'peak':>6} {'anon':>6} "
        f"{'page cache +GiB':>15}  (after cold + warm)  row cache, miss engine"
    )
    for phase, entries in result["phases"].items():
        for name, r in entries.items():
            plane = r.get("dataplane") or {}
            cache, engine = plane.get("cache") or {}, plane.get("engine") or {}
            where = "  (bench process)" if r["process"] != "server" else ""
            if cache:
                where += (
                    f"  {_gib(cache.get('budget_bytes'))} GiB {cache.get('policy', '')}, "
                    f"{engine.get('kind')} QD {engine.get('queue_depth')}"
                    + (f" ({engine['fallback_reason']})" if engine.get("fallback_reason") else "")
                )
            w(
                f"{phase:<8} {name:<9} {_gib(r['rss_bytes']):>8} {_gib(r['rss_peak_bytes']):>6} "
                f"{_gib(r['rss_anon_bytes']):>6} {_gib(r['cached_growth_bytes']):>15}{where}"
            )
    w()
    for name, r in (result.get("restart") or {}).items():
        hot = r["hotset"]
        w(
            f"restart, {name}: {r['fill_steps']} decode steps fill the cache, the next "
            f"{r['timed_steps']} are timed; hot-set refill {hot.get('state')}, "
            f"{hot.get('done_rows', 0):,} rows in {hot.get('refill_seconds') or 0:.2f} s, "
            f"ready and refilled {r['start_to_refilled_s']:.2f} s after the start "
            f"(without: ready after {r['start_to_ready_s']:.2f} s)"
        )
        for label, key in (
            ("kept running", "continued"),
            ("restarted, hot set", "with_hotset"),
            ("restarted, none", "without_hotset"),
        ):
            s, lat = r[key], r[key]["latency"]
            hit = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f} %"
            w(
                f"  {label:<19} hit rate {hit:>7}  mean {lat['mean_ms']:8.3f} ms  "
                f"p99 {lat['p99_ms']:8.3f} ms  pass {s['wall_s']:7.2f} s"
            )
        w()
    w(
        "* mmap and seed: misses are major page faults; readahead (the seed's memmaps do not "
        "ask for random access) reads more than the faults: see disk 4K/s"
    )
    w(
        "ratios: "
        + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v}" for k, v in o.items())
            for name, o in result["ratios"].items()
            if o
        )
    )
    others = [
        s["others_cpu"]
        for e in result["phases"].values()
        for r in e.values()
        for s in (r["cold"], r["warm"])
    ]
    if max([result["cpu_busy_before"], result["cpu_busy_after"], *others, 0]) > 0.10:
        w("WARNING: other processes used > 10 % of the CPUs: re-run on a quiet machine")


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument(
        "--trace",
        default=TRACE,
        help="trace file from bench/sim/text_trace.py",
    )
    ap.add_argument("--dir", help="parent of the temporary table directory (default $TMPDIR)")
    ap.add_argument(
        "--hold-gib",
        type=float,
        default=0.0,
        help="memory the holder process takes, in GiB (default 0)",
    )
    ap.add_argument(
        "--table-gib",
        type=float,
        default=0.0,
        help="table size in GiB (default: --table-factor × the memory left)",
    )
    ap.add_argument("--table-factor", type=float, default=2.0)
    ap.add_argument("--parts", type=int, default=128, help="shards (default 128)")
    ap.add_argument("--files", type=int, default=16, help="checkpoint files (default 16)")
    ap.add_argument(
        "--contenders",
        type=lambda s: [c for c in s.split(",") if c],
        help=f"subset of {','.join(CONTENDERS)} (default: all this build has)",
    )
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=1000,
        help="decode steps of 32 sequences × 16 ids (default 1000)",
    )
    ap.add_argument(
        "--prefill-chunks",
        type=int,
        default=16,
        help="prefill chunks of 2048 tokens × 16 ids (default 16)",
    )
    ap.add_argument(
        "--restart-modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=["direct"],
        help="modes whose hot-set persistence is measured (default direct; '' for none)",
    )
    ap.add_argument(
        "--restart-steps",
        type=int,
        default=500,
        help="decode steps that fill the cache before the restart, and as "
        "many timed after it (default 500)",
    )
    ap.add_argument(
        "--cache-size",
        help="--cache-size for the direct/buffered servers (default: the server's own)",
    )
    ap.add_argument("--queue-depth", type=int, help="--queue-depth for the miss engine")
    ap.add_argument("--read-engine", help="--read-engine: io_uring | threads | auto")
    add_server_args(ap)
    ap.add_argument("--seed-workers", type=int, default=32)
    ap.add_argument(
        "--seed-batches",
        type=int,
        default=0,
        help="time the seed on only the first N decode steps and prefill chunks "
        "(0: all). Its memmaps take the device's read-ahead on every fault "
        "(read_ahead_kb: 8 MiB on some virtual disks), which can make a "
        "full pass take hours; per-batch figures stay comparable",
    )
    ap.add_argument(
        "--probe-seconds",
        type=float,
        default=2.0,
        help="seconds per queue depth of the disk probe (default 2)",
    )
    ap.add_argument(
        "--probe-kind",
        default="auto",
        choices=("auto", "io_uring", "threads"),
        help="the probe's read engine (default auto: io_uring, else threads)",
    )
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="also write 1 to /proc/sys/vm/drop_caches before each start (root)",
    )
    add_json(ap)
    args = ap.parse_args(argv)
    if args.contenders:
        unknown = set(args.contenders) - set(CONTENDERS)
        if unknown:
            ap.error(f"unknown contenders {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-cold-", args.dir) as workdir:
        result = run(args, workdir)
        report(result)
        save_json(result, args.json, indent=1)
        return 0


if __name__ == "__main__":
    sys.exit(main())
