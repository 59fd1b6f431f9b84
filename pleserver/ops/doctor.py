"""``pleserver doctor``: check a host before the first start, and advise.

What an operator wants to know before ple-server serves a checkpoint here, each
finding with a status (``ok``, ``warn``, ``fail``, ``info``) and the numbers
behind it:

- ``io_uring``: may this process set up an io_uring (a kernel switch or a
  seccomp profile, as in many containers, refuses it)? Tried, not guessed;
- ``o_direct``: does the model's file system take ``O_DIRECT`` reads?
- ``memlock``: ``ulimit -l`` here and ``LimitMEMLOCK=`` of the installed units
  (``cache_mlock`` needs room for the row cache);
- ``thp``: transparent huge pages (the row cache asks for them);
- ``memory``: available memory against the planned row cache, and the
  unified-memory warning (GPU and CPU share the RAM: ``pleserver plan``
  sizes the box for vLLM's share);
- ``disk``: the random-read ceiling of the model's disk, measured by the native
  probe at queue depths 1, 64 and 128;
- ``tables``: the checkpoint's tables (as ``pleserver inspect``).

Then the advice: the ``io`` mode, ``cache_size``, ``queue_depth`` and
``read_engine`` to set, each with its reason. Only a checkpoint the server
cannot serve fails the run (exit status 1); everything else is advice.
"""

from __future__ import annotations

import glob
import mmap
import os
import platform
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from pleclient.checkpoint import CheckpointError, TableSpec, discover_tables
from pleserver import __version__
from pleserver.box import Box, read_text, this_box
from pleserver.config import ServerConfig
from pleserver.data import budget
from pleserver.host import memory_room
from pleserver.observe.stats import format_bytes

QUEUE_DEPTHS = (1, 64, 128)
PROBE_BLOCK = 4096
ENOUGH_OF_BEST = 0.9  # a queue depth within 10 % of the best one is deep enough
UNIT_GLOBS = (
    "/etc/systemd/system/ple-server.service",
    "/etc/systemd/system/ple-server@.service",
    "/lib/systemd/system/ple-server*.service",
)


@dataclass
class Finding:
    status: str  # "ok" | "warn" | "fail" | "info"
    summary: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Advice:
    setting: str
    value: Any
    reason: str


@dataclass
class Report:
    model: str | None
    findings: dict[str, Finding]
    tables: list[TableSpec]
    advice: list[Advice]

    @property
    def ok(self) -> bool:
        return all(f.status != "fail" for f in self.findings.values())

    def to_json(self) -> dict:
        return {
            "version": __version__,
            "ok": self.ok,
            "model": self.model,
            "checks": {
                name: {"status": f.status, "summary": f.summary, **f.data}
                for name, f in self.findings.items()
            },
            "tables": [dict(t.info(), bytes=t.nbytes, files=t.files) for t in self.tables],
            "recommendation": {
                a.setting: {"value": a.value, "reason": a.reason} for a in self.advice
            },
        }


def run(
    model: str | None,
    config: ServerConfig,
    probe_seconds: float = 2.0,
    queue_depths: tuple[int, ...] = QUEUE_DEPTHS,
) -> Report:
    """Every check, then the advice. ``config`` supplies the settings the advice
    starts from (the defaults when the host has no config file)."""
    findings: dict[str, Finding] = {}
    tables: list[TableSpec] = []
    findings["io_uring"] = check_io_uring()
    findings["futex_waitv"] = check_futex_waitv()
    if model:
        try:
            tables = discover_tables(model)
        except CheckpointError as exc:
            findings["tables"] = Finding("fail", str(exc), {"problems": exc.problems})
        else:
            total = sum(t.nbytes for t in tables)
            findings["tables"] = Finding(
                "ok",
                f"{len(tables)} tables, {format_bytes(total)}",
                {"count": len(tables), "bytes": total},
            )
    files = sorted({path for t in tables for path in t.files})
    # Without tables there are no files to check: say why (a model given whose
    # tables failed is not a model to ask for).
    no_files = "the model's tables could not be read (see tables)" if model else "give --model DIR"
    findings["o_direct"] = (
        check_o_direct(files) if files else Finding("info", f"not checked: {no_files}")
    )
    findings["memlock"] = check_memlock(config)
    findings["thp"] = check_thp()
    box = this_box(config.gpu_memory)
    plan = (
        budget.plan(tables, config.io, config.cache_size, config.prewarm_reserve, box)
        if tables
        else None
    )
    findings["memory"] = check_memory(config, plan, box)
    direct = findings["o_direct"].status == "ok"
    engine = "io_uring" if findings["io_uring"].status == "ok" else "threads"
    findings["disk"] = (
        check_disk(files, probe_seconds, queue_depths, direct, engine)
        if files
        else Finding("info", f"not measured: {no_files}")
    )
    # The advice weighs the io modes afresh (auto), whatever the config sets.
    fresh = (
        budget.plan(tables, "auto", config.cache_size, config.prewarm_reserve, box)
        if tables
        else None
    )
    return Report(
        os.path.abspath(model) if model else None, findings, tables, advise(config, findings, fresh)
    )


