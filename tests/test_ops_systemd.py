"""systemd integration: the unit and snippets as systemd reads them, and the
notify protocol as a real server speaks it to a real datagram socket."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pleclient import PleClient

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
UNIT = DEPLOY / "ple-server.service"
TEMPLATE = DEPLOY / "ple-server@.service"
UNIT_EXEC = "/opt/ple-server/bin/pleserver"


def require_tool(name: str) -> str:
    """The tool's path; a test needing a missing tool fails in CI (CI=true),
    where .ci/run installs it, and is skipped elsewhere."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: `apt-get install systemd` (.ci/run installs it in CI)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


# ---------------------------------------------------------------- unit files
def unit_settings(unit: Path = UNIT) -> dict[str, list[str]]:
    """Every ``Key=value`` of the unit (comments dropped), values in order."""
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@pytest.mark.parametrize(
    "source,name", [(UNIT, "ple-server.service"), (TEMPLATE, "ple-server@flash-next.service")]
)
def test_unit_file_passes_systemd_analyze_verify(tmp_path, source, name):
    analyze = require_tool("systemd-analyze")
    # verify also checks that ExecStart's program exists: stand one in for the
    # installed /opt/ple-server/bin/pleserver; the rest of the unit is verbatim.
    program = tmp_path / "pleserver"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    text = source.read_text()
    assert text.count(UNIT_EXEC) == 1
    (tmp_path / source.name).write_text(text.replace(UNIT_EXEC, str(program)))
    # A template is verified through an instance of it.
    result = subprocess.run(
        [
            analyze,
            "verify",
            "--man=no",
            str(tmp_path / source.name) if source is UNIT else f"{tmp_path}/{name}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"},
    )
    ours = [line for line in result.stderr.splitlines() if "ple-server" in line]
    assert result.returncode == 0 and not ours, result.stderr


def test_unit_is_notify_type_with_watchdog_restart_and_directories():
    s = unit_settings()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert int(s["WatchdogSec"][0]) > 0
    assert s["Restart"] == ["on-failure"]
    assert s["User"] == ["ple-server"]
    assert s["RuntimeDirectory"] == ["ple-server"] and s["RuntimeDirectoryPreserve"] == ["yes"]
    assert s["StateDirectory"] == ["ple-server"]
    assert s["LimitMEMLOCK"] == ["infinity"]
    assert s["ExecStart"][0].startswith(f"{UNIT_EXEC} serve --config /etc/ple-server/")
    # `systemctl reload`: SIGHUP, which reloads the config (Type=notify-reload
    # would need systemd 253; the units support 249).
    assert s["ExecReload"] == ['/bin/sh -c "kill -HUP $MAINPID"']
    # `systemctl help ple-server`: the man page the package installs (man/).
    assert s["Documentation"] == ["man:pleserver(1)"]


def test_template_is_the_unit_with_per_instance_config_socket_and_state():
    single, template = unit_settings(), unit_settings(TEMPLATE)
    per_instance = {"Description", "ExecStart", "StateDirectory", "SyslogIdentifier"}
    assert {k: v for k, v in single.items() if k not in per_instance} == {
        k: v for k, v in template.items() if k not in per_instance
    }
    assert template["ExecStart"] == [
        f"{UNIT_EXEC} serve --config /etc/ple-server/%i.toml "
        "--socket /run/ple-server/%i.sock "
        "--state-dir /var/lib/ple-server/%i"
    ]
    assert template["StateDirectory"] == ["ple-server/%i"]
    assert template["RuntimeDirectory"] == ["ple-server"]  # shared: every socket in one place


def test_manual_restarts_leave_room_before_the_start_limit():
    s = unit_settings()
    # A crash loop (a start every RestartSec + ≈1 s) hits the limit within the
    # interval; an operator restarting by hand does not, 10 times a minute.
    burst, interval = int(s["StartLimitBurst"][0]), int(s["StartLimitIntervalSec"][0])
    assert burst * (int(s["RestartSec"][0]) + 1) < interval and burst / interval * 60 >= 10


def test_unit_keeps_dev_shm_and_proc_visible():
    s = unit_settings()
    for isolating in (
        "PrivateDevices",
        "PrivateIPC",
        "PrivateUsers",
        "ProtectProc",
        "ProcSubset",
        "DynamicUser",
    ):
        assert isolating not in s, f"{isolating}= breaks clients or the server: see the unit"


