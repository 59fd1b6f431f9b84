"""``pleserver plan``: size ple-server for a box beside vLLM, with the arithmetic.

What vLLM takes comes first. On a unified-memory box (DGX Spark, GX10: the
GPU allocates from the same RAM) it is ``--gpu-memory-utilization`` of the
box's memory, weights and KV cache and activations alike, and vLLM refuses
to start when less than that is free; the OS and its services hold their
part (``--system``); ple-server gets what is left. On a box with a discrete
GPU, vLLM's share is of the GPU's own memory, and ple-server's room is the
RAM less the system's part.

From there, as the server itself decides (``pleserver.data.budget``):

- ``cache_size``: on unified memory ``UNIFIED_CACHE_SHARE`` of what is left
  (the server's own default when the utilization is vLLM's 0.9), on a
  discrete box ``CACHE_SHARE`` of the memory less ``prewarm_reserve``; at
  least ``MIN_CACHE_BYTES``, at most what the tables need;
- ``io``: ``mmap`` when the tables fit in that cache, else ``direct``;
- ``prewarm_budget`` (``mmap`` only): what is left once ple-server's other
  memory and ``prewarm_reserve`` are taken, at most the tables;

and what ple-server needs beside the row cache: what it uses at start, the
read buffers' bound, the hot set's keys and the hints, the channels. Every
term is a line of the report (``Plan.vllm``, ``Plan.server``); ``warnings``
say what does not fit: vLLM's share without room for the weights (and the KV
cache asked for), vLLM's share and ple-server's together past the box, a row
cache smaller than the hot set, mapped tables larger than what is left.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pleclient.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    discover_tables,
    local_model_dir,
    read_header,
)
from pleclient.families import FAMILIES
from pleclient.protocol import ChannelLayout
from pleserver.box import SYSTEM_RESERVE, VLLM_GPU_MEMORY_UTILIZATION, Box
from pleserver.config import ServerConfig
from pleserver.data import hints
from pleserver.data.budget import CACHE_SHARE, MIN_CACHE_BYTES, UNIFIED_CACHE_SHARE, unified_room
from pleserver.observe.stats import format_bytes

START_BYTES = 25 << 20
"""What a server holds once started, before its row cache and requests
(measured: deploy/README.md, Sizing)."""
DEFAULT_ROW_BYTES = 320
"""The widest row assumed without a checkpoint: BF16 rows of 160 columns."""
DEFAULTS = ServerConfig()


@dataclass(frozen=True)
class Checkpoint:
    """What ``plan`` needs of a checkpoint (bytes)."""

    weights: int  # the safetensors tensors that are not PLE tables: what vLLM loads
    tables: int  # the PLE tables, as the server serves them
    row_bytes: int  # the widest served row
    rows: int  # every table's rows together


def read_checkpoint(model: str) -> Checkpoint:
    """The sizes of ``model``'s checkpoint; raises ``CheckpointError`` (every
    problem, as ``pleserver inspect`` names them)."""
    tables = discover_tables(model, fingerprint=False)
    folder = local_model_dir(model)
    index = os.path.join(folder, INDEX_FILE)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if os.path.exists(index):  # vLLM loads the files the index names
        try:
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(folder, [f"{index}: unreadable index ({exc})"]) from exc
        files = sorted(os.path.join(folder, n) for n in names)
    weights = 0
    problems: list[str] = []
    for path in files:
        tensors, bad = read_header(path)
        problems += bad
        weights += sum(
            t.nbytes for t in tensors.values() if not any(f.owns(t.name) for f in FAMILIES)
        )
    if problems:
        raise CheckpointError(folder, problems)
    return Checkpoint(
        weights,
        sum(t.nbytes for t in tables),
        max(t.row_bytes for t in tables),
        sum(t.rows for t in tables),
    )


@dataclass(frozen=True)
class Inputs:
    """What ``plan`` is asked: the box, what vLLM takes, the tables (bytes)."""

    box: Box
    box_source: str  # where its memory figure came from
    tables: int
    tables_source: str
    weights: int | None = None
    weights_source: str = ""
    row_bytes: int = DEFAULT_ROW_BYTES
    rows: int | None = None  # None: the tables over row_bytes
    utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    kv_cache: int | None = None
    system: int = SYSTEM_RESERVE
    reserve: int = DEFAULTS.prewarm_reserve
    io: str = "auto"
    clients: int = 1
    hot_set: int | None = None


class PlanError(ValueError):
    """What ``plan`` was asked cannot be planned: the message says what to give."""


def gather_inputs(
    *,
    model: str | None,
    tables: int | None,
    weights: int | None,
    memory: int | None,
    unified: bool | None,
    row_bytes: int | None,
    utilization: float,
    clients: int,
    **rest: Any,
) -> Inputs:
    """``Inputs`` from what the command line gave: the checkpoint's sizes
    (``model``; ``tables`` and ``weights`` say them without one), the box
    (``memory`` and ``unified``; this one, detected, without them). Raises
    ``PlanError`` for a plan that cannot be made, ``CheckpointError`` for a
    checkpoint that cannot be read."""
    from pleserver.box import detect_unified
    from pleserver.host import meminfo_path, read_meminfo

    if not 0 < utilization <= 1:
        raise PlanError(
            f"--gpu-memory-utilization is a share of the memory, above 0 and at most 1 "
            f"(vLLM's default: {VLLM_GPU_MEMORY_UTILIZATION}), got {utilization}"
        )
    if clients < 1 or (row_bytes is not None and row_bytes < 1):
        raise PlanError("--clients and --row-bytes count at least 1")
    if memory is not None:
        if unified is None:  # another box: its GPU is not this one's to detect
            raise PlanError(
                "--memory describes a box other than this one: say whether its GPU "
                "allocates from that memory, --unified (DGX Spark, GX10, Jetson) or "
                "--discrete (a GPU with memory of its own)"
            )
        source = "--memory"
        why = "--unified" if unified else "--discrete"
    else:
        memory = read_meminfo("MemTotal")
        if memory is None:
            raise PlanError(
                f"cannot read MemTotal from {meminfo_path()}: give the box's memory, --memory SIZE"
            )
        source = f"this box's MemTotal ({meminfo_path()})"
        if unified is None:
            unified, why, guessed = detect_unified()
            if guessed:  # a plan on a guess would be wrong one way or the other
                raise PlanError(
                    f"cannot tell whether this box's GPU shares its memory ({why}); for the "
                    "plan, say --unified or --discrete"
                )
        else:
            why = "--unified" if unified else "--discrete"
    box = Box(memory, None, unified, why)
    rows = None
    weights_source = "--weights" if weights is not None else ""
    if model is not None:
        found = read_checkpoint(model)
        if tables is None:
            tables, tables_source = found.tables, f"the PLE tables of {model}"
            rows = found.rows
        else:
            tables_source = "--tables"
        if weights is None:
            weights = found.weights
            weights_source = f"the safetensors of {model} less its PLE tables"
        if row_bytes is None:
            row_bytes = found.row_bytes
    elif tables is None:
        raise PlanError(
            "give the checkpoint, --model DIR (its PLE tables and its weights are read), "
            "or the PLE tables' size, --tables SIZE (and the weights', --weights SIZE)"
        )
    else:
        tables_source = "--tables"
    if tables <= 0:
        raise PlanError(f"the PLE tables hold no bytes ({tables_source}): give their size")
    return Inputs(
        box=box,
        box_source=source,
        tables=tables,
        tables_source=tables_source,
        weights=weights,
        weights_source=weights_source,
        row_bytes=row_bytes or DEFAULT_ROW_BYTES,
        rows=rows,
        utilization=utilization,
        clients=clients,
        **rest,
    )


@dataclass(frozen=True)
class Term:
    """One line of the arithmetic: ``sign`` (``""``, ``"−"``, ``"+"``, ``"="``)
    and its bytes, what it is, how it is reckoned."""

    name: str
    value: int | None
    how: str
    sign: str = ""
    indent: int = 0

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.value, "sign": self.sign, "how": self.how}


@dataclass(frozen=True)
class Setting:
    """A setting of the config file: its value as written (None: leave it
    out) and why."""

    name: str
    value: str | None
    why: str
    bytes: int | None = None


@dataclass
class Plan:
    inputs: Inputs
    vllm: list[Term] = field(default_factory=list)
    server: list[Term] = field(default_factory=list)
    settings: list[Setting] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.warnings

    def to_json(self) -> dict:
        i = self.inputs
        return {
            "fits": self.fits,
            "box": {**i.box.to_json(), "memory_source": i.box_source},
            "inputs": {
                "gpu_memory_utilization": i.utilization,
                "weights_bytes": i.weights,
                "weights_source": i.weights_source or None,
                "tables_bytes": i.tables,
                "tables_source": i.tables_source,
                "row_bytes": i.row_bytes,
                "kv_cache_bytes": i.kv_cache,
                "system_bytes": i.system,
                "prewarm_reserve_bytes": i.reserve,
                "io": i.io,
                "clients": i.clients,
                "hot_set_bytes": i.hot_set,
            },
            "vllm": [t.to_json() for t in self.vllm],
            "server": [t.to_json() for t in self.server],
            "settings": {
                s.name: {"value": s.value, "bytes": s.bytes, "why": s.why} for s in self.settings
            },
            "warnings": self.warnings,
        }


def size_text(n: int) -> str:
    """A size for the config file, rounded down (never more than planned) to
    the largest unit that loses under a tenth of it: ``3G``, ``1587M``."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        whole = n >> shift
        if whole and n - (whole << shift) < n / 10:
            return f"{whole}{unit}"
    return str(n)


