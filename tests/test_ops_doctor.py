"""``pleserver doctor``: a real run on this host over a generated checkpoint,
and one in a container-like setting where a seccomp filter refuses io_uring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pleclient import _sync
from pleserver import _native
from pleserver.devkit.launcher import ServerLauncher
from tests.host import require_o_direct

CHECKS = ("io_uring", "futex_waitv", "tables", "o_direct", "memlock", "thp", "memory", "disk")
STATUSES = {"ok", "warn", "fail", "info"}

# A seccomp filter refusing io_uring_setup and futex_waitv (system calls 425
# and 449 on x86_64 and aarch64 alike) with EPERM, installed in a child that
# then execs the doctor: what a container runtime's default profile does.
SECCOMP_LAUNCHER = textwrap.dedent("""
    import ctypes, os, platform, struct, sys
    ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
    RET_ALLOW, RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
    program = [(LD_ABS, 0, 0, 4),            # the system call's architecture
               (JEQ, 0, 4, ARCH),            # another one: allow
               (LD_ABS, 0, 0, 0),            # the system call number
               (JEQ, 1, 0, 425),             # io_uring_setup ...
               (JEQ, 0, 1, 449),             # ... or futex_waitv ...
               (RET, 0, 0, RET_ERRNO | EPERM),   # ... fails with EPERM
               (RET, 0, 0, RET_ALLOW)]
    filters = b"".join(struct.pack("HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(filters)
    prog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buf))
    prog_buf = ctypes.create_string_buffer(prog)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \\
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog_buf), 0, 0):
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")
    os.execv(sys.executable, [sys.executable, "-m", "pleserver.cli", *sys.argv[1:]])
