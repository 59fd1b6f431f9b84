"""The metrics port under hostile peers, against a real server: idle and
half-sent requests far past the connection cap, deadlines, the places kept for
whole requests (probes and scrapes through a slowloris), the head limit; and
the health socket, which answers the exec probes through a connect flood on
the port. The attacker runs as ``nobody`` where the test is root (a uid the
control socket refuses: anyone on the host can reach a TCP port), else as the
test's own uid."""

from __future__ import annotations

import errno
import http.client
import os
import resource
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from pleserver.observe.health import ask
from tests.harness import (
    OtherUser,
    child_report,
    footprint,
    python_child,
    quiet_footprint,
    run_child,
)
from tests.test_ops_cli import pleserver
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


def test_past_the_cap_a_new_connection_takes_the_place_of_a_half_sent_head(
    start_server, checkpoint
):
    """At the cap, a new connection closes the one that has been sending its
    head the longest, among those of the address holding the most heads: a
    whole request is answered however many half-sent heads are held, and one
    address's heads cannot push out another's."""
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--metrics-max-connections",
        "3",
        "--metrics-timeout-s",
        "60",
    )
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    def hold(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
        sock.sendall(HALF_REQUEST)
        return sock

    other = hold("127.0.0.2")  # the oldest, alone at its address
    time.sleep(0.2)
    first = hold("127.0.0.1")
    time.sleep(0.2)
    second = hold("127.0.0.1")
    held = [other, first, second]
    try:
        time.sleep(0.2)  # all three accepted: the cap is reached
        held.append(hold("127.0.0.1"))
        assert first.recv(4096) == b""  # closed unanswered: its address held the most
        held.append(hold("127.0.0.2"))
        assert second.recv(4096) == b""  # 127.0.0.1 still held the most
        other.settimeout(0.5)
        with pytest.raises(TimeoutError):
            other.recv(4096)  # still held: older than all, but alone at its address
        # At the cap, whole requests are answered (read as they come, or
        # given a head's place when their bytes come after the accept).
        assert probe(url, "/healthz") == 200
        assert probe(url, "/metrics") == 200
        assert probe(url, "/healthz", "127.0.0.2") == 200
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)  # the closes seen: the scrape below finds free places
    scrape = Scrape(url)
    assert scrape.value("ple_metrics_connections_rejected_total", reason="evicted") >= 2
    assert scrape.value("ple_metrics_connections_rejected_total", reason="connection_cap") == 0
    assert "for each new one, the one sending its request head longest is closed" in server.log()


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


SLOWLORIS = """
import selectors
host, port, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
head = sys.argv[5].encode()
selector = selectors.DefaultSelector()
opened = 0

def open_one():
    global opened
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    selector.register(s, selectors.EVENT_WRITE)
    opened += 1

for _ in range(count):
    open_one()
print(json.dumps({"uid": os.geteuid(), "started": True}), flush=True)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    for key, events in selector.select(0.2):
        s = key.fileobj
        if events & selectors.EVENT_WRITE and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            try:
                s.send(head)  # and never a byte more, nor a byte read
                selector.modify(s, selectors.EVENT_READ)
                continue
            except OSError:
                pass
        # Answered, closed or refused: another in its place at once.
        selector.unregister(s)
        s.close()
        open_one()
print(json.dumps({"uid": os.geteuid(), "opened": opened}), flush=True)
"""
WHOLE_SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: ple-server\r\n\r\n"


def probe(url: str, path: str, source: str = "127.0.0.1", timeout: float = 2.0) -> int:
    """One probe as the kubelet makes it (a new connection, answered within
    ``timeout``): its status, or 0 when it failed without one."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


@pytest.mark.parametrize(
    "attack,head,scraper",
    [
        # 40 heads that never end, each reopened as soon as it is closed; the
        # probes and the scrapes come from the attacker's own address.
        ("half-sent heads", HALF_REQUEST, "127.0.0.1"),
        # 40 whole /metrics requests whose answers are never read, reopened as
        # soon as they are answered; the scraper is another peer.
        ("whole scrapes", WHOLE_SCRAPE, "127.0.0.2"),
    ],
)
def test_probes_and_scrapes_are_answered_through_a_slowloris(
    start_server, checkpoint, attack, head, scraper
):
    """A uid the control socket refuses holds more requests open than the
    port's cap and reopens each at once: every /healthz probe (a kubelet's: a
    new connection, answered within 2 s) and every scrape is answered."""
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--metrics-max-connections",
        "16",
        "--metrics-timeout-s",
        "2",
    )
    url = metrics_url(server)
    port = url.rsplit(":", 1)[1].split("/")[0]
    attacker = python_child(
        SLOWLORIS, "127.0.0.1", port, "40", "8", head.decode(), user=attacker_user()
    )
    try:
        assert attacker.stdout is not None
        assert child_report_line(attacker)["started"]
        time.sleep(1.0)  # every place taken, the reopening under way
        statuses: dict[str, list[int]] = {"/healthz": [], "/metrics": []}
        stop = time.monotonic() + 4.0
        while time.monotonic() < stop:
            statuses["/healthz"].append(probe(url, "/healthz"))
            if len(statuses["/healthz"]) % 5 == 0:
                statuses["/metrics"].append(probe(url, "/metrics", scraper))
            time.sleep(0.1)
        report = child_report(
            subprocess.CompletedProcess([], 0, attacker.communicate(timeout=30)[0], "")
        )
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.communicate()
    assert report["opened"] > 100, report  # the attack ran: its connections were turned over
    for path, got in statuses.items():
        assert got and all(status == 200 for status in got), (attack, path, got)
    assert "Traceback" not in server.log(), server.log_tail()


@pytest.mark.parametrize("size", [8192, 8193, 9 * 1024, 15 * 1024])
def test_a_request_head_is_answered_up_to_8_kib_and_refused_past_it(start_server, checkpoint, size):
    """HEAD_LIMIT, as deploy/README.md and docs/SECURITY.md say: 8 KiB of
    request line and headers, the blank line that ends them included."""
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0")
    url = metrics_url(server)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    start = b"GET /healthz HTTP/1.1\r\nX-Padding: "
    head = start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == size
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head)
        reply = conn.recv(4096)
    expected = b"200" if size <= 8192 else b"431"
    assert reply.split(b" ", 2)[1] == expected, (size, reply)
    assert request(url, "/healthz")[0] == 200


CONNECT_FLOOD = """
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
in_flight, connects = [], 0
print(json.dumps({"uid": os.geteuid(), "started": True}), flush=True)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))  # never waited for: the next one at once
    in_flight.append(s)
    connects += 1
    if len(in_flight) > 512:
        in_flight.pop(0).close()
