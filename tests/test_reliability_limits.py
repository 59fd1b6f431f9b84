"""Resource limits and the socket path: too many clients, a channel that does
not fit, a /dev/shm too small, a socket in use, a stale socket, a socket path
that is not a socket. Each is a clear error and leaves no partial state."""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket

import numpy as np
import pytest

from pleclient import AccessDenied, PleClient, RequestError
from pleclient import protocol as p
from tests.harness import (
    RawSession,
    no_growth,
    quiet_footprint,
    settles_to,
    shm_entries,
    wait_until,
)


def test_clients_over_max_clients_are_refused_until_one_leaves(start_server, checkpoint):
    server = start_server(checkpoint, "--max-clients", "2")
    # (the readiness probe's session may not be gone yet: wait for room)
    first, second = _connect_when_admitted(server), _connect_when_admitted(server)
    with pytest.raises(AccessDenied, match=r"already has 2 clients \(max_clients = 2\)"):
        server.client()
    assert first.lookup(1, [1]).shape == (1, 160)  # the admitted ones are unaffected
    second.close()
    _connect_when_admitted(server).close()
    first.close()
    assert "already has 2 clients" in server.log()


def _connect_when_admitted(server, timeout: float = 10.0) -> PleClient:
    admitted = []

    def attempt() -> bool:
        try:
            admitted.append(server.client())
            return True
        except AccessDenied:
            return False

    assert wait_until(attempt, timeout), "never admitted"
    return admitted[0]


def test_a_refusal_is_read_even_when_the_hello_finds_the_socket_closed(
    start_server, checkpoint, monkeypatch
):
    """The server refuses at accept: it sends its reason and closes. A client
    whose hello then meets the closed socket still reports that reason."""
    from pleclient import client as client_module

    server = start_server(checkpoint, "--max-clients", "1")
    holder = _connect_when_admitted(server)
    operator = RawSession(server.socket)  # takes the one session beyond max_clients
    operator.hello()
    connect = client_module._connect_socket

    def connect_then_dawdle(path, timeout):
        sock = connect(path, timeout)
        # Speak only once the server has refused us and closed its end.
        poll = select.poll()
        poll.register(sock, select.POLLRDHUP)
        assert poll.poll(10_000), "the server did not close the refused connection"
        return sock

    monkeypatch.setattr(client_module, "_connect_socket", connect_then_dawdle)
    with pytest.raises(AccessDenied, match="max_clients = 1"):
        PleClient.connect(server.socket)
    holder.close()
    operator.close()


def test_a_channel_over_max_channel_bytes_is_refused_with_the_numbers(start_server, checkpoint):
    server = start_server(checkpoint, "--max-channel-bytes", "16M")
    baseline = quiet_footprint(server.pid, segments=0)
    with pytest.raises(
        RequestError, match=r"needs 21 MiB, over max_channel_bytes \(16 MiB\)"
    ) as refused:
        server.client(capacity=16384, depth=4)
    assert refused.value.code == p.ErrorCode.CHANNEL_LIMIT
    assert no_growth(baseline, settles_to(server.pid, baseline))
    with server.client(capacity=4096, depth=4) as client:  # one that fits
        assert client.lookup(3, [1, 2]).shape == (2, 320)


def test_no_room_for_a_channel_is_a_clear_error_and_leaves_nothing(start_server, checkpoint):
    """The server may not make files over 8 MiB (RLIMIT_FSIZE, as `LimitFSIZE=`
    would): a 21 MiB channel cannot be made, a 1.3 MiB one can."""
    server = start_server(checkpoint, prefix=("prlimit", f"--fsize={8 << 20}", "--"))
    baseline = quiet_footprint(server.pid, segments=0)
    with pytest.raises(
        RequestError,
        match=r"cannot reserve 20\.5 MiB for a channel \(File "
        r"too large.*ask for a smaller capacity or depth",
    ) as refused:
        server.client()
    assert refused.value.code == p.ErrorCode.NO_RESOURCES
    assert no_growth(baseline, settles_to(server.pid, baseline))
    with server.client(capacity=1024) as client:
        assert client.lookup(1, np.arange(1024)).shape == (1024, 160)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="needs root and unshare(1) for a private mount namespace",
)
def test_a_tiny_dev_shm_does_not_matter(start_server, checkpoint):
    """Channels are memfds with their synchronization words inside: a server whose
    /dev/shm (in its own mount namespace) has room for nothing serves as usual."""
    serve = (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs -o size=4k,nr_inodes=2 tmpfs /dev/shm && exec "$@"',
        "sh",
    )
    server = start_server(checkpoint, prefix=serve)
    with server.client() as client:
        rows = client.lookup(3, np.arange(20_000) % 10_007)
        assert rows.shape == (20_000, 320)
    shm = os.listdir(f"/proc/{server.pid}/root/dev/shm")
    assert shm == [], shm
    assert os.statvfs(f"/proc/{server.pid}/root/dev/shm").f_blocks == 1  # the tiny one


def test_a_socket_in_use_by_a_live_server_is_refused_and_the_live_one_goes_on(
    start_server, checkpoint
):
    live = start_server(checkpoint)
    second = start_server(checkpoint, socket_path=live.socket, wait=False)
    assert second.exit_code() == 2
    assert "is in use by a live ple-server" in second.log()
    assert os.path.exists(live.socket)
    with live.client() as client:
        assert client.lookup(1, [1]).shape == (1, 160)


def test_a_stale_socket_of_a_dead_server_is_replaced(start_server, checkpoint, tmp_path):
    path = str(tmp_path / "stale.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening, then gone: what a killed server leaves
    dead.close()
    server = start_server(checkpoint, socket_path=path)
    assert f"removing stale socket {path}" in server.log()
    with server.client() as client:
        assert client.lookup(1, [1]).shape == (1, 160)


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_a_socket_path_that_is_not_a_socket_is_left_alone(start_server, checkpoint, tmp_path, kind):
    path = tmp_path / "ple.sock"
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    if kind == "file":
        path.write_text("keep me")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(precious)
    server = start_server(checkpoint, socket_path=str(path), wait=False)
    assert server.exit_code() == 2
    assert "is not a socket" in server.log(), server.log()[-2000:]
    assert precious.read_text() == "keep me"
    assert path.is_dir() if kind == "directory" else path.read_text() == "keep me"


def test_the_server_creates_no_shared_memory_names(start_server, checkpoint):
    server = start_server(checkpoint)
    with server.client() as client:
        client.lookup(1, [1])
        assert not shm_entries()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    assert not shm_entries()  # nothing for the next start to clean up
