"""The cells of ``bench/real_vllm/coordinator.py``: what each one runs, what it costs, its prompts,
its server figures and the summary of a run. Pure Python (no vLLM, no torch), so the
plan, the deadline and the summary are the same code on the GPU host and in the
CPU test.

**A cell is one engine start**: one ``LLM`` (or one ``vllm serve``) in its own
process group, with a ple-server of its own where it uses one, and the
measurements it runs inside that engine (vLLM's start costs 75–95 s on a warm
host and about 220 s on a fresh one; a measurement costs seconds). Its name
says what it is, words joined by ``-`` in any order:

  stock | offload | shm     the PLE table: resident in vLLM (``cpu_offload``
                            off), vLLM's ``cpu_offload`` (pinned host memory,
                            UVA), or rows from ple-server (``VLLM_PLE_BACKEND=shm``)
  eager | piecewise | default
                            ``enforce_eager``, ``-cc.cudagraph_mode=PIECEWISE``,
                            or vLLM's default (FULL_AND_PIECEWISE breakable graphs)
  serve                     ``vllm serve`` driven over HTTP by the ``openai``
                            client (else ``LLM.generate``)
  host                      shm: the host route (``VLLM_PLE_SHM_GPU_PATH=off``;
                            else the GPU-driven route)
  direct                    shm: ``--io direct`` with a 1 GiB row cache (else
                            ``--io mmap``)
  nopa                      shm: ``VLLM_PLE_SHM_PROMPT_AHEAD=off``
  kernels | memops          shm: ``VLLM_PLE_SHM_GPU_OPS`` (the GPU-driven route's
                            ring and collect as two kernels of the plugin's,
                            ``pleclient.gpu_kernels``, or the driver's stream
                            memory operations; else the plugin's default,
                            kernels)
  unordered                 shm: ple-server's ``--no-gather-in-order`` (a step's
                            layers read side by side, not one after another)
  nospin                    shm: ple-server's ``--spin-us 0`` (its serving loop
                            sleeps at once after a request: no core spun beside
                            vLLM's own)
  pin                       the engine on every CPU but the last ``PIN_SERVER_CPUS``,
                            ple-server (shm) on those: whether the server's
                            threads slow vLLM's host side where they share CPUs
  fp8 | nvfp4 | large | deep | deepsmall | dsv41
                            the checkpoint (else ``small-bf16``): ``CHECKPOINTS``;
                            dsv41 is a whole DeepSeek-V4.1 with Engram tables
                            (``LLM.generate`` only: a stock engine gets the
                            tables copied in through a worker extension)
  mp0                       ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
                            in the same process, every prompt queued before the
                            first step
  gpus<N>                   ``--tensor-parallel-size N``: N GPU workers, each
                            its own client of the one ple-server (a host with
                            N GPUs)
  x<N>                      N exact runs (default 3)
  tp | tp<N>                throughput, N repetitions (default 3) of
                            concurrency 1, 8 and 32, interleaved
  ttft | ttft<N>            the TTFT of an 8 000-token prompt alone, N
                            repetitions (default 3): new text whose rows no
                            lookup read yet, then the same text again (every row
                            read before it: what prompt-ahead leaves a prompt
                            that waited at least its read time)
  prof                      decode under vLLM's torch profiler (``profiler_config``):
                            ``PROFILE_TOKENS`` tokens at concurrency 1 and 32,
                            what the GPU did in each decode step (``gpu_trace``)
  noexact                   no exact runs
  restart                   serve: 32 greedy streams of 3 584 tokens, three
                            runs; shm: ple-server killed, reloaded and
                            restarted under the second (``RESTART_EVENTS``);
                            stock: the references of their output
  verify                    shm-eager-mp0: every PLE lookup of the engine's
                            steps compared bit for bit with the checkpoint's
                            bytes, stock's resident table (``verify``)
  #<k>                      another engine of the same cell (a second stock
                            engine for the spread between engines)

e.g. ``stock-default-tp``, ``shm-default-direct-large-tp``,
``serve-shm-piecewise-host``, ``stock-default-mp0-x10``. ``PLANS`` name lists of
cells for one device call each.

**Exact runs**: 8 prompts of real English text (one of 2 900 tokens, chunked
at 512), 32 greedy tokens, ``logprobs=5``, ``ignore_eos``, every prompt
submitted at once (``vllm serve``: one after another, each streamed alone,
since concurrent HTTP arrivals change the steps' batches and stock's output
from run to run: 5 outcomes in 6 runs); the token ids and logprobs are the outcome
(``exact.Outcome``). A shm (or offload) run is judged against every
stock run of the same reference (API, graphs mode, trunk and table size,
multiprocessing): the stock runs of every engine of it, in this call and in
the host's earlier calls. Prefix caching is off in every engine, so a
repetition computes its prompts again. The FP8 checkpoint holds the BF16 one's
numbers, so BF16 stock runs are its references too.

**Decode rate**: the steady state inside a repetition, without the prefill
steps that the output tokens/s over the wall time carries. Each token's time
is taken where the engine made it (``LLM.generate``: the engine core's
timestamp on the step's outputs; ``vllm serve``: the chunk's arrival at the
client). From the last request's first token to the first request's last,
every request of the repetition is decoding and no prompt is being filled:
the tokens made in that window over its length are the decode tokens/s
(``steady_window``). At concurrency 1 that is 1 / TPOT.

**Throughput**: repetition r of concurrency c submits c prompts of 256 tokens
at once (new text each time), 512 tokens each with ``ignore_eos``; output
tokens/s over the wall time, TTFT and TPOT per request. Repetitions are
interleaved (1, 8, 32, 1, 8, 32, …) so that a drift of the host falls on every
figure alike; each figure is given as median [min–max] over them. The server's
counters before and after each measurement give its row-cache hit rate, the
miss reads per second the decode demanded, its lookup time (p50 / p99 of its
request histogram) and its CPU seconds per row read from disk. The first
repetition of a cell on a fresh server (started cold: no hot set, nothing
prewarmed) is its cold figure, the later ones warm.

Every figure of a random-weight model over a byte-level vocabulary is a
figure of this harness's checkpoint, not of Qwen3.8-Flash-Next's real text:
its generated tokens, and so its decode's n-grams, are the random model's.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.real_vllm import gpu_trace
from bench.real_vllm import steps as vllm_steps

CELL_FORMAT = "vllm-real-cell/1"
RUN_FORMAT = "vllm-real-run/1"
CONCURRENCY = (1, 8, 32)
EXACT_TOKENS = 32
EXACT_PROMPTS = 8
LONG_PROMPT_TOKENS = 2900  # chunked prefill over several 512-token steps
TP_PROMPT_TOKENS = 256
TP_OUTPUT_TOKENS = 512
TTFT_PROMPT_TOKENS = 8000  # the checkpoint's 8 192 positions, less the output
TTFT_OUTPUT_TOKENS = 8
PROFILE_CONCURRENCY = (1, 32)
PROFILE_TOKENS = 128  # decode steps enough for medians; a trace of a few MB
PROFILE_TEXT_REP = 10  # the throughput text windows of repetition 10 on: unread
DIRECT_CACHE = "1G"
PIN_SERVER_CPUS = 2  # pin: the CPUs kept for ple-server, the last ones
RESTART_STREAMS = 32
RESTART_TOKENS = 3584  # ≈ 20 s at concurrency 32 on the 4-layer trunk: every event inside
RESTART_EVENTS = (  # (seconds into the disturbed run, what is done to ple-server)
    (2.0, "kill9-restart"),  # a crash, and Restart=on-failure at once
    (5.0, "reload"),  # systemctl reload: SIGHUP
    (8.0, "restart"),  # systemctl restart: SIGTERM, then a start
    (11.0, "kill9-away"),  # a crash, and no server for RESTART_AWAY_S
)
RESTART_AWAY_S = 3.0


# ----------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of ``bench/real_vllm/checkpoint.py``."""

    name: str
    layers: int
    ngram_vocab_base: int
    dtype: str = "bf16"
    twin_of: str | None = None  # FP8, NVFP4: the copy of this BF16 checkpoint
    model: str = "qwen4exp"  # | deepseek-v41 (bench/real_vllm/checkpoint.py --model)

    @property
    def family(self) -> str:
        """Checkpoints of one family hold the same numbers (an FP8 twin included),
        so a stock run of one is a reference for the others. NVFP4 rounds the
        rows: its copy is a family of its own."""
        if self.model != "qwen4exp":
            return self.model
        rounded = "-nvfp4" if self.dtype == "nvfp4" else ""
        return f"{self.layers}L-{self.ngram_vocab_base}{rounded}"

    @property
    def dummy_weights(self) -> bool:
        """Only the n-gram tables are in the files: vLLM draws the other weights
        (``load_format="dummy"``), and a stock engine gets the tables copied in
        (``bench/real_vllm/engram_tables.py``)."""
        return self.model == "deepseek-v41"

    def args(self, work: Path) -> list[str]:
        """``bench/real_vllm/checkpoint.py``'s arguments, but ``--out`` and ``--device``."""
        if self.model != "qwen4exp":
            return ["--model", self.model]
        if self.twin_of:
            return ["--twin-of", str(work / "ckpt" / self.twin_of), "--dtype", self.dtype]
        return [
            "--layers",
            str(self.layers),
            "--ngram-vocab-base",
            str(self.ngram_vocab_base),
            "--dtype",
            self.dtype,
        ]


