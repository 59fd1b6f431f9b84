"""The Prometheus endpoint, scraped over HTTP from a real server in every io
mode: the documented series and no others, ``promtool check metrics`` on each
scrape, the numbers of ``pleserver stats``, refusals and channel memory, the
disk read latency histogram, the health paths."""

from __future__ import annotations

import gzip
import http.client
import os
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pleclient import PleClient, RequestError
from pleclient import protocol as p
from pleserver.observe.metrics import SnapshotCollector
from pleserver.observe.stats import BUCKETS_S
from tests.harness import OtherUser, RawSession, child_report, run_child, wait_until

README = Path(__file__).resolve().parent.parent / "deploy" / "README.md"
IO_MODES = ("direct", "buffered", "mmap")
NOBODY = OtherUser("nobody", 65534, 65534)
NOT_YET_REPORTED: set[str] = set()
"""Documented series the server exports only once its stats carry the field
(none now: hints are counted in every mode, ``test_hints_are_counted_per_table_and_reason``)."""


def documented_series() -> dict[str, set[str]]:
    """The series of the metrics table in deploy/README.md, with the io modes
    (its ``io`` column) in which each exists."""
    out = {}
    for name, modes in re.findall(
        r"^\| `(ple_[a-z_]+)` \| [^|]+ \| ([a-z, ]+) \|", README.read_text(), re.MULTILINE
    ):
        out[name] = set(IO_MODES) if modes.strip() == "all" else set(modes.split(", "))
    return out


def metrics_url(server) -> str:
    match = re.search(r"metrics on (http://\S+/metrics)", server.log())
    assert match, server.log()
    return match.group(1)


def served_series(scrape: Scrape) -> set[str]:
    return {
        name + "_total" if f.type == "counter" else name
        for name, f in scrape.families.items()
        if name.startswith("ple_")
    }


class Scrape:
    """One scrape: samples by (name, labels)."""

    def __init__(self, url: str | None = None, text: str | None = None) -> None:
        if text is None:
            assert url is not None
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
                text = response.read().decode()
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in self.families.values()
            for s in f.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def table(self, name: str, layer: int, **labels: str) -> float:
        matches = [
            v
            for (n, ls), v in self.samples.items()
            if n == name
            and dict(ls).get("layer") == str(layer)
            and all(dict(ls).get(k) == v2 for k, v2 in labels.items())
        ]
        assert len(matches) == 1, (name, layer, labels, matches)
        return matches[0]


def serve_in_mode(start_server, checkpoint, io: str, state_dir: Path):
    """A server in ``io`` mode with a prewarm (mmap) or a hot set (the others)
    and a little traffic: every series of its mode has something to say."""
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--io",
        io,
        "--prewarm",
        "full",
        "--state-dir",
        str(state_dir),
    )
    with server.client() as client:
        client.lookup(1, np.arange(0, 20_000, 7))
        client.lookup(3, [0, 1])
    return server


@pytest.mark.parametrize("io", IO_MODES)
def test_each_io_mode_serves_its_documented_series_and_no_other(
    start_server, checkpoint, tmp_path, io
):
    server = serve_in_mode(start_server, checkpoint, io, tmp_path)
    scrape = Scrape(metrics_url(server))
    expected = {name for name, modes in documented_series().items() if io in modes}
    assert served_series(scrape) == expected - NOT_YET_REPORTED
    assert "process_resident_memory_bytes" in scrape.families
    assert "process_start_time_seconds" in scrape.families
    if io == "mmap":  # no row cache: a hit ratio would page on a healthy host
        assert not any(n.startswith(("ple_cache_", "ple_disk_")) for n in scrape.families)


@pytest.mark.parametrize("io", IO_MODES)
def test_promtool_check_metrics_passes_on_a_scrape_in_every_io_mode(
    start_server, checkpoint, tmp_path, io
):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    server = serve_in_mode(start_server, checkpoint, io, tmp_path)
    text = Scrape(metrics_url(server)).text
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout + check.stderr == ""  # not even a lint warning


def test_the_documented_table_lists_each_series_once_with_known_modes():
    text = README.read_text()
    names = re.findall(r"^\| `(ple_[a-z_]+)` \|", text, re.MULTILINE)
    assert len(names) == len(set(names)) == len(documented_series())
    assert all(modes <= set(IO_MODES) for modes in documented_series().values())


