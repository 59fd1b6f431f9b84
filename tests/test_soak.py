"""The bounded soak: ``bench/soak.py`` for ``$PLE_SOAK_SECONDS`` (default 40 s)
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
            str(REPO / "bench" / "soak.py"),
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