CHECKPOINTS = {
    c.name: c
    for c in (
        Checkpoint("small-bf16", 4, 100_000),  # two tables of 0.51 GB: mmap
        Checkpoint("small-fp8", 4, 100_000, "fp8", twin_of="small-bf16"),
        Checkpoint("small-nvfp4", 4, 100_000, "nvfp4", twin_of="small-bf16"),  # rounded
        Checkpoint("large-bf16", 4, 1_100_000),  # two of 5.6 GB: 10.5 GiB, --io direct
        Checkpoint("deep-bf16", 16, 550_000),  # four of 2.8 GB: 10.5 GiB
        Checkpoint("deepsmall-bf16", 16, 100_000),  # the deep trunk on mmap
        # the whole DeepSeek-V4.1 of pleserver.devkit.deepseek_v41: two Engram tables of
        # about 0.1 GB (FP8 rows of 264 bytes) on decoder layers 1 and 14
        Checkpoint("dsv41-fp8", 16, 0, "fp8", model="deepseek-v41"),
    )
}
CHECKPOINT_WORDS = {
    "fp8": "small-fp8",
    "nvfp4": "small-nvfp4",
    "large": "large-bf16",
    "deep": "deep-bf16",
    "deepsmall": "deepsmall-bf16",
    "dsv41": "dsv41-fp8",
}


# ----------------------------------------------------------------------- cells
class CellError(ValueError):
    """A cell name that does not describe a cell that can run."""


@dataclass(frozen=True)
class Cell:
    name: str
    api: str = "generate"  # generate | serve
    backend: str = "stock"  # stock | offload | shm
    mode: str = "default"  # eager | piecewise | default
    checkpoint: str = "small-bf16"
    route: str = "gpu"  # shm: gpu | host
    gpu_ops: str | None = None  # shm, gpu route: memops | kernels; None: the plugin's
    io: str = "mmap"  # shm: mmap | direct
    cache_size: str | None = None  # shm direct: the row cache
    prompt_ahead: bool = True
    gather_in_order: bool = True  # shm: ple-server's gather_in_order
    spin: bool = True  # shm: ple-server's spin_us as configured (False: 0)
    pin: bool = False  # the engine and ple-server on CPUs apart (``pin_cpus``)
    multiproc: bool = True
    exact_runs: int = 3
    throughput_reps: int = 0
    ttft_reps: int = 0
    restart: bool = False  # serve: the streams; shm: the server killed, reloaded, restarted
    verify: bool = False  # shm eager mp0: every PLE row checked against the checkpoint
    profile: bool = False  # generate: decode steps under vLLM's torch profiler
    gpus: int = 1  # --tensor-parallel-size
    instance: int = 1

    @property
    def shm(self) -> bool:
        return self.backend == "shm"

    @property
    def stock(self) -> bool:
        return self.backend == "stock"

    def cache_size_gib(self) -> float | None:
        """The row cache of a ``direct`` cell, GiB."""
        from pleserver.config import parse_size

        return parse_size(self.cache_size) / 2**30 if self.cache_size else None

    def reference_key(self) -> str:
        """Stock runs of this key are the references of a shm cell of it (the
        same engine shape: a TP engine's sums run in another order)."""
        family = CHECKPOINTS[self.checkpoint].family
        gpus = f"/tp{self.gpus}" if self.gpus > 1 else ""
        return f"{self.api}/{self.mode}/{family}/{'mp' if self.multiproc else 'mp0'}{gpus}"

    def env(self, socket: str | None = None) -> dict[str, str]:
        """The environment the engine starts with (beside the host's)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.multiproc else "0"}
        if CHECKPOINTS[self.checkpoint].model == "deepseek-v41":
            # vLLM's DeepGEMM warm-up compiles 246 kernels on a fresh host, more
            # than 7 minutes of an H100's start (more than a device call holds
            # beside the cells); skipped, the kernels the runs use are compiled
            # when first used, the same kernels, in stock and shm alike.
            env["VLLM_DEEP_GEMM_WARMUP"] = "skip"
        if self.shm:
            env["VLLM_PLE_BACKEND"] = "shm"
            if socket:
                env["VLLM_PLE_SHM_SOCKET"] = socket
            env["VLLM_PLE_SHM_GPU_PATH"] = "off" if self.route == "host" else "auto"
            if self.route == "gpu" and self.gpu_ops:
                env["VLLM_PLE_SHM_GPU_OPS"] = self.gpu_ops
            if not self.prompt_ahead:
                env["VLLM_PLE_SHM_PROMPT_AHEAD"] = "off"
        return env

    def server_args(self) -> list[str]:
        """ple-server's flags beside ``--model`` and ``--socket``."""
        if not self.shm:
            return []
        args = ["--io", self.io, "--prewarm", "none", "--hotset-save-interval", "0"]
        if self.io == "direct":
            args += ["--cache-size", self.cache_size or DIRECT_CACHE]
        if not self.gather_in_order:
            args.append("--no-gather-in-order")
        if not self.spin:
            args += ["--spin-us", "0"]
        return args

    def to_json(self) -> dict:
        return {**asdict(self), "reference_key": self.reference_key()}


