#!/usr/bin/env python3
"""Real vLLM 0.33 on the GPU host: stock against ``VLLM_PLE_BACKEND=shm``, cell by cell.

``bench/device_vllm.sh`` runs this on the GPU host after ``. .gpu-bundle/site.sh``
(``../shared/gpu-vllm/README.md``); the cells, their names and what they measure
are in ``bench/real_vllm/cells.py``, the exactness rule in ``bench/real_vllm/exact.py``.

``run`` is the coordinator. It imports neither torch nor vLLM, and for each cell

1. decides whether the cell fits before the deadline (``--t0`` + ``--deadline-s``;
   its expected cost from ``cells.Costs`` and the starts measured on this
   host so far, ``<work>/history.json``) and otherwise records it as skipped,
   saying why;
2. starts ``python -m bench.real_vllm.coordinator cell NAME`` in a process
   group of its own (``setsid``):
   the cell starts its ple-server (``python -m pleserver.cli serve --model …
   --socket … --io mmap|direct [--cache-size 1G]``, through
   ``pleserver.devkit.launcher``, with a state directory that does not exist, so every
   server starts cold and saves no hot set), then the engine, and writes its
   JSON after every measurement;
3. ends the whole group when the cell returns or its time is up (SIGTERM, then
   SIGKILL): a finished ``LLM``'s engine core otherwise keeps about 70 GB of GPU
   memory and the next engine fails. The coordinator is a child subreaper, so an
   engine process that left the group is still found (as its child) and ended;
   then it waits for the GPU's memory to be given back;
4. adds what it saw (times, exit code, the log's tail) to the cell's JSON:
   ``<out>/cells/<name>.json``, and a copy under ``<work>/cells/`` that later
   calls on the same host read as references.

At the start, where a cell reads tables with ``--io direct``, the disk is probed
(4 KiB ``O_DIRECT`` random reads at queue depth 1 and 128 over the table files:
``pleserver doctor``'s probe) into ``<out>/run.json``. At the end the summary
(cells, exactness verdicts, throughput) of every cell of this call and of the
earlier calls on the host is printed, and written to ``<out>/summary.txt``.

    python -m bench.real_vllm.coordinator plan --cells exact-1           # the expected timeline
    python -m bench.real_vllm.coordinator run --cells stock-eager,shm-eager \
        --work /tmp/vllm-real --out $OUT
    python -m bench.real_vllm.coordinator summary fetched/cells          # any set of cell JSONs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import itertools
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.harness.checkout import bench_only, installed_first
from bench.harness.provenance import cpu_topology, thread_cpu_s
from bench.real_vllm import engram_tables, gpu_trace
from bench.real_vllm import steps as vllm_steps
from bench.real_vllm.cells import (
    CELL_FORMAT,
    CHECKPOINTS,
    CONCURRENCY,
    EXACT_TOKENS,
    PROFILE_CONCURRENCY,
    PROFILE_TEXT_REP,
    PROFILE_TOKENS,
    RESTART_AWAY_S,
    RESTART_EVENTS,
    RESTART_STREAMS,
    RESTART_TOKENS,
    RUN_FORMAT,
    TP_OUTPUT_TOKENS,
    TP_PROMPT_TOKENS,
    TTFT_OUTPUT_TOKENS,
    TTFT_PROMPT_TOKENS,
    Cell,
    CellError,
    Costs,
    Decision,
    History,
    cell_brief,
    checkpoints_needed,
    decide,
    exact_prompts,
    expand,
    load_cells,
    load_runs,
    parse_cell,
    pin_cpus,
    plan_text,
    prompts_digest,
    prose,
    resident_load_s,
    server_counters,
    server_delta,
    steady_window,
    summary,
    table_gib_estimate,
    throughput_prompts,
    ttft_prompt,
)

log = logging.getLogger("bench.real_vllm.coordinator")

BENCH = Path(__file__).resolve().parents[1]
MODEL_NAME = "qwen4-exp"
ENGINE = {
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "gpu_memory_utilization": 0.5,
    "max_model_len": 8192,  # the ttft cells' 8 000-token prompt
}
LOGPROBS = 5
GROUP_GRACE_S = 10.0  # SIGTERM to SIGKILL
GPU_FREE_WAIT_S = 20.0
GPU_FREE_SLACK_MIB = 1024  # given back: within this much of the use before the first cell
LOG_TAIL_CHARS = 4000
PROFILE_TRACE_OUT_BYTES = 8 * 1024 * 1024  # a compact trace this small goes to $OUT (64 MiB a call)
OUT_LOG_BYTES = 256 * 1024  # the part of a cell's log that goes to $OUT
_PR_SET_CHILD_SUBREAPER = 36


def say(*parts) -> None:
    print(*parts, flush=True)


def file_stem(name: str) -> str:
    """A cell's name as a file name of plain characters ('#2' → '_2')."""
    return name.replace("#", "_")