print(json.dumps({"uid": os.geteuid(), "connects": connects}), flush=True)
"""


@pytest.fixture
def health_dir():
    """A directory every uid may search: only the socket's own mode keeps
    other uids out of a health socket made there."""
    path = Path(tempfile.mkdtemp(prefix="ple-health-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


NOBODY_ASKS = """
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except OSError as exc:
    print(json.dumps({"uid": os.geteuid(), "connect": exc.errno}), flush=True)
    sys.exit(0)
try:
    s.sendall(b"GET /healthz HTTP/1.1\\r\\n\\r\\n")
    answer = s.recv(4096).decode()
except OSError:  # closed unanswered before the request went out, or reset
    answer = ""
print(json.dumps({"uid": os.geteuid(), "connect": 0, "answer": answer}), flush=True)
"""


def test_the_health_socket_answers_root_and_the_servers_uid_only(
    start_server, checkpoint, health_dir
):
    """Mode 0600, so another uid's connect is refused by the kernel; and a
    mode loosened by hand still answers no other uid (SO_PEERCRED). Removed at
    stop; `pleserver health` then says why it failed."""
    path = str(health_dir / "health.sock")
    server = start_server(checkpoint, "--health-socket", path)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    for flags in ((), ("--ready",)):
        probe_run = pleserver("health", *flags, path)
        assert (probe_run.returncode, probe_run.stdout) == (0, "ok\n"), probe_run
    with socket.socket(socket.AF_UNIX) as conn:  # what curl --unix-socket sends
        conn.connect(path)
        conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: ple-server\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 200 OK\r\n")
    if attacker_user() is not None:
        report = child_report(run_child(NOBODY_ASKS, path, user=NOBODY))
        assert report == {"uid": NOBODY.uid, "connect": errno.EACCES}, report
        os.chmod(path, 0o666)
        report = child_report(run_child(NOBODY_ASKS, path, user=NOBODY))
        assert report == {"uid": NOBODY.uid, "connect": 0, "answer": ""}, report
        assert f"uid {NOBODY.uid} refused" in server.log()
    assert server.stop() == 0, server.log_tail()
    assert not os.path.lexists(path)
    probe_run = pleserver("health", path)
    assert probe_run.returncode == 1 and "is ple-server running" in probe_run.stderr, probe_run


def test_a_health_socket_in_use_or_not_a_socket_fails_the_start_clearly(
    start_server, checkpoint, health_dir
):
    path = str(health_dir / "health.sock")
    start_server(checkpoint, "--health-socket", path)
    second = start_server(checkpoint, "--health-socket", path, wait=False)
    assert second.proc.wait(30) == 2
    assert "health_socket: " + path + " is in use by a live ple-server" in second.log()
    plain = health_dir / "plain"
    plain.write_text("not a socket")
    third = start_server(checkpoint, "--health-socket", str(plain), wait=False)
    assert third.proc.wait(30) == 2
    assert "exists and is not a socket" in third.log() and plain.read_text() == "not a socket"


def test_exec_probes_are_answered_through_a_connect_flood_on_the_metrics_port(
    start_server, checkpoint, health_dir
):
    """A uid the control socket refuses floods the metrics port with connects
    past its accept rate, so the kernel's backlog overflows: the kubelet's
    HTTP probes of /healthz wait and time out, while probes through the health
    socket (the manifests' exec probes) are answered at once, every one."""
    path = str(health_dir / "health.sock")
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0", "--health-socket", path)
    url = metrics_url(server)
    port = url.rsplit(":", 1)[1].split("/")[0]
    flooder = python_child(CONNECT_FLOOD, "127.0.0.1", port, "6", user=attacker_user())
    try:
        assert flooder.stdout is not None
        assert child_report_line(flooder)["started"]
        time.sleep(0.5)
        over_http, through_socket = [], []
        stop = time.monotonic() + 4.0
        while time.monotonic() < stop:
            started = time.monotonic()
            through_socket.append(ask(path, timeout=2.0))
            elapsed = time.monotonic() - started
            assert elapsed < 1.0, f"a probe through the health socket took {elapsed:.2f} s"
            if len(through_socket) % 2 == 0:
                # The kubelet's default probe timeout: 1 s.
                over_http.append(probe(url, "/healthz", timeout=1.0))
            time.sleep(0.1)
        report = child_report(
            subprocess.CompletedProcess([], 0, flooder.communicate(timeout=30)[0], "")
        )
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.communicate()
    assert report["connects"] > 10_000, report
    assert through_socket and all(answer == (True, "ok") for answer in through_socket)
    # The flood is one the metrics port cannot absorb: some HTTP probe failed.
    assert any(status != 200 for status in over_http), over_http