def pin_cpus(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """A ``pin`` cell's CPUs, from those it may use: (the engine's, ple-server's)."""
    cpus = sorted(cpus)
    if len(cpus) <= PIN_SERVER_CPUS:
        raise CellError(
            f"pin: {len(cpus)} CPUs leave none for the engine beside ple-server's {PIN_SERVER_CPUS}"
        )
    return cpus[:-PIN_SERVER_CPUS], cpus[-PIN_SERVER_CPUS:]


MODES = ("eager", "piecewise", "default")
BACKENDS = ("stock", "offload", "shm")


def parse_cell(name: str) -> Cell:
    """The cell a name describes (module docstring); CellError names what is wrong."""
    base, _, instance = name.partition("#")
    fields: dict = {"name": name}
    if instance:
        if not instance.isdigit() or int(instance) < 1:
            raise CellError(f"{name}: '#{instance}' must be a positive instance number")
        fields["instance"] = int(instance)
    seen_backend = seen_mode = False
    for word in base.split("-"):
        if word in BACKENDS:
            if seen_backend:
                raise CellError(f"{name}: two backends; a cell has one of {BACKENDS}")
            fields["backend"], seen_backend = word, True
        elif word in MODES:
            if seen_mode:
                raise CellError(f"{name}: two graph modes; a cell has one of {MODES}")
            fields["mode"], seen_mode = word, True
        elif word == "serve":
            fields["api"] = "serve"
        elif word == "host":
            fields["route"] = "host"
        elif word == "direct":
            fields["io"] = "direct"
            fields["cache_size"] = DIRECT_CACHE
        elif word == "nopa":
            fields["prompt_ahead"] = False
        elif word in _gpu_ops()[1]:
            fields["gpu_ops"] = word
        elif word == "unordered":
            fields["gather_in_order"] = False
        elif word == "nospin":
            fields["spin"] = False
        elif word == "pin":
            fields["pin"] = True
        elif word in CHECKPOINT_WORDS:
            fields["checkpoint"] = CHECKPOINT_WORDS[word]
        elif word == "mp0":
            fields["multiproc"] = False
        elif word == "noexact":
            fields["exact_runs"] = 0
        elif word == "restart":
            fields["restart"] = True
        elif word == "verify":
            fields["verify"] = True
        elif word == "prof":
            fields["profile"] = True
        elif m := re.fullmatch(r"gpus(\d+)", word):
            fields["gpus"] = int(m[1])
        elif m := re.fullmatch(r"x(\d+)", word):
            fields["exact_runs"] = int(m[1])
        elif m := re.fullmatch(r"tp(\d*)", word):
            fields["throughput_reps"] = int(m[1] or 3)
        elif m := re.fullmatch(r"ttft(\d*)", word):
            fields["ttft_reps"] = int(m[1] or 3)
        else:
            raise CellError(
                f"{name}: unknown word {word!r}; a cell name joins {BACKENDS}, {MODES}, "
                "serve, host, direct, nopa, kernels, memops, unordered, nospin, pin, "
                "fp8/nvfp4/large/deep/deepsmall/dsv41, mp0, gpus<N>, x<N>, tp[<N>], ttft[<N>], "
                "noexact, restart, verify, prof "
                "(bench/real_vllm/cells.py)"
            )
    if not seen_backend:
        raise CellError(f"{name}: no backend; name one of {BACKENDS}")
    cell = Cell(**fields)
    problem = cell_problem(cell)
    if problem:
        raise CellError(f"{name}: {problem}")
    return cell


def _gpu_ops() -> tuple[str, tuple[str, ...]]:
    """The plugin's default GPU ops and every choice (imported when first
    asked: the coordinator imports this module before the installed
    pleclient is found, ``installed_first``)."""
    from pleclient.vllm_plugin.settings import DEFAULT_GPU_OPS, GPU_OPS

    return DEFAULT_GPU_OPS, GPU_OPS


def cell_problem(cell: Cell) -> str | None:
    """Why a cell cannot run as named, or None."""
    if cell.gpu_ops and (not cell.shm or cell.route != "gpu"):
        return f"{cell.gpu_ops}: the GPU-driven route's operations; it needs shm on that route"
    if not cell.shm and (
        cell.route != "gpu"
        or cell.io != "mmap"
        or not cell.prompt_ahead
        or not cell.gather_in_order
        or not cell.spin
    ):
        return (
            "host, direct, nopa, unordered and nospin are ple-server settings: they need the "
            "shm backend"
        )
    if cell.shm and cell.route == "host" and cell.mode == "default":
        return (
            "the host route under vLLM's default full CUDA graphs is refused by the plugin "
            "at start (docs/VLLM.md, Supported compilation settings); use eager or piecewise"
        )
    if cell.api == "serve" and not cell.multiproc:
        return "vllm serve always runs its engine core in a process of its own: drop mp0"
    if cell.restart and cell.api != "serve":
        return (
            "restart runs vllm serve's streams (disturbing ple-server under them, or, on "
            "stock, as the reference): it needs serve"
        )
    if cell.verify and not (
        cell.shm and cell.mode == "eager" and not cell.multiproc and cell.api == "generate"
    ):
        return (
            "verify checks each lookup in Python: it needs shm, eager (a replayed CUDA graph "
            "never reaches Python) and mp0 (the check is installed in the engine's process)"
        )
    if cell.gpus < 1:
        return "gpus<N>: at least one GPU"
    if cell.gpus > 1 and cell.verify:
        return "verify installs its check in the engine's process: one GPU (drop gpus)"
    dummy = CHECKPOINTS[cell.checkpoint].dummy_weights
    if dummy and cell.api != "generate":
        return (
            "dsv41's stock engine gets its Engram tables through LLM.collective_rpc after the "
            "start (load_format=dummy reads no file): drop serve"
        )
    if dummy and (cell.verify or cell.restart):
        return "verify and restart are Qwen4Exp PLE cells: drop dsv41"
    if cell.profile and cell.api != "generate":
        return "prof profiles LLM.generate's worker (LLM.start_profile): drop serve"
    if cell.restart and cell.backend == "offload":
        return "restart's references are stock's streams: use stock or shm"
    if cell.exact_runs == 0 and not (
        cell.throughput_reps or cell.ttft_reps or cell.restart or cell.profile
    ):
        return "neither exact runs nor throughput: it would measure nothing"
    return None


PLANS: dict[str, list[str]] = {
    # Each plan is one device call's worth in the order that matters most; what
    # does not fit is skipped and named, to run first in the next call.
    # `python -m bench.real_vllm.coordinator plan --cells NAME [--warm]
    # [--spent-s S]` prints the timeline.
    #
    # Session 1, exactness. Call 1, on a fresh host (the install, then the
    # first start's kernel compiles: ≈ 220 s):
    "exact-1": ["stock-eager", "shm-eager", "shm-eager-host", "stock-eager#2"],
    # call 2: vLLM's default graphs; does mp0 make stock reproducible?
    "exact-2": ["stock-default", "shm-default", "stock-default-mp0-x10", "shm-default-mp0"],
    # the check with no noise: every row of an engine's steps against the checkpoint
    "verify": ["shm-eager-mp0-verify", "shm-eager-mp0-host-verify"],
    # call 3: FP8, piecewise graphs and the host route, prompt-ahead off
    "exact-3": [
        "shm-default-fp8",
        "shm-piecewise-host",
        "stock-piecewise",
        "shm-default-nopa",
        "stock-default#2",
    ],
    # the same under mp0, where stock is reproducible: each shm cell exact or not
    "exact-3-mp0": [
        "stock-default-mp0",
        "shm-default-mp0",
        "shm-default-fp8-mp0",
        "shm-default-nopa-mp0",
        "stock-piecewise-mp0",
        "shm-piecewise-host-mp0",
    ],
    # NVFP4 tables (vLLM's Triton decode resident; the plugin's decode from rows)
    "nvfp4": ["stock-default-nvfp4-mp0", "shm-default-nvfp4-mp0"],
    # the whole DeepSeek-V4.1 (Engram on layers 1 and 14): shm against stock, eager and
    # vLLM's default graphs, mp0 (every prompt queued before the first step)
    "dsv41": [
        "stock-eager-dsv41-mp0",
        "shm-eager-dsv41-mp0",
        "stock-default-dsv41-mp0",
        "shm-default-dsv41-mp0",
        "shm-default-dsv41-mp0-memops",
    ],
    # tensor parallel over two GPUs of one host (nvidia-h200-x2): two GPU workers, each
    # a client of the one ple-server; exactness under mp0, then the decode rate
    "gpus2": [
        "stock-default-large-gpus2-mp0",
        "shm-default-large-direct-gpus2-mp0",
        "stock-default-large-gpus2-noexact-tp",
        "shm-default-large-direct-gpus2-noexact-tp",
    ],
    # vllm serve, driven by the openai client
    "serve": ["serve-stock-default", "serve-shm-default", "serve-stock-default#2"],
    # ple-server killed, reloaded and restarted under vllm serve's 32 streams
    # (the GPU-driven route, vLLM's default graphs), then on the host route
    # and stock's own streams twice, the references of their output
    "restart": [
        "serve-stock-default-restart-noexact",
        "serve-shm-default-restart-noexact",
        "serve-stock-default-restart-noexact#2",
        "serve-shm-piecewise-host-restart-noexact",
    ],
    # Session 2, the benchmark (each cell also makes its 3 exact runs). The
    # 4-layer trunk with 10.5 GiB tables: resident, from disk, vLLM's offload
    "bench-1": [
        "stock-default-large-tp",
        "shm-default-direct-large-tp",
        "offload-default-large-tp",
    ],
    # where concurrency 1 loses its time on mmap (the H200's 0.67): the loop's
    # spin against none, and the same tables through the row cache
    "c1": ["stock-default-tp", "shm-default-tp", "shm-default-nospin-tp", "shm-default-direct-tp"],
    # small tables on mmap, and a second engine from disk
    "bench-2": ["stock-default-tp", "shm-default-tp", "shm-default-direct-large-tp#2"],
    # the 16-layer trunk (PLE on layers 2, 6, 10, 14), 10.5 GiB tables
    "bench-3": ["stock-default-deep-tp", "shm-default-direct-deep-tp", "offload-default-deep-tp"],
    # the loop without its spin after GPU-driven requests (the default since
    # cb5e9ed) beside stock, on mmap and from disk
    "spin": [
        "stock-default-tp",
        "shm-default-tp",
        "stock-default-deep-tp",
        "shm-default-direct-deep-tp",
    ],
    # the deep trunk from disk with the loop's new spin, the decode rate and the
    # 8 000-token prompt's TTFT (one call on a fresh host: the 10.5 GiB
    # checkpoint, the compiles)
    "deep-ttft": ["stock-default-deep-tp-ttft", "shm-default-direct-deep-tp-ttft"],
    # the deep trunk on mmap, beside vLLM's offload (issue 33's second trunk)
    "deep-mmap": [
        "stock-default-deepsmall-tp",
        "shm-default-deepsmall-tp",
        "offload-default-deepsmall-tp",
    ],
    # what the GPU does in a decode step, stock against shm, under vLLM's torch
    # profiler: the deep trunk on mmap, where no row is read from disk
    # (a fresh host's call holds the first pair), then the 4-layer trunk: the
    # cost per PLE layer from 4 layers against 2
    "prof": [
        "stock-default-deepsmall-noexact-prof",
        "shm-default-deepsmall-noexact-prof",
        "stock-default-noexact-prof",
        "shm-default-noexact-prof",
    ],
    # where shm's unprofiled decode loss goes (docs/BENCHMARKS.md, "What the GPU
    # does in a decode step"): shm's forward graph against stock's (a fresh
    # host's first call), then the decode rate with the engine and ple-server
    # on CPUs apart or shared (the next call)
    "split": [
        "shm-default-deepsmall-noexact-prof",
        "stock-default-deepsmall-noexact-prof",
        "stock-default-deepsmall-noexact-tp2",
        "shm-default-deepsmall-noexact-tp2",
        "stock-default-deepsmall-pin-noexact-tp2",
        "shm-default-deepsmall-pin-noexact-tp2",
    ],
    # the GPU-driven route's ring and collect as kernels (pleclient.gpu_kernels,
    # the default) against the stream memory operations: the decode rate of
    # both ways beside stock on one host, 3 interleaved repetitions (a fresh
    # host's call), then the forward graph under the profiler beside stock's
    # (the next call)
    "ops": [
        "stock-default-deepsmall-noexact-tp",
        "shm-default-deepsmall-kernels-noexact-tp",
        "shm-default-deepsmall-memops-noexact-tp",
        "shm-default-deepsmall-kernels-noexact-prof",
        "stock-default-deepsmall-noexact-prof",
    ],
    # the kernels exact against stock under mp0 (where stock is reproducible),
    # eager and in vLLM's default graphs, and every eager row against the checkpoint
    "ops-exact": [
        "stock-default-deepsmall-mp0",
        "shm-default-deepsmall-kernels-mp0",
        "shm-eager-mp0-kernels-verify",
    ],
    # eager stock and shm on one host, and vllm serve's exact cells
    "close-33": [
        "stock-eager-mp0",
        "shm-eager-mp0",
        "serve-stock-default",
        "serve-shm-default",
        "serve-stock-default#2",
    ],
}


def expand(spec: str | Iterable[str]) -> list[Cell]:
    """Cells of a comma-separated list of cell names and plan names."""
    words = spec.split(",") if isinstance(spec, str) else list(spec)
    cells: list[Cell] = []
    for word in (w.strip() for w in words):
        if not word:
            continue
        for name in PLANS.get(word, [word]):
            cells.append(parse_cell(name))
    names = [c.name for c in cells]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CellError(f"cells named twice: {twice}; add #2 for a second engine of a cell")
    return cells


def checkpoints_needed(cells: Iterable[Cell]) -> list[Checkpoint]:
    """The checkpoints the cells load, each after the one it is the twin of."""
    names: list[str] = []
    for cell in cells:
        ck = CHECKPOINTS[cell.checkpoint]
        for name in ([ck.twin_of] if ck.twin_of else []) + [ck.name]:
            if name not in names:
                names.append(name)
    return [CHECKPOINTS[n] for n in names]


# ----------------------------------------------------------------------- costs
@dataclass(frozen=True)
class Costs:
    """Expected seconds of a cell's parts, from the harness's runs on the GPU
    host (H100 and H200, docs/BENCHMARKS.md); a start measured on this host
    replaces the guess for its API and mode (``History``)."""

    engine_start_s: dict[str, float] = field(
        default_factory=lambda: {"eager": 70.0, "piecewise": 80.0, "default": 80.0}
    )
    # A model's first start on a host, every kernel of it compiled (a deadline
    # that overruns ends the cell, what it measured kept). Qwen4Exp: 174–182 s
    # on the H100, 224 s on the H200, 257–266 s on the H100 for the deep
    # trunk's. DeepSeek-V4.1 (eager, DeepGEMM's warm-up skipped): 309 s to
    # start on an H100 (TileLang's compiles, FlashInfer's JIT build in vLLM's
    # warm-up), and its first runs compiled on: the first had not ended 55 s
    # later.
    first_start_extra_s: dict[str, float] = field(
        default_factory=lambda: {"qwen4exp": 180.0, "deepseek-v41": 360.0}
    )
    first_compile_extra_s: float = 30.0  # a later first start with torch.compile (not eager)
    serve_extra_s: float = 15.0  # vllm serve's API server and readiness
    server_start_s: float = 5.0  # ple-server, nothing prewarmed
    exact_run_s: float = 4.0  # 8 prompts (2.9 k + 7 short), 32 tokens
    # Concurrency 1, 8, 32 × 512 tokens, plus prefill: measured 5 s (4 layers)
    # and 8.5 s (16 layers from disk) a repetition on an H100.
    tp_rep_s: float = 8.0
    # An 8 000-token prompt twice: 16 prefill chunks each, and from disk its
    # 256 k-512 k rows read once (≈ 100 k reads/s at QD 128).
    ttft_rep_s: float = 4.0
    disk_factor: float = 1.3  # --io direct decode: 0.79–1.0 × stock (H100, 1 GiB row cache)
    resident_s_per_gib: float = 2.0  # tables read into GPU or pinned memory at load
    verify_factor: float = 3.0  # an exact run with every row copied out and compared
    restart_s: float = 110.0  # 3 runs of 32 streams × 3 072 tokens, the events, the starts
    profile_s: float = 40.0  # 2 profiled generates, the traces written and read
    teardown_s: float = 10.0  # ending the process group, writing the JSON
    margin_s: float = 15.0  # kept free before the deadline


@dataclass
class History:
    """Engine starts measured on this host (``<work>/history.json``): whether
    the host has compiled vLLM's kernels yet, and how long a start took. A
    cold start (the host's first, or its first compiled one) is kept apart:
    it says nothing of the next start's time."""

    starts: list[dict] = field(default_factory=list)  # {"api", "mode", "seconds", "cold"}

    @classmethod
    def load(cls, path: Path) -> History:
        try:
            return cls(json.loads(path.read_text())["starts"])
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"starts": self.starts}, indent=1))

    # A model's first start compiles its own kernels (DeepSeek-V4.1's DeepGEMM and
    # TileLang beside Qwen4Exp's Triton and CuTe DSL): starts are kept per model.
    def of_model(self, model: str) -> list[dict]:
        return [s for s in self.starts if s.get("model", "qwen4exp") == model]

    def compiled(self, model: str = "qwen4exp") -> bool:
        return any(s["mode"] != "eager" for s in self.of_model(model))

    def record(self, api: str, mode: str, seconds: float, model: str = "qwen4exp") -> None:
        """A start of ``seconds`` (without the load of resident tables)."""
        cold = not self.of_model(model) or (mode != "eager" and not self.compiled(model))
        self.starts.append(
            {"api": api, "mode": mode, "model": model, "seconds": round(seconds, 1), "cold": cold}
        )

    def measured(self, api: str, mode: str, model: str = "qwen4exp") -> float | None:
        """The latest warm start of this API, mode and model."""
        seen = [
            s["seconds"]
            for s in self.of_model(model)
            if s["api"] == api and s["mode"] == mode and not s.get("cold")
        ]
        return seen[-1] if seen else None