# ===================================================================== the host
def machine() -> dict:
    """The host, as a reader of the figures needs it (bench.harness.provenance
    has the CPU side; this one names the GPU host and its GPUs)."""
    info: dict = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        **cpu_topology(),
    }
    try:
        with open("/proc/meminfo") as f:
            total = next(line for line in f if line.startswith("MemTotal:"))
        info["ram_gib"] = round(int(total.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    gpu = _nvidia_smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    if gpu:
        info["gpu"] = gpu.strip().splitlines()
    return info


def source() -> dict:
    """The commit measured: ``$COMMIT`` where the caller set it (the device copy
    of a working tree carries a .git of another commit), else ``git``'s."""
    if os.environ.get("COMMIT"):
        return {"commit": os.environ["COMMIT"]}
    try:
        commit = subprocess.run(
            ["git", "-C", str(BENCH.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"commit": commit or None}


def _nvidia_smi(*args: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def gpu_count() -> int | None:
    """GPUs this host has (None without ``nvidia-smi``: the engine will say)."""
    out = _nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return len(out.split()) if out else None


def gpu_used_mib() -> int | None:
    out = _nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits")
    try:
        return sum(int(x) for x in out.split()) if out else None
    except ValueError:
        return None


def probe_disk(model_dir: Path, seconds: float = 2.0) -> dict:
    """``pleserver doctor``'s disk probe over the table files: 4 KiB random reads
    at queue depth 1 and 128, O_DIRECT where the file system takes it; the mean
    latency is queue depth / rate (Little's law)."""
    from pleclient.checkpoint import discover_tables
    from pleserver.ops import doctor

    files = sorted({p for t in discover_tables(str(model_dir), fingerprint=False) for p in t.files})
    direct = doctor.check_o_direct(files).status == "ok"
    engine = "io_uring" if doctor.check_io_uring().status == "ok" else "threads"
    finding = doctor.check_disk(files, seconds, (1, 128), direct, engine)
    results = finding.data["results"]
    for r in results:
        r["mean_latency_s"] = r["queue_depth"] / r["reads_per_s"] if r["reads_per_s"] else None
    return {"model": str(model_dir), "summary": finding.summary, "results": results}


# ============================================================== the coordinator
def process_table() -> dict[int, tuple[int, int, str]]:
    """pid → (ppid, process group, state) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [pid for pid, (_, g, state) in process_table().items() if g == pgid and state != "Z"]


def become_subreaper() -> bool:
    """Orphans of the cells become our children (PR_SET_CHILD_SUBREAPER), so an
    engine process that left its group is still found and ended."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end_group(proc: subprocess.Popen, grace_s: float | None = None) -> dict:
    """End a cell's process group (its leader is ``proc``): SIGTERM, SIGKILL
    after ``grace_s`` (``GROUP_GRACE_S``); then any child of ours left over (an
    orphan the subreaper took). What it took, for the cell's JSON."""
    grace_s = GROUP_GRACE_S if grace_s is None else grace_s
    pgid = proc.pid
    seen = len(group_members(pgid))
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        if not group_members(pgid):
            break
        time.sleep(0.1)
    killed = group_members(pgid)
    if killed:
        _signal_group(pgid, signal.SIGKILL)
        end = time.monotonic() + 5.0
        while group_members(pgid) and time.monotonic() < end:
            time.sleep(0.1)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    orphans = [
        pid
        for pid, (ppid, _, state) in process_table().items()
        if ppid == os.getpid() and pid != proc.pid and state != "Z"
    ]
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_children()
    return {"processes": seen, "sigkilled": len(killed), "orphans_killed": len(orphans)}


def _reap_children() -> None:
    """Collect every exited child (orphans the subreaper inherited included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_gpu_free(baseline_mib: int | None, timeout_s: float = GPU_FREE_WAIT_S) -> int | None:
    """Wait until the GPU's used memory is back within ``GPU_FREE_SLACK_MIB`` of
    ``baseline_mib`` (the ended engine's memory given back); the last reading
    (None: no nvidia-smi)."""
    end = time.monotonic() + timeout_s
    used = gpu_used_mib()
    if used is None or baseline_mib is None:
        return used
    while used > baseline_mib + GPU_FREE_SLACK_MIB and time.monotonic() < end:
        time.sleep(1.0)
        used = gpu_used_mib()
    return used


def cell_argv(cell: Cell, work: Path, out: Path, run_id: str, order: int, end_at: float) -> list:
    return [
        sys.executable,
        "-m",
        "bench.real_vllm.coordinator",
        "cell",
        cell.name,
        "--work",
        str(work.resolve()),
        "--out",
        str(out.resolve()),
        "--run-id",
        run_id,
        "--order",
        str(order),
        "--end-at",
        f"{end_at:.3f}",
    ]


def cell_record(cell: Cell, run_id: str, order: int, status: str, **more) -> dict:
    """A cell's JSON: who it is, where it stands, and ``more``."""
    return {
        "format": CELL_FORMAT,
        "run_id": run_id,
        "order": order,
        "name": cell.name,
        "cell": cell.to_json(),
        "status": status,
        **more,
    }


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


# What the plugin says in each worker's log as its route is chosen
# (gpu_route.py's GpuRoute.choose): the route and the ops in fact, which a
# cell's name only asks for (a kernels request that cannot build runs memops).
GPU_ROUTE_LINE = re.compile(
    r"PLE backend shm: GPU-driven lookups( \(CPU stand-in\))? on (\S+) \((\w+)\)"
)
HOST_ROUTE_LINE = re.compile(r"PLE backend shm: host path[ ,:(]")


def routes_run(log: str) -> list[str]:
    """Each worker's route as its log says, in order: ``gpu:<ops>`` (``gpu:host``
    for the CPU stand-in) or ``host``."""
    found = []
    for line in log.splitlines():
        if m := GPU_ROUTE_LINE.search(line):
            found.append("gpu:host" if m[1] else f"gpu:{m[3]}")
        elif HOST_ROUTE_LINE.search(line):
            found.append("host")
    return found


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def checkpoint_table_gib(work: Path, cell: Cell) -> float:
    """The tables' GiB from the checkpoint's marker, else the estimate."""
    try:
        marker = json.loads((work / "ckpt" / cell.checkpoint / "bench-checkpoint.json").read_text())
        return marker["table_bytes"] / 2**30
    except (OSError, ValueError, KeyError):
        return table_gib_estimate(cell.checkpoint)


def run(
    cells: list[Cell],
    work: Path,
    out: Path,
    *,
    t0: float,
    deadline_s: float,
    costs: Costs | None = None,
    run_id: str | None = None,
    probe: bool = True,
    argv_of: Callable[..., list] = cell_argv,
) -> list[dict]:
    """Run the cells in order (module docstring); their JSONs."""
    costs = costs or Costs()
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S")
    for d in (out / "cells", out / "logs", work / "cells", work / "logs"):
        d.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    history_path = work / "history.json"
    history = History.load(history_path)
    info: dict = {
        "format": RUN_FORMAT,
        "run_id": run_id,
        "cells": [c.name for c in cells],
        "deadline_s": deadline_s,
        "t0": t0,
        "machine": machine(),
        "source": source(),
    }
    direct = [c for c in cells if c.shm and c.io == "direct"]
    if probe and direct:
        model = work / "ckpt" / direct[0].checkpoint
        try:
            info["disk"] = probe_disk(model)
            say(f"== disk: {info['disk']['summary']}")
        except Exception as exc:  # the probe is a figure, not a precondition
            info["disk"] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"== disk probe failed: {exc}")
    info["gpu_used_mib_before"] = baseline = gpu_used_mib()
    _write_json(out / "run.json", info)
    results = []
    gpus = gpu_count()
    for order, cell in enumerate(cells):
        left = t0 + deadline_s - time.time()
        d = decide(cell, left, costs, history, checkpoint_table_gib(work, cell))
        if d.run and gpus is not None and cell.gpus > gpus:
            d = Decision(False, d.expected_s, d.left_s, f"skipped: {cell.gpus} GPUs, {gpus} here")
        if not d.run:
            say(f"== {cell.name}: {d.reason}")
            record = cell_record(
                cell,
                run_id,
                order,
                "skipped",
                reason=d.reason,
                coordinator={"expected_s": d.expected_s, "left_s": d.left_s},
            )
            _write_json(out / "cells" / f"{file_stem(cell.name)}.json", record)
            results.append(record)
            continue
        say(f"== {cell.name}: {d.reason}")
        gib = checkpoint_table_gib(work, cell)
        record = run_one(
            cell, work, out, run_id, order, d.expected_s, t0 + deadline_s, argv_of, baseline
        )
        start = (record.get("times") or {}).get("engine_start_s")
        if start is not None:
            load = min(resident_load_s(cell, costs, gib), start / 2)  # a guess: never most of it
            history.record(cell.api, cell.mode, start - load, CHECKPOINTS[cell.checkpoint].model)
            history.save(history_path)
        say(
            f"   {record.get('status')} in {record['coordinator']['wall_s']:.0f} s"
            + (f": {record['error']}" if record.get("error") else "")
        )
        if record.get("exact") or record.get("throughput"):
            say(f"   {cell_brief(record)}")
        results.append(record)
    _write_json(work / "runs" / run_id / "run.json", info)
    text = summary(load_cells([out / "cells", work / "cells"]), load_runs([out, work / "runs"]))
    (out / "summary.txt").write_text(text + "\n")
    say(text)
    return results


def run_one(
    cell: Cell,
    work: Path,
    out: Path,
    run_id: str,
    order: int,
    expected_s: float,
    hard_end: float,
    argv_of: Callable[..., list],
    gpu_baseline_mib: int | None = None,
) -> dict:
    """One cell in its own process group, ended whatever happens; its JSON."""
    stem = file_stem(cell.name)
    log_path = work / "logs" / f"{run_id}-{stem}.log"
    json_path = out / "cells" / f"{stem}.json"
    kill_at = hard_end - 5.0
    # The cell stops measuring in time to write its JSON and leave its teardown
    # to the group's end before kill_at.
    end_at = kill_at - 15.0
    json_path.unlink(missing_ok=True)  # only what this cell writes is read back
    t = time.monotonic()
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            argv_of(cell, work, out, run_id, order, end_at),
            # Not the checkout: vLLM inspects the model in a `python -m`
            # subprocess, which would import the checkout's unbuilt pleclient
            # ahead of the installed one. A directory of the bench package alone.
            cwd=bench_only(work),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},  # a killed cell's log is whole
        )
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, kill_at - time.time()))
        except subprocess.TimeoutExpired:
            timed_out = True
        ended = end_group(proc)
    wall = time.monotonic() - t
    try:
        record = json.loads(json_path.read_text())
    except (OSError, ValueError):
        record = cell_record(
            cell, run_id, order, "failed", error="the cell wrote no JSON (see its log)"
        )
    if timed_out:
        record["status"] = "killed"
        record["error"] = (
            f"still running at the deadline: its process group was ended after {wall:.0f} s "
            f"(expected {expected_s:.0f} s); what it measured before is kept"
        )
    elif record.get("status") == "running":
        record["status"] = "failed"
        if not record.get("error"):
            record["error"] = f"exited with status {proc.returncode} mid-cell (see its log)"
    record["coordinator"] = {
        "expected_s": round(expected_s, 1),
        "wall_s": round(wall, 1),
        "exit_code": proc.returncode,
        "ended": ended,
        "gpu_used_mib_after": wait_gpu_free(gpu_baseline_mib),
        "log": str(log_path),
    }
    if record.get("status") != "done":
        record["log_tail"] = _tail(log_path, LOG_TAIL_CHARS)
    if cell.shm:
        # The whole logs (the lines are near their start, which a tail may have
        # lost): the cell's, and vllm serve's, where its workers log.
        record["routes_run"] = []
        for path in (log_path, work / "logs" / f"{run_id}-{stem}.serve.log"):
            with contextlib.suppress(OSError):
                record["routes_run"] += routes_run(path.read_text(errors="replace"))
    _write_json(json_path, record)
    _write_json(work / "cells" / f"{run_id}-{stem}.json", record)
    (out / "logs" / f"{stem}.log").write_text(_tail(log_path, OUT_LOG_BYTES))
    for part in ("server", "serve"):  # ple-server's log, vllm serve's
        path = work / "logs" / f"{run_id}-{stem}.{part}.log"
        if path.exists():
            (out / "logs" / f"{stem}.{part}.log").write_text(_tail(path, OUT_LOG_BYTES))
    return record


# ===================================================================== the cell
class CellRecord:
    """The cell's JSON, rewritten (atomically) after every step, so that a cell
    ended at the deadline keeps what it measured."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path = path
        self.data = data
        self.save()

    def save(self) -> None:
        _write_json(self.path, self.data)


def _stat_cpu(stat: str) -> tuple[str, float]:
    """A ``/proc/…/stat`` line's name and user + system CPU seconds (the name
    may hold spaces and parentheses: the fields follow its last ``)``)."""
    head, rest = stat.rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_process(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit
    their starter's)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


class Served:
    """The cell's ple-server, and what the figures need of it."""

    def __init__(
        self, model_dir: Path, cell: Cell, log_path: Path, cpus: list[int] | None = None
    ) -> None:
        """``cpus``: the CPUs its threads run on (``pin``), else any."""
        from pleserver.devkit.launcher import ServerLauncher

        self.cpus = cpus

        self._state = tempfile.mkdtemp(prefix="vllm-real-state-")
        # A state directory that does not exist: no hot set is loaded or saved,
        # so the server starts cold.
        missing = os.path.join(self._state, "none")
        # Written when the server stops (a restart cell's killed servers write none).
        self.trace_path = os.path.join(self._state, "lookups.npy")
        self.args = [
            *cell.server_args(),
            "--state-dir",
            missing,
            "--lookup-trace",
            self.trace_path,
        ]
        # One socket for every start: a restart is a new server where the old one was.
        self.launcher = ServerLauncher(
            model_dir,
            *self.args,
            socket_path=os.path.join(self._state, "ple.sock"),
            log_level="INFO",
            log_path=log_path,
            # Not the checkout: `python -m` would import its unbuilt pleserver.
            cwd=self._state,
            die_with_parent=True,  # (started from the main thread, as every restart is)
        )
        self.server = self._start()

    def _start(self):
        server = self.launcher.start()
        if self.cpus:
            pin_process(server.pid, self.cpus)
        return server

    def kill(self, sig: int) -> None:
        """End the server with ``sig`` (SIGKILL: a crash; SIGTERM: a stop)."""
        self.server.stop(sig)
        self.server.close()

    def start(self) -> float:
        """Start it again on the same socket; the seconds until it was ready."""
        t = time.perf_counter()
        self.server = self._start()
        return time.perf_counter() - t

    @property
    def socket(self) -> str:
        return self.server.socket

    @property
    def pid(self) -> int:
        return self.server.pid

    def snapshot(self) -> dict:
        from pleclient import PleClient

        return PleClient.query_stats(self.socket)

    def counters(self) -> dict:
        return server_counters(self.snapshot())

    def settled_counters(self, timeout_s: float = 1.0) -> dict:
        """The counters once two reads 20 ms apart agree: the server counts a
        request just after it has answered it, so a measurement that ends with
        its last answer reads again until the count has caught up."""
        last = self.counters()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.counters()
            if now == last:
                break
            last = now
        return last

    def cpu_seconds(self) -> float:
        """User + system CPU of the server process, all its threads."""
        with open(f"/proc/{self.pid}/stat") as f:
            return _stat_cpu(f.read())[1]

    def gather_cpu_seconds(self) -> float:
        """User + system CPU of the gather workers (``ple-gather-N``): the
        miss path's probe, reads and copies, without the serving loop's spin
        (``spin_us``), which at hundreds of steps a second never ends."""
        threads = thread_cpu_s(self.pid)
        return sum(cpu for name, cpu in threads.items() if name.startswith("ple-gather-"))

    def stop_for_trace(self):
        """Stop the server (SIGTERM: it writes its trace), and its lookup trace,
        or None where it wrote none."""
        from pleserver.observe.trace import load

        self.server.stop()
        return load(self.trace_path) if os.path.exists(self.trace_path) else None

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            shutil.rmtree(self._state, ignore_errors=True)


