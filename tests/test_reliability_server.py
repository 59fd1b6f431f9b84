"""Server faults: SIGKILL with requests in flight, restart on the same socket,
SIGTERM with requests in flight, a SHUTDOWN that arrives in pieces."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pleclient import PleClient, ProtocolMismatch, ServerGone
from pleclient import protocol as p
from pleserver.control.segments import create_segment
from tests.harness import python_child, shm_entries, wait_until

TIMEOUT = 10.0  # the clients' timeout


LOOPER = """
path, model, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
from pleserver.devkit.synthetic import read_reference
client = PleClient.connect(path, timeout=10.0, name=f"looper{seed}")
refs = {t.layer: read_reference(model, t.name) for t in client.tables}
rng = np.random.default_rng(seed)
done = 0
print("ready", flush=True)
while True:
    layer = int(rng.choice([1, 3]))
    ids = rng.integers(0, refs[layer].shape[0], int(rng.choice([1, 500, 16384, 40000])))
    try:
        rows = client.lookup(layer, ids)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                          "at": time.monotonic(), "done": done}), flush=True)
        break
    assert np.array_equal(rows, refs[layer][ids]), "wrong rows"
    done += 1
    if done == 1:
        print("served", flush=True)
"""


def last_report(out: str, err: str) -> dict:
    """The JSON line a child printed last."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no report from the child:\n{out}\n{err}"
    return json.loads(lines[-1])


def start_loopers(server, checkpoint, n: int) -> list:
    children = [
        python_child(LOOPER, server.socket, str(checkpoint), str(seed)) for seed in range(n)
    ]
    for child in children:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return children


def test_server_killed_with_requests_in_flight_gives_every_client_server_gone(
    start_server, checkpoint, references
):
    server = start_server(checkpoint)
    loopers = start_loopers(server, checkpoint, 3)
    for child in loopers:  # in its loop: a request in the server's hands most of the time
        assert child.stdout.readline().strip() == "served", child.stderr.read()
    client = server.client(timeout=TIMEOUT)
    ids = np.arange(client.capacity) % 10_007
    tickets = [client.submit(3, ids) for _ in range(client.depth)]
    killed_at = time.monotonic()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    for ticket in tickets:  # answered before the kill, or ServerGone: never a hang
        try:
            assert np.array_equal(ticket.wait(), references[3][ids])
        except ServerGone:
            pass
        ticket.release()
    with pytest.raises(ServerGone, match="closed the connection"):
        client.lookup(1, [1, 2, 3])
    assert time.monotonic() - killed_at < TIMEOUT
    for child in loopers:
        out, err = child.communicate(timeout=2 * TIMEOUT)
        report = last_report(out, err)
        assert report["error"] == "ServerGone", report
        assert report["at"] - killed_at < TIMEOUT, report
        assert report["done"] > 0
        print(
            f"looper: ServerGone {report['at'] - killed_at:.3f} s after the kill, "
            f"{report['done']} lookups verified before"
        )
    client.close()
    assert not shm_entries()


RECONNECTING = """
path, model = sys.argv[1], sys.argv[2]
from pleserver.devkit.synthetic import read_reference
refs = None
rng = np.random.default_rng(7)
gone = verified = 0
deadline = time.monotonic() + 60
client = None
print("ready", flush=True)
while time.monotonic() < deadline:
    try:
        if client is None:
            client = PleClient.connect(path, timeout=10.0, name="reconnecting")
            servers = client.server_info["pid"]
            if refs is None:
                refs = {t.layer: read_reference(model, t.name) for t in client.tables}
        ids = rng.integers(0, 10_007, 2000)
        assert np.array_equal(client.lookup(3, ids), refs[3][ids]), "wrong rows"
        verified += 1
        if not gone and verified == 1:
            print("served", flush=True)  # by the first server: it may go now
        if gone and verified >= 50:
            break
    except ServerGone:
        gone += 1
        client.close()
        client = None
        verified = 0
    except PleError:  # no server on the socket yet: retry
        client = None
        time.sleep(0.05)  # the retry interval of a reconnecting client
print(json.dumps({"gone": gone, "verified_after": verified,
                  "server": client.server_info["pid"] if client else None}), flush=True)
"""


def test_a_new_server_on_the_same_socket_is_picked_up_by_a_reconnecting_client(
    start_server, checkpoint, tmp_path
):
    first = start_server(checkpoint)
    child = python_child(RECONNECTING, first.socket, str(checkpoint))
    assert child.stdout.readline().strip() == "ready"
    assert child.stdout.readline().strip() == "served", child.stderr.read()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert os.path.exists(first.socket)  # a stale socket file is left behind
    second = start_server(checkpoint, socket_path=first.socket)
    assert "removing stale socket" in second.log()
    out, err = child.communicate(timeout=60)
    report = last_report(out, err)
    assert report == {"gone": 1, "verified_after": 50, "server": second.pid}, err
    assert not shm_entries()