def expected_seconds(cell: Cell, costs: Costs, history: History, table_gib: float = 0.0) -> float:
    """What a cell is expected to take, start to end."""
    model = CHECKPOINTS[cell.checkpoint].model
    measured = history.measured(cell.api, cell.mode, model)
    if measured is not None:
        start = 1.05 * measured
    else:
        start = costs.engine_start_s[cell.mode] + (cell.api == "serve") * costs.serve_extra_s
        if not history.of_model(model):
            start += costs.first_start_extra_s[model]
        elif cell.mode != "eager" and not history.compiled(model):
            start += costs.first_compile_extra_s
    start += resident_load_s(cell, costs, table_gib)
    if cell.shm:
        start += costs.server_start_s
    elif CHECKPOINTS[cell.checkpoint].dummy_weights:
        start += 2 * costs.exact_run_s  # the runs before and after the tables' copy
    rep = costs.tp_rep_s * (costs.disk_factor if cell.io == "direct" else 1.0)
    return (
        start
        + cell.exact_runs * costs.exact_run_s * (costs.verify_factor if cell.verify else 1.0)
        + cell.throughput_reps * rep
        + cell.ttft_reps * costs.ttft_rep_s * (costs.disk_factor if cell.io == "direct" else 1.0)
        + cell.restart * costs.restart_s
        + cell.profile * costs.profile_s
        + costs.teardown_s
    )


