"""Configuration reloads (SIGHUP, ``systemctl reload ple-server``) against a
real server: each class of reloadable setting changes in the file, a SIGHUP,
and its effect observed from outside (a uid refused or let in, a limit met on
the next channel, a hint dropped, the loop's spin, the log, the metrics port),
while a session opened before keeps working; a bad file changes nothing; a
restart-only change is logged with its reason and left as it is; and
``pleserver config check --against-running`` / ``--against`` say what the
server does."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from pleclient import AccessDenied, PleClient, RequestError
from pleclient import protocol as p
from pleserver.config import SETTINGS, ServerConfig
from pleserver.control.reload import RELOADABLE, RESTART_ONLY, classify, diff
from pleserver.devkit.launcher import LaunchedServer, ServerLauncher
from tests.harness import (
    REPO,
    Bystander,
    OtherUser,
    RawSession,
    cpu_seconds,
    footprint,
    python_child,
    wait_until,
)

NOBODY = OtherUser("nobody", 65534, 65534)


def pleserver(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def write_config(path: Path, checkpoint: Path, text: str = "") -> Path:
    path.write_text(f'model = "{checkpoint}"\n{text}\n')
    return path


def reload(server: LaunchedServer, timeout: float = 30.0) -> list[str]:
    """SIGHUP ``server`` and wait until it says the reload is over: the
    fields of the READY=1 that follows its RELOADING=1."""
    seen = len(server.notify.messages)
    os.kill(server.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    reloading = False
    while (left := deadline - time.monotonic()) > 0:
        fields = server.notify.receive(left)
        if fields is None:
            break
        reloading = reloading or "RELOADING=1" in fields
        if reloading and "READY=1" in fields:
            return fields
    received = [f for _, fields in server.notify.messages[seen:] for f in fields]
    raise AssertionError(
        f"no RELOADING=1 then READY=1 within {timeout} s of SIGHUP (received {received}); "
        f"the log ends:\n{server.log_tail()}"
    )


def settings(server: LaunchedServer) -> dict:
    """The settings in effect, as the server's stats report them."""
    return PleClient.query_stats(server.socket)["config"]["settings"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    """Whether a metrics endpoint answers /metrics on 127.0.0.1:``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def config_path(tmp_path, checkpoint) -> Path:
    return write_config(tmp_path / "config.toml", checkpoint)


# ------------------------------------------------------------- the tables
def test_every_setting_is_either_reloadable_or_restart_only_with_its_reason():
    assert set(RELOADABLE) | set(RESTART_ONLY) == set(SETTINGS)
    assert not set(RELOADABLE) & set(RESTART_ONLY)
    assert all(len(why) > 20 for why in [*RELOADABLE.values(), *RESTART_ONLY.values()])
    # The budget's default is measured at start: dropping a set value needs a restart.
    assert not classify("max_channel_memory", 1 << 30, None).reloadable
    assert classify("max_channel_memory", None, 1 << 30).reloadable
    # The hint queue's ring is sized, and counted in the memory budget, at start.
    assert classify("hint_queue_rows", 65536, 4).reloadable
    assert not classify("hint_queue_rows", 65536, 65537).reloadable
    old, new = ServerConfig(model="/m"), ServerConfig(model="/m", max_clients=3, io="direct")
    assert [(c.name, c.reloadable) for c in diff(old, new)] == [
        ("max_clients", True),
        ("io", False),
    ]


# ------------------------------------------------------------ access lists
def test_access_lists_apply_to_new_connections_and_open_sessions_stay(
    start_server, checkpoint, config_path
):
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid (nobody)")
    write_config(config_path, checkpoint, f"allow_uids = [{NOBODY.uid}]")
    server = start_server(checkpoint, "--config", str(config_path))
    # A client of uid nobody with its session open, and told what to do line by line.
    child = python_child(
        """
        client = PleClient.connect(sys.argv[1])
        print("connected", flush=True)
        for line in sys.stdin:
            if line.strip() == "lookup":
                rows = client.lookup(1, [0, 1, 2])
                print(json.dumps({"rows": rows.shape[0]}), flush=True)
            elif line.strip() == "connect":
                try:
                    PleClient.query_stats(sys.argv[1])
                    print(json.dumps({"connect": "ok"}), flush=True)
                except PleError as exc:
                    print(json.dumps({"connect": type(exc).__name__}), flush=True)
        client.close()
        """,
        server.socket,
        user=NOBODY,
        stdin=subprocess.PIPE,
    )

    def ask(what: str) -> dict:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(what + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else ""
        return json.loads(line)

    try:
        assert child.stdout is not None and child.stdout.readline() == "connected\n"
        assert ask("connect") == {"connect": "ok"}
        write_config(config_path, checkpoint, "allow_uids = []")
        reload(server)
        # Refused from now on; its session opened before is served on.
        assert ask("connect") == {"connect": "AccessDenied"}
        assert ask("lookup") == {"rows": 3}
        assert (
            f"1 open session(s) of peers the new access lists refuse (uids {NOBODY.uid}) stay open"
            in server.log()
        )
        # Let in again, by its group this time.
        write_config(config_path, checkpoint, f"allow_gids = [{NOBODY.gid}]")
        reload(server)
        assert ask("connect") == {"connect": "ok"}
        assert ask("lookup") == {"rows": 3}
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)
    assert child.returncode == 0, child.stderr.read() if child.stderr else ""


# ------------------------------------------------------------------ limits
def test_channel_limits_apply_to_the_next_channel_and_open_channels_stay(
    start_server, checkpoint, config_path, references
):
    server = start_server(checkpoint, "--config", str(config_path))
    with Bystander(server, references) as bystander:  # capacity 16384, lookups up to 5000
        bystander.wait_for_lookups(5)
        write_config(config_path, checkpoint, "max_capacity = 100")
        reload(server)
        with pytest.raises(RequestError, match=r"capacity 200 out of range 1\.\.100"):
            server.client(capacity=200)
        with server.client() as client:  # the default follows the lower limit
            assert client.capacity == 100
        bystander.wait_for_lookups(10)  # its channel of 16384 rows, served on

        write_config(config_path, checkpoint, "max_clients = 1")
        reload(server)
        with pytest.raises(AccessDenied, match=r"max_clients = 1"):
            server.client()
        bystander.wait_for_lookups(10)

        write_config(config_path, checkpoint, "max_clients = 2")
        reload(server)
        with server.client() as client:
            assert client.lookup(3, [5]).shape == (1, 320)
        bystander.wait_for_lookups(5)

        # A budget under what the bystander's channel holds already: it stays,
        # and no new channel fits.
        write_config(config_path, checkpoint, 'max_channel_memory = "1M"')
        reload(server)
        with pytest.raises(RequestError, match=r"no memory for a channel"):
            server.client()
        bystander.wait_for_lookups(10)
    assert settings(server)["max_clients"] == 64
    assert "over the new max_channel_memory: no channel opens until" in server.log()


def test_session_timeouts_apply_to_sessions_open_before(start_server, checkpoint, config_path):
    server = start_server(checkpoint, "--config", str(config_path))
    with RawSession(server.socket) as idle, server.client() as client:
        idle.hello()  # and then nothing: idle_timeout_s (1 min) away from being closed
        assert not idle.closed_by_server(1.0)
        write_config(config_path, checkpoint, 'idle_timeout_s = "300ms"')
        reload(server)
        assert idle.closed_by_server(5.0)
        time.sleep(0.5)  # a client with a channel is never closed for idling
        assert client.lookup(1, [7]).shape == (1, 160)


def test_the_socket_files_mode_is_set_again(start_server, checkpoint, config_path):
    server = start_server(checkpoint, "--config", str(config_path))
    assert os.stat(server.socket).st_mode & 0o777 == 0o666
    write_config(config_path, checkpoint, "socket_mode = 0o660")
    reload(server)
    assert os.stat(server.socket).st_mode & 0o777 == 0o660


def test_the_hint_queue_bound_applies_to_the_next_hint(
    start_server, checkpoint, config_path, tmp_path
):
    server = start_server(
        checkpoint, "--config", str(config_path), "--io", "direct", "--state-dir", str(tmp_path)
    )
    with server.client() as client:
        client.hint(1, np.arange(50))  # queued and read: the queue holds 65536 rows
        assert wait_until(lambda: client.stats()["tables"][0]["hints_received"] == 50), (
            client.stats()["tables"][0]
        )
        write_config(config_path, checkpoint, "hint_queue_rows = 4")
        reload(server)
        client.hint(1, np.arange(100, 150))  # 50 rows: more than the queue now holds

        def dropped() -> dict:
            return client.stats()["tables"][0]["hints_dropped_by"]

        assert wait_until(lambda: dropped()["queue_full"] == 50), dropped()
        assert client.stats()["hints"]["queue_rows"] == 4
        assert client.lookup(1, [0, 1]).shape == (2, 160)


def test_the_serving_loops_spin_applies_from_its_next_pass(start_server, checkpoint, config_path):
    write_config(config_path, checkpoint, "spin_us = 0")
    server = start_server(checkpoint, "--config", str(config_path))

    def cpu_after_a_lookup(client: PleClient, seconds: float = 0.8) -> float:
        client.lookup(1, [0])
        before = cpu_seconds(server.pid)
        time.sleep(seconds)
        return cpu_seconds(server.pid) - before

    with server.client() as client:
        assert cpu_after_a_lookup(client) < 0.1  # sleeps at once
        write_config(config_path, checkpoint, 'spin_us = "2s"')
        reload(server)
        # Spins (yielding the CPU each pass) for 2 s after each request: on a
        # shared machine it gets a part of a core, far more than a sleeper.
        assert cpu_after_a_lookup(client) > 0.2
    assert "spin_us 0s → 2s: applies from the serving loop's next pass" in server.log()


# ---------------------------------------------------------------- log level
@pytest.fixture
def launch_without_log_flag():
    """A server whose log level only the config file sets (the tests' usual
    launcher passes --log-level DEBUG, which would override the file)."""
    with ExitStack() as servers:

        def start(*args: str) -> LaunchedServer:
            model, *extra = args
            launcher = ServerLauncher(model, *extra, cwd=REPO)
            return servers.enter_context(launcher.start())

        yield start


def test_the_log_level_applies_at_once(launch_without_log_flag, checkpoint, config_path):
    write_config(config_path, checkpoint, 'log_level = "INFO"')
    server = launch_without_log_flag(str(checkpoint), "--config", str(config_path))
    # A stats session closes at DEBUG.
    closed = re.compile(r"DEBUG pleserver\.server: session \d+ closed: .*\(stats\)")
    PleClient.query_stats(server.socket)
    time.sleep(0.3)
    assert not closed.search(server.log())
    write_config(config_path, checkpoint, 'log_level = "DEBUG"')
    reload(server)
    PleClient.query_stats(server.socket)
    assert wait_until(lambda: closed.search(server.log())), server.log_tail()
    # Down to WARNING: a client's channel opening (INFO) is no longer logged.
    write_config(config_path, checkpoint, 'log_level = "WARNING"')
    reload(server)
    with server.client(name="after-warning") as client:
        client.lookup(1, [0])
    time.sleep(0.3)
    assert "(after-warning), channel" not in server.log()


# ------------------------------------------------------------------ metrics
def test_the_metrics_endpoint_moves_with_its_address(start_server, checkpoint, config_path):
    first, second = free_port(), free_port()
    write_config(config_path, checkpoint, f'metrics_address = "127.0.0.1:{first}"')
    server = start_server(checkpoint, "--config", str(config_path))
    assert answers(first)
    with server.client() as client:
        write_config(config_path, checkpoint, f'metrics_address = "127.0.0.1:{second}"')
        reload(server)
        assert answers(second) and not answers(first)
        text = scrape(second)
        assert 'ple_config_reloads_total{result="ok"} 1.0' in text
        assert "ple_config_last_reload_successful 1.0" in text
        assert client.lookup(1, [3]).shape == (1, 160)  # its session, served on

        # An address that cannot be served fails the reload, which then
        # changes nothing: not even the other setting of the same file.
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = taken.getsockname()[1]
            write_config(
                config_path, checkpoint, f'metrics_address = "127.0.0.1:{busy}"\nmax_clients = 3'
            )
            assert "configuration reload failed" in " ".join(reload(server))
        assert answers(second)
        assert settings(server)["max_clients"] == 64
        text = scrape(second)
        assert 'ple_config_reloads_total{result="failed"} 1.0' in text
        assert "ple_config_last_reload_successful 0.0" in text

        write_config(config_path, checkpoint, "")  # no metrics_address: none
        reload(server)
        assert not answers(second)
        assert client.lookup(1, [4]).shape == (1, 160)
    assert f"metrics endpoint on 127.0.0.1:{second} closed (metrics_address = none)" in (
        server.log()
    )


# ------------------------------------------------------------ bad file, restart
def test_a_bad_file_changes_nothing_and_the_server_keeps_serving(
    start_server, checkpoint, config_path, references
):
    server = start_server(checkpoint, "--config", str(config_path))
    with Bystander(server, references) as bystander:
        bystander.wait_for_lookups(5)
        # One good change among two problems: nothing is applied.
        write_config(config_path, checkpoint, "max_clients = 2\nmax_depth = 65\nbogus = 1")
        ready = reload(server)
        assert any("configuration reload failed" in f for f in ready), ready
        log = server.log()
        assert "reload #1 failed; nothing changed" in log
        assert f"{config_path}: unknown key 'bogus'" in log
        assert f"{config_path}: max_depth: at most {p.MAX_DEPTH}" in log
        bystander.wait_for_lookups(10)
        stats = PleClient.query_stats(server.socket)
        assert stats["config"]["settings"]["max_clients"] == 64
        assert (stats["config"]["reloads"], stats["config"]["reloads_failed"]) == (1, 1)
        assert stats["config"]["last_reload_ok"] is False
        human = pleserver("stats", "--socket", server.socket).stdout
        assert "1 reload(s), 1 failed" in human and "FAILED" in human
        assert "unknown key 'bogus'" in human

        config_path.unlink()  # a named file gone is a problem too
        reload(server)
        assert f"{config_path}: no such config file" in server.log()

        write_config(config_path, checkpoint, "max_clients = 2")  # fixed
        reload(server)
        bystander.wait_for_lookups(5)
    stats = PleClient.query_stats(server.socket)
    assert stats["config"]["settings"]["max_clients"] == 2
    assert stats["config"]["last_reload_ok"] is True
    assert server.running


def test_a_restart_only_change_is_logged_with_its_reason_and_not_applied(
    start_server, checkpoint, config_path, references
):
    write_config(config_path, checkpoint, 'io = "mmap"')
    server = start_server(checkpoint, "--config", str(config_path))
    with Bystander(server, references) as bystander:
        bystander.wait_for_lookups(5)
        threads = footprint(server.pid).threads
        write_config(
            config_path, checkpoint, 'io = "direct"\ngather_workers = 2\nchunk_rows = 1024'
        )
        ready = reload(server)
        assert any("waiting for a restart: io, gather_workers" in f for f in ready), ready
        bystander.wait_for_lookups(10)
    log = server.log()
    assert "reload #1: io mmap → direct: needs a restart: the io mode decides at start" in log
    assert "reload #1: gather_workers 4 → 2: needs a restart: the gather worker threads" in log
    assert "io stays mmap until then" in log
    assert "reload #1: chunk_rows 4096 → 1024: applies from the serving loop's next turn" in log
    stats = PleClient.query_stats(server.socket)
    assert stats["dataplane"]["io"] == "mmap"
    assert footprint(server.pid).threads == threads
    config = stats["config"]
    assert (config["settings"]["io"], config["settings"]["gather_workers"]) == ("mmap", 4)
    assert config["settings"]["chunk_rows"] == 1024
    assert [c["setting"] for c in config["restart_pending"]] == ["io", "gather_workers"]
    human = pleserver("stats", "--socket", server.socket).stdout
    assert "read but waiting for a restart: io mmap → direct, gather_workers 4 → 2" in human
    as_json = json.loads(pleserver("stats", "--json", "--socket", server.socket).stdout)
    assert as_json["config"]["last_reload_applied"] == ["chunk_rows"]


def test_the_command_lines_flags_still_override_the_file(start_server, checkpoint, config_path):
    write_config(config_path, checkpoint, "max_clients = 7")
    server = start_server(checkpoint, "--config", str(config_path), "--max-clients", "5")
    write_config(config_path, checkpoint, "max_clients = 9\nidle_timeout_s = 30")
    reload(server)
    assert settings(server)["max_clients"] == 5
    assert settings(server)["idle_timeout_s"] == 30.0
    assert "the command line's --model, --socket, --max-clients, --log-level override it" in (
        server.log()
    )


# ------------------------------------------------------------ config check
def test_config_check_against_the_running_server_says_what_its_reload_does(
    start_server, checkpoint, config_path
):
    server = start_server(checkpoint, "--config", str(config_path))
    new = write_config(
        config_path.parent / "new.toml", checkpoint, 'max_clients = 3\nio = "direct"'
    )
    checked = pleserver("config", "check", str(new), "--against-running", "--socket", server.socket)
    assert checked.returncode == 0, checked.stderr
    text = checked.stdout
    assert f"that server reads {config_path}: a reload reads that file, not {new}" in text
    applies, _, restart = text.partition("needs a restart (")
    assert "max_clients 64 → 3: applies to new sessions and channels" in applies
    assert "io auto → direct: needs a restart: the io mode decides" in restart
    report = json.loads(
        pleserver(
            "config", "check", str(new), "--against-running", "--socket", server.socket, "--json"
        ).stdout
    )
    assert (report["reload"], report["restart"]) == (["max_clients"], ["io"])
    assert report["against"]["running"]["pid"] == server.pid
    # The server, reloaded with that file, logs the same lines.
    config_path.write_text(new.read_text())
    reload(server)
    for line in text.splitlines():
        if line.startswith("  "):
            assert f"reload #1: {line.strip()}" in server.log(), line
    # Without a file: the server's own, which now matches what it runs with.
    same = pleserver("config", "check", "--against-running", "--socket", server.socket)
    assert "needs a restart" in same.stdout and "io auto → direct" in same.stdout
    assert "a reload (systemctl reload ple-server, or SIGHUP) applies" not in same.stdout


def test_config_check_against_an_old_file(tmp_path, checkpoint):
    old = write_config(tmp_path / "old.toml", checkpoint, 'allow_uids = [0]\nprewarm = "full"')
    new = write_config(tmp_path / "new.toml", checkpoint, 'allow_uids = [0, 1]\nprewarm = "none"')
    result = pleserver("config", "check", str(new), "--against", str(old))
    assert result.returncode == 0, result.stderr
    assert "allow_uids 0 → 0, 1: applies to new connections" in result.stdout
    assert "prewarm full → none: needs a restart: the prewarm runs once" in result.stdout
    same = pleserver("config", "check", str(old), "--against", str(old))
    assert same.stdout.endswith("no setting differs: a reload changes nothing\n")
    bad = write_config(tmp_path / "bad.toml", checkpoint, "max_clients = 0")
    refused = pleserver("config", "check", str(bad), "--against", str(old), "--json")
    assert refused.returncode == 1 and json.loads(refused.stdout)["ok"] is False
    wrong = pleserver("config", "check", str(new), "--socket", "/nonexistent.sock")
    assert wrong.returncode == 2 and "--against-running" in wrong.stderr