def test_sigterm_with_requests_in_flight_completes_them(start_server, checkpoint, references):
    server = start_server(checkpoint)
    loopers = start_loopers(server, checkpoint, 2)
    client = server.client(timeout=TIMEOUT)
    rng = np.random.default_rng(11)
    wanted = [
        (layer, rng.integers(0, references[layer].shape[0], client.capacity))
        for layer in (1, 3, 1, 3)
    ]
    tickets = [client.submit(layer, ids) for layer, ids in wanted]
    server.proc.send_signal(signal.SIGTERM)
    for (layer, ids), ticket in zip(wanted, tickets, strict=True):
        assert np.array_equal(ticket.wait(), references[layer][ids])
        ticket.release()
    assert server.exit_code() == 0
    with pytest.raises(ServerGone):
        client.lookup(1, [1])
    for child in loopers:  # each finished its last request, or was told the server left
        out, err = child.communicate(timeout=2 * TIMEOUT)
        assert "wrong rows" not in err
        report = last_report(out, err)
        assert report["error"] == "ServerGone", report
    client.close()
    assert "stopping (SIGTERM)" in server.log() and not shm_entries()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_stats_on_a_departed_server_raises_server_gone(start_server, checkpoint, sig):
    server = start_server(checkpoint)
    client = server.client()
    client.lookup(1, [1])
    server.proc.send_signal(sig)
    server.proc.wait()
    with pytest.raises(ServerGone):
        client.stats()
    client.close()


# A server's side of one session, written by hand, so that its SHUTDOWN can be
# sent in two pieces: the real server sends each frame in one piece.
TABLE = {
    "name": "model.layers.1.ple.ple_embedding.ngram_embedding",
    "layer": 1,
    "rows": 16,
    "cols": 160,
    "dtype": "F8_E4M3",
    "row_bytes": 160,
    "scale": 1.0,
    "fingerprint": "0" * 32,
    "shard_size": 16,
    "parts": 1,
}


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]


def serve_by_hand(listener: socket.socket, go: threading.Event, pieces: list[bytes]) -> None:
    """Answer hello and open_channel (with a real channel segment); once ``go``
    is set, send ``pieces`` one at a time, each after the client has read the
    one before; then wait for the client to hang up."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(TIMEOUT)
        p.recv_message(conn)  # hello
        p.send_message(
            conn,
            {
                "type": p.MessageType.WELCOME.value,
                "version": p.PROTOCOL_VERSION,
                "server": "by hand",
                "instance": "pieces",
                "pid": os.getpid(),
                "tables": [TABLE],
            },
        )
        p.recv_message(conn)  # open_channel
        layout = p.ChannelLayout(2, 16, TABLE["row_bytes"])
        fd, segment = create_segment("pieces", layout)
        try:
            p.send_message(
                conn, {"type": p.MessageType.CHANNEL.value, "layout": layout.to_wire()}, fds=[fd]
            )
            assert go.wait(TIMEOUT)
            for piece in pieces:
                assert wait_until(lambda: unread_bytes(conn) == 0, TIMEOUT, 0.005)
                conn.sendall(piece)
            conn.recv(1)  # returns when the client closes
        finally:
            segment.close()
            os.close(fd)


def wait_on_a_server_by_hand(tmp_path, pieces: list[bytes]) -> None:
    """A client's ticket that the hand-made server never answers, waited on
    while the server sends ``pieces`` on the control socket."""
    path = str(tmp_path / "pieces.sock")
    go = threading.Event()
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener,
        ThreadPoolExecutor(1) as pool,
    ):
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(TIMEOUT)
        server = pool.submit(serve_by_hand, listener, go, pieces)
        client = PleClient.connect(path, timeout=TIMEOUT)
        try:
            ticket = client.submit(1, [0])  # never answered: the client waits, checking
            go.set()  # the control socket between two waits
            ticket.wait()
        finally:
            go.set()
            client.close()
            server.result(TIMEOUT)


def test_a_shutdown_read_in_two_pieces_is_still_a_shutdown(tmp_path):
    frame = p.encode_frame({"type": p.MessageType.SHUTDOWN.value, "reason": "SIGTERM"})
    with pytest.raises(ServerGone, match=r"shutting down \(SIGTERM\)"):
        wait_on_a_server_by_hand(tmp_path, [frame[: len(frame) // 2], frame[len(frame) // 2 :]])


def test_a_malformed_frame_on_the_control_socket_is_a_protocol_error(tmp_path):
    with pytest.raises(ProtocolMismatch, match=r"malformed frame.*exceeds"):
        wait_on_a_server_by_hand(tmp_path, [b"\xff\xff\xff\xff"])