def resident_load_s(cell: Cell, costs: Costs, table_gib: float) -> float:
    """The part of a stock engine's start that loads its tables (none for shm)."""
    return 0.0 if cell.shm else costs.resident_s_per_gib * table_gib


@dataclass(frozen=True)
class Decision:
    run: bool
    expected_s: float
    left_s: float
    reason: str


def decide(
    cell: Cell, left_s: float, costs: Costs, history: History, table_gib: float = 0.0
) -> Decision:
    """Run the cell only when it is expected to end before the deadline."""
    expected = expected_seconds(cell, costs, history, table_gib)
    usable = left_s - costs.margin_s
    if expected > usable:
        return Decision(
            False,
            expected,
            left_s,
            f"skipped: expected {expected:.0f} s, {max(usable, 0):.0f} s left before the "
            f"deadline (raise DEADLINE_S, or run it first in the next call)",
        )
    return Decision(True, expected, left_s, f"expected {expected:.0f} s of {usable:.0f} s left")


def plan_text(
    cells: list[Cell], deadline_s: float, costs: Costs, history: History, spent_s: float = 0.0
) -> str:
    """The expected timeline of a call (``bench.real_vllm.coordinator plan``) whose first
    ``spent_s`` seconds went to the install and the checkpoints."""
    lines, clock = [f"{'(install, checkpoints)':<36} {spent_s:>5.0f} s"], spent_s
    history = History(list(history.starts))
    for cell in cells:
        gib = table_gib_estimate(cell.checkpoint)
        d = decide(cell, deadline_s - clock, costs, history, gib)
        if d.run:
            clock += d.expected_s
            guess = costs.engine_start_s[cell.mode] + (cell.api == "serve") * costs.serve_extra_s
            history.record(cell.api, cell.mode, guess, CHECKPOINTS[cell.checkpoint].model)
            lines.append(f"{cell.name:<36} {d.expected_s:>5.0f} s  ends at {clock:>5.0f} s")
        else:
            lines.append(f"{cell.name:<36} {d.expected_s:>5.0f} s  {d.reason}")
    return "\n".join(lines)


def table_gib_estimate(checkpoint: str) -> float:
    """PLE tables of a checkpoint, GiB (16 heads × base rows × 160 columns);
    a DeepSeek-V4.1's Engram tables: the devkit's default (206 MB)."""
    ck = CHECKPOINTS[checkpoint]
    if ck.model == "deepseek-v41":
        return 0.19
    tables = len({4: (2, 3), 16: (2, 6, 10, 14)}[ck.layers])
    row_bytes = 160 * (1 if ck.dtype == "fp8" else 2)
    return tables * 16 * ck.ngram_vocab_base * row_bytes / 2**30


# --------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prose:
    """Real English text and where it came from."""

    documents: tuple[tuple[str, str], ...]  # (name, text)
    source: str

    @property
    def text(self) -> str:
        return "\n\n".join(text for _, text in self.documents)


EXACT_TOPICS = ("execmodel", "exceptions", "truth", "if", "while", "for", "try", "with")


def prose() -> Prose:
    """The Python language reference's topics (``pydoc_data.topics``, which ships
    with Python: the GPU host has no network), sorted by name; the exact
    prompts come from ``EXACT_TOPICS`` first. Without pydoc_data, the
    repository's own documentation."""
    try:
        import pydoc_data.topics as topics

        docs = tuple((name, topics.topics[name]) for name in sorted(topics.topics))
        return Prose(docs, f"pydoc_data.topics of Python {sys.version.split()[0]}")
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        docs = tuple(
            (p.name, p.read_text(errors="replace")) for p in sorted((root / "docs").glob("*.md"))
        )
        return Prose(docs, "the repository's docs/*.md")


def tokens_of(text: str) -> list[int]:
    """The byte-level tokenizer of ``bench/real_vllm/checkpoint.py``: id = byte."""
    return list(text.encode("utf-8"))


def exact_prompts(p: Prose) -> list[list[int]]:
    """8 prompts: the first 2 900 tokens of one topic (several prefill chunks),
    then 7 of 100–400 tokens."""
    by_name = dict(p.documents)
    names = [n for n in EXACT_TOPICS if n in by_name]
    names += [n for n, _ in p.documents if n not in names]
    lengths = [LONG_PROMPT_TOKENS, 100, 150, 200, 250, 300, 350, 400]
    prompts = []
    for name, length in zip(names, lengths, strict=False):
        ids = tokens_of(by_name[name])
        prompts.append(ids[:length])
    return prompts


def throughput_prompts(p: Prose, rep: int, concurrency: int) -> list[list[int]]:
    """``concurrency`` prompts of 256 tokens, text no other (rep, concurrency)
    of the run reads: windows of the whole text after the exact prompts'."""
    ids = tokens_of(p.text)
    slot = sum(CONCURRENCY) * rep + sum(c for c in CONCURRENCY if c < concurrency)
    start = 8 * LONG_PROMPT_TOKENS + slot * TP_PROMPT_TOKENS
    out = []
    for i in range(concurrency):
        a = (start + i * TP_PROMPT_TOKENS) % max(1, len(ids) - TP_PROMPT_TOKENS)
        out.append(ids[a : a + TP_PROMPT_TOKENS])
    return out


def ttft_prompt(p: Prose, rep: int) -> list[int]:
    """An 8 000-token window of the text no throughput prompt of the run reads
    (after 20 repetitions' worth of theirs), new for each repetition."""
    ids = tokens_of(p.text)
    start = 8 * LONG_PROMPT_TOKENS + 20 * sum(CONCURRENCY) * TP_PROMPT_TOKENS
    a = (start + rep * TTFT_PROMPT_TOKENS) % max(1, len(ids) - TTFT_PROMPT_TOKENS)
    return ids[a : a + TTFT_PROMPT_TOKENS]


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


# --------------------------------------------------------------- server figures
SERVER_COUNTERS = (
    "requests",
    "rows",
    "hits",
    "misses",
    "reads",
    "read_bytes",
    "hints_received",
    "hints_read",
)


def server_counters(snapshot: dict) -> dict:
    """The counters of a ``PleClient.query_stats`` snapshot this bench uses,
    summed over the tables, and the request-time histogram's buckets."""
    out = dict.fromkeys(SERVER_COUNTERS, 0)
    buckets: list[int] = []
    io_known = False
    for t in snapshot.get("tables", []):
        out["requests"] += t.get("requests", 0)
        out["rows"] += t.get("rows", 0)
        out["hints_received"] += t.get("hints_received", 0) or 0
        out["hints_read"] += t.get("hints_read", 0) or 0
        io = t.get("io") or {}
        if io.get("hit_rate") is not None or io.get("reads"):
            io_known = True
        for key in ("hits", "misses", "reads", "read_bytes"):
            out[key] += io.get(key, 0) or 0
        b = t.get("server_time", {}).get("buckets", [])
        buckets = [x + y for x, y in zip(buckets, b, strict=True)] if buckets else list(b)
    out["buckets"] = buckets
    out["io_known"] = io_known
    return out


def server_delta(
    before: dict, after: dict, cpu_s: float, wall_s: float, gather_cpu_s: float | None = None
) -> dict:
    """What the server did between two ``server_counters``: the raw counts, kept
    so that measurements can be summed before figures are taken. ``cpu_s``: the
    whole process's CPU; ``gather_cpu_s``: its gather workers' alone (None:
    not measured, and no figure is made of it)."""
    delta = {k: after[k] - before[k] for k in SERVER_COUNTERS}
    delta["buckets"] = [a - b for a, b in zip(after["buckets"], before["buckets"], strict=True)]
    delta["io_known"] = after["io_known"]
    delta["cpu_s"] = cpu_s
    if gather_cpu_s is not None:
        delta["gather_cpu_s"] = gather_cpu_s
    delta["wall_s"] = wall_s
    return delta


def add_deltas(deltas: list[dict]) -> dict | None:
    deltas = [d for d in deltas if d]
    if not deltas:
        return None
    total = {k: sum(d[k] for d in deltas) for k in (*SERVER_COUNTERS, "cpu_s", "wall_s")}
    if all("gather_cpu_s" in d for d in deltas):  # (not in runs before it was measured)
        total["gather_cpu_s"] = sum(d["gather_cpu_s"] for d in deltas)
    total["buckets"] = [sum(col) for col in zip(*(d["buckets"] for d in deltas), strict=True)]
    total["io_known"] = any(d["io_known"] for d in deltas)
    return total