# ------------------------------------------------------------------ checks
def check_io_uring() -> Finding:
    from pleserver import _native

    switch = read_text("/proc/sys/kernel/io_uring_disabled").strip()
    data: dict[str, Any] = {"io_uring_disabled": int(switch) if switch.isdigit() else None}
    try:
        engine = _native.ReadEngine(queue_depth=8, kind="io_uring")
    except OSError as exc:
        reason = str(exc)
    else:
        try:
            kind, reason = engine.kind, engine.fallback_reason
        finally:
            engine.close()
        if kind == "io_uring":
            return Finding("ok", "io_uring allowed (a ring was set up)", data)
    hint = (
        "kernel.io_uring_disabled = " + switch
        if switch not in ("", "0")
        else "a seccomp profile refuses it (containers: RuntimeDefault; systemd: SystemCallFilter=)"
    )
    return Finding(
        "warn",
        f"io_uring refused: {reason} ({hint}); misses are read by a pool of pread threads instead",
        {**data, "reason": reason},
    )


def check_futex_waitv() -> Finding:
    """Whether the idle serving loop can sleep on every channel at once."""
    from pleclient import _sync

    kernel = os.uname().release
    if _sync.HAVE_FUTEX_WAITV:
        return Finding(
            "ok",
            "futex_waitv available: the idle serving loop sleeps on every channel at once",
            {"kernel": kernel},
        )
    return Finding(
        "warn",
        f"futex_waitv unavailable (kernel {kernel}; it needs Linux 5.16, and a seccomp "
        "profile may refuse it): the idle serving loop polls its channels every 0.5 ms "
        "(idle_wait = poll), which adds up to 0.5 ms to a request after an idle spell",
        {"kernel": kernel},
    )


def check_o_direct(files: list[str]) -> Finding:
    path = max(files, key=os.path.getsize)
    mount = mount_of(path)
    data = {"file": path, **mount}
    where = f"{mount['fstype']} at {mount['mountpoint']} ({mount['source']})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return Finding(
            "warn",
            f'O_DIRECT refused on {where}: {exc.strerror}; use io = "buffered"',
            {**data, "error": exc.strerror},
        )
    buf = mmap.mmap(-1, PROBE_BLOCK)  # page-aligned, as O_DIRECT wants
    try:
        os.preadv(fd, [buf], 0)
    except OSError as exc:
        return Finding(
            "warn",
            f'O_DIRECT reads fail on {where}: {exc.strerror}; use io = "buffered"',
            {**data, "error": exc.strerror},
        )
    finally:
        os.close(fd)
        buf.close()
    return Finding("ok", f"O_DIRECT reads work on {where}", data)


