"""The north-star benchmark: decode and prefill with the PLE table on disk, against resident.

One run, in this order (``bench/device_northstar.sh`` wraps it for the GPU host):

1. **the table**: an FP8 table of 160-byte rows, ``--table-factor`` (10.5) ×
   the row cache (``--cache-size``, default 1 GiB: 70 M rows, 10.5 GiB), 128
   shards in 16 safetensors files. Its content is made in memory, many threads
   at once (chunk c of 2²⁰ 64-bit words: PCG64 seeded ``[--seed, c]``), and
   written with large writes, one thread per file, then fsync'ed and dropped
   from the page cache. With ``--table-dir`` it is kept there and reused when
   its manifest and 256 sampled rows match (a second run on the same host
   skips the write);
2. **the disk**: 4 KiB ``O_DIRECT`` random reads over the table's files at
   queue depth 1 and 128 (``pleserver._native.probe_random_reads``, the probe
   of ``pleserver doctor``), ``--probe-seconds`` each;
3. **the trace**: ids from ``bench/sim/text_trace.py`` (real text, vLLM's hashing;
   ``--trace``), scaled onto the table's rows. Each case takes its own window
   of text, laid out over the trace in matrix order (no case reads text an
   earlier case read, while the trace lasts); its last tokens (three of the
   largest steps: 6 144 with 2 048-token chunks) are the warm-up text, never
   timed. A decode case of batch B and S steps is B
   sequences of S consecutive tokens decoded in lock step; a prefill case is
   ``--prompt-repeats`` prompts of k chunks of ``--chunk-tokens`` (2 048)
   consecutive tokens;
4. **the cases** (the matrix, below), each path of each case in turn. A path
   that talks to ``pleserver`` gets a server of its own, started cold:
   ``pleserver serve --io direct --cache-size …`` with a fresh, empty state
   directory (no hot set) and nothing prewarmed; it stops when the path ends.
   Before the timed steps each path builds its step (the eager warm-up steps
   and the CUDA graph capture of ``bench/gpu/decode.py``) and replays it once,
   all three steps on the warm-up text: the timed text's rows are never
   touched before they are timed.

**Engram** (``--trace bench/traces/engram-text.npz``, from
``bench/sim/engram_trace.py``: DeepSeek-V4.1-Flash's hash of the same text):
every case has the trace's two Engram layers (1 and 14; ``--ple-at`` does not
apply), each reading 24 rows a token (48 in all), and the table's rows are
256 bytes, an Engram row's FP8 values, which is what a cold Engram row reads
from disk (the server keeps its 8 bytes of scales resident). Both layers' ids
index one table (layer 14's past layer 1's rows, scaled together onto the
table): the reads are those of two tables of that size. The targets
(issue 30): steady decode ≤ 1.03 × a, and the step's stall (layer 1, one
layer of compute ahead of it) ≤ 1.2 × its physical bound.

The emulated model (``bench/gpu/decode.py``): ``--layers`` (32) decoder layers
``x = tanh(x @ W)``, W [H, H] BF16, H chosen so that one layer's matmul at
batch 32 takes ``step / layers`` (``--step-ms`` 7 → 219 µs, 40 → 1 250 µs, a
GB10-class step: H up to 65 536), and one PLE layer per case at
``--ple-at`` (1: the second layer, one layer of compute ahead of it; 16: the
middle) adding ``rows.view(tokens, 16 · 160).to(bf16) @ Wp``, its 16 ids per
token looked up in the table. A decode step's ids are fed into the static
input buffer from the trace (on the device) before each step.

The matrix (``--part``), each part sized for one device call of < 9 minutes
with the table written in it, server restarts included:

  part 1   decode at ≈ 7 ms: PLE layer 1 and 16 × batch 1, 32, 128, 1 000 steps
           (7 s a path resident; ≈ 17 s from disk at batch 128, whose ≈ 700–1 600
           first-touch reads a step keep the disk busy); prefill: PLE layer 1
           and 16 × prompts of 1 and 4 chunks of 2 048 tokens, 3 prompts a case
  part 2   decode at ≈ 40 ms: the same 6 cases, 250 steps (10 s a path)

1 000 steps give the 50 first steps, 450 warming and 500 steady ones (250:
50, 75, 125); a first-touch rate that still falls (text keeps bringing new
n-grams) shows in the per-window miss figures. The cases run with the
targets' first (decode at batch 32, then the 4-chunk prompts; then the 1-chunk
ones, batch 128, batch 1), so that a run cut short by ``--deadline-s`` (no path
starts that would end past it) loses the others.

Paths (``--paths``), in this order in each case:

  a                    the table resident on the GPU: ``index_select`` on a side
                       stream, one CUDA graph per step (the reference)
  b                    vLLM's ``cpu_offload``: a Triton kernel reading the
                       pinned host table over UVA, on a side stream
  prompt-ahead-arrival prefill: every chunk of a prompt hinted when it arrives,
                       then ``--queue-wait-ms`` of queue (a request waits for the
                       running step to end: 7 ms, one decode step), then as e
  prompt-ahead         prefill: chunks 2..n hinted when the prompt is scheduled
                       (as chunk 1 is enqueued), then as e
  e                    the GPU-driven channel (``pleclient.gpu``), every PLE
                       layer's lookup rung at the start of the step graph
                       (lookahead: a step's ids are known when it starts)
  d                    the GPU-driven channel, each PLE layer rung one layer
                       ahead (vLLM's ``_start_layer_ple_prefetch`` today)

Paths that talk to the server run from the most lookahead to the least, so
that if the disk (a virtual disk's host) kept what an earlier path read, it
could only favour the paths with less lookahead. At PLE layer 1, e and d have
the same schedule (both ring before layer 0): the pair shows the run-to-run
spread. The hint paths go through ``Hints``, which sends as the vLLM plugin's
prompt-ahead does (a thread of its own, chunk by chunk, each chunk's ids once,
``PleClient.hint`` waiting for slots). A 1-chunk prompt has no later chunk, so
prompt-ahead is e there and is not run.

Per-step times are GPU times: a CUDA event after every step, the steps of a
decode case enqueued back to back with no host synchronization (the graph
paths run under ``torch.cuda.set_sync_debug_mode("error")``; ``ahead`` counts
the steps still queued when the host had enqueued them all). A prefill prompt
starts on an idle GPU (one synchronization between prompts, outside any
step). Reported per decode case, mean ms per step over

  first 50   steps 0–49: the server's row cache holds only the warm-up's rows;
  warming    steps 50 to ⌊S/2⌋ − 1;
  steady     steps ⌊S/2⌋ to S − 1 (the second half; the issue's "steady");
  whole      all S steps,

(with fewer than 100 steps, "first 50" is the first quarter), each path's
ratio to a over the same window, and per prefill case each prompt's time (the
sum of its chunks) as median and first prompt, chunk 1 and chunks 2..n, and
the ratios to a. Every path's rows are checked against the table on the
device at sampled steps (decode: 0, 1, 49, S/4, S/2, 3S/4, S − 1; prefill:
every chunk), copied off as those steps ran: the rows of the cold run itself.

Miss figures per path, over its timed steps: misses and reads per step (the
server's counters before and after), the server's request time (p50 / p99 of
the difference of its histograms), its read latency (p50 / p99 over the
server's life: one case plus its warm-up), and from the kernel
(``/proc/diskstats`` of the disk under the table: every process's reads) the
mean read latency and the reads in flight (averaged over the steps' time, and
over the time the disk was busy). From the trace: each step's first-touch ids
(their row not in any earlier step nor the warm-up: a row cache that never
evicts misses exactly these; the server's count is printed beside it) per
window. The physical bound of a decode step's stall, the disk's own time for
the step's reads issued together (reads ÷ the rate at a queue depth of that
many reads, probed at depths 1, 8, 32 and 128 and interpolated between them;
past 128, the QD-128 rate), is printed beside the measured stall (x − a) per
window; reads per window are the trace's first-touch rows scaled by
the path's measured reads per first-touch row. Also: the CPU other processes
used during each path (``OthersMeter``), the commit, the machine.

Targets (issue 20; ≈ 7 ms step, batch 32): decode, PLE layer in the middle,
e / a ≤ 1.03 steady and ≤ 1.08 whole; PLE layer 1, e's steady stall ≤ 1.2 ×
its bound; prefill of a 4-chunk cold prompt ≤ 1.15 × a (prompt-ahead); every
path bit-exact, no host synchronization in the graph paths.

Without CUDA (or with ``--cpu``) the same run goes at a small size on the CPU:
the layers are CPU matmuls (``--hidden``, 256), a is ``index_select`` on the
table in memory, d and e are the GPU-driven channel's CPU stand-in
(``GpuLookups`` over ``HostStream``, the same words from the host) against the
same cold server, steps timed on the host clock; b is unavailable.

  python -m bench.evals.northstar --part 1 --json ns1.json       # GPU: decode ≈ 7 ms + prefill
  python -m bench.evals.northstar --part 2 --json ns2.json       # GPU: decode ≈ 40 ms
  python -m bench.evals.northstar --cpu                          # this box: ≈ 1 min
  python -m bench.evals.northstar --cpu --trace bench/traces/engram-text.npz
  bash bench/device_northstar.sh 1                         # on the GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bench.evals.cold import ceiling
from bench.gpu.decode import (
    Batch,
    GpuDriven,
    Model,
    SideGather,
    _driver,
    build_step,
    calibrate,
    no_host_sync,
    run_ops,
)
from bench.gpu.lookup import make_uva_kernel
from bench.harness.checkout import REPO, TRACE
from bench.harness.provenance import OthersMeter, machine, source
from bench.harness.servers import hist_quantiles
from bench.sim.text_trace import load_trace, trace_geometry
from pleclient import PleClient
from pleclient.checkpoint import INDEX_FILE, TableSpec, discover_tables
from pleclient.gpu import DEFAULT_GPU_OPS, GPU_OPS
from pleclient.vllm_plugin.prompt_ahead import SLOT_WAIT_S, unique_in_order
from pleserver.config import parse_size
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_safetensors

PATHS = ("a", "b", "prompt-ahead-arrival", "prompt-ahead", "e", "d")
SERVER_PATHS = ("prompt-ahead-arrival", "prompt-ahead", "e", "d")
HINT_PATHS = ("prompt-ahead-arrival", "prompt-ahead")
AT_STEP_START = ("prompt-ahead-arrival", "prompt-ahead", "e")
WINDOWS = ("first 50", "warming", "steady", "whole")
WARMUP_STEPS = 3  # two eager steps before the graph capture, one replay after it
PLE_ROW_BYTES = 160  # FP8, 160 columns: Qwen3.8-Flash-Next's rows
ENGRAM_ROW_BYTES = 256  # an Engram row's FP8 values: what a cold row reads (scales resident)
CHUNK_WORDS = 1 << 20  # 64-bit words of table content per generator stream (8 MiB)
TABLE_FORMAT = "northstar-table/1"
TARGET_BATCH = 32
H_CAP = 65536


def say(*parts) -> None:
    print(*parts, flush=True)


# ----------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Case:
    """One cell of the matrix. ``steps``: decode steps, or chunks per prompt."""

    kind: str  # decode | prefill
    step_ms: float  # the target step (sets H); CPU: 0
    ple_at: tuple[int, ...]  # its PLE (or Engram) layers
    batch: int  # decode: sequences; prefill: tokens per chunk
    steps: int  # decode: steps; prefill: chunks per prompt
    prompts: int = 1  # prefill: prompts, one after the other

    @property
    def layers(self) -> str:
        return "+".join(str(i) for i in self.ple_at)

    @property
    def key(self) -> str:
        step = f"{self.step_ms:g} ms" if self.step_ms else "cpu"
        if self.kind == "decode":
            return f"decode L{self.layers} b{self.batch} {step} {self.steps} steps"
        return f"prefill L{self.layers} {self.steps}x{self.batch} {step} {self.prompts} prompts"

    @property
    def tokens(self) -> int:
        """Tokens of text the case times."""
        return self.batch * self.steps * self.prompts


PARTS = {
    # part → (decode step ms, decode steps, prefill?)
    "1": ((7.0,), (1000,), True),
    "2": ((40.0,), (250,), False),
}


def matrix(args) -> tuple[list[Case], list[Case]]:
    """(every case of the full matrix in order, the cases this run runs). The
    text windows are laid out over the full matrix, so a case reads the same
    text whichever part runs it."""
    parts = ["1", "2"] if args.part == "all" else [args.part]
    cases: list[Case] = []
    run: list[Case] = []
    for name in ("cpu",) if args.cpu else ("1", "2"):
        if name == "cpu":
            steps_ms, steps, prefill = (0.0,), (args.steps or 120,), True
        else:
            steps_ms, steps, prefill = PARTS[name]
            if args.step_ms:
                steps_ms = tuple(args.step_ms)
            if args.steps:
                steps = (args.steps,) * len(steps_ms)
        mine: list[Case] = []
        for step_ms, n in zip(steps_ms, steps, strict=True):
            for ple in args.ple_at:
                mine += [Case("decode", step_ms, ple, b, n) for b in args.batches]
        if prefill and args.prompts:
            for ple in args.ple_at:
                mine += [
                    Case("prefill", steps_ms[0], ple, args.chunk_tokens, k, args.prompt_repeats)
                    for k in args.prompts
                ]
        cases += mine
        if name == "cpu" or name in parts:
            run += mine
    return cases, sorted(run, key=first_the_targets)


def first_the_targets(case: Case) -> int:
    """Run order: the targets' cases first (decode at batch 32, then the
    4-chunk prompts), so that a run cut short by --deadline-s loses others;
    then the 1-chunk prompts, the largest batches, the rest."""
    if case.kind == "prefill":
        return 1 if case.steps > 1 else 2
    return 0 if case.batch == TARGET_BATCH else 3 if case.batch > TARGET_BATCH else 4


# ------------------------------------------------------------------ the table
def table_content(rows: int, row_bytes: int, seed: int, threads: int) -> np.ndarray:
    """The table's bytes, uint8 [rows, row_bytes]: chunk c of CHUNK_WORDS words
    from PCG64 seeded [seed, c], bytes that would be an FP8 NaN (0x7F, 0xFF)
    flipped in their lowest bit. Made by ``threads`` threads (NumPy releases
    the GIL in the generator and the ufuncs)."""
    if (rows * row_bytes) % 8:
        raise ValueError(f"{rows} rows × {row_bytes} B is not a whole number of 64-bit words")
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    words = out.reshape(-1).view(np.uint64)

    def fill(c: int) -> None:
        a, b = c * CHUNK_WORDS, min((c + 1) * CHUNK_WORDS, words.size)
        words[a:b] = np.random.PCG64([seed, c]).random_raw(b - a)
        part = out.reshape(-1)[8 * a : 8 * b]
        nan = np.bitwise_and(part, 0x7F)
        np.equal(nan, 0x7F, out=nan.view(np.bool_))
        np.bitwise_xor(part, nan, out=part)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(math.ceil(words.size / CHUNK_WORDS))))
    return out


def write_table(model_dir: str, spec: SyntheticTable, data: np.ndarray, files: int) -> None:
    """The checkpoint of ``pleserver.devkit.synthetic.write_checkpoint`` (its layout:
    a small non-PLE tensor first, shards spread over the files, the global
    scale last, an index and config.json) with ``data`` as the rows; one
    thread per file, 64 MiB writes, each file fsync'ed and dropped from the
    page cache."""
    os.makedirs(model_dir, exist_ok=True)
    per_file: list[list] = [[] for _ in range(files)]
    per_file[0].append(("model.embed_tokens.weight", "BF16", (3, 5), bytes(30)))
    size = math.ceil(spec.rows / spec.parts)
    flat = data.reshape(-1)
    step = 64 << 20

    def producer(lo: int, n: int):
        a, b = lo * spec.row_bytes, (lo + n) * spec.row_bytes
        return lambda: (memoryview(flat[i : min(i + step, b)]) for i in range(a, b, step))

    for i, n in enumerate(spec.shard_rows()):
        name = f"{spec.name}.shard_{i}.weight"
        per_file[i * files // spec.parts].append(
            (name, spec.dtype, (n, spec.cols), producer(i * size, n))
        )
    scale = spec.global_scale()
    assert scale is not None  # FP8 has one
    per_file[-1].append((f"{spec.name}.{scale[0]}", "F32", (), struct.pack("<f", scale[1])))
    names = [f"model-{k + 1:05d}-of-{files:05d}.safetensors" for k in range(files)]

    def write(k: int) -> None:
        path = os.path.join(model_dir, names[k])
        write_safetensors(path, per_file[k])
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(files) as pool:
        list(pool.map(write, range(files)))
    weight_map = {name: names[k] for k, tensors in enumerate(per_file) for name, *_ in tensors}
    with open(os.path.join(model_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        ple = {k: getattr(spec, k) for k in ("layer", "rows", "cols", "dtype", "parts")}
        json.dump({"ple_tables": [ple]}, f, indent=1)


def sample_rows_match(spec: TableSpec, data: np.ndarray, count: int, seed: int) -> bool:
    """Whether ``count`` random rows of the files equal ``data`` (plain preads)."""
    rng = np.random.default_rng(seed)
    shards = sorted((s for s in spec.shards if s.rows), key=lambda s: s.index)
    for row in rng.integers(0, spec.rows, count).tolist():
        shard = shards[row // spec.shard_size]
        offset = shard.offset + (row - shard.index * spec.shard_size) * spec.row_bytes
        fd = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.pread(fd, spec.row_bytes, offset) != data[row].tobytes():
                return False
        finally:
            os.close(fd)
    return True


def prepare_table(args, workdir: str) -> tuple[TableSpec, np.ndarray, dict]:
    """The table on disk and in memory, written or reused; what happened."""
    rows = args.rows
    spec = SyntheticTable(
        layer=0, rows=rows, cols=args.row_bytes, dtype="F8_E4M3", parts=args.parts
    )
    manifest = {
        "format": TABLE_FORMAT,
        "rows": rows,
        "row_bytes": args.row_bytes,
        "dtype": spec.dtype,
        "parts": args.parts,
        "files": args.files,
        "seed": args.seed,
        "chunk_words": CHUNK_WORDS,
    }
    model_dir = os.path.join(args.table_dir or workdir, "model")
    t0 = time.monotonic()
    data = table_content(rows, args.row_bytes, args.seed, os.cpu_count() or 1)
    info: dict = {"content_s": round(time.monotonic() - t0, 1), "dir": model_dir}
    manifest_path = os.path.join(model_dir, "northstar.json")
    try:
        with open(manifest_path) as f:
            reuse = json.load(f) == manifest
        if reuse:
            table = discover_tables(model_dir, fingerprint=False)[0]
            reuse = table.rows == rows and sample_rows_match(table, data, 256, args.seed)
    except (OSError, ValueError, IndexError, KeyError):
        reuse = False
    if reuse:
        info["written"] = False
    else:
        free = shutil.disk_usage(os.path.dirname(model_dir) or ".").free
        if data.nbytes > free - (1 << 30):
            raise SystemExit(
                f"a {data.nbytes / 2**30:.1f} GiB table does not fit in {model_dir} "
                f"({free / 2**30:.1f} GiB free): use --table-dir or a smaller --table-factor"
            )
        shutil.rmtree(model_dir, ignore_errors=True)
        t0 = time.monotonic()
        write_table(model_dir, spec, data, args.files)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        info.update(written=True, write_s=round(time.monotonic() - t0, 1))
    table = discover_tables(model_dir)[0]
    info.update(
        rows=table.rows,
        row_bytes=table.row_bytes,
        dtype=table.dtype,
        parts=table.parts,
        files=len(table.files),
        bytes=table.rows * table.row_bytes,
    )
    return table, data, info


# --------------------------------------------------------------- the disk
def block_device(path: str) -> tuple[str | None, str]:
    """The /proc/diskstats name of the disk under ``path``, and how it was found:
    the file system's own device, else the device its mount names, else the
    only disk the machine has."""
    with open("/proc/diskstats") as f:
        stats = {(int(v[0]), int(v[1])): v[2] for v in map(str.split, f)}
    st = os.stat(path)
    if (name := stats.get((os.major(st.st_dev), os.minor(st.st_dev)))) is not None:
        return name, "the file system's device"
    best, fstype, source = "", "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount, after = fields[4], fields[fields.index("-") + 1 :]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, fstype, source = mount, after[0], after[1]
    if source.startswith("/dev/") and os.path.basename(source) in stats.values():
        return os.path.basename(source), f"the device of the mount {best}"
    disks = [
        d
        for d in os.listdir("/sys/block")
        if not d.startswith(("loop", "ram", "zram", "dm-", "md", "sr")) and d in stats.values()
    ]
    if fstype == "overlay" and len(disks) == 1:  # a container's root: its layers are on it
        return disks[0], "the machine's only disk, under the overlay root"
    return None, f"none: {path} is on {fstype} {source} and the machine has disks {disks}"


def diskstats(device: str | None) -> dict | None:
    """The kernel's read counters of ``device``: reads completed, ms spent in
    reads (summed over reads), ms the device was busy."""
    if device is None:
        return None
    with contextlib.suppress(OSError), open("/proc/diskstats") as f:
        for line in f:
            v = line.split()
            if v[2] == device:
                return {"reads": int(v[3]), "read_ms": int(v[6]), "busy_ms": int(v[12])}
    return None


def disk_delta(d0: dict | None, d1: dict | None, wall_s: float) -> dict | None:
    if d0 is None or d1 is None:
        return None
    reads, read_ms, busy_ms = (d1[k] - d0[k] for k in ("reads", "read_ms", "busy_ms"))
    return {
        "reads": reads,
        "mean_read_ms": read_ms / reads if reads else None,
        "in_flight_avg": read_ms / (wall_s * 1e3) if wall_s else None,
        "in_flight_busy": read_ms / busy_ms if busy_ms else None,
    }


# --------------------------------------------------------------- the trace
class Text:
    """The trace's ids on this table, and a window of text for every case."""

    def __init__(self, path: str, rows: int, cases: list[Case]) -> None:
        self.trace = load_trace(path)
        self.ids = self.trace.scaled_ids(rows)
        # the tail is warm-up text: enough for the largest step's warm-up
        self.end = len(self.ids) - WARMUP_STEPS * max(c.batch for c in cases)
        if self.end <= 0:
            raise SystemExit(f"the trace {path} has too few tokens ({len(self.ids)})")
        self.start: dict[Case, int] = {}
        self.wrapped: list[str] = []
        self.touched: dict[Case, tuple[np.ndarray, np.ndarray]] = {}
        cursor = 0
        for case in cases:
            if case.tokens > self.end:
                raise SystemExit(
                    f"{case.key} needs {case.tokens} tokens, the trace has {self.end}: "
                    "fewer steps or prompts"
                )
            if cursor + case.tokens > self.end:
                cursor = 0
                self.wrapped.append(case.key)
            self.start[case] = cursor
            cursor += case.tokens

    def timed(self, case: Case) -> np.ndarray:
        """int64 [steps, the case's layers, ids per step and layer] of the case's
        window. Decode: ``batch`` sequences of ``steps`` tokens in lock step;
        prefill: the chunks."""
        a = self.start[case]
        steps = case.steps * case.prompts if case.kind == "prefill" else case.steps
        return self.layered(self.ids[a : a + case.tokens], case, steps)

    def warmup(self, case: Case) -> np.ndarray:
        """int64 [WARMUP_STEPS, layers, ids] from the warm-up text."""
        ids = self.ids[self.end : self.end + WARMUP_STEPS * case.batch]
        return self.layered(ids, case, WARMUP_STEPS)

    def layered(self, ids: np.ndarray, case: Case, steps: int) -> np.ndarray:
        """Consecutive tokens' ids [tokens, heads] as [steps, layers, ids]: each
        of the case's layers its own block of the trace's columns (a PLE
        trace's one block serves any PLE layer), a decode step a token of each
        of ``batch`` sequences, a prefill step a chunk."""
        per = self.trace.heads // self.trace.layers
        blocks = [self.block_of(layer) for layer in case.ple_at]
        cols = np.concatenate([np.arange(b * per, (b + 1) * per) for b in blocks])
        x = ids[:, cols].reshape(-1, len(blocks), per)  # [tokens, layers, ids]
        if case.kind == "prefill":
            x = x.reshape(steps, -1, len(blocks), per)  # [chunks, tokens, layers, ids]
        else:
            x = x.reshape(case.batch, steps, len(blocks), per).transpose(1, 0, 2, 3)
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(steps, len(blocks), -1))

    def block_of(self, layer: int) -> int:
        """The trace's column block of ``layer``'s ids."""
        if self.trace.layers == 1:
            return 0
        layer_ids = self.trace.meta["geometry"]["layer_ids"]
        if layer not in layer_ids:
            raise SystemExit(f"the trace {self.trace.path} has no ids of layer {layer}")
        return layer_ids.index(layer)

    def first_touch(self, case: Case) -> tuple[np.ndarray, np.ndarray]:
        """``first_touch`` of the case's timed steps after its warm-up."""
        if case not in self.touched:
            warm, timed = self.warmup(case), self.timed(case)
            self.touched[case] = first_touch(
                warm.reshape(len(warm), -1), timed.reshape(len(timed), -1)
            )
        return self.touched[case]


