"""The Prometheus endpoint, scraped over HTTP from a real server."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pleclient import PleClient, RequestError
from pleserver.stats import BUCKETS_S
from tests.harness import wait_until

README = Path(__file__).resolve().parent.parent / "deploy" / "README.md"


def documented_series() -> set[str]:
    """The series of the metrics table in deploy/README.md."""
    return set(re.findall(r"^\| `(ple_[a-z_]+)` \|", README.read_text(), re.MULTILINE))


def metrics_url(server) -> str:
    match = re.search(r"metrics on (http://\S+/metrics)", server.log())
    assert match, server.log()
    return match.group(1)


class Scrape:
    """One scrape: samples by (name, labels)."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            self.text = response.read().decode()
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


@pytest.fixture
def metrics_server(start_server, checkpoint):
    return start_server(checkpoint, "--metrics-address", "127.0.0.1:0")


def test_every_documented_series_is_served_and_nothing_undocumented(start_server, checkpoint):
    server = start_server(checkpoint, "--metrics-address", "127.0.0.1:0", "--prewarm", "full")
    with server.client() as client:
        client.lookup(1, [0, 1])
        scrape = Scrape(metrics_url(server))
    served = {
        name + "_total" if f.type == "counter" else name
        for name, f in scrape.families.items()
        if name.startswith("ple_")
    }
    assert documented_series() == served
    assert "process_resident_memory_bytes" in scrape.families


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
    assert delta("ple_server_time_seconds_count") == 5
    assert delta("ple_queue_time_seconds_count") == 5
    assert delta("ple_server_time_seconds_sum") > 0
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
        assert (
            scrape.table("ple_server_time_seconds_count", t["layer"]) == t["server_time"]["count"]
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
        for n in (1, 100, 10_000):
            client.lookup(1, np.arange(n))
    scrape = Scrape(metrics_url(metrics_server))
    for name in ("ple_server_time_seconds_bucket", "ple_queue_time_seconds_bucket"):
        buckets = sorted(
            (float(dict(ls)["le"]), v)
            for (n, ls), v in scrape.samples.items()
            if n == name and dict(ls)["layer"] == "1"
        )
        bounds, counts = zip(*buckets, strict=True)
        assert bounds[0] == BUCKETS_S[0] and bounds[-2] == BUCKETS_S[-1]
        assert bounds[-1] == float("inf") and counts[-1] == 3
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