def check_memlock(config: ServerConfig) -> Finding:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    units = {}
    for pattern in UNIT_GLOBS:
        for unit in glob.glob(pattern):
            for line in read_text(unit).splitlines():
                if line.strip().startswith("LimitMEMLOCK="):
                    units[unit] = line.strip().partition("=")[2]
    shown = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
    data = {
        "ulimit_l_bytes": None if soft == resource.RLIM_INFINITY else soft,
        "hard_bytes": None if hard == resource.RLIM_INFINITY else hard,
        "units": units,
    }
    where = "; ".join(f"{os.path.basename(u)}: LimitMEMLOCK={v}" for u, v in units.items())
    summary = f"ulimit -l here: {shown}" + (
        f"; {where}" if where else "; no installed ple-server unit found"
    )
    if config.cache_mlock and soft != resource.RLIM_INFINITY and not units:
        return Finding(
            "warn",
            summary + "; cache_mlock = true needs a limit above the row "
            "cache (the unit sets LimitMEMLOCK=infinity)",
            data,
        )
    return Finding("ok", summary, data)


def check_thp() -> Finding:
    enabled = _bracketed(read_text("/sys/kernel/mm/transparent_hugepage/enabled"))
    defrag = _bracketed(read_text("/sys/kernel/mm/transparent_hugepage/defrag"))
    data = {"enabled": enabled, "defrag": defrag}
    if enabled in ("always", "madvise"):
        return Finding(
            "ok",
            f"transparent huge pages: {enabled} (the row cache asks for "
            f"them with madvise); defrag: {defrag}",
            data,
        )
    if enabled is None:
        return Finding("info", "transparent huge pages: not available on this kernel", data)
    return Finding(
        "warn",
        f"transparent huge pages: {enabled}: the row cache uses 4 KiB "
        "pages (more TLB misses on random rows); `echo madvise > "
        "/sys/kernel/mm/transparent_hugepage/enabled` allows them",
        data,
    )


def check_memory(config: ServerConfig, plan: budget.Budget | None, box: Box) -> Finding:
    view = memory_room()
    data: dict[str, Any] = {
        "available_bytes": view.available,
        "available_source": view.describe(),
        "reserve_bytes": config.prewarm_reserve,
        "unified_memory": box.unified,
        "box": box.to_json(),
    }
    summary = f"available: {view.describe()}"
    status = "ok"
    if plan is not None:
        data.update(
            planned_cache_bytes=plan.cache_bytes,
            planned_cache_reason=plan.cache_reason,
            planned_io=plan.io,
        )
        summary += f"; planned row cache {format_bytes(plan.cache_bytes)} ({plan.cache_reason})"
        if plan.io != "mmap" and plan.cache_bytes > view.available - config.prewarm_reserve:
            status = "warn"
            summary += (
                f": more than is available less the reserve "
                f"({format_bytes(config.prewarm_reserve)}); lower cache_size"
            )
    if box.unified:
        status = "warn"
        summary += (
            f". Unified memory ({box.why}): the GPU allocates from this RAM too. Size "
            "cache_size and prewarm_budget for what vLLM leaves, not for what is free "
            "now: `pleserver plan --model DIR --gpu-memory-utilization U` does the "
            "arithmetic (deploy/README.md, Sizing)"
        )
    return Finding(status, summary, data)


def check_disk(
    files: list[str], seconds: float, queue_depths: tuple[int, ...], direct: bool, engine: str
) -> Finding:
    from pleserver import _native

    kind = "io_uring" if engine == "io_uring" else "threads"
    results = []
    for depth in queue_depths:
        # The probe's threads are the process's only busy ones while it runs:
        # the process's CPU over it is what the kernel and the device's driver
        # cost a read here, the floor under a server's CPU per read.
        cpu = time.process_time()
        r = _native.probe_random_reads(
            files, block=PROBE_BLOCK, queue_depth=depth, seconds=seconds, direct=direct, kind=kind
        )
        cpu = time.process_time() - cpu
        results.append(
            {
                "queue_depth": depth,
                "reads_per_s": r["reads_per_s"],
                "reads": r["reads"],
                "seconds": r["seconds"],
                "kind": r["kind"],
                "direct": direct,
                "cpu_us_per_read": round(1e6 * cpu / r["reads"], 2) if r["reads"] else None,
            }
        )
    shown = ", ".join(
        f"QD {r['queue_depth']}: {r['reads_per_s']:,.0f}/s"
        + (f" ({r['cpu_us_per_read']:.1f} µs CPU a read)" if r["cpu_us_per_read"] else "")
        for r in results
    )
    cached = "" if direct else " (through the page cache: cached blocks inflate it)"
    return Finding(
        "ok",
        f"random {PROBE_BLOCK // 1024} KiB reads ({results[0]['kind']}"
        f"{', O_DIRECT' if direct else ''}): {shown}{cached}",
        {"block": PROBE_BLOCK, "results": results},
    )