@pytest.fixture
def metrics_server(start_server, checkpoint):
    return start_server(checkpoint, "--metrics-address", "127.0.0.1:0")


def test_counters_and_histograms_move_with_traffic(metrics_server):
    url = metrics_url(metrics_server)
    before = Scrape(url)
    with metrics_server.client() as client:
        row_bytes = client.table(3).row_bytes
        for _ in range(5):
            client.lookup(3, np.arange(100))
        with pytest.raises(RequestError):
            client.lookup(3, [10**9])
        during = Scrape(url)
    assert during.value("ple_clients") == 1 and during.value("ple_channels") == 1

    def delta(name: str, **labels: str) -> float:
        return during.table(name, 3, **labels) - before.table(name, 3, **labels)

    assert delta("ple_requests_total") == 5
    assert delta("ple_rows_total") == 500
    assert delta("ple_bytes_total") == 500 * row_bytes
    assert delta("ple_errors_total", kind="id_out_of_range") == 1
    assert delta("ple_errors_total", kind="bad_table") == 0
    assert delta("ple_server_time_seconds_count", size="small") == 5
    assert delta("ple_server_time_seconds_count", size="large") == 0
    assert delta("ple_queue_time_seconds_count") == 5
    assert delta("ple_server_time_seconds_sum", size="small") > 0
    assert during.table("ple_requests_total", 1) == before.table("ple_requests_total", 1)


def test_clients_fall_back_to_zero_after_the_client_leaves(metrics_server):
    url = metrics_url(metrics_server)
    with metrics_server.client():
        assert Scrape(url).value("ple_clients") == 1
    assert wait_until(lambda: Scrape(url).value("ple_channels") == 0)
    scrape = Scrape(url)
    assert scrape.value("ple_channels") == 0 and scrape.value("ple_clients") == 0


def test_metrics_show_the_numbers_of_pleserver_stats(metrics_server):
    with metrics_server.client() as client:
        client.lookup(1, np.arange(1000))
        client.lookup(3, np.arange(10))
    stats = PleClient.query_stats(metrics_server.socket)
    scrape = Scrape(metrics_url(metrics_server))
    for t in stats["tables"]:
        assert scrape.table("ple_requests_total", t["layer"]) == t["requests"]
        assert scrape.table("ple_rows_total", t["layer"]) == t["rows"]
        assert scrape.table("ple_bytes_total", t["layer"]) == t["bytes"]
        for size in ("small", "large"):
            count = t["server_time_by_size"][size]["count"]
            assert scrape.table("ple_server_time_seconds_count", t["layer"], size=size) == count
        assert (
            sum(h["count"] for h in t["server_time_by_size"].values()) == t["server_time"]["count"]
        )
        assert scrape.table("ple_table_size_bytes", t["layer"]) == t["table_bytes"]
        assert (
            scrape.table(
                "ple_table_info",
                t["layer"],
                dtype=t["dtype"],
                fingerprint=t["fingerprint"],
                rows=str(t["rows_total"]),
            )
            == 1
        )


def test_latency_buckets_are_cumulative_in_seconds_up_to_the_count(metrics_server):
    with metrics_server.client() as client:
        # (a lookup over the channel's capacity goes as several requests)
        capacity = client.capacity
        assert capacity >= 16_384  # the last one a large request (from 16 384 rows)
        for n in (1, 100, 10_000, capacity):
            client.lookup(1, np.arange(n) % 20_011)
    scrape = Scrape(metrics_url(metrics_server))
    for name, labels, total in (
        ("ple_server_time_seconds_bucket", {"size": "small"}, 3),
        ("ple_server_time_seconds_bucket", {"size": "large"}, 1),
        ("ple_queue_time_seconds_bucket", {}, 4),
    ):
        buckets = sorted(
            (float(dict(ls)["le"]), v)
            for (n, ls), v in scrape.samples.items()
            if n == name
            and dict(ls)["layer"] == "1"
            and all(dict(ls).get(k) == v2 for k, v2 in labels.items())
        )
        bounds, counts = zip(*buckets, strict=True)
        assert bounds[0] == BUCKETS_S[0] and bounds[-2] == BUCKETS_S[-1]
        assert bounds[-1] == float("inf") and counts[-1] == total, (name, labels)
        assert list(counts) == sorted(counts)


