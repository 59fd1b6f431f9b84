"""The eventcount in plain C (``pleclient/native/eventcount.c``) under the
sanitizers: ``tests/native/test_eventcount.c`` — threads publishing and
waiting, the payload each publish orders, no lost wake-up — built with
AddressSanitizer and UBSan, and with ThreadSanitizer, and run.

The program links the very files the extension is built from
(``eventcount.c``, ``futex.c``); what it checks is in its own header comment.
``make native-sanitize`` runs this file too (it runs ``tests/test_native_*``).
``tests/test_aarch64.py`` runs this file in its arm64 root too (under
qemu-user there, where both sanitizers work), and checks the eventcount's
barriers in the aarch64 build's disassembly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "pleclient" / "native"
PROGRAM = REPO / "tests" / "native" / "test_eventcount.c"
SOURCES = [PROGRAM, NATIVE / "eventcount.c", NATIVE / "futex.c"]

SANITIZERS = {
    # The extension's own warnings, as errors.
    "address,undefined": [
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-Werror",
    ],
    # GCC warns that TSan does not model atomic_thread_fence: the fences order
    # only atomics here (E3/E4/E5), which TSan never reports; the payload is
    # ordered by E1/E2, which it does check.
    "thread": ["-fsanitize=thread", "-Wno-tsan"],
}
ROUNDS = {"address,undefined": "10000", "thread": "2000"}  # minutes at most under qemu


def compiler() -> str | None:
    """The C compiler the extension is built with (``$CC``, else Python's)."""
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def clean_env() -> dict[str, str]:
    """This environment without the preloaded libasan of ``make native-sanitize``
    (it is for the interpreter; a TSan program cannot run beside it)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    # No leak check: the program allocates nothing of its own, and LeakSanitizer
    # cannot run under ptrace or qemu-user.
    env["ASAN_OPTIONS"] = "detect_leaks=0"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    env["TSAN_OPTIONS"] = "halt_on_error=1"
    return env


@pytest.mark.parametrize("sanitizers", list(SANITIZERS))
def test_the_eventcount_loses_no_wake_up_between_threads(tmp_path, sanitizers):
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler (the extension's build needs one too)")
    program = tmp_path / "test_eventcount"
    env = clean_env()
    build = subprocess.run(
        [cc, "-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-D_GNU_SOURCE",
         "-fno-omit-frame-pointer", *SANITIZERS[sanitizers], f"-I{NATIVE}",
         *map(str, SOURCES), "-o", str(program), "-pthread"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if build.returncode != 0 and "cannot find -l" in build.stderr:  # no libasan / libtsan
        missing = next(line for line in build.stderr.splitlines() if "cannot find -l" in line)
        pytest.skip(f"the compiler has no {sanitizers} sanitizer runtime here: {missing}")
    assert build.returncode == 0, build.stderr
    run = subprocess.run(
        [str(program), ROUNDS[sanitizers]], capture_output=True, text=True, env=env, timeout=600
    )
    if run.returncode != 0 and "unexpected memory mapping" in run.stderr:
        # TSan's shadow memory and a kernel with more mmap randomization than
        # it knows: the same program without address randomization.
        setarch = shutil.which("setarch")
        if setarch is None:
            pytest.skip(f"ThreadSanitizer cannot run on this kernel's layout: {run.stderr[:200]}")
        run = subprocess.run(
            [setarch, os.uname().machine, "-R", str(program), ROUNDS[sanitizers]],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no lost wake-up" in run.stdout
    assert "Sanitizer" not in run.stderr, run.stderr
