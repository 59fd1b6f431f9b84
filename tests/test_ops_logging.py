"""Log lines an operator reads in the journal: one per session, none per
request, priorities and no timestamps when stderr is the journal; and the
JSON lines a log shipper reads (``log_format = "json"``), with the journal's
field names, on the journal or off it."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.observe import logs
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
    model,
    env: dict[str, str],
    log_path: Path,
    journal: bool,
    ready: bool = True,
    flags: tuple[str, ...] = (),
    status: int = 2,
) -> str:
    """Run `pleserver serve` with ``flags``, stderr on ``log_path`` (announced
    as the journal stream when ``journal``), until it is ready — or, unless
    ``ready``, until it exits with ``status`` — then stop it; its log."""
    log_path.touch()
    if journal:
        st = os.stat(log_path)
        env = {**env, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    with ServerLauncher(model, *flags, log_path=log_path, env=env).start(wait=ready) as server:
        if not ready:
            assert server.exit_code() == status, server.log()
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

    # (The hot set starts after READY=1: its line may come after the start.)
    line = wait_for_line(server, r"^.*does not exist.*$", timeout=30)
    assert " WARNING " in line and str(missing) in line and "StateDirectory=" in line, line


# ------------------------------------------------------------------ JSON lines
JOURNAL_FIELDS = {"MESSAGE", "PRIORITY", "LOGGER", "TIMESTAMP", "THREAD_NAME", "CODE_FILE"}
JSON = ("--log-format", "json")


def json_entries(text: str, prefixed: bool = False) -> list[dict]:
    """Every line of ``text`` as the JSON object it must be; with ``prefixed``,
    after its ``<N>`` priority prefix, which must be the entry's PRIORITY."""
    entries = []
    for line in text.splitlines():
        if prefixed:
            m = re.fullmatch(r"<(\d)>(.*)", line)
            assert m, line
            entry = json.loads(m.group(2))
            assert entry["PRIORITY"] == m.group(1), line
        else:
            entry = json.loads(line)
        assert set(entry) >= JOURNAL_FIELDS, line
        entries.append(entry)
    return entries


def test_json_lines_carry_the_journals_field_names(checkpoint, tmp_path):
    text = run_server(checkpoint, {}, tmp_path / "plain.log", journal=False, flags=JSON)
    entries = json_entries(text)
    ready = next(e for e in entries if "ready: serving" in e["MESSAGE"])
    assert ready["PRIORITY"] == "6" and ready["LOGGER"] == "pleserver.server", ready
    assert ready["CODE_FILE"].endswith("server.py") and ready["CODE_LINE"].isdigit(), ready
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", ready["TIMESTAMP"])
    assert {e["PRIORITY"] for e in entries} <= {"7", "6", "4"}, text  # debug, info, warning


def test_a_start_up_error_is_a_json_line_with_error_priority(tmp_path):
    model = tmp_path / "no-such-model"
    text = run_server(model, {}, tmp_path / "plain.log", journal=False, ready=False, flags=JSON)
    (error,) = [e for e in json_entries(text) if e["PRIORITY"] == "3"]
    assert "no-such-model" in error["MESSAGE"] and error["LOGGER"] == "pleserver", error


def test_an_invalid_configuration_is_reported_as_json_when_json_was_asked(tmp_path):
    # The bad value is another setting's: the log format asked for still applies.
    env = {"PLE_SERVER_LOG_FORMAT": "json"}
    log_path = tmp_path / "plain.log"
    flags = ("--cache-size", "lots")
    text = run_server(tmp_path, env, log_path, journal=False, ready=False, flags=flags, status=78)
    (entry,) = json_entries(text)
    assert entry["PRIORITY"] == "3" and "--cache-size: not a size: 'lots'" in entry["MESSAGE"]


def test_on_the_journal_json_lines_keep_the_priority_prefix(checkpoint, tmp_path):
    text = run_server(checkpoint, {}, tmp_path / "journal.log", journal=True, flags=JSON)
    entries = json_entries(text, prefixed=True)
    assert any("ready: serving" in e["MESSAGE"] for e in entries), text


def test_a_json_line_carries_the_calls_extra_fields_and_its_traceback():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.formatter("json", journal=False))
    logger = logging.getLogger("pleserver.test-json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise OSError(5, "Input/output error")
        except OSError:
            logger.exception(
                "read of %s failed", "shard 3", extra={"session": 7, "path": Path("/x")}
            )
    finally:
        logger.removeHandler(handler)
    (entry,) = json_entries(out.getvalue())
    assert entry["MESSAGE"] == "read of shard 3 failed" and entry["PRIORITY"] == "3", entry
    assert entry["SESSION"] == 7 and entry["PATH"] == "/x", entry
    assert (
        "Traceback" in entry["EXCEPTION_TEXT"] and "Input/output error" in entry["EXCEPTION_TEXT"]
    )


def test_a_reload_switches_the_log_to_json(checkpoint, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('log_format = "text"\n')
    launcher = ServerLauncher(checkpoint, "--config", str(config), log_level="INFO")
    with launcher.start() as server:
        config.write_text('log_format = "json"\n')
        os.kill(server.pid, signal.SIGHUP)
        assert wait_until(lambda: re.search(r"^{.*reload", server.log(), re.M), 30), server.log()
        lines = server.log().splitlines()
    switched = next(i for i, line in enumerate(lines) if line.startswith("{"))
    assert all(TIMESTAMP.match(line) for line in lines[:switched]), lines
    json_entries("\n".join(lines[switched:]))
