"""Log lines an operator reads in the journal: one per session, none per
request, priorities and no timestamps when stderr is the journal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from pleclient import PleClient
from pleserver.launcher import ServerLauncher
from tests.harness import wait_until

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def wait_for_line(server, pattern: str, timeout: float = 10.0) -> str:
    """The first line matching ``pattern`` in the server's log, once there is one."""

    def search():
        return re.search(pattern, server.log(), re.MULTILINE)

    assert wait_until(search, timeout), f"no line matching {pattern!r} in:\n{server.log()}"
    return search().group(0)


def test_a_session_logs_one_line_when_it_opens_and_one_when_it_closes(start_server, checkpoint):
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
            subprocess.run(
                [sys.executable, "-m", "pleserver.cli", "stats", "--socket", server.socket],
                check=True,
                capture_output=True,
                timeout=60,
            )
            PleClient.query_stats(server.socket)
        assert len(server.log().splitlines()) == settled, server.log()


def run_server(
    model, env: dict[str, str], log_path: Path, journal: bool, ready: bool = True
) -> str:
    """Run `pleserver serve` with stderr on ``log_path`` (announced as the
    journal stream when ``journal``) until it is ready — or, unless ``ready``,
    until it exits with status 2 — then stop it; its log."""
    log_path.touch()
    if journal:
        st = os.stat(log_path)
        env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    with ServerLauncher(model, log_path=log_path, env=env).start(wait=ready) as server:
        if not ready:
            assert server.exit_code() == 2, server.log()
    return log_path.read_text()


def test_on_the_journal_lines_carry_a_priority_and_no_timestamp(checkpoint, tmp_path):
    text = run_server(
        checkpoint, {"INVOCATION_ID": "0" * 32}, tmp_path / "journal.log", journal=True
    )
    lines = text.splitlines()
    assert any(
        re.match(r"<6>INFO pleserver\.server: ple-server .* ready: serving", line) for line in lines
    ), text
    assert all(re.match(r"<\d>", line) and not TIMESTAMP.match(line[3:]) for line in lines), text


def test_errors_reach_the_journal_with_error_priority(checkpoint, tmp_path):
    text = run_server(
        tmp_path / "no-such-model", {}, tmp_path / "journal.log", journal=True, ready=False
    )
    assert re.search(r"^<3>ERROR pleserver: .*no-such-model", text, re.MULTILINE), text


def test_off_the_journal_lines_carry_timestamps(checkpoint, tmp_path):
    # INVOCATION_ID alone (a systemd service whose stderr is not the journal)
    # keeps the timestamps: only $JOURNAL_STREAM matching stderr drops them.
    text = run_server(
        checkpoint, {"INVOCATION_ID": "0" * 32}, tmp_path / "plain.log", journal=False
    )
    assert "ready: serving" in text
    assert all(TIMESTAMP.match(line) for line in text.splitlines()), text


def test_a_missing_state_dir_is_a_warning_that_says_how_to_make_it(
    start_server, checkpoint, tmp_path
):
    missing = tmp_path / "no-state"
    server = start_server(checkpoint, "--io", "direct", "--state-dir", str(missing))
    line = next(x for x in server.log().splitlines() if "does not exist" in x)
    assert " WARNING " in line and str(missing) in line and "StateDirectory=" in line, line
