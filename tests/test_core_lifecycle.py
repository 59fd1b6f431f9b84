"""Server lifecycle: clean stop, a killed client's resources, stale names, demo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pleclient import PleClient
from tests.harness import shm_entries, wait_until


def segment_mappings(pid: int) -> list[str]:
    """The server's mappings of channel segments (memfds named ple.<pid>.<session>)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/memfd:ple." in line]


def test_sigterm_stops_cleanly_and_removes_the_socket(server):
    with server.client() as client:
        client.lookup(1, [1, 2, 3])
    assert server.stop(signal.SIGTERM) == 0
    assert not os.path.exists(server.socket)
    assert "stopped" in server.log()


def test_client_killed_mid_session_frees_its_channel(server):
    code = textwrap.dedent(f"""
        import sys, time
        from pleclient import PleClient
        c = PleClient.connect({server.socket!r})
        c.lookup(3, list(range(100)))
        t = c.submit(3, list(range(2000)))  # in flight, never collected
        print("ready", flush=True)
        time.sleep(60)  # alive, its request in flight, until the test kills it
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    assert PleClient.query_stats(server.socket)["channels"] == 1
    assert len(segment_mappings(server.pid)) == 1
    child.kill()
    child.wait()
    assert wait_until(lambda: PleClient.query_stats(server.socket)["channels"] == 0)
    assert wait_until(lambda: not segment_mappings(server.pid))
    assert not shm_entries()
    with server.client() as client:  # and the server keeps serving
        assert client.lookup(3, [5]).shape == (1, 320)


def test_a_session_creates_no_name_another_process_could_open(server):
    with server.client() as client:
        client.lookup(1, [0])
        assert not shm_entries()
        assert len(segment_mappings(server.pid)) == 1


@pytest.mark.parametrize("io", [None, "mmap"])
def test_demo_runs_end_to_end(tmp_path, io):
    demo = [sys.executable, "-m", "pleserver.cli", "demo", "--seconds", "1"]
    demo += ["--cache-dir", str(tmp_path), *(["--io", io] if io else [])]
    result = subprocess.run([*demo, "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["mismatches"] == 0 and report["requests"] > 0
    assert report["server_exit_code"] == 0
    assert {t["dtype"] for t in report["stats"]["tables"]} == {"F8_E4M3", "BF16", "NVFP4"}
    io_stats = [t["io"] for t in report["stats"]["tables"]]
    if io is None:  # by default the headline path: a row cache smaller than the tables
        assert report["stats"]["dataplane"]["io"] in ("direct", "buffered")
        assert sum(x["hits"] for x in io_stats) > 0 and sum(x["misses"] for x in io_stats) > 0
        assert sum(x["reads"] for x in io_stats) > 0
        text = subprocess.run(demo, capture_output=True, text=True, timeout=300).stdout
        assert re.search(r"a row cache of 16 MiB: \d+ hits, \d+ misses \(hit rate", text), text
    else:
        assert report["stats"]["dataplane"]["io"] == "mmap"


def test_stats_cli_human_and_json(server):
    with server.client() as client:
        client.lookup(1, np.arange(10))
    run = [sys.executable, "-m", "pleserver.cli", "stats", "--socket", server.socket]
    human = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert human.returncode == 0 and "F8_E4M3" in human.stdout and "p50" in human.stdout
    data = json.loads(
        subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=30).stdout
    )
    assert data["tables"][0]["requests"] == 1 and data["tables"][0]["rows"] == 10
