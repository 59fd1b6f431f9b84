"""The optional Prometheus endpoint (``metrics_address = "host:port"``).

A custom collector reads ``Server.snapshot()`` at scrape time, so the endpoint
shows exactly the numbers of ``pleserver stats`` and costs nothing between
scrapes. Series (per-table ones carry the labels ``layer`` and ``table``; the
table label is the tensor name prefix, the layer its PLE layer number):

- ``ple_requests_total``, ``ple_rows_total``, ``ple_bytes_total`` — served
  lookups, rows and row bytes;
- ``ple_errors_total{kind}`` — rejected requests by kind (``bad_table``,
  ``bad_count``, ``id_out_of_range``, ``internal``);
- ``ple_server_time_seconds``, ``ple_queue_time_seconds`` — histograms of the
  time from taking a request to completing it, and from the client's submit to
  the server taking it. Buckets are every third bucket of ``pleserver.stats``
  (4 per decade, 1 µs to 100 s): the cumulative counts at these bounds are
  exact;
- ``ple_table_info{dtype,rows,cols,row_bytes,fingerprint}`` (always 1),
  ``ple_table_size_bytes``, ``ple_table_resident_ratio`` (page-cache residency,
  0–1, refreshed at most every 2 s; absent while unknown);
- ``ple_clients``, ``ple_channels`` — connected sessions, open channels;
- ``ple_prewarm_done_bytes``, ``ple_prewarm_target_bytes``,
  ``ple_prewarm_progress_ratio``, ``ple_prewarm_state{state}`` (1 for the current
  state; ``none`` when prewarm is off);
- ``ple_server_info{version,model,socket}`` (always 1), ``ple_uptime_seconds``;
- the standard ``process_*`` series (CPU, resident memory, open fds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pleserver.stats import BUCKETS_S, ERROR_KINDS

log = logging.getLogger(__name__)

TABLE_LABELS = ["layer", "table"]
PREWARM_STATES = ("none", "pending", "running", "done", "budget", "memory", "stopped", "failed")
BUCKET_STEP = 3  # export every third stats bucket: 4 per decade


class MetricsError(OSError):
    """The endpoint cannot start; the message names the address and the fix."""


class SnapshotCollector(Collector):
    """Turns one ``snapshot()`` dict into metric families, at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # no scrape at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        info = GaugeMetricFamily("ple_server_info", "ple-server version, model and socket "
                                 "(always 1).", labels=["version", "model", "socket"])
        info.add_metric([snap["version"], snap["model"], snap["socket"]], 1)
        yield info
        yield GaugeMetricFamily("ple_uptime_seconds", "Seconds since the server started.",
                                value=snap["uptime_s"])
        yield GaugeMetricFamily("ple_clients", "Connected client sessions.",
                                value=snap["clients"])
        yield GaugeMetricFamily("ple_channels", "Open shared-memory channels.",
                                value=snap["channels"])
        yield from _prewarm(snap.get("prewarm"))
        yield from _tables(snap["tables"])


def _prewarm(pw: dict | None) -> Iterator[Metric]:
    pw = pw or {"state": "none", "done_bytes": 0, "target_bytes": 0, "fraction": 0.0}
    yield GaugeMetricFamily("ple_prewarm_done_bytes", "Bytes read into the page cache by "
                            "the prewarm so far.", value=pw["done_bytes"])
    yield GaugeMetricFamily("ple_prewarm_target_bytes", "Bytes the prewarm means to read "
                            "(the tables, or the budget).", value=pw["target_bytes"])
    yield GaugeMetricFamily("ple_prewarm_progress_ratio", "Prewarm progress, 0 to 1.",
                            value=pw["fraction"])
    state = GaugeMetricFamily("ple_prewarm_state", "1 for the prewarm's current state.",
                              labels=["state"])
    for name in PREWARM_STATES:
        state.add_metric([name], 1 if pw["state"] == name else 0)
    yield state


