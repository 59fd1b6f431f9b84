"""The load beside the timed client and the client itself: the *bystander*, a
small steady client whose latency is what the attack, flood and fairness
benchmarks report, and the helper processes (flooders, submitters, attackers)
that load the server meanwhile. A helper is a ``python -c`` program of its
script's own: it prints ``ready`` once its load is on, and its report (JSON,
or a number) as the last line of its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.provenance import OthersMeter, proc_ticks

CPU_BURNER = """
import json, os, sys, time
stop = sys.argv[1]
print("ready", flush=True)
while not os.path.exists(stop):
    for _ in range(100_000):  # the stop file looked at every few ms
        pass
print(json.dumps({"cpu_s": round(time.process_time(), 3)}), flush=True)
"""
"""A control load: a process that keeps a core busy and asks the server for
nothing, until its stop file exists. Beside the bystander it shows what
sharing the machine's cores with a busy process costs a lookup by itself, the
floor under what a flood of the same processes can cost it."""

DISK_PROBE = """
import json, sys, time
from pleserver import _native
paths, queue_depth, seconds, kind = json.loads(sys.argv[1])
cpu = time.process_time()  # the probe's threads: its own CPU for its reads
r = _native.probe_random_reads(paths, block=4096, queue_depth=queue_depth, seconds=seconds,
                               direct=True, kind=kind)
r["cpu_s"] = time.process_time() - cpu
print(json.dumps(r), flush=True)
"""
"""The disk probe of ``pleserver doctor`` in a process of its own (it runs with
the GIL released, where no signal handler runs: its caller can still end it):
4 KiB ``O_DIRECT`` random reads over ``paths`` at ``queue_depth`` for
``seconds``, its report and CPU as JSON. Its argument: ``[paths, queue_depth,
seconds, kind]`` as JSON."""

DISK_LOAD = 'print("ready", flush=True)\n' + DISK_PROBE
"""A control load: ``DISK_PROBE`` as a helper (``Helpers``), asking the server
for nothing. Beside a bystander whose lookups read the disk it shows what the
disk's own queue costs a read at that depth: the floor under what a client's
large cold reads through the server can cost it."""


def cores_used(pids: Sequence[int], ticks0: Sequence[int], wall_s: float) -> float:
    """The cores ``pids`` kept busy since their CPU ticks were ``ticks0``, over
    ``wall_s`` seconds."""
    used = sum(proc_ticks(p) - t for p, t in zip(pids, ticks0, strict=True))
    return round(used / OthersMeter.HZ / wall_s, 2) if wall_s > 0 else 0.0


class FirstTouches:
    """Stands in for a generator's ``integers`` where a bystander must never
    look a row up twice (every lookup a miss, whatever earlier cases left in
    the cache): successive slices of one permutation of ``rows`` rows."""

    def __init__(self, rows: int, seed: int) -> None:
        self._order = np.random.default_rng(seed).permutation(rows)
        self._next = 0

    def integers(self, low: int, high: int, size: int) -> np.ndarray:
        if low != 0 or high != len(self._order):
            whole = len(self._order)
            raise ValueError(f"FirstTouches draws from [0, {whole}), not [{low}, {high})")
        if self._next + size > high:
            raise RuntimeError(f"every one of the {high} rows was looked up once already")
        ids = self._order[self._next : self._next + size]
        self._next += size
        return ids


def bystander(
    client, table, seconds: float, gap_ms: float, rng: np.random.Generator | FirstTouches
) -> np.ndarray:
    """A bystander's lookups of 16 random ids of ``table`` (a handle or an
    index), one every ``gap_ms`` for ``seconds``: each call's latency, in ms."""
    info = client.table(table) if isinstance(table, (int, str)) else table
    out = np.empty((16, info.row_bytes), dtype=np.uint8)
    samples = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        ids = rng.integers(0, info.rows, 16)
        t0 = time.perf_counter_ns()
        client.lookup(info, ids, out=out)
        samples.append(time.perf_counter_ns() - t0)
        time.sleep(gap_ms * 1e-3)
    return np.array(samples) / 1e6


def latency_ms(ms: np.ndarray) -> dict:
    """The count, p50, p99, p99.9 and max of latencies in ms, rounded to µs."""
    return {
        "bystander_lookups": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "p999_ms": round(float(np.percentile(ms, 99.9)), 3),
        "max_ms": round(float(ms.max()), 3),
    }


class Helpers:
    """Helper processes, one per argument list, each running ``script`` with the
    checkout first on its path; killed on ``close`` if still running (a
    context manager), so that no load outlives its case."""

    def __init__(
        self, what: str, script: str, argvs: Iterable[Sequence[str]], nice: int = 0
    ) -> None:
        self.what = what
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.procs: list[subprocess.Popen] = []
        try:
            for argv in argvs:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", script, *argv],
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=REPO,
                        env=env,
                        preexec_fn=(lambda: os.nice(nice)) if nice else None,
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, detail: Callable[[], str] | None = None) -> None:
        """Until every helper said ``ready``; ``detail`` (the server's log, say)
        explains one that did not."""
        for proc in self.procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                more = f":\n{detail()}" if detail is not None else ""
                raise RuntimeError(f"a {self.what} did not start{more}")

    def outputs(self, timeout: float = 60) -> list[str]:
        """Each helper's output, once it ended."""
        return [proc.communicate(timeout=timeout)[0] for proc in self.procs]

    def reports(self, timeout: float = 60) -> list[dict]:
        """Each helper's last line of output, as JSON; a helper that ended
        without one (its error is on the benchmark's stderr) stops the case."""
        found = []
        for proc, out in zip(self.procs, self.outputs(timeout), strict=True):
            lines = out.strip().splitlines()  # (after "ready", read by wait_ready)
            if not lines:
                raise RuntimeError(
                    f"a {self.what} ended (exit status {proc.returncode}) without its report: "
                    "its error is above"
                )
            found.append(json.loads(lines[-1]))
        return found

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Helpers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
