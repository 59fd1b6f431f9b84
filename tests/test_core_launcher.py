"""pleserver.devkit.launcher: ready on the server's READY=1, a failed start reported at
once, and nothing left behind — process, sockets, log — whatever happened."""

from __future__ import annotations

import os
import socket
import time

import pytest

from pleserver.devkit.launcher import ServerLauncher, ServerStartError


def gone(pid: int) -> bool:
    """No process ``pid`` (reaped, not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_started_server_is_ready_and_close_leaves_nothing(checkpoint):
    with ServerLauncher(checkpoint).start() as server:
        assert "READY=1" in server.ready_fields
        assert f"MAINPID={server.pid}" in server.ready_fields
        with server.client() as client:  # ready means answering
            assert client.lookup(1, [0, 1]).shape == (2, 160)
        made = [server.socket, server.notify.path, str(server.log_path)]
        assert all(os.path.exists(path) for path in made)
    assert server.proc.returncode == 0  # SIGTERM: a clean stop
    assert gone(server.pid)
    assert not [path for path in made if os.path.exists(path)]
    assert "ready: serving" in server.log()  # still readable after close


def test_a_server_that_cannot_start_fails_the_start_at_once_with_its_log(tmp_path):
    started = time.monotonic()
    with pytest.raises(ServerStartError) as failed:
        ServerLauncher(tmp_path / "no-such-model").start(timeout=60)
    assert time.monotonic() - started < 30  # its exit, not the timeout, ended the wait
    message = str(failed.value)
    assert "exited with 2 before sending 'READY=1'" in message
    assert "no-such-model" in message  # the tail of its log says why


def test_the_server_is_reaped_when_the_with_block_raises(checkpoint):
    with pytest.raises(KeyError), ServerLauncher(checkpoint).start() as server:
        raise KeyError("a failing test")
    assert gone(server.pid)
    assert not os.path.exists(server.socket)


def test_only_the_launched_process_can_say_ready(checkpoint):
    """Like systemd's NotifyAccess=main: a READY=1 from another process on the
    notify socket does not count."""
    with ServerLauncher(checkpoint).start(wait=False) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as impostor:
            impostor.sendto(b"READY=1\nMAINPID=1", server.notify.path)
        ready = server.wait_ready()
        assert f"MAINPID={server.pid}" in ready
        server.notify.drain()  # the impostor's datagram, if READY=1 came first
        assert server.notify.ignored == [os.getpid()]
        with server.client() as client:
            assert client.lookup(3, [5]).shape == (1, 320)


def test_stop_reports_the_exit_code_and_a_restart_reuses_the_socket(checkpoint, tmp_path):
    launcher = ServerLauncher(checkpoint, socket_path=str(tmp_path / "ple.sock"))
    with launcher.start() as first:
        assert first.kill() == -9
    with launcher.start() as second:  # the stale socket of the killed one is replaced
        assert second.socket == first.socket
        with second.client() as client:
            assert client.server_info["pid"] == second.pid
        assert second.stop() == 0