def _tables(tables: list[dict]) -> Iterator[Metric]:
    requests = CounterMetricFamily("ple_requests", "Lookups served.", labels=TABLE_LABELS)
    rows = CounterMetricFamily("ple_rows", "Rows served.", labels=TABLE_LABELS)
    nbytes = CounterMetricFamily("ple_bytes", "Row bytes served.", labels=TABLE_LABELS)
    errors = CounterMetricFamily("ple_errors", "Rejected requests, by kind.",
                                 labels=[*TABLE_LABELS, "kind"])
    server_time = HistogramMetricFamily(
        "ple_server_time_seconds", "Seconds from taking a request to completing it.",
        labels=TABLE_LABELS)
    queue_time = HistogramMetricFamily(
        "ple_queue_time_seconds", "Seconds from the client's submit to the server taking "
        "the request.", labels=TABLE_LABELS)
    info = GaugeMetricFamily("ple_table_info", "Table geometry and fingerprint (always 1).",
                             labels=[*TABLE_LABELS, "dtype", "rows", "cols", "row_bytes",
                                     "fingerprint"])
    size = GaugeMetricFamily("ple_table_size_bytes", "Bytes of the table on disk.",
                             labels=TABLE_LABELS)
    resident = GaugeMetricFamily("ple_table_resident_ratio", "Fraction of the table in the "
                                 "page cache, 0 to 1.", labels=TABLE_LABELS)
    for t in tables:
        labels = [str(t["layer"]), t["name"]]
        requests.add_metric(labels, t["requests"])
        rows.add_metric(labels, t["rows"])
        nbytes.add_metric(labels, t["bytes"])
        for kind in dict.fromkeys([*ERROR_KINDS, *t["errors"]]):
            errors.add_metric([*labels, kind], t["errors"].get(kind, 0))
        server_time.add_metric(labels, _buckets(t["server_time"]), t["server_time"]["sum_s"])
        queue_time.add_metric(labels, _buckets(t["queue_time"]), t["queue_time"]["sum_s"])
        info.add_metric([*labels, t["dtype"], str(t["rows_total"]), str(t["cols"]),
                         str(t["row_bytes"]), t["fingerprint"]], 1)
        size.add_metric(labels, t["table_bytes"])
        if t.get("resident_fraction") is not None:
            resident.add_metric(labels, t["resident_fraction"])
    yield from (requests, rows, nbytes, errors, server_time, queue_time, info, size, resident)


def _buckets(hist: dict) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets from a stats histogram (``counts[i]`` holds
    the values in ``(BUCKETS_S[i-1], BUCKETS_S[i]]``, the last one the overflow)."""
    counts = hist["buckets"]
    out, seen = [], 0
    for i, bound in enumerate(BUCKETS_S):
        seen += counts[i]
        if i % BUCKET_STEP == 0 or i == len(BUCKETS_S) - 1:
            out.append((floatToGoString(bound), seen))
    out.append(("+Inf", hist["count"]))
    return out


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9478"``, ``"[::1]:9478"``, ``"0.0.0.0:0"`` → (host, port)."""
    host, sep, port = address.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise MetricsError(f"metrics address {address!r} is not host:port (e.g. "
                           "127.0.0.1:9478); fix metrics_address")
    return host, int(port)


class MetricsEndpoint:
    """HTTP endpoint for Prometheus on a daemon thread; ``start()`` binds (and
    raises ``MetricsError`` when it cannot), ``stop()`` closes it."""

    def __init__(self, address: str, snapshot: Callable[[], dict]) -> None:
        self.address = address
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        ProcessCollector(registry=self.registry)
        self._httpd = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0), or None before ``start()``."""
        return self._httpd.server_address[1] if self._httpd is not None else None

    def start(self) -> None:
        host, port = parse_address(self.address)
        try:
            self._httpd, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {self.address}: "
                               f"{exc.strerror or exc}; choose a free port or another "
                               "address for metrics_address (or leave it out)") from None
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on http://%s:%d/metrics", shown, self.port)

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        self._httpd = self._thread = None
