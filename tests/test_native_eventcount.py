"""The eventcount in plain C (``pleclient/native/eventcount.c``) under the
sanitizers: ``tests/native/test_eventcount.c`` — threads publishing and
waiting, the payload each publish orders, no lost wake-up — built with
AddressSanitizer and UBSan, and with ThreadSanitizer, and run.

The program links the very files the extension is built from
(``eventcount.c``, ``futex.c``); what it checks is in its own header comment.
``make native-sanitize`` runs this file too (it runs ``tests/test_native_*``).

Where an aarch64 cross compiler is installed (Debian: ``gcc-aarch64-linux-gnu``,
``libc6-dev-arm64-cross``), the eventcount is also cross-built: its edges
must compile to aarch64's barriers, and the C test runs under qemu-aarch64.
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
ROUNDS = {"address,undefined": "20000", "thread": "5000"}


def compiler() -> str | None:
    """The C compiler the extension is built with (``$CC``, else Python's)."""
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def clean_env() -> dict[str, str]:
    """This environment without the preloaded libasan of ``make native-sanitize``
    (it is for the interpreter; a TSan program cannot run beside it)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["ASAN_OPTIONS"] = "detect_leaks=1"
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


AARCH64_CC = "aarch64-linux-gnu-gcc"
BARRIERS = {"stlr": "E1's release store", "ldar": "E2's acquire load", "dmb\tish": "E3-E5's fences"}


def test_cross_built_for_aarch64_the_eventcount_has_the_barriers_its_edges_name():
    """On aarch64 (Grace) a plain store may become visible out of order: the
    edges must compile to STLR, LDAR and DMB ISH, warning-free."""
    cross = shutil.which(AARCH64_CC)
    if cross is None:
        pytest.skip(f"no aarch64 cross compiler ({AARCH64_CC}) on this host")
    asm = subprocess.run(
        [cross, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-S",
         "-o", "-", str(NATIVE / "eventcount.c")],
        capture_output=True, text=True, env=clean_env(),
    )  # fmt: skip
    assert asm.returncode == 0, asm.stderr
    missing = [why for insn, why in BARRIERS.items() if insn not in asm.stdout]
    assert not missing, f"no instruction for {missing} in:\n{asm.stdout}"


def test_the_c_test_passes_on_aarch64_under_qemu(tmp_path):
    """The C test cross-built and run by qemu's user-mode emulation: the code
    works on aarch64 (qemu on x86-64 keeps the host's stronger ordering, so
    this is no test of the barriers themselves: the one above is)."""
    cross = shutil.which(AARCH64_CC)
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip(f"needs {AARCH64_CC} and qemu-aarch64 (missing: "
                    f"{'the compiler' if cross is None else 'qemu'})")  # fmt: skip
    program = tmp_path / "test_eventcount_aarch64"
    build = subprocess.run(
        [cross, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-static",
         f"-I{NATIVE}", *map(str, SOURCES), "-o", str(program), "-pthread"],
        capture_output=True, text=True, env=clean_env(),
    )  # fmt: skip
    if build.returncode != 0 and "cannot find -l" in build.stderr:
        pytest.skip(f"no static aarch64 libc for {AARCH64_CC}: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr
    run = subprocess.run(
        [qemu, str(program), "5000"], capture_output=True, text=True, env=clean_env(), timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no lost wake-up" in run.stdout
