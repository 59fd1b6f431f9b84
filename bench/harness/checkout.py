"""Where the checkout is, and how a benchmark keeps its packages out of the way
of the installed ones.

``python -m bench.<kind>.<name>`` from the repository root puts the root first on
``sys.path``: the benchmarks that time this checkout's code want exactly that.
The real-vLLM ones run where only the *installed* pleserver and pleclient have
their native modules (a GPU host's checkout is not built), so they take the
root back out (``installed_first``) and start their own subprocesses from a
directory that holds the ``bench`` package alone (``bench_only``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH)
TRACE = os.path.join(BENCH, "traces", "qwen-text.npz")  # bench.sim.text_trace's real-text trace
ENGRAM_TRACE = os.path.join(BENCH, "traces", "engram-text.npz")  # bench.sim.engram_trace's


def installed_first() -> None:
    """Drop the entry ``python -m`` put first on ``sys.path`` for the working
    directory when that is the checkout, so that ``import pleclient`` finds the
    installed package. Called before anything imports pleserver or pleclient;
    the ``bench`` package, imported already, keeps working (an explicit
    ``PYTHONPATH`` is left as it is: whoever set it meant it)."""
    # Every entry that is the checkout, not only the first: a ``.pth`` file of
    # the environment (NVIDIA's CUTLASS DSL ships one) may have put its own
    # entry in front of it. '' is the working directory.
    repo = os.path.realpath(REPO)
    explicit = {
        os.path.realpath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e
    }
    sys.path[:] = [
        e
        for e in sys.path
        if os.path.realpath(e or os.getcwd()) != repo or os.path.realpath(e or ".") in explicit
    ]
    for name in ("pleclient", "pleserver"):
        module = sys.modules.get(name)
        if module is not None and os.path.realpath(module.__file__ or "").startswith(repo + os.sep):
            raise RuntimeError(
                f"{name} was imported from the checkout ({module.__file__}) before "
                "installed_first(): move that import below it"
            )


def bench_only(parent: Path) -> Path:
    """A directory under ``parent`` whose only entry is a link to the ``bench``
    package: the working directory of a subprocess that runs ``python -m
    bench.<kind>.<name>`` outside the checkout, and whose own ``python -m``
    subprocesses (vLLM starts some) import no package of the checkout."""
    path = parent / "bench-only"
    path.mkdir(parents=True, exist_ok=True)
    link = path / "bench"
    if not link.is_symlink() or os.readlink(link) != BENCH:
        link.unlink(missing_ok=True)
        link.symlink_to(BENCH, target_is_directory=True)
    return path