def measured(served: Served | None, fn: Callable[[], dict]) -> dict:
    """``fn()``'s result with the server's delta over it (where there is a server)."""
    before = served.counters() if served else None
    cpu0 = served.cpu_seconds() if served else 0.0
    gather0 = served.gather_cpu_seconds() if served else 0.0
    t = time.perf_counter()
    t0_ns = time.monotonic_ns()
    result = fn()
    result["window_ns"] = [t0_ns, time.monotonic_ns()]  # (the lookup trace's clock)
    wall = time.perf_counter() - t
    if served and before is not None:
        after = served.settled_counters()
        result["server"] = server_delta(
            before,
            after,
            served.cpu_seconds() - cpu0,
            wall,
            gather_cpu_s=served.gather_cpu_seconds() - gather0,
        )
    return result


def engine_kwargs(cell: Cell, profile_dir: Path | None = None) -> dict:
    """``LLM(...)``'s arguments for a cell (besides the model); ``profile_dir``:
    where a ``prof`` cell's worker writes its traces."""
    kwargs: dict = {
        **ENGINE,
        "enable_prefix_caching": False,  # every repetition computes its prompts
        "disable_log_stats": False,  # RequestOutput.metrics: TTFT and TPOT
        "seed": 0,
        "engram_config": {"cpu_offload": cell.backend == "offload"},
    }
    if cell.mode == "eager":
        kwargs["enforce_eager"] = True
    elif cell.mode == "piecewise":
        kwargs["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if cell.gpus > 1:
        kwargs["tensor_parallel_size"] = cell.gpus
    if CHECKPOINTS[cell.checkpoint].dummy_weights:
        # only the Engram tables are in the files; the model is text-only
        kwargs["load_format"] = "dummy"
        kwargs["limit_mm_per_prompt"] = {"image": 0}
        if not cell.shm:
            kwargs["worker_extension_cls"] = engram_tables.EXTENSION
    if profile_dir is not None:
        kwargs["profiler_config"] = profiler_config(profile_dir)
    return kwargs


def profiler_config(directory: Path) -> dict:
    """vLLM's torch profiler for a ``prof`` cell: the worker's CPU activity (its
    step annotations, the launching calls) and CUDA's, without stacks, shapes
    or the front end's trace (``gpu_trace`` reads what is left)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(directory),
        "torch_profiler_activities": ["CPU", "CUDA"],
        "torch_profiler_with_stack": False,
        "torch_profiler_record_shapes": False,
        "torch_profiler_use_gzip": True,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,
    }


def serve_argv(cell: Cell, model_dir: Path, port: int) -> list[str]:
    """``vllm serve``'s command line for a cell: the same engine as ``engine_kwargs``."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--max-num-seqs",
        str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(ENGINE["max_num_batched_tokens"]),
        "--gpu-memory-utilization",
        str(ENGINE["gpu_memory_utilization"]),
        "--max-model-len",
        str(ENGINE["max_model_len"]),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--engram-config",
        json.dumps({"cpu_offload": cell.backend == "offload"}),
    ]
    if cell.gpus > 1:
        argv += ["--tensor-parallel-size", str(cell.gpus)]
    if cell.mode == "eager":
        argv.append("--enforce-eager")
    elif cell.mode == "piecewise":
        argv += ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
    return argv


