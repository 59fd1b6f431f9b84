"""The bounded soak: ``bench/evals/soak.py`` for ``$PLE_SOAK_SECONDS`` (default 40 s)
with three client processes joining, leaving and failing at random. Every row
is checked; nothing may fail; the server's footprint stays flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO, shm_entries

SECONDS = float(os.environ.get("PLE_SOAK_SECONDS", "40"))


def test_bounded_soak_verifies_every_row_and_the_server_stays_flat(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.evals.soak",
            "--seconds",
            str(SECONDS),
            "--clients",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 240,
        cwd=REPO,
    )
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = {
        k: report[k]
        for k in (
            "seconds",
            "requests_verified",
            "rows_verified",
            "sessions",
            "worker_processes",
            "faults",
            "failures",
        )
    }
    print("soak:", json.dumps(summary))
    print(
        "server:",
        json.dumps(
            {
                k: report["server"][k]
                for k in (
                    "baseline",
                    "final",
                    "ranges",
                    "rss_anon_growth_second_half_mib",
                    "exit_status",
                )
            }
        ),
    )
    assert report["failures"] == 0, report["failure_samples"]
    assert report["flat"], report["server"]
    assert report["server"]["exit_status"] == 0
    assert report["requests_verified"] > 100 * SECONDS / 40
    assert all(report["faults"][kind] > 0 for kind in ("kill", "abandon", "reject")), report[
        "faults"
    ]
    assert run.returncode == 0
    assert not shm_entries()


INTEGRITY_SECONDS = float(os.environ.get("PLE_INTEGRITY_SOAK_SECONDS", "3"))


def test_integrity_soak_smoke_every_mode_verifies_rows_and_none_is_wrong(tmp_path):
    """``bench/evals/integrity_soak.py`` for ``$PLE_INTEGRITY_SOAK_SECONDS`` (default
    3 s) per io mode: attackers rewriting their slots beside honest clients
    that check every row; no row may differ from the checkpoint."""
    out = tmp_path / "integrity.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.evals.integrity_soak",
            "--seconds",
            str(INTEGRITY_SECONDS),
            "--rows",
            "30000",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=5 * INTEGRITY_SECONDS + 400,
        cwd=REPO,
    )
    print(run.stdout)
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [m["mode"] for m in report["modes"]] == [
        "mmap",
        "direct:io_uring",
        "direct:threads",
        "buffered:io_uring",
        "buffered:threads",
    ]
    for mode in report["modes"]:
        assert mode["wrong_rows"] == 0, mode
        assert mode["failed_requests"] == 0 and not mode["crashed_clients"], mode
        assert mode["rows_verified"] > 0 and mode["attacker_requests"] > 0, mode
        assert mode["rewrites"] > 0, mode
        assert mode["server_exit"] == 0 and mode["tracebacks_in_log"] == 0, mode
    assert report["ok"] and run.returncode == 0
    assert not shm_entries()