def bucket_quantile(buckets: list[int], q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding quantile ``q`` of the
    server's request-time histogram (``pleserver.observe.stats.bucket_quantile``)."""
    from pleserver.observe.stats import bucket_quantile as quantile

    return quantile(buckets, q)


def server_figures(delta: dict | None) -> dict:
    """Hit rate, miss reads/s, lookup p50/p99 and CPU per row of a delta."""
    if not delta:
        return {}
    wall = delta["wall_s"] or math.nan
    looked = delta["hits"] + delta["misses"]
    return {
        "rows": delta["rows"],
        "hit_rate": delta["hits"] / looked if delta["io_known"] and looked else None,
        "misses_per_s": delta["misses"] / wall if delta["io_known"] else None,
        "reads_per_s": delta["reads"] / wall if delta["io_known"] else None,
        "lookup_p50_s": bucket_quantile(delta["buckets"], 0.5),
        "lookup_p99_s": bucket_quantile(delta["buckets"], 0.99),
        "cpu_s": delta["cpu_s"],
        "cpu_us_per_miss": (
            1e6 * delta["cpu_s"] / delta["misses"]
            if delta["io_known"] and delta["misses"]
            else None
        ),
        # The miss path's own CPU (the gather workers: probe, reads, copies),
        # beside the process's, whose serving loop spins between requests.
        "gather_cpu_us_per_miss": (
            1e6 * delta["gather_cpu_s"] / delta["misses"]
            if delta["io_known"] and delta["misses"] and "gather_cpu_s" in delta
            else None
        ),
        "cpu_us_per_row": 1e6 * delta["cpu_s"] / delta["rows"] if delta["rows"] else None,
        "hints_received": delta["hints_received"],
        "hints_read": delta["hints_read"],
    }


# ------------------------------------------------------------------- the figures
def spread(values: list[float]) -> dict | None:
    """min / median / max of repetitions."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None
    return {
        "n": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation: a figure that was measured)."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def steady_window(token_times: Iterable[Sequence[float]]) -> dict | None:
    """The window where every request decodes (module docstring, "Decode
    rate"): from the last request's first token to the first request's last,
    and the tokens made in it (after its start, up to its end). None when the
    window is empty: a request ended before another's first token, or one
    request made fewer than two tokens."""
    times = [sorted(t) for t in token_times]
    if not times or any(len(t) < 2 for t in times):
        return None
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    if end <= start:
        return None
    tokens = sum(bisect.bisect_right(t, end) - bisect.bisect_right(t, start) for t in times)
    return {"requests": len(times), "tokens": tokens, "window_s": end - start}


def decode_tok_s(rep: dict) -> float | None:
    """A repetition's decode tokens/s (``steady_window``), or None without a
    window."""
    window = rep.get("steady")
    if not window or not window.get("window_s"):
        return None
    return window["tokens"] / window["window_s"]


def ttft_figures(reps: list[dict]) -> dict[str, dict]:
    """Per kind (``unread``, ``read``): the 8 000-token prompt's TTFT spread over
    the repetitions, and the server's figures over them."""
    out: dict[str, dict] = {}
    for kind in ("unread", "read"):
        rs = [r for r in reps if r["kind"] == kind and r.get("ttft_s")]
        if rs:
            out[kind] = {
                "ttft_s": spread([r["ttft_s"] for r in rs]),
                "server": server_figures(add_deltas([r.get("server") for r in rs])),
            }
    return out


def throughput_figures(reps: list[dict]) -> dict[int, dict]:
    """Per concurrency: tokens/s spread over repetitions, TTFT and TPOT p50/p99
    over every request of them, server figures over their sum (and of the
    first repetition alone: the cold one on a fresh server)."""
    out: dict[int, dict] = {}
    for c in sorted({r["concurrency"] for r in reps}):
        rs = [r for r in reps if r["concurrency"] == c and r.get("tok_s") is not None]
        ttft = [x for r in rs for x in r.get("ttft_s") or [] if x is not None]
        tpot = [x for r in rs for x in r.get("tpot_s") or [] if x is not None]
        decode = [decode_tok_s(r) for r in rs]
        out[c] = {
            "tok_s": spread([r["tok_s"] for r in rs]),
            "tok_s_each": [r["tok_s"] for r in rs],
            "decode_tok_s": spread([d for d in decode if d is not None]),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5),
            "tpot_p99_s": percentile(tpot, 0.99),
            "server": server_figures(add_deltas([r.get("server") for r in rs])),
            "server_first": server_figures(rs[0].get("server")) if rs else {},
        }
    return out


# -------------------------------------------------------------------- summary
def load_cells(dirs: Iterable[Path]) -> list[dict]:
    """Every cell JSON under the directories, once each (a cell copied to two
    places counts once: its run id and name)."""
    seen: dict[tuple, dict] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("**/*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("format") == CELL_FORMAT:
                seen.setdefault((data.get("run_id"), data.get("name")), data)
    return sorted(seen.values(), key=lambda d: (d.get("run_id") or "", d.get("order", 0)))


def judgments(cells: list[dict]) -> dict[str, dict]:
    """Every shm (and vLLM offload) cell's exact runs, judged against the stock
    runs of its reference key (all runs loaded); per cell: verdicts and a
    one-line result."""
    from bench.real_vllm.exact import Outcome, distinct_outcomes, judge

    stock: dict[tuple[str, str, str], list[Outcome]] = {}
    for c in cells:
        if c["cell"]["backend"] == "stock":
            exact = c.get("exact") or {}
            for run in exact.get("runs", []):
                o = Outcome.from_json(run)
                key = (c["cell"]["reference_key"], o.prompts_digest, submission(c))
                stock.setdefault(key, []).append(o)
    out: dict[str, dict] = {}
    for c in cells:
        key = _cell_key(c)
        runs = [Outcome.from_json(r) for r in (c.get("exact") or {}).get("runs", [])]
        if not runs:
            continue
        if c["cell"]["backend"] == "stock":
            out[key] = {
                "line": f"{c['cell']['backend']}: {len(runs)} runs, "
                f"{distinct_outcomes(runs)} distinct outcome(s)",
                "verdicts": [],
            }
            continue
        refs = stock.get((c["cell"]["reference_key"], runs[0].prompts_digest, submission(c)), [])
        if len(refs) < 2:
            out[key] = {
                "line": f"no verdict: {len(refs)} stock run(s) of "
                f"{c['cell']['reference_key']} (2 needed)",
                "verdicts": [],
            }
            continue
        verdicts = [judge(refs, r) for r in runs]
        passed = sum(v.passed for v in verdicts)
        same = sum(v.how == "identical" for v in verdicts)
        worst = next((v for v in verdicts if not v.passed), verdicts[0])
        word = "PASS" if passed == len(verdicts) else "FAIL"
        out[key] = {
            "line": f"{word} {passed}/{len(verdicts)} ({same} identical to a stock run; "
            f"{len(refs)} stock runs, {verdicts[0].stock_outcomes} distinct)"
            + ("" if word == "PASS" else f": {worst.detail}"),
            "verdicts": [v.to_json() for v in verdicts],
        }
    return out


def route_mismatch(c: dict) -> str | None:
    """What a shm cell's workers ran, where it is not what the cell asked for
    (``routes_run``, from their logs): its figures are not the named way's."""
    ran = c.get("routes_run")
    cell = c.get("cell") or {}
    if ran is None or cell.get("backend") != "shm":
        return None
    ops = cell.get("gpu_ops") or _gpu_ops()[0]  # (None: the plugin's default)
    wanted = "host" if cell.get("route") == "host" else f"gpu:{ops}"
    if not ran:
        return f"NOT AS NAMED: no worker said which route it ran (wanted {wanted})"
    if set(ran) != {wanted}:
        return f"NOT AS NAMED: its workers ran {', '.join(ran)}, not {wanted}"
    return None


def cell_brief(c: dict) -> str:
    """One line of what a cell measured, printed as it ends."""
    from bench.real_vllm.exact import Outcome, distinct_outcomes

    parts = []
    runs = [Outcome.from_json(r) for r in (c.get("exact") or {}).get("runs", [])]
    if runs:
        parts.append(f"{len(runs)} exact runs, {distinct_outcomes(runs)} distinct")
    reps = (c.get("throughput") or {}).get("reps", [])
    if reps:
        figures = throughput_figures(reps)
        parts.append(
            "tok/s "
            + ", ".join(
                f"c{conc} {_num((f['tok_s'] or {}).get('median'))}" for conc, f in figures.items()
            )
        )
        parts.append(
            "decode/s "
            + ", ".join(
                f"c{conc} {_num((f['decode_tok_s'] or {}).get('median'))}"
                for conc, f in figures.items()
            )
        )
    timed = ttft_figures((c.get("ttft") or {}).get("reps", []))
    if timed:
        parts.append(
            "8k TTFT ms "
            + ", ".join(f"{kind} {_ms(f['ttft_s']['median'])}" for kind, f in timed.items())
        )
    srv = (c.get("server") or {}).get("cell")
    if srv:
        f = server_figures(srv)
        parts.append(
            f"server hit {_pct(f.get('hit_rate'))} %, lookup p99 {_ms(f.get('lookup_p99_s'))} ms"
        )
    return "; ".join(parts)


def _cell_key(c: dict) -> str:
    return f"{c.get('run_id', '?')}/{c['name']}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def load_runs(dirs: Iterable[Path]) -> list[dict]:
    """Every run's ``run.json`` under the directories (the disk probe, the host)."""
    runs: dict[str, dict] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("**/run.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("format") == RUN_FORMAT:
                runs.setdefault(data.get("run_id", str(path)), data)
    return [runs[k] for k in sorted(runs)]


def submission(c: dict) -> str:
    """How a cell's exact runs submitted their prompts: ``at_once`` (every
    prompt queued together; cells written before the field) or ``in_turn``
    (``vllm serve``: one after another). Runs are judged only against stock
    runs submitted alike: stock sent its prompts concurrently over HTTP gave 5
    outcomes in 6 runs, a spread no in-turn run should be judged by."""
    return (c.get("exact") or {}).get("submission", "at_once")


def references(cells: list[dict]) -> list[str]:
    """Per reference key: the stock engines, their exact runs and how many
    distinct outcomes they gave (1: stock reproduced itself)."""
    from bench.real_vllm.exact import Outcome, distinct_outcomes

    by_key: dict[tuple[str, str, str], tuple[set, list]] = {}
    for c in cells:
        if c["cell"]["backend"] != "stock":
            continue
        for run in (c.get("exact") or {}).get("runs", []):
            o = Outcome.from_json(run)
            engines, runs = by_key.setdefault(
                (c["cell"]["reference_key"], o.prompts_digest, submission(c)), (set(), [])
            )
            engines.add(_cell_key(c))
            runs.append(o)
    return [
        f"{key + ('' if sent == 'at_once' else ' ' + sent):<34} {len(engines)} engine(s), "
        f"{len(runs)} runs, {distinct_outcomes(runs)} distinct outcome(s)"
        for (key, _, sent), (engines, runs) in sorted(by_key.items())
    ]


def summary(cells: list[dict], runs: Iterable[dict] = ()) -> str:
    """The tables a run prints at its end (``bench.real_vllm.coordinator summary`` for any set
    of cell JSONs and run.json files)."""
    lines = []
    for run in runs:
        disk = run.get("disk") or {}
        for r in disk.get("results", []):
            lat, cpu = r.get("mean_latency_s"), r.get("cpu_us_per_read")
            lines.append(
                f"== disk ({run.get('run_id')}): QD {r['queue_depth']}: "
                f"{r['reads_per_s']:,.0f} reads/s of {r.get('block', 4096)} B, mean latency "
                f"{'-' if lat is None else f'{1e6 * lat:.0f} µs'}"
                f"{'' if cpu is None else f', {cpu:.1f} µs of CPU a read'}"
                f"{'' if r.get('direct') else ' (page cache, not O_DIRECT)'}"
            )
        if disk.get("error"):
            lines.append(f"== disk ({run.get('run_id')}): probe failed: {disk['error']}")
    if lines:
        lines.append("")
    lines.append("== cells")
    lines.append(f"{'cell':<40} {'status':<8} {'start s':>8} {'total s':>8}  note")
    for c in cells:
        t = c.get("times") or {}
        note = c.get("error") or c.get("reason") or route_mismatch(c) or ""
        lines.append(
            f"{c['name']:<40} {c.get('status', '?'):<8} {_num(t.get('engine_start_s')):>8} "
            f"{_num(t.get('total_s')):>8}  {note[:100]}"
        )
    refs = references(cells)
    if refs:
        lines += ["", "== stock references (exact runs of every stock engine of a key)", *refs]
    verdicts = judgments(cells)
    if verdicts:
        lines += ["", "== exactness (shm and offload against every stock run of their reference)"]
        for c in cells:
            v = verdicts.get(_cell_key(c))
            if v:
                lines.append(f"{c['name']:<40} {c['cell']['reference_key']:<30} {v['line']}")
    checked = [c for c in cells if c.get("verify")]
    if checked:
        lines += ["", "== every PLE row of the engine's steps against the checkpoint (verify)"]
        for c in checked:
            v = c["verify"]
            verdict = (
                "PASS: bit-equal"
                if v.get("rows") and not v.get("mismatched_rows")
                else f"FAIL: {v.get('mismatched_rows', '?')} rows differ"
                if v.get("mismatched_rows")
                else "no rows checked"
            )
            lines.append(
                f"{c['name']:<40} {v.get('layers', 0)} layers, {v.get('lookups', 0)} lookups, "
                f"{v.get('rows', 0)} rows: {verdict}"
                + "".join(f"\n    {m}" for m in v.get("mismatches", []))
            )
    tabled = [c for c in cells if c.get("engram_tables")]
    if tabled:
        lines += [
            "",
            "== stock's Engram tables copied in (dummy weights): did they change its output?",
        ]
        for c in tabled:
            t = c["engram_tables"]
            other = len(t["prompts_with_other_tokens"])
            verdict = (
                "NO: the output ignores the rows, so exactness says nothing of them"
                if not t["output_changed"]
                else f"yes, {other} prompts' tokens differ (exactness tests the rows)"
                if other
                else "yes, in the logprobs only (exactness tests the rows)"
            )
            lines.append(f"{c['name']:<40} {len(t['loaded'])} tensors: {verdict}")
    lines += streams_lines(cells)
    served = [c for c in cells if (c.get("server") or {}).get("cell")]
    if served:
        lines += [
            "",
            "== ple-server over each shm cell (from the engine's readiness to its end; "
            "vLLM's start-up profiling looked up 'start rows')",
            f"{'cell':<40} {'io':<7} {'start rows':>10} {'rows':>10} {'hit %':>6} "
            f"{'lookup p50/p99 ms':>17} {'cpu s':>7} {'cpu µs/miss':>11} "
            f"{'gather µs/miss':>14} {'hints read':>10}",
        ]
        for c in served:
            srv = c["server"]
            f = server_figures(srv["cell"])
            lines.append(
                f"{c['name']:<40} {c['cell']['io']:<7} "
                f"{(srv.get('at_ready') or {}).get('rows', 0):>10} {f['rows']:>10} "
                f"{_pct(f.get('hit_rate')):>6} "
                f"{_ms(f.get('lookup_p50_s')) + '/' + _ms(f.get('lookup_p99_s')):>17} "
                f"{f['cpu_s']:>7.2f} {_num(f.get('cpu_us_per_miss'), '.1f'):>11} "
                f"{_num(f.get('gather_cpu_us_per_miss'), '.1f'):>14} {f['hints_read']:>10}"
            )
    tp = [c for c in cells if (c.get("throughput") or {}).get("reps")]
    if tp:
        stock_median = _stock_medians(tp)
        lines += [
            "",
            "== throughput: output tok/s median [min-max] over interleaved repetitions, and "
            "the first one's (a fresh server's cold start);",
            "   TTFT and TPOT ms p50/p99 over every request; server figures over the "
            "repetitions (hit rate, miss reads/s, lookup time, CPU per row read from disk)",
            f"{'cell':<34} {'c':>3} {'tok/s':>7} {'[min-max]':>13} {'×stock':>6} {'1st':>6} "
            f"{'1st hit%':>8} {'TTFT p50/p99':>15} {'TPOT p50/p99':>13} {'hit %':>6} "
            f"{'miss/s':>8} {'lookup p50/p99 ms':>17} {'cpu µs/miss':>11}",
        ]
        for c in tp:
            figures = throughput_figures(c["throughput"]["reps"])
            for conc, f in figures.items():
                sp, srv, first = f["tok_s"] or {}, f["server"], f["server_first"]
                base = stock_median.get((c["cell"]["reference_key"], conc))
                ratio = (
                    f"{sp['median'] / base:.2f}"
                    if sp and base and c["cell"]["backend"] != "stock"
                    else ""
                )
                first_tok = f["tok_s_each"][0] if f["tok_s_each"] else None
                lines.append(
                    f"{c['name']:<34} {conc:>3} {_num(sp.get('median')):>7} "
                    f"{'[' + _num(sp.get('min')) + '-' + _num(sp.get('max')) + ']':>13} "
                    f"{ratio:>6} {_num(first_tok):>6} {_pct(first.get('hit_rate')):>8} "
                    f"{_ms(f['ttft_p50_s']) + '/' + _ms(f['ttft_p99_s']):>15} "
                    f"{_ms(f['tpot_p50_s']) + '/' + _ms(f['tpot_p99_s']):>13} "
                    f"{_pct(srv.get('hit_rate')):>6} {_num(srv.get('misses_per_s')):>8} "
                    f"{_ms(srv.get('lookup_p50_s')) + '/' + _ms(srv.get('lookup_p99_s')):>17} "
                    f"{_num(srv.get('cpu_us_per_miss'), '.1f'):>11}"
                )
        lines += decode_lines(tp)
        lines += vllm_steps.summary_lines(tp, _stock_step_ms(tp))
    lines += ttft_lines(cells)
    lines += gpu_trace.summary_lines(cells)
    return "\n".join(lines)


def decode_lines(cells: list[dict]) -> list[str]:
    """The decode rate (``steady_window``) of each throughput cell, against stock's."""
    stock = _stock_pool(cells, "throughput", _concurrency, lambda r: [decode_tok_s(r)])
    lines = [
        "",
        "== decode: tok/s while every request decodes (from the last first token to the "
        "first last one: no prefill step in it), median [min-max] over the repetitions, "
        "and the first one's",
        f"{'cell':<34} {'c':>3} {'decode/s':>8} {'[min-max]':>13} {'×stock':>6} {'1st':>6} "
        f"{'1st ×stock':>10}",
    ]
    for c in cells:
        for conc, f in throughput_figures(c["throughput"]["reps"]).items():
            sp = f["decode_tok_s"] or {}
            base = stock.get((c["cell"]["reference_key"], conc))
            firsts = [decode_tok_s(r) for r in c["throughput"]["reps"] if r["concurrency"] == conc]
            first = firsts[0] if firsts else None
            mine = c["cell"]["backend"] != "stock" and base
            lines.append(
                f"{c['name']:<34} {conc:>3} {_num(sp.get('median')):>8} "
                f"{'[' + _num(sp.get('min')) + '-' + _num(sp.get('max')) + ']':>13} "
                f"{_num(sp['median'] / statistics.median(base), '.2f') if mine and sp else '':>6} "
                f"{_num(first):>6} "
                f"{_num(first / base[0], '.2f') if mine and first else '':>10}"
            )
    return lines


def ttft_lines(cells: list[dict]) -> list[str]:
    """The ``ttft`` cells: the 8 000-token prompt's TTFT unread and read, against
    stock's (the median of every stock engine of the reference)."""
    timed = [c for c in cells if (c.get("ttft") or {}).get("reps")]
    if not timed:
        return []
    stock = _stock_pool(timed, "ttft", lambda r: r["kind"], lambda r: [r.get("ttft_s")])
    lines = [
        "",
        f"== TTFT of a {TTFT_PROMPT_TOKENS}-token prompt alone, ms median [min-max]: "
        "'unread' new text, 'read' the same text again (its rows read before it)",
        f"{'cell':<34} {'kind':<7} {'TTFT ms':>8} {'[min-max]':>15} {'×stock':>6} "
        f"{'hit %':>6} {'lookup p50/p99 ms':>17}",
    ]
    for c in timed:
        for kind, f in ttft_figures(c["ttft"]["reps"]).items():
            sp, srv = f["ttft_s"], f["server"]
            base = stock.get((c["cell"]["reference_key"], kind))
            ratio = (
                f"{sp['median'] / statistics.median(base):.2f}"
                if base and c["cell"]["backend"] != "stock"
                else ""
            )
            lines.append(
                f"{c['name']:<34} {kind:<7} {_ms(sp['median']):>8} "
                f"{'[' + _ms(sp['min']) + '-' + _ms(sp['max']) + ']':>15} {ratio:>6} "
                f"{_pct(srv.get('hit_rate')):>6} "
                f"{_ms(srv.get('lookup_p50_s')) + '/' + _ms(srv.get('lookup_p99_s')):>17}"
            )
    return lines


def streams_lines(cells: list[dict]) -> list[str]:
    """The restart cells: per run, its failed streams and its longest token gap;
    each event's stall; and each run's tokens judged against every stock
    streams run of its reference (``exact``'s rule, tokens only)."""
    from bench.real_vllm.exact import Outcome, distinct_outcomes, judge

    restart = [c for c in cells if (c.get("restart") or {}).get("runs")]
    if not restart:
        return []
    stock: dict[tuple[str, str], list[Outcome]] = {}
    for c in restart:
        if c["cell"]["backend"] == "stock":
            for run in c["restart"]["runs"].values():
                if run.get("outcome"):
                    o = Outcome.from_json(run["outcome"])
                    stock.setdefault((c["cell"]["reference_key"], o.prompts_digest), []).append(o)
    lines = [
        "",
        f"== streams under restarts ({RESTART_STREAMS} greedy streams of {RESTART_TOKENS} "
        "tokens; shm: ple-server disturbed in the second run; tokens judged against every "
        "stock streams run)",
        f"{'cell':<40} {'run':<10} {'failed':>6} {'wall s':>7} {'gap max ms':>10}  output",
    ]
    for c in restart:
        for name, run in c["restart"]["runs"].items():
            if not run.get("outcome"):
                verdict = "-"
            elif c["cell"]["backend"] == "stock":
                verdict = "reference"
            else:
                o = Outcome.from_json(run["outcome"])
                refs = stock.get((c["cell"]["reference_key"], o.prompts_digest), [])
                if len(refs) < 2:
                    verdict = f"no verdict: {len(refs)} stock streams run(s) (2 needed)"
                else:
                    v = judge(refs, o)
                    verdict = f"{'PASS' if v.passed else 'FAIL'} {v.how}: {v.detail}"
            lines.append(
                f"{c['name']:<40} {name:<10} {len(run.get('failed', [])):>6} "
                f"{_num(run.get('wall_s'), '.1f'):>7} {_num(run.get('gap_max_ms')):>10}  "
                f"{verdict}"
            )
        for e in c["restart"].get("events", []):
            lines.append(
                f"{'':<40} {e['kind']:<14} at {e.get('at')} s: server start "
                f"{_num(e.get('server_start_s'), '.2f')} s, stall {_num(e.get('stall_s'), '.2f')} s"
            )
    for (key, _), runs in sorted(stock.items()):
        lines.append(
            f"stock streams of {key}: {len(runs)} runs, {distinct_outcomes(runs)} distinct"
        )
    return lines


def _stock_pool(
    cells: list[dict],
    section: str,
    key: Callable[[dict], object],
    values: Callable[[dict], Iterable[float | None]],
) -> dict[tuple[str, Any], list[float]]:
    """The figures ``values(rep)`` of every repetition in ``section`` of every
    stock cell, pooled per (reference key, ``key(rep)``), in order (a key's
    first figure is the first repetition of its first stock engine)."""
    pooled: dict[tuple[str, Any], list[float]] = {}
    for c in cells:
        if c["cell"]["backend"] != "stock":
            continue
        for r in (c.get(section) or {}).get("reps", []):
            figures = [v for v in values(r) if v is not None]
            if figures:
                pooled.setdefault((c["cell"]["reference_key"], key(r)), []).extend(figures)
    return pooled


def _concurrency(rep: dict) -> int:
    return rep["concurrency"]


def _stock_step_ms(cells: list[dict]) -> dict[tuple[str, Any], float]:
    """Stock's decode step (ms) per (reference key, concurrency): the
    concurrency over its median decode rate (``steady_window``), every
    repetition of every stock engine of that key. A request's TPOT is no
    measure of the step: it carries the prefill steps of the prompts that came
    after its own (5.2 ms where the decode step took 4.3)."""
    pooled = _stock_pool(cells, "throughput", _concurrency, lambda r: [decode_tok_s(r)])
    return {k: 1e3 * k[1] / statistics.median(v) for k, v in pooled.items()}


def _stock_medians(cells: list[dict]) -> dict[tuple[str, Any], float]:
    """Median tok/s of the stock cells per (reference key, concurrency), over
    every repetition of every stock engine of that key."""
    pooled = _stock_pool(cells, "throughput", _concurrency, lambda r: [r.get("tok_s")])
    return {k: statistics.median(v) for k, v in pooled.items()}