class GenerateEngine:
    """``LLM.generate``: the offline engine, prompts as token ids."""

    EXACT_SUBMISSION = "at_once"  # every prompt queued at once (cells.submission)

    def __init__(self, cell: Cell, model_dir: Path, profile_dir: Path | None = None) -> None:
        from vllm import LLM

        self.profile_dir = profile_dir
        self.llm = LLM(model=str(model_dir), **engine_kwargs(cell, profile_dir))

    def _generate(self, prompts: list[list[int]], max_tokens: int, logprobs: int | None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=logprobs,
            detokenize=False,
        )
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return self.llm.generate(inputs, params, use_tqdm=False)

    def exact(self, prompts: list[list[int]], max_tokens: int) -> dict:
        outputs = self._generate(prompts, max_tokens, LOGPROBS)
        tokens, logprobs = [], []
        for o in outputs:
            c = o.outputs[0]
            tokens.append(list(c.token_ids))
            logprobs.append(
                [{str(t): lp.logprob for t, lp in pos.items()} for pos in (c.logprobs or [])]
            )
        return {"tokens": tokens, "logprobs": logprobs}

    def throughput(self, prompts: list[list[int]], max_tokens: int) -> dict:
        t = time.perf_counter()
        with EngineTokenTimes(self.llm.llm_engine.engine_core) as times:
            outputs = self._generate(prompts, max_tokens, None)
        wall = time.perf_counter() - t
        ttft, tpot, generated = [], [], 0
        for o in outputs:
            n = len(o.outputs[0].token_ids)
            generated += n
            m = getattr(o, "metrics", None)
            if m is not None and getattr(m, "first_token_latency", 0):
                ttft.append(m.first_token_latency)
                if n > 1 and m.last_token_ts > m.first_token_ts:
                    tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        return {
            "wall_s": wall,
            "output_tokens": generated,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "steady": steady_window(times.of_requests()),
        }

    def close(self) -> None:
        pass  # the process group's end frees the engine