def first_touch(warm: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step: ids whose row no earlier step and no warm-up step had (what a
    cache that never evicts misses, duplicates counted), and their rows."""
    count, n = steps.shape
    flat = steps.reshape(-1)
    rows, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    first_step = first // n
    fresh = ~np.isin(rows, warm)
    new_rows = np.bincount(first_step[fresh], minlength=count)
    step_of = np.arange(flat.size) // n
    missed = fresh[inverse] & (first_step[inverse] == step_of)
    new_ids = np.bincount(step_of[missed], minlength=count)
    return new_ids, new_rows


def windows(count: int) -> dict[str, tuple[int, int]]:
    """Step ranges [a, b) of the reported windows for ``count`` decode steps."""
    half = count // 2
    first = 50 if count >= 100 else max(1, count // 4)
    return {
        "first 50": (0, first),
        "warming": (first, half),
        "steady": (half, count),
        "whole": (0, count),
    }


def summarize(values: list[float] | np.ndarray, spans: dict[str, tuple[int, int]]) -> dict:
    out = {}
    for name, (a, b) in spans.items():
        part = np.asarray(values[a:b], dtype=np.float64)
        out[name] = (
            {
                "steps": int(part.size),
                "mean": float(part.mean()),
                "p50": float(np.percentile(part, 50)),
                "p90": float(np.percentile(part, 90)),
            }
            if part.size
            else {"steps": 0, "mean": None, "p50": None, "p90": None}
        )
    return out


# ----------------------------------------------------------------- the rig
class Clock:
    """When each step ended: a CUDA event per step (GPU time), or the host clock."""

    def __init__(self, count: int, cuda: bool) -> None:
        self.cuda = cuda
        self.ends: list = [None] * count
        self.starts: dict[int, object] = {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, step: int) -> None:
        """Step ``step`` starts a run of steps (not after step - 1)."""
        self.starts[step] = self._now()

    def end(self, step: int) -> None:
        self.ends[step] = self._now()

    def queued(self) -> int | None:
        return sum(not e.query() for e in self.ends) if self.cuda else None

    def step_ms(self) -> list[float]:
        out = []
        for s, end in enumerate(self.ends):
            start = self.starts.get(s, self.ends[s - 1] if s else None)
            if self.cuda:
                out.append(start.elapsed_time(end))
            else:
                out.append((end - start) * 1e3)
        return out


class HostGather:
    """a on the CPU: ``index_select`` from the table in memory, at the use."""

    capturable = False

    def __init__(self, batch: Batch, table: torch.Tensor) -> None:
        self.batch, self.table = batch, table

    def start(self, j: int) -> None:
        pass

    def collect(self, j: int) -> None:
        torch.index_select(self.table, 0, self.batch.ids[j], out=self.batch.rows[j])


class Unavailable(Exception):
    """A path that cannot run here; the text says why."""


class ColdServer:
    """``pleserver serve --io direct`` on the table: a fresh, empty state
    directory (no hot set), nothing prewarmed; checked to be cold and direct."""

    def __init__(self, model_dir: str, args, workdir: str) -> None:
        self.state = tempfile.mkdtemp(prefix="state-", dir=workdir)
        self.launched = ServerLauncher(
            model_dir,
            "--io",
            "direct",
            "--cache-size",
            args.cache_size,
            "--state-dir",
            self.state,
            "--hotset-save-interval",
            "0",
            "--prewarm",
            "none",
            "--max-capacity",
            str(args.capacity),
            # Room for a whole prompt's hinted rows (4 chunks × 2 048 tokens ×
            # 16 ids = 131 072): the default queue holds half of that.
            "--hint-queue-rows",
            str(HINT_QUEUE_ROWS),
            log_level="WARNING",
            cwd=REPO,
            die_with_parent=True,
            ready_timeout=300.0,
        ).start()
        stats = self.stats()
        plane = stats.get("dataplane") or {}
        cache = plane.get("cache") or {}
        if plane.get("io") != "direct" or cache.get("used_rows", 1) != 0:
            self.close()
            raise RuntimeError(
                f"the server is not a cold direct-I/O server: io {plane.get('io')!r} "
                f"({plane.get('io_reason')}), {cache.get('used_rows')} rows cached; "
                "put the table on a file system that takes O_DIRECT (--table-dir)"
            )
        self.cache_bytes = cache.get("budget_bytes")

    @property
    def socket(self) -> str:
        return self.launched.socket

    @property
    def pid(self) -> int:
        return self.launched.pid

    def stats(self) -> dict:
        return PleClient.query_stats(self.launched.socket, timeout=30.0)

    def close(self) -> None:
        self.launched.close()
        shutil.rmtree(self.state, ignore_errors=True)


HINT_QUEUE_ROWS = 1 << 20
"""The servers' ``--hint-queue-rows``: every hinted row of a prompt queued."""
HINT_DEPTH = 16
"""Slots of the hint session: 16 × ``--capacity`` ids in flight at once."""


class Hints:
    """Prefetch hints for the prompt-ahead paths, sent the way the vLLM
    plugin's prompt-ahead sends them (``pleclient.vllm_plugin.prompt_ahead``):
    by a thread of their own, chunk by chunk in prompt order, each chunk's ids
    once, waiting for a hint slot to come back (``PleClient.hint(wait=…)``).
    The caller, in the scheduler's place, only hands the prompt over: its host
    time per call is kept, and the time until the thread sent the last id."""

    def __init__(self, socket_path: str, table: str, capacity: int) -> None:
        self.table = table
        self.client = PleClient.connect(
            socket_path, name="northstar-hints", capacity=capacity, depth=HINT_DEPTH
        )
        self.via = "PleClient.hint from a thread (the plugin's prompt-ahead)"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hints")
        self.calls_ms: list[float] = []
        self.sent_ms: list[float] = []
        self.ids = 0

    def hint(self, chunks: np.ndarray) -> None:
        """Hint the rows of ``chunks`` (one id array per chunk, in order)."""
        t0 = time.perf_counter()
        self.pool.submit(self._send, chunks, t0)
        self.calls_ms.append((time.perf_counter() - t0) * 1e3)

    def _send(self, chunks: np.ndarray, t0: float) -> None:
        for chunk in chunks:
            ids = unique_in_order(np.asarray(chunk).reshape(-1))
            self.client.hint(self.table, ids, wait=SLOT_WAIT_S)
            self.ids += ids.size
        self.sent_ms.append((time.perf_counter() - t0) * 1e3)

    def drain(self) -> None:
        """Wait until every prompt handed over was sent."""
        self.pool.submit(lambda: None).result()

    @property
    def skipped(self) -> int:
        return self.client.hints_skipped

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()


@dataclass
class Rig:
    """What every case shares."""

    args: argparse.Namespace
    cuda: bool
    device: str
    table: TableSpec
    model_dir: str
    workdir: str
    table_dev: torch.Tensor  # a's table, and the reference of the checks
    pinned: torch.Tensor | None  # b's table (None on the CPU)
    uva: object
    why_not_b: str | None
    models: dict = field(default_factory=dict)  # step ms → (Model, H, layer µs)
    cache_bytes: int | None = None


def model_for(rig: Rig, case: Case) -> Model:
    """The case's model: one per step size, the PLE layer set per case."""
    if case.step_ms not in rig.models:
        args = rig.args
        if rig.cuda:
            hidden, layer_us = calibrate(case.step_ms * 1e3 / args.layers, TARGET_BATCH, H_CAP)
        else:
            hidden, layer_us = args.hidden, cpu_layer_us(args.hidden, TARGET_BATCH)
        model = Model(
            hidden,
            args.layers,
            1,
            rig.table.cols,
            torch.float8_e4m3fn,
            [0],
            device=rig.device,
            ids_per_token=args.ids_per_layer,
        )
        rig.models[case.step_ms] = (model, hidden, layer_us)
        step = f"a {case.step_ms:g} ms step" if case.step_ms else "the CPU"
        say(
            f"model for {step}: {args.layers} layers, H = {hidden}, "
            f"{layer_us:.0f} µs per layer matmul at batch {TARGET_BATCH}"
        )
    model = copy.copy(rig.models[case.step_ms][0])
    model.ple_at = {layer: j for j, layer in enumerate(case.ple_at)}
    return model


def cpu_layer_us(hidden: int, tokens: int, iters: int = 20) -> float:
    w = torch.randn(hidden, hidden, dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    x @ w
    t0 = time.perf_counter()
    for _ in range(iters):
        x @ w
    return (time.perf_counter() - t0) * 1e6 / iters


def open_lookups(rig: Rig, socket_path: str, per_layer: int):
    """A GPU-driven session (the CPU stand-in on the CPU) and the table's info."""
    from pleclient.gpu import GpuLookups, stream_memops_supported

    if rig.cuda:
        ok, why = stream_memops_supported(torch.device(rig.device))
        if not ok:
            raise Unavailable(f"no stream memory operations: {why}")
    gl = GpuLookups.open(
        socket_path,
        device=rig.device,
        capacity=rig.args.capacity,
        depth=per_layer,
        timeout=60.0,
        name="northstar",
        ops=rig.args.gpu_ops,
    )
    if rig.cuda and gl.ops != rig.args.gpu_ops:
        gl.close()  # a fallback passed off as the ops asked for would mislabel every figure
        raise Unavailable(f"--gpu-ops {rig.args.gpu_ops}: {gl.ops} would run (see the log)")
    info = next((t for t in gl.tables if t.name == rig.table.name), None)
    if info is None:
        gl.close()
        raise RuntimeError(f"the server lists no table {rig.table.name}")
    return gl, info


def make_path(name: str, batch: Batch, rig: Rig, lookups, info, per_layer: int):
    if name == "a":
        if not rig.cuda:
            return HostGather(batch, rig.table_dev)
        table = rig.table_dev
        return SideGather(batch, lambda ids, out: torch.index_select(table, 0, ids, out=out))
    if name == "b":
        uva, pinned = rig.uva, rig.pinned
        return SideGather(batch, lambda ids, out: uva(pinned, ids, out))  # type: ignore[operator]
    path = GpuDriven(batch, lookups, info, rig.args.capacity, per_layer, side=False)
    path.capturable = rig.cuda
    return path


def build(path, ops, batch: Batch, model: Model, cuda: bool):
    """The step as callables (graph replays on CUDA), after the warm-up steps
    0 and 1 of ``batch.id_sets``; then one more (step 2) to settle it."""
    if cuda:
        pieces, graphs = build_step(path, ops, batch, model)
    else:
        for s in range(2):
            batch.feed(s)
            run_ops(ops, path, batch, model)
        pieces, graphs = [lambda: run_ops(ops, path, batch, model)], []
    batch.feed(2)
    for piece in pieces:
        piece()
    sync(cuda)
    return pieces, graphs


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# ----------------------------------------------------------------- one run
@dataclass
class Run:
    case: str
    path: str
    unavailable: str | None = None
    error: str | None = None
    steps: int = 0
    step_ms: list[float] = field(default_factory=list)
    windows: dict = field(default_factory=dict)  # decode: window → stats of step ms
    prompts: dict = field(default_factory=dict)  # prefill: prompt figures
    exact: bool | None = None
    checked_steps: int = 0
    sync_checked: bool = False
    ahead: int | None = None
    wall_s: float = 0.0
    server: dict | None = None
    disk: dict | None = None
    trace: dict | None = None
    bound: dict | None = None
    hints: dict | None = None
    others_cpu: float | None = None


def why_not(case: Case, name: str, rig: Rig) -> str | None:
    """Why ``name`` does not run in ``case`` ("" when it is no path of its kind)."""
    if name == "b":
        return rig.why_not_b
    if name not in HINT_PATHS:
        return None
    if case.kind != "prefill":
        return ""  # hints are for prompts
    if name == "prompt-ahead" and case.steps == 1:
        return "a 1-chunk prompt has no later chunk to hint: the same as e"
    return None


def run_path(case: Case, name: str, rig: Rig, text: Text) -> Run:
    """One path of one case: its own cold server (for the server's paths), the
    warm-up on other text, the timed steps, the checks and the figures."""
    run = Run(case.key, name)
    with PathRun(case, name, rig, text, run) as pr:
        try:
            pr.open()
            if case.kind == "decode":
                pr.time_decode()
            else:
                pr.time_prefill()
            pr.figures()
        except Unavailable as exc:
            run.unavailable = str(exc)
        except Exception as exc:  # report it, go on with the next path
            run.error = f"{type(exc).__name__}: {exc}"
            if pr.server is not None:
                run.error += f"; server log: {pr.server.launched.log_tail(600)}"
    return run


class PathRun:
    """The parts of ``run_path``; leaving the ``with`` block frees them all."""

    def __init__(self, case: Case, name: str, rig: Rig, text: Text, run: Run) -> None:
        self.case, self.name, self.rig, self.text, self.run = case, name, rig, text, run
        self.cuda = rig.cuda
        self.n = case.batch * rig.args.ids_per_layer  # ids per step and PLE layer
        self.per_layer = math.ceil(self.n / rig.args.capacity)  # slots per PLE layer
        self.server: ColdServer | None = None
        self.lookups = self.hints = None
        self.pieces: list = []
        self.graphs: list = []

    def open(self) -> None:
        """Server, session, step: built and settled on the warm-up text."""
        rig, name = self.rig, self.name
        model = model_for(rig, self.case)
        info = None
        if name in SERVER_PATHS:
            self.server = ColdServer(rig.model_dir, rig.args, rig.workdir)
            rig.cache_bytes = self.server.cache_bytes
            self.lookups, info = open_lookups(
                rig, self.server.socket, self.per_layer * len(self.case.ple_at)
            )
            if name in HINT_PATHS:
                self.hints = Hints(self.server.socket, rig.table.name, rig.args.capacity)
        warm = self.device_ids(self.text.warmup(self.case))
        self.batch = Batch(
            model, self.case.batch, rig.table.row_bytes, rig.table.rows, 0, id_sets=warm
        )
        self.path = make_path(name, self.batch, rig, self.lookups, info, self.per_layer)
        ops = model.schedule(at_step_start=name in AT_STEP_START)
        self.pieces, self.graphs = build(self.path, ops, self.batch, model, self.cuda)
        self.timed = self.text.timed(self.case)
        self.batch.id_sets = self.device_ids(self.timed)  # from now on: the timed text
        count = self.count = self.timed.shape[0]
        if self.case.kind == "decode":
            marks = {0, 1, min(49, count - 1), count // 4, count // 2, (3 * count) // 4, count - 1}
            self.samples = sorted(marks)
        else:
            self.samples = list(range(count))
        self.snaps = torch.empty(
            (len(self.samples), *self.batch.rows.shape), dtype=torch.uint8, device=rig.device
        )
        self.slot_of = {s: k for k, s in enumerate(self.samples)}
        self.clock = Clock(count, self.cuda)
        self.strict = self.cuda and self.path.capturable

    def device_ids(self, ids: np.ndarray) -> torch.Tensor:
        """[steps, PLE layers, ids] on the device."""
        return torch.from_numpy(ids).to(self.rig.device)

    def step(self, s: int) -> None:
        """Enqueue step ``s`` (no host synchronization on CUDA)."""
        self.batch.feed(s)
        for piece in self.pieces:
            piece()
        self.clock.end(s)
        if s in self.slot_of:  # the rows as this step left them, checked later
            self.snaps[self.slot_of[s]].copy_(self.batch.rows)

    @contextlib.contextmanager
    def measured(self):
        """Counters and CPU use around the timed steps."""
        s0 = self.server.stats() if self.server else None
        d0 = diskstats(self.rig.args.disk_device)
        meter = OthersMeter([self.server.pid] if self.server else [])
        meter.start()
        t0 = time.monotonic()
        yield
        sync(self.cuda)
        if self.hints is not None:
            self.hints.drain()
        run = self.run
        run.wall_s = time.monotonic() - t0
        run.others_cpu = meter.stop()
        d1 = diskstats(self.rig.args.disk_device)
        if self.server is not None:
            run.server = server_delta(s0, self.server.stats(), self.count)
            run.disk = disk_delta(d0, d1, run.wall_s)

    def time_decode(self) -> None:
        """Every step enqueued back to back."""
        with self.measured():
            with no_host_sync(self.strict):
                self.clock.begin(0)
                for s in range(self.count):
                    self.step(s)
            self.run.ahead = self.clock.queued()

    def time_prefill(self) -> None:
        """Each prompt on an idle GPU: arrival (hints, the queue), then its chunks."""
        k, name, timed = self.case.steps, self.name, self.timed
        with self.measured():
            for p in range(self.case.prompts):
                sync(self.cuda)
                chunks = slice(p * k, (p + 1) * k)
                with no_host_sync(self.strict):
                    if name == "prompt-ahead-arrival":  # the prompt arrives, then waits
                        self.hints.hint(timed[chunks].reshape(k, -1))
                        time.sleep(self.rig.args.queue_wait_ms / 1e3)
                    elif name == "prompt-ahead":  # scheduled: chunk 1 runs next
                        later = slice(p * k + 1, (p + 1) * k)
                        self.hints.hint(timed[later].reshape(k - 1, -1))
                    self.clock.begin(p * k)
                    for s in range(p * k, (p + 1) * k):
                        self.step(s)

    def figures(self) -> None:
        run, case, rig = self.run, self.case, self.rig
        run.sync_checked = self.strict
        run.steps = self.count
        run.step_ms = [round(x, 4) for x in self.clock.step_ms()]
        run.exact = all(
            bool(
                torch.equal(
                    self.snaps[k], table_rows(rig, self.batch.id_sets[s], self.snaps[k].shape)
                )
            )
            for k, s in enumerate(self.samples)
        )
        run.checked_steps = len(self.samples)
        new_ids, new_rows = self.text.first_touch(case)
        if case.kind == "decode":
            spans = windows(self.count)
            run.windows = summarize(run.step_ms, spans)
            run.trace = {
                w: {
                    "misses_per_step": float(new_ids[a:b].mean()) if b > a else None,
                    "new_rows_per_step": float(new_rows[a:b].mean()) if b > a else None,
                }
                for w, (a, b) in spans.items()
            }
        else:
            run.prompts = prompt_figures(run.step_ms, case)
            run.trace = {
                "misses_per_chunk": float(new_ids.mean()),
                "new_rows_per_chunk": float(new_rows.mean()),
            }
        run.trace.update(misses=int(new_ids.sum()), new_rows=int(new_rows.sum()))
        if self.hints is not None:
            run.hints = {
                "via": self.hints.via,
                "calls": len(self.hints.calls_ms),
                "ids": self.hints.ids,
                "skipped": self.hints.skipped,
                "call_ms_max": max(self.hints.calls_ms, default=None),
                "sent_ms_median": float(np.median(self.hints.sent_ms))
                if self.hints.sent_ms
                else None,
                "queue_wait_ms": (
                    rig.args.queue_wait_ms if self.name == "prompt-ahead-arrival" else None
                ),
            }

    def __enter__(self) -> PathRun:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            sync(self.cuda)
        self.pieces.clear()
        self.graphs.clear()  # before the session whose words they ring
        if self.hints is not None:
            self.hints.close()
        if self.lookups is not None:
            self.lookups.close()
        if self.server is not None:
            self.server.close()
        if self.cuda:
            torch.cuda.empty_cache()


def table_rows(rig: Rig, ids: torch.Tensor, shape) -> torch.Tensor:
    return rig.table_dev.index_select(0, ids.reshape(-1)).view(shape)


def prompt_figures(step_ms: list[float], case: Case) -> dict:
    k = case.steps
    prompts = [sum(step_ms[p * k : (p + 1) * k]) for p in range(case.prompts)]
    later = [x for p in range(case.prompts) for x in step_ms[p * k + 1 : (p + 1) * k]]
    return {
        "prompt_ms": prompts,
        "median_ms": statistics.median(prompts),
        "first_ms": prompts[0],
        "chunk1_ms": statistics.mean(step_ms[p * k] for p in range(case.prompts)),
        "later_chunk_ms": statistics.mean(later) if later else None,
    }


def server_delta(s0: dict, s1: dict, steps: int) -> dict:
    """The server's counters over the timed steps (per step), its read latency
    (over its life) and its request time (the histograms' difference)."""
    t0, t1 = s0["tables"][0], s1["tables"][0]
    io0, io1 = t0.get("io") or {}, t1.get("io") or {}
    out = {k: io1.get(k, 0) - io0.get(k, 0) for k in ("hits", "misses", "reads", "read_bytes")}
    out.update(
        misses_per_step=out["misses"] / steps,
        reads_per_step=out["reads"] / steps,
        read_p50_ms=io1.get("read_p50_s", 0) * 1e3,
        read_p99_ms=io1.get("read_p99_s", 0) * 1e3,
        requests=t1["requests"] - t0["requests"],
        request=hist_quantiles(t0["server_time"], t1["server_time"]),
    )
    hinted = {}
    for where0, where1 in ((s0, s1), (t0, t1), (io0, io1)):
        for key, value in where1.items():
            if "hint" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                hinted[key] = value - where0.get(key, 0)
            elif "hint" in key and isinstance(value, dict):
                hinted[key] = {
                    k: v - (where0.get(key) or {}).get(k, 0)
                    for k, v in value.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                }
    if hinted:
        out["hints"] = hinted
    return out


# -------------------------------------------------------------- reporting
def ratio(x, a) -> float | None:
    return x / a if x is not None and a else None


def fmt(v, spec: str = ".3f", none: str = "–") -> str:
    return none if v is None else format(v, spec)


BOUND_DEPTHS = (1, 8, 32, 128)
"""The queue depths the disk is probed at, for the bound of a step's reads."""


def disk_time_s(reads: float, disk: dict) -> float | None:
    """The disk's own time for ``reads`` 4 KiB random reads issued together:
    ``reads ÷ rate(d)`` at the queue depth ``d = reads`` (at most the deepest
    probed, where the rate no longer grows), the rate measured at that depth,
    or interpolated on ``log d`` between the two probed depths around it. At a
    steady depth ``d`` each read takes ``d ÷ rate(d)`` (Little's law), so a
    batch of ``d`` reads is one such latency; a single read is the QD-1
    latency. None without a probe."""
    rates = sorted(
        (int(q), v["reads_per_s"])
        for q, v in disk.items()
        if q.isdigit() and isinstance(v, dict) and v.get("reads_per_s")
    )
    if not rates or reads <= 0:
        return None if not rates else 0.0
    depth = min(max(reads, rates[0][0]), rates[-1][0])
    rate = rates[-1][1]
    for (d0, r0), (d1, r1) in itertools.pairwise(rates):
        if d0 <= depth <= d1:
            t = math.log(depth / d0) / math.log(d1 / d0)
            rate = r0 + t * (r1 - r0)
            break
    return reads / rate


def add_bounds(runs: list[Run], disk: dict) -> None:
    """Each decode server path's stall (x − a) per window beside its physical
    bound: the disk's own time for the step's reads at their queue depth
    (``disk_time_s``), of the window's mean reads a step. That time grows more
    slowly than the reads (the rate rises with depth), so with reads varying
    from step to step it is at least the mean of the steps' own bounds: a
    bound a stall meets more easily, not less."""
    a = next((r for r in runs if r.path == "a" and r.windows), None)
    if a is None or disk_time_s(1.0, disk) is None:
        return
    for r in runs:
        if r.path not in SERVER_PATHS or not r.windows or not r.server or not r.trace:
            continue
        per_row = r.server["reads"] / r.trace["new_rows"] if r.trace["new_rows"] else 0.0
        r.bound = {}
        for w in WINDOWS:
            x, base = r.windows[w]["mean"], a.windows[w]["mean"]
            if x is None or base is None:
                continue
            reads = r.trace[w]["new_rows_per_step"] * per_row
            bound = 1e3 * (disk_time_s(reads, disk) or 0.0)
            r.bound[w] = {
                "reads_per_step": reads,
                "bound_ms": bound,
                "stall_ms": x - base,
                "stall_over_bound": (x - base) / bound if bound > 0 else None,
            }


def report_case(case: Case, runs: list[Run], rig: Rig) -> None:
    _, hidden, layer_us = rig.models.get(case.step_ms, (None, None, None))
    step = f"≈ {case.step_ms:g} ms step" if case.step_ms else "CPU step"
    say(
        f"\n### {case.kind}, {'Engram' if rig.args.engram else 'PLE'} layer "
        f"{case.layers} of {rig.args.layers}, "
        + (
            f"batch {case.batch}, {case.steps} steps"
            if case.kind == "decode"
            else f"{case.steps}-chunk prompts of {case.batch} tokens, {case.prompts} prompts"
        )
        + f", {step} (H {hidden}, {fmt(layer_us, '.0f')} µs/layer)"
    )
    a = next((r for r in runs if r.path == "a" and not r.error and not r.unavailable), None)
    if case.kind == "decode":
        spans = windows(case.steps)
        say(
            "windows (steps): "
            + ", ".join(f"{w} {x}–{y - 1}" for w, (x, y) in spans.items() if y > x)
        )
        say(
            "| path | "
            + " | ".join(f"{w} ms" for w in WINDOWS)
            + " | "
            + " | ".join(f"x/a {w}" for w in WINDOWS)
            + " | misses/step (trace) | reads/step | in flight avg / busy | read ms kernel"
            " (server p50 / p99) | exact | ahead | others |"
        )
        say("|---|" + "---:|" * 12 + "---|---:|---:|")
        for r in runs:
            if not r.windows:
                say(f"| {r.path} | {r.unavailable or r.error or 'not a decode path'} |")
                continue
            cells = [fmt(r.windows[w]["mean"]) for w in WINDOWS]
            cells += [
                fmt(ratio(r.windows[w]["mean"], a.windows[w]["mean"] if a else None))
                for w in WINDOWS
            ]
            say(
                "| "
                + " | ".join([r.path, *cells, *miss_cells(r, r.trace["whole"]["misses_per_step"])])
                + " |"
            )
        for r in runs:
            if r.bound:
                say(
                    f"bound vs stall, {r.path}: "
                    + "; ".join(
                        f"{w} {b['bound_ms']:.2f} vs {b['stall_ms']:.2f} ms "
                        f"({fmt(b['stall_over_bound'], '.2f')}×, "
                        f"{b['reads_per_step']:.0f} reads/step)"
                        for w, b in r.bound.items()
                    )
                )
        tr = next((r.trace for r in runs if r.trace), None)
        if tr:
            say(
                "first-touch misses per step (trace): "
                + ", ".join(f"{w} {fmt(tr[w]['misses_per_step'], '.1f')}" for w in WINDOWS)
            )
    else:
        say(
            "| path | prompt ms (median) | first prompt ms | chunk 1 ms | chunks 2..n ms | "
            "x/a median | x/a first | misses/chunk (trace) | reads/chunk | in flight avg / "
            "busy | read ms kernel (server p50 / p99) | exact | ahead | others |"
        )
        say("|---|" + "---:|" * 10 + "---|---:|---:|")
        for r in runs:
            if not r.prompts:
                say(f"| {r.path} | {r.unavailable or r.error or 'not run'} |")
                continue
            p, pa = r.prompts, a.prompts if a else {}
            cells = [
                fmt(p["median_ms"]),
                fmt(p["first_ms"]),
                fmt(p["chunk1_ms"]),
                fmt(p["later_chunk_ms"]),
                fmt(ratio(p["median_ms"], pa.get("median_ms"))),
                fmt(ratio(p["first_ms"], pa.get("first_ms"))),
            ]
            say(
                "| "
                + " | ".join([r.path, *cells, *miss_cells(r, r.trace["misses_per_chunk"])])
                + " |"
            )
        for r in runs:
            if r.hints:
                say(
                    f"hints, {r.path}: {json.dumps(r.hints)}"
                    + (f"; server: {json.dumps(r.server.get('hints'))}" if r.server else "")
                )


def miss_cells(r: Run, predicted: float | None) -> list[str]:
    s, d = r.server, r.disk
    if s:
        misses = f"{s['misses_per_step']:.1f} ({fmt(predicted, '.1f')})"
        reads = f"{s['reads_per_step']:.1f}"
        latency = (
            f"{fmt(d and d['mean_read_ms'])} ({s['read_p50_ms']:.3f} / {s['read_p99_ms']:.3f})"
        )
        flight = f"{fmt(d and d['in_flight_avg'], '.1f')} / {fmt(d and d['in_flight_busy'], '.1f')}"
    else:
        misses, reads, latency, flight = f"– ({fmt(predicted, '.1f')})", "–", "–", "–"
    exact = {None: "–", True: "yes", False: "NO"}[r.exact]
    return [misses, reads, flight, latency, exact, fmt(r.ahead, "d"), fmt(r.others_cpu, ".1%")]


def summary(results: dict[Case, list[Run]], paths: list[str]) -> None:
    """One line per case: each path over a (decode: whole run, steady in
    brackets; prefill: the median prompt, the first in brackets)."""
    others = [p for p in paths if p != "a"]
    say("\n## x / a: decode whole (steady); prefill median prompt (first prompt)")
    say("| case | a ms | " + " | ".join(others) + " | exact |")
    say("|---|---:|" + "---:|" * len(others) + "---|")
    for case, runs in results.items():
        at = {r.path: r for r in runs}
        a = at.get("a")
        if case.kind == "decode":
            fig = lambda r, w: r.windows[w]["mean"] if r and r.windows else None  # noqa: E731
            keys = ("whole", "steady")
        else:
            fig = lambda r, w: r.prompts.get(w) if r and r.prompts else None  # noqa: E731
            keys = ("median_ms", "first_ms")
        cells = []
        for p in others:
            r = at.get(p)
            if r is None or r.unavailable or r.error:
                cells.append("–")
                continue
            whole, part = (ratio(fig(r, k), fig(a, k)) for k in keys)
            cells.append(f"{fmt(whole)} ({fmt(part)})")
        exact = [r.exact for r in runs if r.exact is not None]
        ok = "–" if not exact else "yes" if all(exact) else "NO"
        say(f"| {case.key} | {fmt(fig(a, keys[0]))} | " + " | ".join(cells) + f" | {ok} |")


def targets(results: dict[Case, list[Run]], args) -> dict:
    """The issue's targets, where this run has the cases they need."""
    out: dict = {}
    mid = max(args.ple_at)
    early = min(args.ple_at)
    for case, runs in results.items():
        at = {r.path: r for r in runs}
        a = at.get("a")
        if case.kind == "decode" and case.batch == TARGET_BATCH and 0 < case.step_ms <= 10:
            e = at.get("e")
            # One PLE layer in the run is early, not in the middle: no mid target.
            if case.ple_at == mid != early and a and e and e.windows and a.windows:
                steady = ratio(e.windows["steady"]["mean"], a.windows["steady"]["mean"])
                whole = ratio(e.windows["whole"]["mean"], a.windows["whole"]["mean"])
                out["decode_mid_e_over_a_steady"] = steady
                out["decode_mid_e_over_a_whole"] = whole
                out["decode_mid_steady_le_1.03"] = steady is not None and steady <= 1.03
                out["decode_mid_whole_le_1.08"] = whole is not None and whole <= 1.08
            if args.engram and a and e and e.windows and a.windows:
                # Both Engram layers in one step: layer 14's reads hide behind
                # 13 layers, layer 1's behind one; the step's ratio holds both.
                # A layer run alone (--ple-at) has its own figures.
                key = "decode_engram" if len(args.ple_at) == 1 else f"decode_engram_L{case.layers}"
                steady = ratio(e.windows["steady"]["mean"], a.windows["steady"]["mean"])
                out[f"{key}_e_over_a_steady"] = steady
                out[f"{key}_e_over_a_whole"] = ratio(
                    e.windows["whole"]["mean"], a.windows["whole"]["mean"]
                )
                out[f"{key}_steady_le_1.03"] = steady is not None and steady <= 1.03
            if case.ple_at == early and e and e.bound and "steady" in e.bound:
                b = e.bound["steady"]
                out["decode_early_stall_ms"] = b["stall_ms"]
                out["decode_early_bound_ms"] = b["bound_ms"]
                ratio_ = b["stall_over_bound"]
                out["decode_early_stall_le_1.2_bound"] = ratio_ is not None and ratio_ <= 1.2
        if case.kind == "prefill" and case.steps == 4 and a and a.prompts:
            key = f"prefill4_L{case.layers}"
            for name in ("prompt-ahead", "prompt-ahead-arrival", "e"):
                r = at.get(name)
                if r and r.prompts:
                    out[f"{key}_{name}_over_a"] = ratio(
                        r.prompts["median_ms"], a.prompts["median_ms"]
                    )
            pa = at.get("prompt-ahead")
            if pa and pa.prompts:
                out[f"{key}_le_1.15"] = out[f"{key}_prompt-ahead_over_a"] <= 1.15
            else:
                why = pa.unavailable or pa.error if pa else "not run"
                out[f"{key}_le_1.15"] = f"not evaluated: prompt-ahead: {why}"
    ran = [r for runs in results.values() for r in runs if r.exact is not None]
    out["every_path_bit_exact"] = bool(ran) and all(r.exact for r in ran)
    # A host synchronization in every step would leave at most one step queued.
    graph = [
        r
        for case, runs in results.items()
        for r in runs
        if case.kind == "decode" and r.sync_checked and r.steps > 4
    ]
    if graph:
        out["graph_paths_no_host_sync"] = all((r.ahead or 0) > 2 for r in graph)
    return out


# ---------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.rsplit("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument(
        "--part",
        choices=("1", "2", "all"),
        default="all",
        help="GPU: 1 = decode at ≈ 7 ms and prefill, 2 = decode at ≈ 40 ms",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        default=None,
        help="run on the CPU at a small size (the default without CUDA)",
    )
    ap.add_argument(
        "--trace",
        default=TRACE,
        help="real-text ids: bench.sim.text_trace's (PLE, the default) or "
        "bench.sim.engram_trace's (DeepSeek-V4.1's two Engram layers in every case)",
    )
    ap.add_argument("--cache-size", help="the server's row cache (GPU 1G, CPU 16M)")
    ap.add_argument(
        "--table-factor", type=float, default=10.5, help="table bytes ÷ row cache bytes (10.5)"
    )
    ap.add_argument("--rows", type=int, help="table rows (default: from --table-factor)")
    ap.add_argument("--parts", type=int, default=128, help="table shards (128)")
    ap.add_argument("--files", type=int, default=16, help="checkpoint files (16)")
    ap.add_argument("--seed", type=int, default=20, help="the table content's seed")
    ap.add_argument("--table-dir", help="keep the table here and reuse it (default: temporary)")
    ap.add_argument("--workdir", help="parent of the temporary directory")
    ap.add_argument("--layers", type=int, help="decoder layers (GPU 32, CPU 8; Engram CPU 16)")
    ap.add_argument(
        "--ple-at",
        type=ints,
        help="PLE layer per case (GPU 1,16; CPU 1,4); with an Engram trace, a case for each "
        "of its layers named, alone (default: one case of all its layers)",
    )
    ap.add_argument("--batches", type=ints, help="decode batches (GPU 1,32,128; CPU 4,32)")
    ap.add_argument("--step-ms", type=floats, help="decode step targets (part 1: 7, part 2: 40)")
    ap.add_argument(
        "--steps", type=int, help="decode steps per case (part 1: 1000, part 2: 250, CPU 120)"
    )
    ap.add_argument("--hidden", type=int, default=256, help="CPU: H of the layers (256)")
    ap.add_argument("--prompts", type=ints, help="chunks per prompt (1,4; '' for no prefill)")
    ap.add_argument("--prompt-repeats", type=int, help="prompts per prefill case (GPU 3, CPU 1)")
    ap.add_argument("--chunk-tokens", type=int, help="prefill chunk tokens (GPU 2048, CPU 256)")
    ap.add_argument(
        "--queue-wait-ms",
        type=float,
        default=7.0,
        help="prompt-ahead-arrival: arrival to scheduling (7: one decode step)",
    )
    ap.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    ap.add_argument(
        "--gpu-ops",
        choices=GPU_OPS,
        default=DEFAULT_GPU_OPS,
        help="how the GPU-driven paths ring and collect: the driver's stream memory "
        f"operations or pleclient.gpu_kernels' two kernels (default {DEFAULT_GPU_OPS})",
    )
    ap.add_argument("--capacity", type=int, default=16384, help="ids per request (16384)")
    ap.add_argument("--probe-seconds", type=float, help="per queue depth (GPU 2, CPU 0.5)")
    ap.add_argument(
        "--deadline-s",
        type=float,
        help="run no path that would end past this many seconds from the start",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results here (after every case)")
    args = ap.parse_args(argv)
    if args.cpu is None:
        args.cpu = not torch.cuda.is_available()
    gpu = not args.cpu
    if not os.path.exists(args.trace):
        built = "engram_trace" if "engram" in os.path.basename(args.trace) else "text_trace"
        ap.error(f"no trace at {args.trace}: build it with python -m bench.sim.{built}")
    geometry = trace_geometry(args.trace)
    args.engram, args.ids_per_layer = geometry["engram"], geometry["ids_per_layer"]
    args.row_bytes = ENGRAM_ROW_BYTES if args.engram else PLE_ROW_BYTES
    engram_alone = args.ple_at if args.engram else None  # a case for each such layer alone
    if engram_alone and set(engram_alone) - set(geometry["layer_ids"]):
        ap.error(
            f"--ple-at {engram_alone}: an Engram trace has the ids of its layers "
            f"{geometry['layer_ids']} only"
        )
    defaults = {
        "cache_size": ("1G", "16M"),
        "layers": (32, 16 if args.engram else 8),
        "ple_at": ([1, 16], [1, 4]),
        "batches": ([1, 32, 128], [4, 32]),
        "prompts": ([1, 4], [1, 4]),
        "prompt_repeats": (3, 1),
        "chunk_tokens": (2048, 256),
        "probe_seconds": (2.0, 0.5),
    }
    for key, (g, c) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, g if gpu else c)
    if gpu and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --cpu")
    if args.cpu:
        args.step_ms = None
    args.paths = [p for p in args.paths.split(",") if p]
    if set(args.paths) - set(PATHS):
        ap.error(f"unknown paths {sorted(set(args.paths) - set(PATHS))}; use {PATHS}")
    args.paths = [p for p in PATHS if p in args.paths]  # the documented order
    if args.rows is None:
        args.rows = int(args.table_factor * parse_size(args.cache_size)) // args.row_bytes
    # Each case's layers: one PLE layer a case; every Engram layer in every case,
    # or each one named with --ple-at alone (a deeper layer's reads without layer 1's)
    if args.engram:
        args.ple_at = (
            [(i,) for i in engram_alone] if engram_alone else [tuple(geometry["layer_ids"])]
        )
    else:
        args.ple_at = [(i,) for i in args.ple_at]
    if not all(0 <= i < args.layers for layers in args.ple_at for i in layers):
        ap.error(f"layers {args.ple_at}: the model's layers are 0..{args.layers - 1}")
    most = max(len(layers) for layers in args.ple_at)
    if math.ceil(args.chunk_tokens * args.ids_per_layer / args.capacity) * most > 64:
        ap.error("a chunk needs more than 64 slots: raise --capacity")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cuda = not args.cpu
    device = "cuda" if cuda else "cpu"
    if not cuda:  # the server needs a core too: torch's threads would fight it
        torch.set_num_threads(1)
    all_cases, cases = matrix(args)
    workdir = tempfile.mkdtemp(prefix="ple-northstar-", dir=args.workdir)
    report: dict = {
        "command": "python -m bench.evals.northstar "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "source": source(),
        "args": {k: v for k, v in vars(args).items()},
    }
    if cuda:
        report["machine"].update(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            device=torch.cuda.get_device_name(),
            driver=_driver(),
        )
    results: dict[Case, list[Run]] = {}
    try:
        kind = " (Engram rows' values: the scales stay resident)" if args.engram else ""
        say(
            f"== table: {args.rows:,} rows × {args.row_bytes} B FP8 for a {args.cache_size} "
            f"row cache{kind}"
        )
        if cuda:  # (what rings and collects on the GPU-driven paths d and e)
            say(f"== GPU-driven paths: --gpu-ops {args.gpu_ops}")
        table, data, report["table"] = prepare_table(args, workdir)
        t = report["table"]
        say(
            f"   {t['bytes'] / 2**30:.2f} GiB in {t['files']} files under {t['dir']}: "
            + (f"written in {t['write_s']} s" if t["written"] else "reused")
            + f" (content made in {t['content_s']} s)"
        )
        args.disk_device, how = block_device(os.path.realpath(table.files[0]))
        report["disk_device"] = {"name": args.disk_device, "found_as": how}
        say(f"== disk {args.disk_device} ({how}): 4 KiB O_DIRECT random reads")
        report["disk"] = ceiling(sorted(table.files), args.probe_seconds, "auto", BOUND_DEPTHS)
        qd1 = report["disk"].get("1", {}).get("reads_per_s")
        if qd1:
            say(f"   one read at QD 1: {1e3 / qd1:.3f} ms")
        text = Text(args.trace, table.rows, all_cases)
        report["trace"] = {
            "path": os.path.basename(args.trace),
            "sha256": text.trace.sha256,
            "tokens": len(text.ids),
            "windows": {c.key: [text.start[c], text.start[c] + c.tokens] for c in cases},
            "reused_text_from": text.wrapped,
        }
        say(
            f"== trace {report['trace']['path']} ({text.trace.sha256[:12]}…), "
            f"{len(text.ids):,} tokens; {len(cases)} cases"
        )
        if text.wrapped:
            say(f"   text reused (windows overlap) from: {', '.join(text.wrapped)}")
        why_not_b = None
        pinned = uva = None
        if cuda:  # b reads pinned host memory (cudaHostAlloc, as vLLM's cpu_offload)
            pinned = torch.from_numpy(data).pin_memory()
            del data
            table_dev = pinned.to(device)
            uva = make_uva_kernel()
            if uva is None:
                why_not_b = "no Triton: the UVA kernel is unavailable"
        else:
            why_not_b = "needs a CUDA device (a kernel reading pinned host memory over UVA)"
            table_dev = torch.from_numpy(data)
        rig = Rig(
            args,
            cuda,
            device,
            table,
            os.path.dirname(table.files[0]),
            workdir,
            table_dev,
            pinned,
            uva,
            why_not_b,
        )
        for case in cases:
            runs: list[Run] = []
            results[case] = runs
            for name in args.paths:
                why = why_not(case, name, rig)
                late = time.monotonic() - started + estimate_s(case) > (args.deadline_s or 1e9)
                if why == "":
                    continue  # not a path of this kind of case
                if why is None and late:
                    why = f"not run: it would end past --deadline-s {args.deadline_s:g}"
                r = Run(case.key, name, unavailable=why) if why else run_path(case, name, rig, text)
                runs.append(r)
                say(f"   {case.key} {name}: {describe(r)}")
            add_bounds(runs, report["disk"])
            report_case(case, runs, rig)
            write_json(args, report, results, rig, started)
        summary(results, args.paths)
        report["targets"] = targets(results, args)
        say("\ntargets: " + json.dumps(report["targets"], default=str))
        others = [
            r.others_cpu for runs in results.values() for r in runs if r.others_cpu is not None
        ]
        if others:
            mean = statistics.mean(others)
            say(f"others used {max(others):.1%} of the CPUs at most (mean {mean:.1%})")
        say(f"commit {report['source']['commit']}; {json.dumps(report['machine'])}")
        write_json(args, report, results, rig, started)
    finally:
        with contextlib.suppress(Exception):
            sync(cuda)
        shutil.rmtree(workdir, ignore_errors=True)
    failed = any(r.exact is False or r.error for runs in results.values() for r in runs)
    return 1 if failed else 0


def estimate_s(case: Case) -> float:
    """A generous guess of one path's time (for --deadline-s)."""
    step = (case.step_ms or 5.0) * 1e-3
    if case.kind == "decode":
        return case.steps * step * 1.6 + 8.0
    return case.prompts * case.steps * 0.4 + 8.0


def describe(r: Run) -> str:
    if r.unavailable:
        return f"unavailable: {r.unavailable}"
    if r.error:
        return f"failed: {r.error}"
    exact = {True: "bit-exact", False: "ROWS DIFFER", None: ""}[r.exact]
    if r.windows:
        w = r.windows
        main = ", ".join(f"{k} {fmt(w[k]['mean'])}" for k in WINDOWS)
    else:
        main = f"prompt median {r.prompts['median_ms']:.2f} ms, first {r.prompts['first_ms']:.2f}"
    return f"{main} ms; {exact}; {r.wall_s:.1f} s"


def write_json(args, report: dict, results, rig: Rig, started: float) -> None:
    if not args.json:
        return
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["models"] = {
        str(k): {"hidden": h, "layer_matmul_us": round(us, 1)}
        for k, (_, h, us) in rig.models.items()
    }
    report["cache_bytes"] = rig.cache_bytes
    report["cases"] = [
        {**asdict(case), "key": case.key, "runs": [asdict(r) for r in runs]}
        for case, runs in results.items()
    ]
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, args.json)


if __name__ == "__main__":
    sys.exit(main())
