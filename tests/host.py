"""What some tests need of the host, and a plain skip where it lacks it.

The suite runs on whatever machine CI has. A test that needs a facility the
kernel or the file system may not offer asks here first: where it is missing,
the test is skipped with the reason and the fix, and pytest's ``-ra`` summary
(pyproject.toml) counts and prints every skip. Facilities the product falls
back from by itself (io_uring → a thread pool, huge pages → normal pages)
need no skip: the tests accept either.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

import pytest

from pleclient import _sync


@functools.cache
def _o_direct_refusal(device: int, directory: str) -> str | None:
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".o_direct-probe-")
    except OSError as exc:
        return f"cannot create a file in {directory}: {exc}"
    os.close(fd)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return (
            f"the file system of {directory} refuses O_DIRECT (EINVAL): "
            "run the tests with a --basetemp on a disk file system"
        )
    finally:
        os.unlink(path)
    return None


def require_o_direct(directory: os.PathLike | str) -> None:
    """Skip the calling test unless files in ``directory`` open with O_DIRECT
    (direct io mode; tmpfs before Linux 6.6 refuses it)."""
    directory = os.fspath(directory)
    reason = _o_direct_refusal(os.stat(directory).st_dev, directory)
    if reason:
        pytest.skip(reason)


def require_futex_waitv() -> None:
    """Skip the calling test unless the kernel has ``futex_waitv`` (Linux ≥ 5.16,
    and no seccomp filter refusing it)."""
    if not _sync.HAVE_FUTEX_WAITV:
        pytest.skip(
            f"this kernel ({os.uname().release}) offers no futex_waitv (Linux ≥ 5.16): "
            "the idle loop's poll fallback is tested instead"
        )