class EngineTokenTimes:
    """Each request's token times as the engine core made them, for the decode
    rate's window (``cells.steady_window``): while in use, the engine-core
    client's ``get_output`` (one call a step's outputs, V1 multiprocessing or
    not) is wrapped to note every output's request and its new tokens, at the
    timestamp the engine core put on the step's outputs. Only the instance's
    attribute is set, and removed after."""

    def __init__(self, engine_core) -> None:
        self.engine_core = engine_core
        self.times: dict[str, list[float]] = {}

    def __enter__(self) -> EngineTokenTimes:
        get_output = self.engine_core.get_output  # the class's, bound

        def noted_get_output(*args, **kwargs):
            outputs = get_output(*args, **kwargs)
            for out in outputs.outputs or ():
                n = len(out.new_token_ids or ())
                if n:
                    self.times.setdefault(out.request_id, []).extend([outputs.timestamp] * n)
            return outputs

        self.engine_core.get_output = noted_get_output
        return self

    def __exit__(self, *exc) -> None:
        del self.engine_core.get_output

    def of_requests(self) -> list[list[float]]:
        return list(self.times.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, end_at: float) -> None:
    """Wait for ``GET url`` to answer 200; raise when the server exits or the
    time is up."""
    while time.time() < end_at:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {proc.returncode} before it was up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vllm serve was not up ({url}) before the cell's time ran out")


def _extra(obj, name: str):
    """A field vLLM adds to an OpenAI object (kept by the client as an extra)."""
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


def _token_id(text: str) -> int:
    """``token_id:123`` (``return_tokens_as_token_ids``) → 123."""
    return int(text.rsplit(":", 1)[1])


async def stream_completion(client, prompt: list[int], max_tokens: int, logprobs: int | None):
    """One streamed completion: its token ids, logprobs per position, and the
    arrival time of each token."""
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        logprobs=logprobs,
        extra_body={
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )
    tokens: list[int] = []
    positions: list[dict[str, float]] = []
    arrivals: list[float] = []
    async for chunk in stream:
        now = time.perf_counter()
        for choice in chunk.choices or []:
            ids = _extra(choice, "token_ids")
            lp = choice.logprobs
            if ids is None and lp is not None and lp.tokens:
                ids = [_token_id(t) for t in lp.tokens]
            ids = list(ids or [])
            tokens += ids
            arrivals += [now] * len(ids)
            if lp is not None and lp.tokens:
                for tok, tok_lp, top in zip(
                    lp.tokens, lp.token_logprobs or [], lp.top_logprobs or [], strict=False
                ):
                    pos = {str(_token_id(k)): v for k, v in (top or {}).items()}
                    if tok_lp is not None:
                        pos[str(_token_id(tok))] = tok_lp
                    positions.append(pos)
    ttft = arrivals[0] - t0 if arrivals else None
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    return {
        "tokens": tokens,
        "logprobs": positions,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "arrivals": arrivals,
    }


