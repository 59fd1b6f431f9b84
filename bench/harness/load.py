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


def bystander(client, table, seconds: float, gap_ms: float, rng: np.random.Generator) -> np.ndarray:
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