def test_prewarm_progress_is_exported(start_server, checkpoint):
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0", "--prewarm", "full")
    assert server.wait_prewarm() == "done"
    scrape = Scrape(metrics_url(server))
    assert scrape.value("ple_prewarm_state", state="done") == 1, scrape.text
    assert scrape.value("ple_prewarm_progress_ratio") == 1
    assert scrape.value("ple_prewarm_done_bytes") == scrape.value("ple_prewarm_target_bytes") > 0
    assert scrape.table("ple_table_resident_ratio", 1) > 0


def test_prewarm_state_is_none_when_prewarm_is_off(metrics_server):
    scrape = Scrape(metrics_url(metrics_server))
    assert scrape.value("ple_prewarm_state", state="none") == 1
    assert scrape.value("ple_prewarm_state", state="running") == 0


def test_an_address_in_use_is_a_clear_startup_error(start_server, checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server(checkpoint, "--metrics-address", f"127.0.0.1:{port}", wait=False)
        assert server.proc.wait(30) == 2
    log = server.log()
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in log
    assert "ready: serving" not in log
    assert not Path(server.socket).exists()


def test_an_unknown_host_is_a_clear_startup_error(start_server, checkpoint):
    server = start_server(checkpoint, "--metrics-address", "no-such-host.invalid:9478", wait=False)
    assert server.proc.wait(60) == 2
    assert "cannot serve metrics on no-such-host.invalid:9478" in server.log()


def test_disk_read_latency_is_a_histogram_of_every_disk_read(start_server, checkpoint):
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0", "--io", "direct")
    with server.client() as client:
        client.lookup(1, np.arange(0, 20_000, 11))
    scrape = Scrape(metrics_url(server))
    assert scrape.families["ple_disk_read_latency_seconds"].type == "histogram"
    reads = scrape.table("ple_disk_reads_total", 1)
    assert reads > 0
    assert scrape.table("ple_disk_read_latency_seconds_count", 1) == reads
    assert scrape.table("ple_disk_read_latency_seconds_sum", 1) > 0
    buckets = sorted(
        (float(dict(ls)["le"]), v)
        for (n, ls), v in scrape.samples.items()
        if n == "ple_disk_read_latency_seconds_bucket" and dict(ls)["layer"] == "1"
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == reads
    assert buckets[0][0] == 2**12 * 1e-9 and buckets[-1][0] == float("inf")


def test_refused_sessions_and_channels_are_counted_by_reason(start_server, checkpoint):
    server = start_server(
        checkpoint,
        "--metrics-address",
        "127.0.0.1:0",
        "--max-clients",
        "1",
        "--max-channel-memory",
        "1M",
    )
    url = metrics_url(server)
    first, second = RawSession(server.socket), RawSession(server.socket)
    with first, second:  # max_clients 1, plus one session for `pleserver stats`
        first.hello()
        reply, _ = first.open_channel()  # a default channel is ≈ 10 MiB: over the budget
        assert reply is not None and reply["code"] == p.ErrorCode.NO_RESOURCES, reply
        reply, _ = first.open_channel(capacity=10**9)
        assert reply is not None and reply["code"] == p.ErrorCode.CHANNEL_LIMIT, reply
        with RawSession(server.socket) as third:
            reply, _ = third.recv()
            assert reply is not None and reply["code"] == p.ErrorCode.TOO_MANY_CLIENTS, reply
    assert wait_until(lambda: Scrape(url).value("ple_clients") == 0)
    with RawSession(server.socket) as old:
        old.send({"type": "hello", "version": p.PROTOCOL_VERSION + 1, "pid": 1})
        reply, _ = old.recv()
        assert reply is not None and reply["code"] == p.ErrorCode.VERSION_MISMATCH, reply
    scrape = Scrape(url)
    assert scrape.value("ple_sessions_refused_total", reason="max_clients") == 1
    assert scrape.value("ple_sessions_refused_total", reason="version_mismatch") == 1
    assert scrape.value("ple_sessions_refused_total", reason="not_allowed") == 0
    assert scrape.value("ple_channels_refused_total", reason="no_resources") == 1
    assert scrape.value("ple_channels_refused_total", reason="channel_limit") == 1
    assert scrape.value("ple_channel_memory_budget_bytes") == 1 << 20
    assert scrape.value("ple_channel_memory_used_bytes") == 0


def test_a_uid_not_allowed_is_counted_as_refused(start_server, checkpoint):
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid (nobody)")
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0")
    refused = run_child(
        """
        try:
            PleClient.query_stats(sys.argv[1])
        except PleError as exc:
            print(json.dumps({"error": type(exc).__name__}))
        """,
        server.socket,
        user=NOBODY,
    )
    assert child_report(refused) == {"error": "AccessDenied"}
    scrape = Scrape(metrics_url(server))
    assert scrape.value("ple_sessions_refused_total", reason="not_allowed") == 1


def test_channel_memory_used_follows_the_open_channels(metrics_server):
    url = metrics_url(metrics_server)
    with metrics_server.client() as client:
        size = p.ChannelLayout(
            client.depth, client.capacity, max(t.row_bytes for t in client.tables)
        ).size
        scrape = Scrape(url)
        assert scrape.value("ple_channel_memory_used_bytes") == size
        assert scrape.value("ple_channel_memory_budget_bytes") > size
    assert wait_until(lambda: Scrape(url).value("ple_channel_memory_used_bytes") == 0)


def test_hints_are_counted_per_table_and_reason(metrics_server):
    """Hints a client sends show in the series of their table: received, read
    or cached, dropped by reason; the queue's series only where a hint reader
    runs."""
    with metrics_server.client() as client:
        client.hint(1, [0, 1, 2])
        client.hint(3, [10_007])  # past the table (dropped before it is looked at)
        assert wait_until(lambda: sum(t["hints_received"] for t in client.stats()["tables"]) == 4)
    scrape = Scrape(metrics_url(metrics_server))
    assert scrape.families["ple_hints_received"].type == "counter"
    assert scrape.table("ple_hints_received_total", 1) == 3
    assert scrape.table("ple_hints_received_total", 3) == 1
    # This server maps its tables (io = mmap): no row cache for hints to fill.
    assert scrape.table("ple_hints_dropped_total", 1, reason="no_cache") == 3
    assert scrape.table("ple_hints_dropped_total", 3, reason="no_cache") == 1
    assert scrape.table("ple_hints_dropped_total", 3, reason="refused") == 0
    assert scrape.table("ple_hints_read_total", 1) == 0
    assert scrape.value("ple_hints_bad_table_total") == 0
    # A snapshot before the serving loop runs: no hint reader, server-wide.
    snapshot = PleClient.query_stats(metrics_server.socket)
    snapshot["hints"] = None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    assert "ple_hints_received_total" in text
    assert "ple_hints_queued_rows" not in text and "ple_hints_bad_table" not in text


def request(url: str, path: str, method: str = "GET", **headers: str):
    """(status, headers, body) of one request to the metrics port."""
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_health_paths_answer_and_every_other_path_is_not_found(metrics_server):
    url = metrics_url(metrics_server)
    assert request(url, "/healthz")[::2] == (200, b"ok\n")
    assert request(url, "/readyz")[::2] == (200, b"ok\n")
    for path in ("/", "/metrics/", "/favicon.ico", "/healthz/x", "/READYZ"):
        assert request(url, path)[0] == 404, path
    status, headers, body = request(url, "/metrics?name[]=ple_clients")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"ple_clients " in body
    status, headers, body = request(url, "/metrics", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    assert request(url, "/metrics", "POST")[0] == 405
    status, headers, body = request(url, "/metrics", **{"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert b"ple_server_info{" in gzip.decompress(body)


def test_a_scrape_sees_every_lookup_answered_before_it(metrics_server):
    """Scrapes share renders, but never one begun before they arrived."""
    url = metrics_url(metrics_server)
    with metrics_server.client() as client:
        for n in range(1, 6):
            client.lookup(3, [n])
            assert Scrape(url).table("ple_requests_total", 3) == n