async def stream_each(base_url: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Every prompt as its own concurrent stream; a failed one is its exception."""
    import openai

    async def one(client, prompt):
        tokens: list[int] = []
        arrivals: list[float] = []
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or []:
                ids = list(_extra(choice, "token_ids") or [])
                tokens += ids
                arrivals += [now] * len(ids)
        return {"tokens": tokens, "arrivals": arrivals}

    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=600.0
    ) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts), return_exceptions=True)


async def stream_in_turn(base_url: str, prompts: list[list[int]], max_tokens: int, logprobs):
    """Every prompt streamed alone, the next once the last has ended."""
    import openai

    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=600.0
    ) as client:
        return [await stream_completion(client, p, max_tokens, logprobs) for p in prompts]


async def stream_all(base_url: str, prompts: list[list[int]], max_tokens: int, logprobs):
    """Every prompt as its own concurrent stream, on a client of this event loop."""
    import openai

    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=600.0
    ) as client:
        return await asyncio.gather(
            *(stream_completion(client, p, max_tokens, logprobs) for p in prompts)
        )


class ServeEngine:
    """``vllm serve`` in the cell's process group, driven by the ``openai`` client."""

    EXACT_SUBMISSION = "in_turn"  # one prompt after another (cells.submission)

    def __init__(self, cell: Cell, model_dir: Path, log_path: Path, end_at: float) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            serve_argv(cell, model_dir, port),
            # Not the checkout: `python -m` would import its unbuilt pleclient,
            # and vLLM runs on without a plugin that fails to load.
            cwd=tempfile.gettempdir(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_healthy(f"http://127.0.0.1:{port}/health", self.proc, end_at)

    def exact(self, prompts: list[list[int]], max_tokens: int) -> dict:
        # One prompt after another: under concurrent HTTP arrivals the steps'
        # batches, and so stock's own output, change from run to run.
        results = asyncio.run(stream_in_turn(self.base_url, prompts, max_tokens, LOGPROBS))
        return {
            "tokens": [r["tokens"] for r in results],
            "logprobs": [r["logprobs"] for r in results],
        }

    def throughput(self, prompts: list[list[int]], max_tokens: int) -> dict:
        t = time.perf_counter()
        results = asyncio.run(stream_all(self.base_url, prompts, max_tokens, None))
        wall = time.perf_counter() - t
        return {
            "wall_s": wall,
            "output_tokens": sum(len(r["tokens"]) for r in results),
            "ttft_s": [r["ttft_s"] for r in results if r["ttft_s"] is not None],
            "tpot_s": [r["tpot_s"] for r in results if r["tpot_s"] is not None],
            "steady": steady_window(r["arrivals"] for r in results),
        }

    def streams(self, prompts: list[list[int]], max_tokens: int) -> list:
        """Each prompt's tokens and their arrival times (perf_counter), or its error."""
        return asyncio.run(stream_each(self.base_url, prompts, max_tokens))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def versions() -> dict:
    """The packages measured, from their metadata (importing vLLM and torch in a
    serve cell's client would cost seconds of the device's time)."""
    from importlib import metadata

    out: dict = {}
    for name in ("vllm", "torch", "transformers", "openai", "pleserver", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cell_main(name: str, work: Path, out: Path, run_id: str, order: int, end_at: float) -> int:
    """Run one cell in this process (the coordinator's child, a process group
    of its own); the exit status says whether it finished."""
    cell = parse_cell(name)
    model_dir = work / "ckpt" / cell.checkpoint
    stem = file_stem(name)
    rec = CellRecord(
        out / "cells" / f"{stem}.json",
        cell_record(cell, run_id, order, "running", error=None, times={}, skipped_measurements=[]),
    )
    data = rec.data
    t_cell = time.monotonic()
    served: Served | None = None
    engine = None
    status = 1
    try:
        marker = model_dir / "bench-checkpoint.json"
        if not marker.exists():
            raise FileNotFoundError(
                f"{model_dir}: no checkpoint ({marker.name} missing); bench/device_vllm.sh "
                "writes it with bench/real_vllm/checkpoint.py before the cells run"
            )
        data["checkpoint"] = json.loads(marker.read_text())
        text = prose()
        data["prompts"] = {"source": text.source}
        if cell.pin:
            engine_cpus, server_cpus = pin_cpus(os.sched_getaffinity(0))
            # (vLLM's processes are this one's children: they inherit it)
            os.sched_setaffinity(0, engine_cpus)
            data["cpus"] = {"engine": engine_cpus, "server": server_cpus}
        if cell.shm:
            t = time.monotonic()
            served = Served(
                model_dir,
                cell,
                work / "logs" / f"{run_id}-{stem}.server.log",
                cpus=server_cpus if cell.pin else None,
            )
            data["server"] = {"args": served.args, "pid": served.pid}
            data["times"]["server_start_s"] = round(time.monotonic() - t, 2)
        env = cell.env(served.socket if served else None)
        os.environ.update(env)
        data["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        t = time.monotonic()
        if cell.api == "serve":
            engine = ServeEngine(
                cell, model_dir, work / "logs" / f"{run_id}-{stem}.serve.log", end_at
            )
        else:
            profile_dir = work / "prof" / f"{run_id}-{stem}" if cell.profile else None
            engine = GenerateEngine(cell, model_dir, profile_dir)
        data["times"]["engine_start_s"] = round(time.monotonic() - t, 1)
        data["versions"] = versions()
        if CHECKPOINTS[cell.checkpoint].dummy_weights and not cell.shm:
            data["engram_tables"] = load_stock_tables(engine, model_dir, text, data["times"])
        if cell.verify:  # (mp0: the worker is in this process)
            from bench.real_vllm import verify as vllm_verify

            layers = engine.llm.collective_rpc(vllm_verify.install, args=(str(model_dir),))
            data["verify"] = {"layers": layers[0]}
        ready = None
        if served:
            snap = served.snapshot()
            data["server"]["dataplane"] = snap.get("dataplane")
            ready = server_counters(snap)  # vLLM's start-up profiling looked rows up
            data["server"]["at_ready"] = ready
            ready_cpu, ready_t = served.cpu_seconds(), time.perf_counter()
            ready_gather = served.gather_cpu_seconds()
        rec.save()
        try:
            measure(cell, engine, served, text, data, rec, end_at)
        finally:
            if cell.verify:
                data["verify"] = engine.llm.collective_rpc(vllm_verify.report)[0]
            if served and ready is not None and served.server.running:
                data["server"]["cell"] = server_delta(
                    ready,
                    served.counters(),
                    served.cpu_seconds() - ready_cpu,
                    time.perf_counter() - ready_t,
                    gather_cpu_s=served.gather_cpu_seconds() - ready_gather,
                )
            if served and served.server.running and not cell.restart:
                add_step_timelines(data, served.stop_for_trace())
        data["status"] = "done"
        status = 0
    except BaseException as exc:
        data["status"] = "failed"
        data["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
    finally:
        data["times"]["total_s"] = round(time.monotonic() - t_cell, 1)
        rec.save()
        for part in (engine, served):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    # An engine's teardown can hang; the coordinator ends the process group.
    os._exit(status)


def load_stock_tables(engine: GenerateEngine, model_dir: Path, text, times: dict) -> dict:
    """A dummy-weight stock engine's Engram tables, from the checkpoint
    (``engram_tables``), with one exact run before and one after: whether
    the tables change the output says whether the cell's exactness means
    anything of the rows (dummy weights are small: a model whose output
    ignored its Engram rows would pass any comparison of them)."""
    prompts = exact_prompts(text)
    before = engine.exact(prompts, EXACT_TOKENS)
    t = time.monotonic()
    loaded = engine.llm.collective_rpc("load_engram_tables", args=(str(model_dir),))[0]
    times["engram_tables_s"] = round(time.monotonic() - t, 1)
    after = engine.exact(prompts, EXACT_TOKENS)
    pairs = zip(before["tokens"], after["tokens"], strict=True)  # the same prompts
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    return {
        "loaded": loaded,
        "output_changed": before != after,
        "prompts_with_other_tokens": differ,
    }


def add_step_timelines(data: dict, records) -> None:
    """Each throughput repetition's steps as the server's trace saw them
    (``steps.timeline``), beside its figures."""
    if records is None:
        return
    for rep in (data.get("throughput") or {}).get("reps", []):
        if rep.get("window_ns"):
            rep["steps"] = vllm_steps.timeline(records, tuple(rep["window_ns"]))


def measure(
    cell: Cell, engine, served: Served | None, text, data: dict, rec: CellRecord, end_at: float
) -> None:
    """The exact runs, then the throughput repetitions, each only when it is
    expected to end before ``end_at``."""
    costs = Costs()
    t = time.monotonic()
    if cell.exact_runs:
        prompts = exact_prompts(text)
        digest = prompts_digest(prompts)
        exact = data["exact"] = {
            "prompts_digest": digest,
            "submission": engine.EXACT_SUBMISSION,
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": EXACT_TOKENS,
            "logprobs": LOGPROBS,
            "runs": [],
            "server": [],
        }
        for i in range(cell.exact_runs):
            if time.time() + costs.exact_run_s > end_at:
                data["skipped_measurements"].append(f"exact runs {i + 1}..{cell.exact_runs}: time")
                break
            r = measured(served, lambda p=prompts: engine.exact(p, EXACT_TOKENS))
            exact["runs"].append(
                {"prompts_digest": digest, "tokens": r["tokens"], "logprobs": r["logprobs"]}
            )
            exact["server"].append(r.get("server"))
            rec.save()
        exact["seconds"] = round(time.monotonic() - t, 1)
    if cell.restart:
        restart_run(engine, served, text, data, rec, end_at)
    if cell.throughput_reps:
        tp = data["throughput"] = {
            "prompt_tokens": TP_PROMPT_TOKENS,
            "output_tokens": TP_OUTPUT_TOKENS,
            "concurrency": list(CONCURRENCY),
            "reps": [],
        }
        rep_s = costs.tp_rep_s * (costs.disk_factor if cell.io == "direct" else 1.0)
        took: dict[int, float] = {}  # the last wall time of each concurrency
        for rep in range(cell.throughput_reps):
            for c in CONCURRENCY:
                expected = 1.2 * took.get(c, rep_s / len(CONCURRENCY))
                if time.time() + expected > end_at:
                    data["skipped_measurements"].append(f"throughput rep {rep + 1} c {c}: time")
                    continue
                prompts = throughput_prompts(text, rep, c)
                t = time.monotonic()
                r = measured(served, lambda p=prompts: engine.throughput(p, TP_OUTPUT_TOKENS))
                took[c] = time.monotonic() - t
                r.update(
                    rep=rep,
                    concurrency=c,
                    tok_s=r["output_tokens"] / r["wall_s"] if r["wall_s"] else None,
                )
                tp["reps"].append(r)
                rec.save()
    if cell.ttft_reps:
        ttft_run(cell, engine, served, text, data, rec, end_at, costs)
    if cell.profile:
        profile_run(engine, text, data, rec, end_at, costs)


def profile_run(
    engine: GenerateEngine, text, data: dict, rec: CellRecord, end_at: float, costs: Costs
) -> None:
    """Decode under vLLM's torch profiler at each of ``PROFILE_CONCURRENCY``
    (new text), the worker's trace read into its decode steps' GPU figures
    (``gpu_trace``); their GPU side (``gpu_trace.compact``) goes to ``$OUT/prof``."""
    assert engine.profile_dir is not None  # a prof cell's engine
    found = data["profile"] = {}
    out = rec.path.parent.parent / "prof"
    for k, c in enumerate(PROFILE_CONCURRENCY):
        if time.time() + costs.profile_s / len(PROFILE_CONCURRENCY) > end_at:
            data["skipped_measurements"].append(f"profile c {c}: time")
            continue
        prompts = throughput_prompts(text, PROFILE_TEXT_REP + k, c)
        before = set(engine.profile_dir.rglob("*.pt.trace.json*"))
        engine.llm.start_profile(profile_prefix=f"c{c}")
        try:
            engine._generate(prompts, PROFILE_TOKENS, None)
        finally:
            engine.llm.stop_profile()
        traces: list[Path] = []
        deadline = time.monotonic() + 60  # the worker writes it as it stops
        while not traces and time.monotonic() < deadline:
            traces = sorted(set(engine.profile_dir.rglob("*.pt.trace.json*")) - before)
            if not traces:
                time.sleep(0.5)
        if not traces:
            found[str(c)] = {"error": f"no trace under {engine.profile_dir}"}
            continue
        trace = traces[0]  # the one worker (no tensor or pipeline parallelism)
        events = gpu_trace.load(trace)
        figures = gpu_trace.decode_figures(gpu_trace.steps(events), c)
        figures["trace"] = trace.name
        found[str(c)] = figures
        out.mkdir(parents=True, exist_ok=True)
        small = out / f"{rec.path.stem}-c{c}.gpu.json.gz"
        gpu_trace.compact(events, small)
        if small.stat().st_size > PROFILE_TRACE_OUT_BYTES:
            small.unlink()
            figures["trace_not_kept"] = "its GPU activities alone were too large for $OUT"
        else:
            figures["trace_kept"] = small.name
        rec.save()


def ttft_run(
    cell: Cell,
    engine,
    served: Served | None,
    text,
    data: dict,
    rec: CellRecord,
    end_at: float,
    costs: Costs,
) -> None:
    """The 8 000-token prompt alone: new text (its rows unread), then the same
    text again (every row read before it), each repetition."""
    timed = data["ttft"] = {
        "prompt_tokens": TTFT_PROMPT_TOKENS,
        "output_tokens": TTFT_OUTPUT_TOKENS,
        "reps": [],
    }
    each = costs.ttft_rep_s * (costs.disk_factor if cell.io == "direct" else 1.0) / 2
    for rep in range(cell.ttft_reps):
        prompt = ttft_prompt(text, rep)
        for kind in ("unread", "read"):
            if time.time() + each > end_at:
                data["skipped_measurements"].append(f"ttft rep {rep + 1} {kind}: time")
                continue
            r = measured(served, lambda p=prompt: engine.throughput([p], TTFT_OUTPUT_TOKENS))
            ttft = r.get("ttft_s") or [None]
            timed["reps"].append(
                {"rep": rep, "kind": kind, "ttft_s": ttft[0], "server": r.get("server")}
            )
            rec.save()


def restart_run(
    engine, served: Served | None, text, data: dict, rec: CellRecord, end_at: float
) -> None:
    """``RESTART_STREAMS`` greedy streams of ``RESTART_TOKENS`` tokens, three
    times: undisturbed, then with ple-server killed, reloaded and restarted
    under them (``RESTART_EVENTS``; stock: undisturbed, the references), then
    undisturbed again. The streams run on a thread of their own; the server is
    restarted from this (main) thread, whose end its death signal is tied to.
    Recorded: every failed stream, each event's server start and the longest
    gap between two tokens of any stream around it, each run's tokens (an
    outcome without logprobs, judged in the summary against stock's streams),
    the disturbed run against both undisturbed ones, and the workers' own
    account (their log: stalls, rows read from the checkpoint)."""
    prompts = throughput_prompts(text, 0, RESTART_STREAMS)
    digest = prompts_digest(prompts)
    record = data["restart"] = {
        "streams": RESTART_STREAMS,
        "max_tokens": RESTART_TOKENS,
        "away_s": RESTART_AWAY_S,
        "prompts_digest": digest,
        "runs": {},
        "events": [],
    }
    tokens: dict[str, list] = {}

    def one_run(name: str, disturb: bool) -> None:
        if time.time() + 90 > end_at:
            data["skipped_measurements"].append(f"restart run {name}: time")
            return
        box: dict = {}
        t0 = time.perf_counter()
        worker = threading.Thread(
            target=lambda: box.update(out=engine.streams(prompts, RESTART_TOKENS))
        )
        worker.start()
        if disturb and served is not None:
            for at, kind in RESTART_EVENTS:
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                event: dict = {"kind": kind, "at": time.perf_counter()}
                if kind == "reload":
                    os.kill(served.pid, signal.SIGHUP)
                else:
                    served.kill(signal.SIGTERM if kind == "restart" else signal.SIGKILL)
                    if kind == "kill9-away":
                        time.sleep(RESTART_AWAY_S)
                    event["server_start_s"] = round(served.start(), 3)
                record["events"].append(event)
        worker.join()
        wall = time.perf_counter() - t0
        out = box.get("out") or []
        failed = [f"{type(r).__name__}: {r}"[:300] for r in out if isinstance(r, BaseException)]
        ok = [r for r in out if not isinstance(r, BaseException)]
        tokens[name] = [r["tokens"] for r in ok] if not failed else []
        gaps = sorted(b - a for r in ok for a, b in itertools.pairwise(r["arrivals"]))
        record["runs"][name] = {
            "wall_s": round(wall, 2),
            "failed": failed,
            "output_tokens": sum(len(r["tokens"]) for r in ok),
            "gap_p50_ms": round(1e3 * gaps[len(gaps) // 2], 2) if gaps else None,
            "gap_max_ms": round(1e3 * gaps[-1], 1) if gaps else None,
            "outcome": (
                {
                    "prompts_digest": digest,
                    "tokens": tokens[name],
                    "logprobs": [[] for _ in tokens[name]],
                }
                if tokens[name]
                else None
            ),
        }
        if disturb and served is not None:
            for event in record["events"]:
                start = event["at"] - 0.05
                # Up to the next event (3 s apart), the away time included.
                end = start + 2.9 + (RESTART_AWAY_S if event["kind"] == "kill9-away" else 0.0)
                around = [
                    b - a
                    for r in ok
                    for a, b in itertools.pairwise(r["arrivals"])
                    if start <= b and a <= end
                ]
                event["stall_s"] = round(max(around), 3) if around else None
                event["at"] = round(event["at"] - t0, 2)
        rec.save()

    one_run("before", False)
    one_run("disturbed", True)
    one_run("after", False)
    same = record["identical_streams"] = {}
    first = record["first_difference"] = {}  # per pair: the earliest and median position
    for a, b in (("disturbed", "before"), ("disturbed", "after"), ("before", "after")):
        if tokens.get(a) and tokens.get(b):
            pairs = list(zip(tokens[a], tokens[b], strict=True))
            same[f"{a}/{b}"] = sum(x == y for x, y in pairs)
            at = sorted(
                next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), len(x))
                for x, y in pairs
            )
            first[f"{a}/{b}"] = {"min": at[0], "median": at[len(at) // 2]}
    record["worker_log"] = worker_restart_lines(engine)
    rec.save()


def worker_restart_lines(engine) -> list[str]:
    """What the vLLM workers logged of each loss of the server (their log is the
    serve log), shortened to the figures."""
    path = getattr(engine, "log_path", None)
    if path is None:
        return []
    wanted = re.compile(
        r"(wait for the next ple-server|answered from the checkpoint|back on ple-server"
        r"|fail from now on|lost ple-server|reconnected to ple-server)"
    )
    lines = Path(path).read_text(errors="replace").splitlines()
    return [line[-300:] for line in lines if wanted.search(line)][-40:]


# ======================================================================== CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run cells (the coordinator)")
    p_run.add_argument("--cells", required=True, help="cell and plan names, comma-separated")
    p_run.add_argument("--work", type=Path, default=Path("/tmp/vllm-real"))
    p_run.add_argument("--out", type=Path, default=Path("."))
    p_run.add_argument(
        "--t0", type=float, help="when the device call began (epoch s; default: now)"
    )
    p_run.add_argument("--deadline-s", type=float, default=540.0)
    p_run.add_argument("--no-probe", action="store_true", help="skip the disk probe")
    p_cell = sub.add_parser("cell", help="run one cell in this process (the coordinator's child)")
    p_cell.add_argument("name")
    p_cell.add_argument("--work", type=Path, required=True)
    p_cell.add_argument("--out", type=Path, required=True)
    p_cell.add_argument("--run-id", required=True)
    p_cell.add_argument("--order", type=int, default=0)
    p_cell.add_argument("--end-at", type=float, required=True)
    p_plan = sub.add_parser("plan", help="the expected timeline of a list of cells")
    p_plan.add_argument("--cells", required=True)
    p_plan.add_argument("--deadline-s", type=float, default=540.0)
    p_plan.add_argument("--work", type=Path, help="read the host's measured starts from here")
    p_plan.add_argument(
        "--warm",
        action="store_true",
        help="as on a host that has started every kind of engine once (compiles cached)",
    )
    p_plan.add_argument(
        "--spent-s",
        type=float,
        default=0.0,
        help="seconds gone before the cells (install, checkpoints)",
    )
    p_ck = sub.add_parser("checkpoints", help="the checkpoints the cells need, one a line")
    p_ck.add_argument("--cells", required=True)
    p_ck.add_argument("--work", type=Path, default=Path("/tmp/vllm-real"))
    p_sum = sub.add_parser("summary", help="the summary of cell JSONs under directories")
    p_sum.add_argument("dirs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.command == "cell":
            return cell_main(args.name, args.work, args.out, args.run_id, args.order, args.end_at)
        if args.command == "summary":
            print(summary(load_cells(args.dirs), load_runs(args.dirs)))
            return 0
        cells = expand(args.cells)
    except CellError as exc:
        print(f"bench.real_vllm.coordinator: {exc}", file=sys.stderr)
        return 2
    if args.command == "plan":
        history = History.load(args.work / "history.json") if args.work else History()
        if args.warm:
            costs = Costs()
            for api in ("generate", "serve"):
                for mode, start in costs.engine_start_s.items():
                    history.record(api, mode, start + (api == "serve") * costs.serve_extra_s)
        print(plan_text(cells, args.deadline_s, Costs(), history, args.spent_s))
        return 0
    if args.command == "checkpoints":
        for ck in checkpoints_needed(cells):
            print(ck.name, *ck.args(args.work))
        return 0
    results = run(
        cells,
        args.work,
        args.out,
        t0=args.t0 or time.time(),
        deadline_s=args.deadline_s,
        probe=not args.no_probe,
    )
    return 0 if all(r.get("status") in ("done", "skipped") for r in results) else 1


if __name__ == "__main__":
    installed_first()
    sys.exit(main())
