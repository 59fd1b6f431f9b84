"""The cached Debian 12 roots of the container tests (the real-systemd test,
the aarch64 test) and the wheelhouses their CPython 3.11 installs from.

``.ci/debian-root [ARCH]`` debootstraps a root once and prints its path;
``wheelhouse`` downloads the manylinux wheels of a requirement list for the
root's Python once, keyed by the list and the machine. Both live under
``PLE_CI_CACHE`` (default /var/cache/pleserver-ci), so a second run starts in
seconds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("PLE_CI_CACHE", "/var/cache/pleserver-ci"))
# Tags the roots' glibc (2.36) can load, newest first.
MANYLINUX = ("manylinux_2_28", "manylinux_2_17", "manylinux2014")


def fail(message: str) -> None:
    """The host cannot run a container test: a failure with the fix, not a skip."""
    pytest.fail(message, pytrace=False)


def debian_root(arch: str | None = None, timeout: float = 1800) -> Path:
    """The cached root's path (the host's architecture, or ``arch``)."""
    command = [str(REPO / ".ci" / "debian-root"), *([arch] if arch else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        what = " ".join([".ci/debian-root", *([arch] if arch else [])])
        fail(f"{what} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def wheelhouse(wanted: list[str], machine: str) -> Path:
    """Wheels of ``wanted`` for CPython 3.11 on ``machine`` (x86_64, aarch64),
    downloaded once into the cache, keyed by the list and the machine."""
    key = hashlib.sha256(json.dumps([wanted, machine]).encode()).hexdigest()[:16]
    path = CACHE / f"wheels-{machine}-{key}"
    if (path / ".complete").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--dest",
            str(path),
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--abi",
            "cp311",
            *(arg for tag in MANYLINUX for arg in ("--platform", f"{tag}_{machine}")),
            *wanted,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        fail(f"pip download of {wanted} for {machine} failed:\n{result.stderr[-4000:]}")
    (path / ".complete").touch()
    return path
