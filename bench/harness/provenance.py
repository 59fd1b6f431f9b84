"""What a figure was measured on: the machine, the commit, the load average,
and the CPU that processes other than the benchmark used meanwhile (other load
on a shared box lands in the timings, so a run reports how much there was)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.checkout import REPO


def machine() -> dict:
    """The host as a reader of the figures needs it: CPU model, cores, RAM,
    kernel, Python, NumPy, transparent huge pages, and the date."""
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cores": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        for key in ("model name", "cpu family", "model", "stepping"):
            for line in lines:
                if line.split(":")[0].strip() == key:
                    info[key.replace(" ", "_")] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["thp"] = f.read().strip()
    except OSError:
        pass
    info.update(cpu_topology())
    return info


def cpu_topology() -> dict:
    """Hardware threads per core and packages, where sysfs says: on a host with
    two threads a core, a busy thread slows its sibling's."""
    out: dict = {}
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            out["threads_per_core"] = len(_cpu_list(f.read()))
        packages = set()
        for path in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id"):
            packages.add(path.read_text().strip())
        out["packages"] = len(packages)
    except (OSError, ValueError):
        pass
    return out


def _cpu_list(text: str) -> list[int]:
    """A sysfs CPU list ("0-3,8") as its numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def source() -> dict:
    """The commit measured, and whether pleserver/pleclient differ from it."""

    def git(*cmd):
        try:
            return subprocess.run(
                ["git", "-C", str(REPO), *cmd], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "--short", "HEAD") or None,
        "modified": git("status", "--porcelain", "--", "pleserver", "pleclient").splitlines(),
    }


def envelope(name: str) -> dict:
    """The head of a result that a reader compares runs by: the command that
    made it (benchmark ``name``), the machine, the commit, and the load on the
    machine before it started."""
    return {
        "command": f"python -m bench.{name} " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "source": source(),
        "loadavg_start": loadavg(),
        "cpu_busy_before": cpu_busy(),
    }


def footer(result: dict) -> str:
    """The last line of a report: the commit (and whether it was modified), the
    CPU and its cores, from a result's ``source`` and ``machine``."""
    src, host = result["source"], result["machine"]
    return (
        f"commit {src['commit']}{' (modified)' if src.get('modified') else ''}, "
        f"{host.get('model_name', '?')}, {host['cores']} cores"
    )


def loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``seconds`` (other processes: we sleep)."""

    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return float("nan")
    return round(1 - (i1 - i0) / max(1, t1 - t0), 3)


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


def proc_ticks(pid: int) -> int:
    """The CPU time (user + system) process ``pid`` used so far, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) process ``pid``'s threads used so far, by
    thread name (threads of one name summed; one that ended meanwhile is left
    out). The server names its own (``ple-serving``, ``ple-gather-N``, …)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The name may hold spaces and parentheses: the fields follow its last ")".
        head, rest = stat.rsplit(")", 1)
        fields = rest.split()
        name = head.split("(", 1)[1]
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class OthersMeter:
    """CPU used by processes other than the benchmark and its servers, as a
    fraction of the machine, between ``start`` and ``stop``: the check that
    nobody else disturbed the timings."""

    HZ = os.sysconf("SC_CLK_TCK")

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _sample(self):
        ours = proc_ticks(os.getpid()) + sum(proc_ticks(p) for p in self.pids)
        return time.monotonic(), _busy_ticks(), ours

    def start(self) -> None:
        self.t0 = self._sample()

    def stop(self) -> float:
        t1 = self._sample()
        wall = t1[0] - self.t0[0]
        others = (t1[1] - self.t0[1]) - (t1[2] - self.t0[2])
        return round(max(0.0, others / self.HZ / (wall * (os.cpu_count() or 1))), 3)
