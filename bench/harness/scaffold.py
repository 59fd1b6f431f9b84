"""A benchmark's frame: its command line, its work directory (removed at the
end, also on an error, Ctrl-C or SIGTERM, with the servers that die with it),
and where its result goes (JSON)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import tempfile
from collections.abc import Iterator


def parser(doc: str | None, work_dir: bool = True) -> argparse.ArgumentParser:
    """The command line of a benchmark whose module docstring is ``doc``: its
    first paragraph is the description, the rest the epilogue of ``--help``;
    with ``work_dir``, ``--dir`` names the work directory's parent."""
    ap = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if work_dir:
        ap.add_argument("--dir", help="parent of the temporary table directory (default $TMPDIR)")
    return ap


def add_load(ap: argparse.ArgumentParser, seconds: float, gap_ms: float = 1.0) -> None:
    """``--seconds`` a case and the bystander's ``--gap-ms``, the two knobs of
    every benchmark that times a bystander beside a load."""
    ap.add_argument(
        "--seconds", type=float, default=seconds, help=f"per case (default {seconds:g})"
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=gap_ms,
        help=f"pause between the bystander's lookups (default {gap_ms:g})",
    )


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """``--server-arg``: extra arguments for every ``pleserver serve`` started."""
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for every `pleserver serve` (repeatable), "
        "e.g. --server-arg=--chunk-rows=8192",
    )


def add_json(ap: argparse.ArgumentParser) -> None:
    """``--json PATH``: the result, also as JSON (``save_json``)."""
    ap.add_argument("--json", metavar="PATH", help="also write the results here, as JSON")


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def work_dir(prefix: str, parent: str | None = None) -> Iterator[str]:
    """A temporary directory for the benchmark's tables and sockets, under
    ``parent`` (else ``$TMPDIR``), removed when the block ends however it ends:
    SIGTERM and Ctrl-C (also when started with ``&``) unwind the block."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def save_json(result: dict, path: str | None, indent: int = 2) -> None:
    """The result as JSON at ``path`` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=indent)