def make_plan(i: Inputs) -> Plan:
    """The arithmetic for ``i``: the module's docstring says what and why."""
    plan = Plan(i)
    total = i.box.memory
    assert total is not None  # (the command says so before it gets here)
    shown_total = format_bytes(total)
    v = plan.vllm
    v.append(Term("memory", total, i.box_source))
    if i.box.unified:
        share = int(i.utilization * total)
        v.append(
            Term(
                "vLLM's share",
                share,
                f"{i.utilization} × {shown_total} (--gpu-memory-utilization)",
                "−",
            )
        )
        if i.weights is not None:
            v.append(Term("weights", i.weights, i.weights_source, indent=1))
            rest = share - i.weights
            v.append(
                Term(
                    "KV cache and activations",
                    rest,
                    f"{format_bytes(share)} − {format_bytes(i.weights)} of weights",
                    indent=1,
                )
            )
            need = i.weights + (i.kv_cache or 0)
            if need > share:
                asked = (
                    f"the weights ({format_bytes(i.weights)}) and the KV cache asked "
                    f"for ({format_bytes(i.kv_cache)})"
                    if i.kv_cache
                    else f"the weights ({format_bytes(i.weights)})"
                )
                # A GiB more for the activations; the system and a minimal
                # ple-server must still fit beside.
                enough = _ceil2((need + (1 << 30)) / total)
                fix = (
                    f"raise --gpu-memory-utilization to at least {enough} (a GiB more for "
                    "the activations)"
                    if enough * total + i.system + MIN_CACHE_BYTES < total
                    else "this box cannot hold them beside the system: serve a smaller "
                    "model, or one quantized further"
                )
                plan.warnings.append(
                    f"vLLM's share ({i.utilization} × {shown_total} = {format_bytes(share)}) "
                    f"does not hold {asked}: vLLM would fail to start or have no room for a "
                    f"KV cache; {fix}"
                )
        elif i.kv_cache is not None:
            v.append(Term("KV cache asked for", i.kv_cache, "--kv-cache", indent=1))
        v.append(Term("the system", i.system, "OS and services (--system)", "−"))
        left = total - share - i.system
        v.append(Term("left for ple-server", left, "", "="))
        room = unified_room(total, i.utilization, i.system)  # left, not below 0
        cache = int(room * UNIFIED_CACHE_SHARE)
        cache_how = f"{UNIFIED_CACHE_SHARE:.0%} × {format_bytes(room)} left for ple-server"
        quarter = int(max(0, total - i.reserve) * CACHE_SHARE)
        if quarter < cache:  # as the server: never more than a quarter of the box
            cache = quarter
            cache_how = (
                f"{CACHE_SHARE:.0%} × ({shown_total} − {format_bytes(i.reserve)} "
                "prewarm_reserve), below half of what is left"
            )
    else:
        v.append(
            Term(
                "vLLM's share",
                None,
                f"{i.utilization} of the GPU's own memory, not of this RAM (discrete GPU)",
            )
        )
        if i.weights is not None:
            v.append(
                Term(
                    "weights",
                    i.weights,
                    f"{i.weights_source}: in the GPU's memory (and this RAM's page cache "
                    "while vLLM loads them)",
                    indent=1,
                )
            )
        v.append(Term("the system", i.system, "OS and services (--system)", "−"))
        left = room = total - i.system
        v.append(Term("left for ple-server", left, "", "="))
        cache = int(max(0, total - i.reserve) * CACHE_SHARE)
        cache_how = (
            f"{CACHE_SHARE:.0%} × ({shown_total} − {format_bytes(i.reserve)} prewarm_reserve)"
        )
    rows = i.rows if i.rows is not None else -(-i.tables // i.row_bytes)
    needed = rows * i.row_bytes
    if cache < MIN_CACHE_BYTES:
        cache, cache_how = MIN_CACHE_BYTES, f"the {format_bytes(MIN_CACHE_BYTES)} minimum"
    if cache > needed:
        cache, cache_how = needed, "what the tables need"
    # io, as the server chooses it for auto: against the row cache's budget.
    if i.io != "auto":
        io, io_why = i.io, "--io"
    elif i.tables <= cache:
        io = "mmap"
        io_why = (
            f"the tables ({format_bytes(i.tables)}) fit in the {format_bytes(cache)} "
            "budget: the page cache serves them"
        )
    else:
        io = "direct"
        io_why = (
            f"the tables ({format_bytes(i.tables)}) exceed the {format_bytes(cache)} "
            "budget: a row cache of that size serves them, misses read with O_DIRECT"
        )
    s = plan.server
    beside = _beside_the_cache(i, io, cache, s)
    if io == "mmap":
        prewarm = min(i.tables, max(0, room - beside - i.reserve))
        s.insert(
            0,
            Term(
                "the tables' page cache",
                prewarm,
                "the prewarm (below); lookups read the rest through it",
            ),
        )
        mine = prewarm + beside
    else:
        s.insert(0, Term("row cache", cache, cache_how))
        mine = cache + beside
    s.append(Term("ple-server in all", mine, f"of the {format_bytes(left)} left", "="))
    if mine > left:
        over = mine - left
        most = (
            _floor2((total - i.system - beside - MIN_CACHE_BYTES) / total)
            if i.box.unified
            else None
        )
        fix = (
            f"lower --gpu-memory-utilization to {most} or below"
            if most is not None and most > 0
            else "this box cannot hold them"
            if i.box.unified
            else "set a smaller cache_size, or fewer clients"
        )
        plan.warnings.append(
            f"vLLM's share and ple-server's ({format_bytes(mine)}) exceed the box by "
            f"{format_bytes(over)}: {fix}"
        )
    if io == "mmap" and i.box.unified and prewarm < i.tables:
        plan.warnings.append(
            f"the tables ({format_bytes(i.tables)}) do not fit in what is left for them "
            f"({format_bytes(prewarm)}): with io = mmap the page cache of what lookups "
            "read grows past it, at vLLM's expense; use io = direct, whose row cache "
            "does not grow"
        )
    if i.hot_set is not None and io != "mmap" and cache < i.hot_set:
        plan.warnings.append(
            f"the tables' hot set ({format_bytes(i.hot_set)}) will not fit in the "
            f"{format_bytes(cache)} row cache: most lookups will read from the disk; "
            + (
                "give ple-server more of the box (a lower --gpu-memory-utilization, then "
                "the cache_size plan prints) or use a box with more memory"
                if i.box.unified
                else "set a cache_size that holds it, or use a box with more memory"
            )
        )
    # The settings, as the config file writes them.
    plan.settings.append(Setting("gpu_memory", i.box.gpu_memory, i.box.why))
    plan.settings.append(Setting("io", io, io_why))
    if io == "mmap":
        plan.settings.append(
            Setting("cache_size", None, "io = mmap: the page cache serves the tables")
        )
        plan.settings.append(Setting("prewarm", "full", "read the tables into the page cache"))
        if prewarm >= i.tables:
            plan.settings.append(
                Setting(
                    "prewarm_budget",
                    None,
                    f"the whole tables ({format_bytes(i.tables)}) fit beside the rest",
                )
            )
        else:
            plan.settings.append(
                Setting(
                    "prewarm_budget",
                    size_text(prewarm),
                    f"{format_bytes(room)} left − {format_bytes(beside)} beside the cache − "
                    f"{format_bytes(i.reserve)} prewarm_reserve; lookups read the rest from disk",
                    prewarm,
                )
            )
    else:
        plan.settings.append(Setting("cache_size", size_text(cache), cache_how, cache))
        plan.settings.append(
            Setting(
                "prewarm_budget",
                None,
                f"io = {io}: the prewarm is for mmap; the row cache refills from the saved hot set",
            )
        )
    return plan


def _beside_the_cache(i: Inputs, io: str, cache: int, terms: list[Term]) -> int:
    """What ple-server holds beside its row cache (or page cache), each part a
    line of ``terms``: as ``DataPlane.limit_request_memory`` and the channels'
    budget count them, with the default settings."""
    from pleserver.data.plane import FILL_THREADS, HOTSET_KEY_COPIES
    from pleserver.data.tables import nat

    parts = [Term("at start", START_BYTES, "the process, its tables' metadata", "+")]
    if io != "mmap":
        workers = DEFAULTS.gather_workers
        threads = workers + max(workers - 1, 1) + FILL_THREADS
        parts.append(
            Term(
                "read buffers",
                threads * nat.READ_ROUND_BYTES,
                f"at most: {threads} reading threads × {format_bytes(nat.READ_ROUND_BYTES)}",
                "+",
            )
        )
        rows = cache // i.row_bytes
        keys = HOTSET_KEY_COPIES * 8 * rows + hints.memory_bytes(DEFAULTS.hint_queue_rows, rows)
        parts.append(
            Term(
                "hot set keys and hints",
                keys,
                f"{HOTSET_KEY_COPIES * 8} B for each of the cache's {rows:,} rows, and the hints",
                "+",
            )
        )
    layout = ChannelLayout(DEFAULTS.default_depth, DEFAULTS.default_capacity, i.row_bytes)
    one = int(layout.size * (1 + 8 / (8 + i.row_bytes)))  # with its requests' id copies
    parts.append(
        Term(
            "channels",
            i.clients * one,
            f"{i.clients} × {format_bytes(one)} (one per vLLM worker, --clients; "
            f"{i.row_bytes}-byte rows)",
            "+",
        )
    )
    terms.extend(parts)
    return sum(t.value or 0 for t in parts)


def _ceil2(x: float) -> float:
    """``x`` rounded up to a hundredth (a utilization that is enough)."""
    return math.ceil(round(x * 100, 6)) / 100


def _floor2(x: float) -> float:
    """``x`` rounded down to a hundredth (a utilization that is not too much)."""
    return math.floor(round(x * 100, 6)) / 100


# ------------------------------------------------------------------ output
def format_plan(plan: Plan) -> str:
    i = plan.inputs
    lines = [
        f"ple-server plan: {format_bytes(i.box.memory or 0)}, {i.box.gpu_memory} GPU memory "
        f"({i.box.why})",
        "",
        "What vLLM takes, and what it leaves",
    ]
    lines += [_term_line(t) for t in plan.vllm]
    lines += ["", "ple-server"]
    lines += [_term_line(t) for t in plan.server]
    lines += ["", "Settings (config file)"]
    for s in plan.settings:
        text = f'  {s.name} = "{s.value}"' if s.value is not None else f"  # {s.name}: leave out"
        lines.append(f"{text:<34}# {s.why}")
    if plan.warnings:
        lines += ["", "Does not fit:"]
        lines += [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)


def _term_line(t: Term) -> str:
    sign = f"{t.sign} " if t.sign else "  "
    name = "  " * t.indent + sign + t.name
    value = format_bytes(t.value) if t.value is not None else "—"
    return f"  {name:<32}{value:>12}  {t.how}".rstrip()
