"""The metrics port under hostile peers, against a real server: idle and
half-sent requests far past the connection cap, deadlines, 503 past the cap.
The attacker runs as ``nobody`` where the test is root (a uid the control
socket refuses: anyone on the host can reach a TCP port), else as the test's
own uid."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.harness import (
    OtherUser,
    child_report,
    footprint,
    python_child,
    quiet_footprint,
    wait_until,
)
from tests.test_ops_metrics import Scrape, metrics_url, request

NOBODY = OtherUser("nobody", 65534, 65534)
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: ple-server\r\n"  # no blank line: never ends
SIGTERM_BUDGET_S = 5.0
"""What systemd and the kubelet would wait for well within their grace
periods; the unbounded server took 4.5 s with 3 000 idle connections."""

HOLD_CONNECTIONS = """
import selectors  # (imported by socket before the privilege drop)
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
half = sys.argv[4].encode()
selector = selectors.DefaultSelector()
socks = []
for _ in range(count):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    socks.append(s)
    selector.register(s, selectors.EVENT_WRITE)
sent = 0
deadline = time.monotonic() + 90
while selector.get_map() and time.monotonic() < deadline:
    for key, _ in selector.select(1.0):
        selector.unregister(key.fileobj)
        if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            try:
                key.fileobj.send(half)
                sent += 1
            except OSError:
                pass
print(json.dumps({"uid": os.geteuid(), "half_requests": sent}), flush=True)
sys.stdin.read()  # hold every socket until the test closes our stdin
"""


def descriptors_for(count: int):
    """A child's pre-exec step: its descriptor limit raised to ``count`` (or the
    hard limit, the most an unprivileged process may take)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < count:
        pytest.skip(f"the hard descriptor limit ({hard}) is under the {count} the attack needs")
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, count), hard))


def attacker_user() -> OtherUser | None:
    return NOBODY if os.geteuid() == 0 else None


def test_idle_half_requests_far_past_the_cap_leave_the_server_serving_and_stopping(
    start_server, checkpoint, references
):
    """3 000 idle half-requests: the server holds its cap of them and turns the
    rest away, so its descriptors and threads do not grow; new clients get
    `welcome`, a channel and exact rows meanwhile; SIGTERM is prompt."""
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--metrics-max-connections",
        "32",
        "--metrics-timeout-s",
        "60",  # the held ones stay held through the whole test
    )
    port = int(metrics_url(server).rsplit(":", 1)[1].split("/")[0])
    with server.client() as client:  # the gather threads exist from here on
        client.lookup(1, [0, 1])
    baseline = quiet_footprint(server.pid)
    attacker = python_child(
        HOLD_CONNECTIONS,
        "127.0.0.1",
        str(port),
        "3000",
        HALF_REQUEST.decode(),
        user=attacker_user(),
        stdin=subprocess.PIPE,
    )
    try:
        assert attacker.stdout is not None
        report = child_report_line(attacker)
        assert report["uid"] == (NOBODY.uid if attacker_user() else os.geteuid())
        assert report["half_requests"] > 32, report
        worst = footprint(server.pid)
        for _ in range(20):  # while the rest are accepted and turned away
            now = footprint(server.pid)
            worst = max(worst, now, key=lambda f: f.fds)
            assert now.threads <= baseline.threads, (baseline, now)
            time.sleep(0.1)
        assert worst.fds <= baseline.fds + 32 + 4, (baseline, worst)
        # The control plane serves new clients throughout.
        for layer in (1, 3):
            with server.client(name="newcomer") as newcomer:
                ids = list(range(0, references[layer].shape[0], 97))
                assert np.array_equal(newcomer.lookup(layer, ids), references[layer][ids])
        assert "metrics port: 32 connections open" in server.log()
        started = time.monotonic()
        assert server.stop() == 0, server.log_tail()
        stopped_in = time.monotonic() - started
        assert stopped_in < SIGTERM_BUDGET_S, f"SIGTERM took {stopped_in:.1f} s"
    finally:
        attacker.kill()
        attacker.communicate()


def child_report_line(child) -> dict:
    """The JSON line a child prints before it holds (it does not exit)."""
    line = child.stdout.readline()
    if not line:
        child.kill()
        raise AssertionError(f"the attacker printed nothing: {child.communicate()[1]}")
    return child_report(subprocess.CompletedProcess([], 0, line, ""))


def test_a_half_sent_request_is_closed_at_its_deadline(start_server, checkpoint):
    server = start_server(
        checkpoint, "--metrics-address", "127.0.0.1:0", "--metrics-timeout-s", "0.5"
    )
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
        idle.sendall(HALF_REQUEST)
        assert idle.recv(4096) == b""  # closed by the server, unanswered
    assert Scrape(url).value("ple_metrics_connections_rejected_total", reason="timeout") == 1


def test_past_the_cap_a_new_connection_gets_503_at_once(start_server, checkpoint):
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--metrics-max-connections",
        "2",
        "--metrics-timeout-s",
        "60",
    )
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(HALF_REQUEST)
        # Both are accepted before the next: the server takes them in order.
        assert wait_until(lambda: request_status(url) == 503, timeout=10)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as third:
            reply = third.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), reply
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: request_status(url) == 200, timeout=10)
    scrape = Scrape(url)
    assert scrape.value("ple_metrics_connections_rejected_total", reason="connection_cap") >= 2


def request_status(url: str) -> int:
    try:
        return request(url, "/healthz")[0]
    except (ConnectionError, OSError):
        return 0


@pytest.mark.parametrize("head", [b"\x00" * 9000, b"BREW /pot HTCPCP/1.0\r\n\r\n"])
def test_a_malformed_or_oversized_request_gets_an_error_and_the_port_serves_on(
    start_server, checkpoint, head
):
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0")
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as bad:
        bad.sendall(head)
        reply = bad.recv(4096)
    assert reply.split(b" ", 2)[1] in (b"400", b"431"), reply
    assert request(url, "/healthz")[0] == 200
    assert Scrape(url).value("ple_metrics_connections_rejected_total", reason="bad_request") == 1
