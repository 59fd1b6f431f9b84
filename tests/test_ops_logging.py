"""Log lines an operator reads in the journal: one per session, none per
request, priorities and no timestamps when stderr is the journal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from pleclient import PleClient

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


@pytest.fixture(autouse=True)
def no_host_config(monkeypatch):
    """Servers started here never read this host's /etc/ple-server/config.toml."""
    monkeypatch.setenv("PLE_SERVER_CONFIG", os.devnull)


def wait_for_line(server, pattern: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, server.log(), re.MULTILINE)
        if match:
            return match.group(0)
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in:\n{server.log()}")


def test_a_session_logs_one_line_when_it_opens_and_one_when_it_closes(start_server,
                                                                      checkpoint):
    server = start_server(checkpoint, "--log-level", "INFO")
    peer = f"pid {os.getpid()} uid {os.getuid()}"
    with server.client(name="ops-test") as client:
        for _ in range(300):
            client.lookup(1, np.arange(32))
    wait_for_line(server, r"^.*session \d+ closed: .*ops-test.*$")
    lines = [line for line in server.log().splitlines() if "ops-test" in line]
    assert len(lines) == 2, lines
    assert re.search(rf"session \d+ open: {peer} \(ops-test\), channel depth", lines[0])
    assert re.search(rf"session \d+ closed: {peer} \(ops-test\), [\d.]+ s, bye", lines[1])


def test_requests_and_stats_queries_add_no_log_lines(start_server, checkpoint):
    server = start_server(checkpoint, "--log-level", "INFO")
    with server.client() as client:
        client.lookup(1, [0])
        settled = len(server.log().splitlines())
        for _ in range(300):
            client.lookup(1, np.arange(32))
        for _ in range(5):
            subprocess.run([sys.executable, "-m", "pleserver.cli", "stats", "--socket",
                            server.socket], check=True, capture_output=True, timeout=60)
            PleClient.query_stats(server.socket)
        assert len(server.log().splitlines()) == settled, server.log()


def run_server(args: list[str], env: dict[str, str], log_path, journal: bool) -> str:
    """Run `pleserver serve` with stderr on ``log_path`` (announced as the
    journal stream when ``journal``) until it is ready or exits; return its log."""
    with open(log_path, "wb") as log:
        if journal:
            st = os.fstat(log.fileno())
            env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.Popen([sys.executable, "-m", "pleserver.cli", "serve", *args],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
        try:
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                if b"ready: serving" in log_path.read_bytes():
                    break
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(30)
    return log_path.read_text()


def test_on_the_journal_lines_carry_a_priority_and_no_timestamp(checkpoint, tmp_path):
    text = run_server(["--model", str(checkpoint), "--socket", str(tmp_path / "s.sock"),
                       "--config", os.devnull], {"INVOCATION_ID": "0" * 32},
                      tmp_path / "journal.log", journal=True)
    lines = text.splitlines()
    assert any(re.match(r"<6>INFO pleserver\.server: ple-server .* ready: serving", line)
               for line in lines), text
    assert all(re.match(r"<\d>", line) and not TIMESTAMP.match(line[3:]) for line in lines), text


def test_errors_reach_the_journal_with_error_priority(checkpoint, tmp_path):
    text = run_server(["--model", str(tmp_path / "no-such-model"), "--socket",
                       str(tmp_path / "s.sock"), "--config", os.devnull], {},
                      tmp_path / "journal.log", journal=True)
    assert re.search(r"^<3>ERROR pleserver: .*no-such-model", text, re.MULTILINE), text


def test_off_the_journal_lines_carry_timestamps(checkpoint, tmp_path):
    # INVOCATION_ID alone (a systemd service whose stderr is not the journal)
    # keeps the timestamps: only $JOURNAL_STREAM matching stderr drops them.
    text = run_server(["--model", str(checkpoint), "--socket", str(tmp_path / "s.sock"),
                       "--config", os.devnull], {"INVOCATION_ID": "0" * 32},
                      tmp_path / "plain.log", journal=False)
    assert "ready: serving" in text
    assert all(TIMESTAMP.match(line) for line in text.splitlines()), text
