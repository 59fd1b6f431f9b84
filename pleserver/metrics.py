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
- ``ple_cache_hits_total``, ``ple_cache_misses_total`` — rows found in and
  missing from the row cache; ``ple_cache_hit_ratio`` (0–1, absent before the
  first lookup), ``ple_cache_misses_per_second`` (over the last 10 s);
  ``ple_disk_reads_total``, ``ple_disk_read_bytes_total``,
  ``ple_disk_read_errors_total``, ``ple_disk_read_latency_seconds{quantile}``
  (0.5 and 0.99, from the miss engine's histogram); ``ple_table_io_mode{io}``
  (1 for the table's mode) — per table;
- ``ple_io_mode{io}`` (1 for the mode in use), ``ple_io_info{io,reason}``;
  ``ple_cache_capacity_rows``, ``ple_cache_used_rows``, ``ple_cache_budget_bytes``,
  ``ple_cache_occupancy_ratio``, ``ple_cache_evictions_total``;
  ``ple_read_engine_info{kind,fallback_reason}``, ``ple_read_queue_depth`` — the
  row cache and the miss engine (zeros and kind ``none`` in mmap mode);
- ``ple_hotset_target_rows``, ``ple_hotset_done_rows``,
  ``ple_hotset_progress_ratio``, ``ple_hotset_state{state}`` — the refill of the
  cache from the saved hot set; ``ple_hotset_saved_rows`` (at the last save);
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
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pleserver.config import parse_host_port
from pleserver.stats import BUCKETS_S, ERROR_KINDS

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)

TABLE_LABELS = ["layer", "table"]
PREWARM_STATES = ("none", "pending", "running", "done", "budget", "memory", "stopped", "failed")
HOTSET_STATES = (
    "off",
    "pending",
    "refilling",
    "done",
    "budget",
    "none",
    "ignored",
    "stopped",
    "failed",
)
IO_MODES = ("direct", "buffered", "mmap")
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
        info = GaugeMetricFamily(
            "ple_server_info",
            "ple-server version, model and socket (always 1).",
            labels=["version", "model", "socket"],
        )
        info.add_metric([snap["version"], snap["model"], snap["socket"]], 1)
        yield info
        yield GaugeMetricFamily(
            "ple_uptime_seconds", "Seconds since the server started.", value=snap["uptime_s"]
        )
        yield GaugeMetricFamily("ple_clients", "Connected client sessions.", value=snap["clients"])
        yield GaugeMetricFamily(
            "ple_channels", "Open shared-memory channels.", value=snap["channels"]
        )
        yield GaugeMetricFamily(
            "ple_gpu_channels",
            "Open channels driven by a GPU (their doorbells are polled).",
            value=snap.get("gpu_channels", 0),
        )
        yield from _prewarm(snap.get("prewarm"))
        yield from _dataplane(snap.get("dataplane"))
        yield from _hotset(snap.get("hotset"))
        yield from _tables(snap["tables"])
        yield from _table_io(snap["tables"])


def _prewarm(pw: dict | None) -> Iterator[Metric]:
    pw = pw or {"state": "none", "done_bytes": 0, "target_bytes": 0, "fraction": 0.0}
    yield GaugeMetricFamily(
        "ple_prewarm_done_bytes",
        "Bytes read into the page cache by the prewarm so far.",
        value=pw["done_bytes"],
    )
    yield GaugeMetricFamily(
        "ple_prewarm_target_bytes",
        "Bytes the prewarm means to read (the tables, or the budget).",
        value=pw["target_bytes"],
    )
    yield GaugeMetricFamily(
        "ple_prewarm_progress_ratio", "Prewarm progress, 0 to 1.", value=pw["fraction"]
    )
    state = GaugeMetricFamily(
        "ple_prewarm_state", "1 for the prewarm's current state.", labels=["state"]
    )
    for name in PREWARM_STATES:
        state.add_metric([name], 1 if pw["state"] == name else 0)
    yield state


def _dataplane(plane: dict | None) -> Iterator[Metric]:
    if not plane:
        return
    mode = GaugeMetricFamily("ple_io_mode", "1 for the io mode in use.", labels=["io"])
    for name in IO_MODES:
        mode.add_metric([name], 1 if plane["io"] == name else 0)
    yield mode
    why = GaugeMetricFamily(
        "ple_io_info", "The io mode and why it was chosen (always 1).", labels=["io", "reason"]
    )
    why.add_metric([plane["io"], plane["io_reason"]], 1)
    yield why
    # Present in every mode (zeros, kind "none" without a row cache), so
    # dashboards and alerts need no per-mode queries.
    cache = plane.get("cache") or {
        "capacity_rows": 0,
        "used_rows": 0,
        "budget_bytes": 0,
        "occupancy": 0.0,
        "evictions": 0,
    }
    engine = plane.get("engine") or {"kind": "none", "fallback_reason": None, "queue_depth": 0}
    yield GaugeMetricFamily(
        "ple_cache_capacity_rows", "Rows the row cache can hold.", value=cache["capacity_rows"]
    )
    yield GaugeMetricFamily(
        "ple_cache_used_rows", "Rows in the row cache.", value=cache["used_rows"]
    )
    yield GaugeMetricFamily(
        "ple_cache_budget_bytes",
        "The row cache's budget (cache_size).",
        value=cache["budget_bytes"],
    )
    yield GaugeMetricFamily(
        "ple_cache_occupancy_ratio", "Used over capacity, 0 to 1.", value=cache["occupancy"]
    )
    yield CounterMetricFamily(
        "ple_cache_evictions", "Rows evicted from the row cache.", value=cache["evictions"]
    )
    info = GaugeMetricFamily(
        "ple_read_engine_info",
        "The miss engine in use, and why io_uring is not, if it is not (always 1).",
        labels=["kind", "fallback_reason"],
    )
    info.add_metric([engine["kind"], engine.get("fallback_reason") or ""], 1)
    yield info
    yield GaugeMetricFamily(
        "ple_read_queue_depth", "Disk reads in flight at most.", value=engine["queue_depth"]
    )


def _hotset(hs: dict | None) -> Iterator[Metric]:
    hs = hs or {
        "state": "off",
        "target_rows": 0,
        "done_rows": 0,
        "fraction": 0.0,
        "saved_rows": None,
    }
    yield GaugeMetricFamily(
        "ple_hotset_target_rows",
        "Rows the hot-set refill means to read into the cache.",
        value=hs["target_rows"],
    )
    yield GaugeMetricFamily(
        "ple_hotset_done_rows", "Rows the hot-set refill has read.", value=hs["done_rows"]
    )
    yield GaugeMetricFamily(
        "ple_hotset_progress_ratio", "Hot-set refill progress, 0 to 1.", value=hs["fraction"]
    )
    state = GaugeMetricFamily(
        "ple_hotset_state", "1 for the hot set's current state.", labels=["state"]
    )
    for name in HOTSET_STATES:
        state.add_metric([name], 1 if hs["state"] == name else 0)
    yield state
    yield GaugeMetricFamily(
        "ple_hotset_saved_rows",
        "Rows in the hot set at its last save (0 before the first).",
        value=hs.get("saved_rows") or 0,
    )


def _table_io(tables: list[dict]) -> Iterator[Metric]:
    hits = CounterMetricFamily(
        "ple_cache_hits", "Rows found in the row cache.", labels=TABLE_LABELS
    )
    misses = CounterMetricFamily(
        "ple_cache_misses", "Rows missing from the row cache (read from disk).", labels=TABLE_LABELS
    )
    ratio = GaugeMetricFamily(
        "ple_cache_hit_ratio", "Hits over lookups, 0 to 1.", labels=TABLE_LABELS
    )
    rate = GaugeMetricFamily(
        "ple_cache_misses_per_second", "Misses per second over the last 10 s.", labels=TABLE_LABELS
    )
    reads = CounterMetricFamily(
        "ple_disk_reads", "Disk reads of the miss engine.", labels=TABLE_LABELS
    )
    read_bytes = CounterMetricFamily(
        "ple_disk_read_bytes", "Bytes read from disk.", labels=TABLE_LABELS
    )
    read_errors = CounterMetricFamily(
        "ple_disk_read_errors", "Failed or short disk reads.", labels=TABLE_LABELS
    )
    latency = GaugeMetricFamily(
        "ple_disk_read_latency_seconds",
        "Disk read latency quantiles.",
        labels=[*TABLE_LABELS, "quantile"],
    )
    mode = GaugeMetricFamily(
        "ple_table_io_mode", "1 for the table's io mode.", labels=[*TABLE_LABELS, "io"]
    )
    for t in tables:
        io = t.get("io")
        if not io:
            continue
        labels = [str(t["layer"]), t["name"]]
        hits.add_metric(labels, io["hits"])
        misses.add_metric(labels, io["misses"])
        if io["hit_rate"] is not None:
            ratio.add_metric(labels, io["hit_rate"])
        rate.add_metric(labels, io["misses_per_s"])
        reads.add_metric(labels, io["reads"])
        read_bytes.add_metric(labels, io["read_bytes"])
        read_errors.add_metric(labels, io["read_errors"])
        latency.add_metric([*labels, "0.5"], io["read_p50_s"])
        latency.add_metric([*labels, "0.99"], io["read_p99_s"])
        for name in IO_MODES:
            mode.add_metric([*labels, name], 1 if t.get("io_mode") == name else 0)
    yield from (hits, misses, ratio, rate, reads, read_bytes, read_errors, latency, mode)


def _tables(tables: list[dict]) -> Iterator[Metric]:
    requests = CounterMetricFamily("ple_requests", "Lookups served.", labels=TABLE_LABELS)
    rows = CounterMetricFamily("ple_rows", "Rows served.", labels=TABLE_LABELS)
    nbytes = CounterMetricFamily("ple_bytes", "Row bytes served.", labels=TABLE_LABELS)
    errors = CounterMetricFamily(
        "ple_errors", "Rejected requests, by kind.", labels=[*TABLE_LABELS, "kind"]
    )
    server_time = HistogramMetricFamily(
        "ple_server_time_seconds",
        "Seconds from taking a request to completing it.",
        labels=TABLE_LABELS,
    )
    queue_time = HistogramMetricFamily(
        "ple_queue_time_seconds",
        "Seconds from the client's submit to the server taking the request.",
        labels=TABLE_LABELS,
    )
    info = GaugeMetricFamily(
        "ple_table_info",
        "Table geometry and fingerprint (always 1).",
        labels=[*TABLE_LABELS, "dtype", "rows", "cols", "row_bytes", "fingerprint"],
    )
    size = GaugeMetricFamily(
        "ple_table_size_bytes", "Bytes of the table on disk.", labels=TABLE_LABELS
    )
    resident = GaugeMetricFamily(
        "ple_table_resident_ratio",
        "Fraction of the table in the page cache, 0 to 1.",
        labels=TABLE_LABELS,
    )
    for t in tables:
        labels = [str(t["layer"]), t["name"]]
        requests.add_metric(labels, t["requests"])
        rows.add_metric(labels, t["rows"])
        nbytes.add_metric(labels, t["bytes"])
        for kind in dict.fromkeys([*ERROR_KINDS, *t["errors"]]):
            errors.add_metric([*labels, kind], t["errors"].get(kind, 0))
        server_time.add_metric(labels, _buckets(t["server_time"]), t["server_time"]["sum_s"])
        queue_time.add_metric(labels, _buckets(t["queue_time"]), t["queue_time"]["sum_s"])
        info.add_metric(
            [
                *labels,
                t["dtype"],
                str(t["rows_total"]),
                str(t["cols"]),
                str(t["row_bytes"]),
                t["fingerprint"],
            ],
            1,
        )
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


class MetricsEndpoint:
    """HTTP endpoint for Prometheus on a daemon thread; ``start()`` binds (and
    raises ``MetricsError`` when it cannot), ``stop()`` closes it."""

    def __init__(self, address: str, snapshot: Callable[[], dict]) -> None:
        self.address = address
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        ProcessCollector(registry=self.registry)
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0), or None before ``start()``."""
        return self._httpd.server_address[1] if self._httpd is not None else None

    def start(self) -> None:
        try:
            host, port = parse_host_port(self.address)
        except ValueError as exc:
            raise MetricsError(f"metrics_address: {exc}") from None
        try:
            self._httpd, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise MetricsError(
                f"cannot serve metrics on {self.address}: "
                f"{exc.strerror or exc}; choose a free port or another "
                "address for metrics_address (or leave it out)"
            ) from None
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