# ------------------------------------------------------------------ advice
def advise(
    config: ServerConfig, findings: dict[str, Finding], plan: budget.Budget | None
) -> list[Advice]:
    advice = []
    if plan is not None:
        if plan.io == "mmap":
            io, reason = "mmap", plan.io_reason
        elif findings["o_direct"].status == "ok":
            io, reason = "direct", plan.io_reason
        else:
            io, reason = (
                "buffered",
                (
                    "O_DIRECT does not work on the model's file system, "
                    "so misses are read through the page cache"
                ),
            )
        if config.io != "auto" and config.io != io:
            reason += f' (the config sets io = "{config.io}")'
        advice.append(Advice("io", io, reason))
        cache, cache_reason = plan.cache_bytes, plan.cache_reason
        if findings["memory"].data.get("unified_memory"):
            cache_reason += "; on unified memory, set it from what vLLM leaves (`pleserver plan`)"
        advice.append(Advice("cache_size", _size_text(cache), cache_reason))
    if findings["io_uring"].status == "ok":
        advice.append(Advice("read_engine", "auto", "io_uring is allowed here"))
    else:
        advice.append(
            Advice(
                "read_engine",
                "threads",
                findings["io_uring"].data.get("reason", "io_uring refused")
                + ": the pread thread pool serves the misses",
            )
        )
    disk = findings["disk"].data.get("results")
    if disk:
        best = max(r["reads_per_s"] for r in disk)
        enough = next(r for r in disk if r["reads_per_s"] >= ENOUGH_OF_BEST * best)
        depth = enough["queue_depth"]
        reason = (
            f"QD {depth} reaches {enough['reads_per_s']:,.0f} reads/s, "
            f"{100 * enough['reads_per_s'] / best:.0f}% of the best measured "
            f"({best:,.0f}/s): the disk's random-read ceiling is about {best:,.0f} "
            "missed rows per second"
        )
        advice.append(Advice("queue_depth", depth, reason))
        if findings["io_uring"].status != "ok":
            advice.append(
                Advice(
                    "read_threads",
                    depth,
                    "one pread thread per read in flight, as many as the queue depth",
                )
            )
    return advice


# ------------------------------------------------------------------ output
def format_report(report: Report, tables_text: str) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "--  "}
    lines = [
        f"ple-server doctor: {platform.node()}, Linux {platform.release()}, "
        f"{platform.machine()}" + (f", model {report.model}" if report.model else "")
    ]
    for name, finding in report.findings.items():
        lines.append(f"[{mark[finding.status]}] {name:<9} {finding.summary}")
    if report.tables:
        lines += ["", tables_text]
    if report.advice:
        lines += ["", "Recommended settings (config file):"]
        for a in report.advice:
            value = f'"{a.value}"' if isinstance(a.value, str) else a.value
            lines.append(f"  {a.setting} = {value}".ljust(32) + f"# {a.reason}")
    lines.append("")
    lines.append("doctor: OK" if report.ok else "doctor: the checkpoint cannot be served")
    return "\n".join(lines)


# ------------------------------------------------------------------ helpers
def mount_of(path: str) -> dict[str, str]:
    """The mount holding ``path``: mount point, file system type, source."""
    real = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "unknown", "source": "unknown"}
    for line in read_text("/proc/self/mountinfo").splitlines():
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best["mountpoint"]):
            best = {"mountpoint": point, "fstype": fields[sep + 1], "source": fields[sep + 2]}
    return best


def _size_text(n: int) -> str:
    """A config size, rounded down to the largest whole unit (never more than planned)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return str(n)


def _bracketed(text: str) -> str | None:
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