""")


def doctor(*args: str, seccomp: bool = False) -> subprocess.CompletedProcess:
    prefix = (
        [sys.executable, "-c", SECCOMP_LAUNCHER]
        if seccomp
        else [sys.executable, "-m", "pleserver.cli"]
    )
    # PLE_SERVER_CONFIG=/dev/null: never this host's config file.
    return subprocess.run(
        [*prefix, "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PLE_SERVER_CONFIG": os.devnull},
    )


def as_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def io_uring_here() -> bool:
    engine = _native.ReadEngine(queue_depth=4, kind="io_uring")
    try:
        return engine.kind == "io_uring"
    finally:
        engine.close()


def test_doctor_checks_this_host_and_recommends_settings(checkpoint):
    report = as_json(doctor("--model", str(checkpoint), "--json", "--probe-seconds", "0.2"))
    assert report["ok"] is True and report["model"] == str(checkpoint)
    checks = report["checks"]
    assert set(checks) == set(CHECKS)
    assert all(c["status"] in STATUSES and c["summary"] for c in checks.values())
    assert (checks["io_uring"]["status"] == "ok") == io_uring_here()
    assert (checks["futex_waitv"]["status"] == "ok") == bool(_sync.HAVE_FUTEX_WAITV)
    # The tables are inspect's.
    inspect = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pleserver.cli", "inspect", str(checkpoint), "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    assert [(t["name"], t["fingerprint"], t["bytes"]) for t in report["tables"]] == [
        (t["name"], t["fingerprint"], t["bytes"]) for t in inspect["tables"]
    ]
    # The probe read at every queue depth.
    disk = checks["disk"]["results"]
    assert [r["queue_depth"] for r in disk] == [1, 64, 128]
    assert all(r["reads"] > 0 and r["reads_per_s"] > 0 for r in disk)
    assert all(r["cpu_us_per_read"] > 0 for r in disk)  # the kernel's cost, the server's floor
    # Memory: what is available against the planned cache.
    memory = checks["memory"]
    assert memory["available_bytes"] > 0 and memory["planned_cache_bytes"] > 0
    # The advice, each with its reason.
    advice = report["recommendation"]
    assert {"io", "cache_size", "read_engine", "queue_depth"} <= set(advice)
    assert all(a["reason"] for a in advice.values())
    assert advice["io"]["value"] in ("mmap", "direct", "buffered")
    assert advice["queue_depth"]["value"] in (1, 64, 128)
    best = max(r["reads_per_s"] for r in disk)
    chosen = next(r for r in disk if r["queue_depth"] == advice["queue_depth"]["value"])
    assert chosen["reads_per_s"] >= 0.9 * best
    # The small tables fit the default budget: served from the page cache.
    assert advice["io"]["value"] == "mmap"


def test_doctor_prints_a_readable_report(checkpoint):
    result = doctor("--model", str(checkpoint), "--probe-seconds", "0.1")
    assert result.returncode == 0, result.stderr
    for name in CHECKS:
        assert f"] {name}" in result.stdout
    assert "Recommended settings" in result.stdout and "queue_depth = " in result.stdout
    assert "fingerprint" in result.stdout  # inspect's table
    assert result.stdout.rstrip().endswith("doctor: OK")


def test_doctor_where_seccomp_refuses_io_uring(checkpoint):
    report = as_json(
        doctor("--model", str(checkpoint), "--json", "--probe-seconds", "0.1", seccomp=True)
    )
    io_uring = report["checks"]["io_uring"]
    assert io_uring["status"] == "warn", io_uring
    assert "EPERM" in io_uring["reason"] or "not permitted" in io_uring["reason"], io_uring
    assert "seccomp" in io_uring["summary"]
    futex_waitv = report["checks"]["futex_waitv"]
    assert futex_waitv["status"] == "warn", futex_waitv
    assert "polls its channels every 0.5 ms" in futex_waitv["summary"]
    # The probe and the advice fall back to the pread threads.
    assert {r["kind"] for r in report["checks"]["disk"]["results"]} == {"threads"}
    advice = report["recommendation"]
    assert advice["read_engine"]["value"] == "threads"
    assert advice["read_threads"]["value"] == advice["queue_depth"]["value"]


def test_doctor_fails_on_a_checkpoint_the_server_cannot_serve(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = doctor("--model", str(tmp_path), "--json", "--probe-seconds", "0.1")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["checks"]["tables"]["status"] == "fail"
    assert report["checks"]["tables"]["problems"]


def test_doctor_without_a_model_checks_the_host_only():
    report = as_json(doctor("--json"))
    assert report["model"] is None and report["tables"] == []
    assert report["checks"]["o_direct"]["status"] == "info"
    assert report["checks"]["disk"]["status"] == "info"
    assert "queue_depth" not in report["recommendation"]


@pytest.mark.parametrize("io", ["buffered", "mmap"])
def test_doctor_starts_from_the_config_it_is_given(checkpoint, tmp_path, io):
    require_o_direct(checkpoint)  # the advice below is direct's
    config = tmp_path / "config.toml"
    config.write_text(f'model = "{checkpoint}"\nio = "{io}"\ncache_size = "1M"\n')
    report = as_json(doctor("--config", str(config), "--json", "--probe-seconds", "0.1"))
    assert report["model"] == str(checkpoint)
    memory = report["checks"]["memory"]
    assert memory["planned_cache_bytes"] == 1 << 20 and memory["planned_io"] == io
    advice = report["recommendation"]
    assert advice["cache_size"]["value"] == "1M"
    # 6 MiB of tables over a 1 MiB cache, on a file system taking O_DIRECT:
    # direct, whatever the file says, and the reason says what it says.
    assert report["checks"]["o_direct"]["status"] == "ok"
    assert advice["io"]["value"] == "direct"
    assert f'the config sets io = "{io}"' in advice["io"]["reason"]


def test_a_server_where_seccomp_refuses_futex_waitv_polls_and_serves(checkpoint, references):
    """What the doctor warns about, as the server lives it: idle_wait = auto
    finds no futex_waitv (nor io_uring) and falls back to polling; requests
    after idle spells are still served, bit-exact."""
    launcher = ServerLauncher(
        checkpoint,
        "--spin-us",
        "0",
        log_level="DEBUG",
        program=[sys.executable, "-c", SECCOMP_LAUNCHER],
    )
    with launcher.start() as server:
        with server.client() as client:
            for i in range(10):
                ids = np.arange(i, i + 16)
                assert np.array_equal(client.lookup(1, ids), references[1][ids])
            assert client.stats()["idle_wait"] == "poll"
        assert "(idle_wait = auto: futex_waitv unavailable)" in server.log()