def test_sysusers_snippet_creates_the_user_and_client_group(tmp_path):
    sysusers = require_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        [sysusers, f"--root={tmp_path}", "-"],
        input=(DEPLOY / "ple-server.sysusers").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    users = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
    }
    groups = {line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert "ple-server" in users and {"ple-server", "ple-clients"} <= groups
    assert users["ple-server"][5] == "/var/lib/ple-server"
    assert users["ple-server"][6].endswith("nologin")


@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles chowns: needs root")
def test_tmpfiles_snippet_creates_the_socket_directory(tmp_path):
    sysusers = require_tool("systemd-sysusers")
    tmpfiles = require_tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    subprocess.run(
        [sysusers, f"--root={tmp_path}", "-"],
        check=True,
        capture_output=True,
        input=(DEPLOY / "ple-server.sysusers").read_text(),
        text=True,
        timeout=60,
    )
    result = subprocess.run(
        [tmpfiles, f"--root={tmp_path}", "--create", "-"],
        input=(DEPLOY / "ple-server.tmpfiles").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "run/ple-server"
    uid = next(
        int(line.split(":")[2])
        for line in (tmp_path / "etc/passwd").read_text().splitlines()
        if line.startswith("ple-server:")
    )
    assert run_dir.is_dir() and run_dir.stat().st_uid == uid
    assert run_dir.stat().st_mode & 0o777 == 0o755


# ----------------------------------------------------------- notify protocol
# pleserver.devkit.launcher listens where systemd would ($NOTIFY_SOCKET): its
# ``notify`` holds what the server sent.
def test_ready_is_sent_once_lookups_are_answered(start_server, checkpoint):
    server = start_server(checkpoint)  # returns as READY=1 arrives
    # The moment READY=1 arrives, a client connects and gets rows.
    with PleClient.connect(server.socket, timeout=5.0) as client:
        rows = client.lookup(3, [0, 1, 10_006])
    assert rows.shape == (3, 320)
    assert f"MAINPID={server.pid}" in server.ready_fields
    assert any(f.startswith("STATUS=serving 2 tables") for f in server.ready_fields)
    server.notify.collect(0.5)
    assert server.notify.fields("READY=1") == ["READY=1"]  # once


def test_status_reports_prewarm_progress_after_ready(start_server, checkpoint):
    server = start_server(checkpoint, "--prewarm", "full", "--prewarm-budget", "4M")
    final = server.wait_for("STATUS=serving 2 tables on " + server.socket + "; prewarm budget")
    statuses = [fields for _, fields in server.notify.messages]
    ready_at = next(i for i, fields in enumerate(statuses) if "READY=1" in fields)
    prewarm_at = [i for i, fields in enumerate(statuses) if any("; prewarm " in f for f in fields)]
    # The prewarm starts after READY=1, and the status line keeps what is served.
    assert prewarm_at and min(prewarm_at) > ready_at, statuses
    lines = [f for f in server.notify.fields("STATUS=") if "; prewarm " in f]
    assert all(
        f.startswith(f"STATUS=serving 2 tables on {server.socket}; prewarm ") for f in lines
    ), lines
    # 4 MiB reads as MiB, never as "0.00 GiB".
    assert (
        "STATUS=serving 2 tables on "
        + server.socket
        + "; prewarm budget: 100.0% (4.00 MiB of 4.00 MiB)"
        in final
    ), final
    assert not any("0.00 GiB" in f for f in lines), lines


def test_watchdog_pings_arrive_at_the_configured_interval(start_server, checkpoint):
    # WATCHDOG_USEC=600 ms: systemd expects a ping every 300 ms at least.
    server = start_server(checkpoint, env={"WATCHDOG_USEC": "600000"})
    with PleClient.connect(server.socket) as client:
        for _ in range(50):
            client.lookup(1, list(range(64)))
        server.notify.collect(3.0)  # the window the pings are counted in
    pings = [t for t, fields in server.notify.messages if "WATCHDOG=1" in fields]
    assert len(pings) >= 4, server.notify.fields()  # ≈ 10 expected in 3 s: generous bound
    assert server.running


def test_no_watchdog_pings_when_the_watchdog_is_meant_for_another_process(start_server, checkpoint):
    server = start_server(
        checkpoint, env={"WATCHDOG_USEC": "600000", "WATCHDOG_PID": str(os.getpid())}
    )
    server.notify.collect(1.5)  # several ping intervals
    assert "WATCHDOG=1" not in server.notify.fields()


def test_stopping_is_sent_on_sigterm(start_server, checkpoint):
    server = start_server(checkpoint)
    server.proc.send_signal(signal.SIGTERM)
    stopping = server.wait_for("STOPPING=1", timeout=20.0)
    assert "STATUS=stopping" in stopping
    assert server.exit_code(20) == 0


def test_a_reload_is_announced_with_reloading_then_ready(start_server, checkpoint):
    server = start_server(checkpoint)
    server.notify.drain()
    seen = len(server.notify.messages)
    sent_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    server.proc.send_signal(signal.SIGHUP)
    ready = server.wait_status("configuration reloaded", timeout=30.0)
    fields = [f for _, message in server.notify.messages[seen:] for f in message]
    assert fields.index("RELOADING=1") < fields.index("READY=1"), fields
    # MONOTONIC_USEC: when the reload began, on the manager's clock (notify-reload needs it).
    usec = int(next(f for f in fields if f.startswith("MONOTONIC_USEC=")).split("=")[1])
    assert sent_at <= usec < sent_at + 30_000_000
    assert f"MAINPID={server.pid}" in fields
    assert ready == f"serving 2 tables on {server.socket}; configuration reloaded"
    with PleClient.connect(server.socket) as client:  # serving on
        assert client.lookup(1, [0]).shape == (1, 160)


def test_a_server_that_cannot_start_never_sends_ready(start_server, checkpoint):
    busy = start_server(checkpoint)  # holds the socket
    server = start_server(checkpoint, socket_path=busy.socket, wait=False)
    assert server.exit_code(30) == 2
    server.notify.drain()  # everything it sent before it exited
    assert "READY=1" not in server.notify.fields()
    assert "in use by a live ple-server" in server.log()
