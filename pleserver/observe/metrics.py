"""The Prometheus series, and the endpoint that serves them (``metrics_address``).

``SnapshotCollector`` turns one ``Server.snapshot()`` (the numbers of
``pleserver stats``) into metric families; ``MetricsEndpoint`` serves them,
with ``/healthz`` and ``/readyz``, through the bounded HTTP server of
``pleserver.observe.metrics_http``, which renders them off the data plane at most
every ``RENDER_INTERVAL_S`` and never per request.

Names follow Prometheus' naming guide: base units (seconds, bytes) in the
name, ``_total`` on counters, ``_ratio`` for 0–1, ``_info`` for a constant 1
whose labels are the value. Rates, ratios over time and times since an event
are left to PromQL (``rate(ple_cache_misses_total[5m])``,
``time() - process_start_time_seconds``), so nothing exported goes stale or
cannot be aggregated across servers. A series that does not apply to the io
mode in use is absent, not zero: a row cache's hits in mmap mode, a prewarm's
progress with a row cache. Per-table series carry the labels ``layer`` (the
PLE layer number) and ``table`` (the tensor name prefix).

Every mode:

- ``ple_server_info{version,model,socket}`` (1), ``ple_clients``,
  ``ple_channels``, ``ple_gpu_channels``, ``ple_serving_spin_seconds_total``
  (the serving loop's time spent spinning: ``spin_us``, after CPU-driven
  requests only);
- ``ple_channel_memory_used_bytes`` and ``ple_channel_memory_budget_bytes``
  (``max_channel_memory``; absent when there is none) — the channels' shared
  memory against its budget;
- ``ple_sessions_refused_total{reason}`` (``not_allowed``: uid or groups not
  in allow_uids/allow_gids; ``max_clients``; ``max_clients_per_uid``: the
  uid holds that many sessions; ``rate_limited``: past the per-uid accept
  rate; ``version_mismatch``) and
  ``ple_channels_refused_total{reason}`` (``no_resources``: the channel memory
  budget, the segment could not be reserved, or no descriptor left;
  ``channel_limit``: past max_capacity, max_depth or max_channel_bytes);
- ``ple_io_mode{io}`` (1 for the mode in use), ``ple_io_info{io,reason}`` (1);
- per table: ``ple_requests_total``, ``ple_rows_total``, ``ple_bytes_total``,
  ``ple_errors_total{kind}`` (``bad_table``, ``bad_count``,
  ``id_out_of_range``, ``read_error``, ``internal``), the histograms
  ``ple_server_time_seconds{size}`` (taking a request to completing it;
  ``large`` from ``LARGE_REQUEST_ROWS`` rows, a prefill chunk's, else
  ``small``) and
  ``ple_queue_time_seconds`` (the client's submit to the server taking it) —
  every third bucket of ``pleserver.observe.stats`` (4 per decade, 1 µs to 100 s), so
  the cumulative counts are exact —, ``ple_table_info{dtype,rows,cols,
  row_bytes,fingerprint}`` (1), ``ple_table_size_bytes``,
  ``ple_table_io_mode{io}``;
- prefetch hints, in rows, per table: ``ple_hints_received_total``,
  ``ple_hints_read_total`` (read into the row cache), ``ple_hints_cached_total``
  (cached already, not read), ``ple_hints_hits_total`` (hinted rows a
  lookup found in the cache: the hits hints brought, each row once),
  ``ple_hints_dropped_total{reason}`` (``no_cache``: io = mmap;
  ``disk_busy``; ``queue_full``; ``cache_full``; ``refused``: bad count or
  ids; ``read_error``); and ``ple_hints_queued_rows``,
  ``ple_hints_held_requests`` (hint slots waiting past ``hint_rate``),
  ``ple_hints_bad_table_total`` (a table index the server does not have);
- ``ple_metrics_connections_rejected_total{reason}`` (``connection_cap``,
  ``evicted``: closed while sending its request head to make room for a new
  connection, ``timeout``, ``bad_request``) — this endpoint's own refusals;
- configuration reloads (SIGHUP): ``ple_config_reloads_total{result}``
  (``ok``, ``failed``), ``ple_config_last_reload_successful`` (1 or 0; 1 before
  the first reload), ``ple_config_last_reload_success_timestamp_seconds`` (the
  start, or the last successful reload), ``ple_config_restart_pending_settings``
  (changes read by a reload that need a restart);
- the standard ``process_*`` series (CPU, resident memory, open fds, start time).

``io = direct`` or ``buffered`` (a row cache and a miss engine):

- ``ple_cache_capacity_rows``, ``ple_cache_used_rows``,
  ``ple_cache_budget_bytes``, ``ple_cache_occupancy_ratio``,
  ``ple_cache_evictions_total``; ``ple_read_engine_info{kind,fallback_reason}``
  (1), ``ple_read_queue_depth``;
- per table: ``ple_cache_hits_total``, ``ple_cache_misses_total``,
  ``ple_disk_reads_total``, ``ple_disk_read_bytes_total``,
  ``ple_disk_read_errors_total``, and the histogram
  ``ple_disk_read_latency_seconds`` (the miss engine's own, one bucket per
  power of two of nanoseconds, 4 µs to 17 s; a bound counts the reads under
  it), ``ple_table_resident_scales_bytes`` (``resident_scales``);
- ``ple_hotset_target_rows``, ``ple_hotset_done_rows``,
  ``ple_hotset_progress_ratio``, ``ple_hotset_state{state}``,
  ``ple_hotset_saved_rows`` — the refill of the cache from the saved hot set;
  ``ple_hotset_save_failing`` (1 while the last save failed),
  ``ple_hotset_save_failures_total``,
  ``ple_hotset_last_save_timestamp_seconds`` — its saves.

``io = mmap`` (the page cache):

- ``ple_prewarm_done_bytes``, ``ple_prewarm_target_bytes``,
  ``ple_prewarm_progress_ratio``, ``ple_prewarm_state{state}`` (state ``none``
  when prewarm is off);
- per table: ``ple_table_resident_ratio`` (refreshed at most every 2 s).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pleserver.config import parse_host_port
from pleserver.observe.metrics_http import Check, MetricsError, MetricsHTTPServer
from pleserver.observe.snapshot import (
    ConfigSnapshot,
    DataplaneSnapshot,
    HistogramSnapshot,
    HotsetSnapshot,
    PrewarmSnapshot,
    ReadLatency,
    Snapshot,
    TableSnapshot,
)
from pleserver.observe.stats import BUCKETS_S, ERROR_KINDS, LARGE_REQUEST_ROWS, READ_BUCKETS_S

__all__ = ["MetricsEndpoint", "MetricsError", "SnapshotCollector"]

log = logging.getLogger("pleserver.metrics")

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
SESSION_REFUSALS = {
    "not_allowed": "not_allowed",
    "max_clients": "too_many_clients",
    "max_clients_per_uid": "uid_limit",
    "rate_limited": "rate_limited",
    "version_mismatch": "version_mismatch",
}
CHANNEL_REFUSALS = {"no_resources": "no_resources", "channel_limit": "channel_limit"}
"""Series reason → the ERROR code (lower case) the control plane counted."""


NO_PREWARM: PrewarmSnapshot = {
    "state": "none",
    "done_bytes": 0,
    "target_bytes": 0,
    "total_bytes": 0,
    "fraction": 0.0,
}
"""The prewarm's series of a server that has none (io = mmap, prewarm = none)."""
NO_HOTSET: HotsetSnapshot = {
    "state": "off",
    "file": "",
    "target_rows": 0,
    "done_rows": 0,
    "fraction": 0.0,
    "refill_seconds": None,
    "saved_rows": None,
    "saved_unix": None,
    "save_error": None,
    "save_failures": 0,
    "save_interval_s": 0.0,
}
"""The hot set's series of a server without one (no state_dir)."""


class SnapshotCollector(Collector):
    """Turns one ``Snapshot`` into metric families, at render time."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # no snapshot at registration

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        info = GaugeMetricFamily(
            "ple_server_info",
            "ple-server version, model and socket (always 1).",
            labels=["version", "model", "socket"],
        )
        info.add_metric([snap["version"], snap["model"], snap["socket"]], 1)
        yield info
        yield GaugeMetricFamily("ple_clients", "Connected client sessions.", value=snap["clients"])
        yield GaugeMetricFamily(
            "ple_channels", "Open shared-memory channels.", value=snap["channels"]
        )
        yield GaugeMetricFamily(
            "ple_gpu_channels",
            "Open channels driven by a GPU (their doorbells are polled).",
            value=snap.get("gpu_channels", 0),
        )
        yield CounterMetricFamily(
            "ple_serving_spin_seconds",
            "Seconds the serving loop spent spinning after CPU-driven requests (spin_us).",
            value=snap["spin_seconds"],
        )
        yield from _control(snap)
        yield from _config(snap.get("config"))
        plane = snap["dataplane"]
        mode = plane["io"] if plane is not None else None
        if plane is not None:
            yield from _dataplane(plane)
        if mode == "mmap":
            yield from _prewarm(snap.get("prewarm"))
        elif mode is not None:
            yield from _hotset(snap.get("hotset"))
        yield from _tables(snap["tables"])
        if mode not in (None, "mmap"):
            yield from _table_io(snap["tables"])
        yield from _hints(snap)


def _control(snap: Snapshot) -> Iterator[Metric]:
    memory = snap.get("channel_memory") or {}
    yield GaugeMetricFamily(
        "ple_channel_memory_used_bytes",
        "Bytes of channel segments in existence or being reserved.",
        value=memory.get("used_bytes", 0),
    )
    if memory.get("budget_bytes") is not None:
        yield GaugeMetricFamily(
            "ple_channel_memory_budget_bytes",
            "The channels' memory budget (max_channel_memory); a channel past it is refused.",
            value=memory["budget_bytes"],
        )
    yield CounterMetricFamily(
        "ple_channel_opens_abandoned",
        "Channel openings skipped: their session closed before its segment was reserved.",
        value=snap["abandoned_channel_opens"],
    )
    errors = snap.get("control_errors") or {}
    # Refusals at accept are counted by pleserver.control.connections, by its own reasons
    # (a rate-limited uid and a full server share one ERROR code); the rest by
    # the ERROR code the control plane sent.
    counted = {**errors, **(snap.get("refused") or {})}
    for name, help_text, reasons in (
        (
            "ple_sessions_refused",
            "Sessions refused or ended at admission, by reason.",
            SESSION_REFUSALS,
        ),
        ("ple_channels_refused", "Channel openings refused, by reason.", CHANNEL_REFUSALS),
    ):
        family = CounterMetricFamily(name, help_text, labels=["reason"])
        for reason, code in reasons.items():
            family.add_metric([reason], counted.get(code, 0))
        yield family


def _config(config: ConfigSnapshot | None) -> Iterator[Metric]:
    """Configuration reloads (SIGHUP), named as Prometheus names its own
    (``prometheus_config_last_reload_successful``): the start's load counts as
    a successful one, so a server never reloaded reads 1 and its start time."""
    if not config:
        return
    reloads = CounterMetricFamily(
        "ple_config_reloads",
        "Configuration reloads (SIGHUP, systemctl reload), by result.",
        labels=["result"],
    )
    failed = config.get("reloads_failed", 0)
    reloads.add_metric(["ok"], config.get("reloads", 0) - failed)
    reloads.add_metric(["failed"], failed)
    yield reloads
    yield GaugeMetricFamily(
        "ple_config_last_reload_successful",
        "1 when the last configuration load (a reload, or the start) succeeded.",
        value=0 if config.get("last_reload_ok") is False else 1,
    )
    yield GaugeMetricFamily(
        "ple_config_last_reload_success_timestamp_seconds",
        "When the configuration in effect was last loaded whole (the start, or a "
        "successful reload), in seconds since the epoch.",
        value=config.get("loaded_unix", 0),
    )
    yield GaugeMetricFamily(
        "ple_config_restart_pending_settings",
        "Settings the last successful reload read but left as they were: they need a restart.",
        value=len(config.get("restart_pending") or ()),
    )


def _prewarm(prewarm: PrewarmSnapshot | None) -> Iterator[Metric]:
    pw = prewarm if prewarm is not None else NO_PREWARM
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


def _dataplane(plane: DataplaneSnapshot) -> Iterator[Metric]:
    mode = GaugeMetricFamily("ple_io_mode", "1 for the io mode in use.", labels=["io"])
    for name in IO_MODES:
        mode.add_metric([name], 1 if plane["io"] == name else 0)
    yield mode
    why = GaugeMetricFamily(
        "ple_io_info", "The io mode and why it was chosen (always 1).", labels=["io", "reason"]
    )
    why.add_metric([plane["io"], plane["io_reason"]], 1)
    yield why
    cache, engine = plane.get("cache"), plane.get("engine")
    if not cache or not engine:  # mmap mode: no row cache, no miss engine
        return
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
        "ple_read_queue_depth",
        "Disk reads in flight at most, every request together.",
        value=engine["queue_depth"],
    )
    yield GaugeMetricFamily(
        "ple_reads_in_flight", "Disk reads in flight now.", value=engine.get("in_flight", 0)
    )
    yield GaugeMetricFamily(
        "ple_reads_in_flight_peak",
        "The most disk reads in flight at once since start (at most queue_depth, and the "
        "small requests' reserve beyond it).",
        value=engine.get("peak_in_flight", 0),
    )
    reads = plane.get("read_buffers")
    if reads is not None:
        for name, value, help_text in (
            ("limit", reads["limit_bytes"], "The miss path's read buffers' bound (0: none set)."),
            ("charged", reads["charged_bytes"], "Bytes of read buffers held now."),
            ("peak", reads["peak_bytes"], "The most bytes of read buffers held at once."),
        ):
            yield GaugeMetricFamily(f"ple_read_buffer_{name}_bytes", help_text, value=value)
        yield CounterMetricFamily(
            "ple_read_buffer_waits",
            "Rounds of disk reads that waited for room under the read buffers' bound.",
            value=reads["waits"],
        )
        yield CounterMetricFamily(
            "ple_read_buffer_returned_bytes",
            "Read buffers given back to the kernel, bytes of their charge (pages later "
            "rounds fault in again, at most).",
            value=reads["returned_bytes"],
        )


def _hotset(hotset: HotsetSnapshot | None) -> Iterator[Metric]:
    hs = hotset if hotset is not None else NO_HOTSET
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
    yield GaugeMetricFamily(
        "ple_hotset_save_failing",
        "1 while the last save of the hot set failed (stats' save_error says why).",
        value=1 if hs.get("save_error") else 0,
    )
    yield CounterMetricFamily(
        "ple_hotset_save_failures",
        "Saves of the hot set that failed.",
        value=hs.get("save_failures") or 0,
    )
    yield GaugeMetricFamily(
        "ple_hotset_last_save_timestamp_seconds",
        "When the hot set was last saved (Unix time; 0 before the first save).",
        value=hs.get("saved_unix") or 0,
    )


def _table_io(tables: list[TableSnapshot]) -> Iterator[Metric]:
    """The row cache's and the miss engine's per-table series (not in mmap mode)."""
    hits = CounterMetricFamily(
        "ple_cache_hits", "Rows found in the row cache.", labels=TABLE_LABELS
    )
    misses = CounterMetricFamily(
        "ple_cache_misses", "Rows missing from the row cache (read from disk).", labels=TABLE_LABELS
    )
    reads = CounterMetricFamily(
        "ple_disk_reads", "Disk reads of the miss engine.", labels=TABLE_LABELS
    )
    read_bytes = CounterMetricFamily(
        "ple_disk_read_bytes", "Bytes read from disk (whole 4 KiB blocks).", labels=TABLE_LABELS
    )
    read_errors = CounterMetricFamily(
        "ple_disk_read_errors", "Failed or short disk reads.", labels=TABLE_LABELS
    )
    latency = HistogramMetricFamily(
        "ple_disk_read_latency_seconds",
        "Seconds from submitting a disk read to its completion.",
        labels=TABLE_LABELS,
    )
    scales = GaugeMetricFamily(
        "ple_table_resident_scales_bytes",
        "Bytes of the table's scales kept in memory (resident_scales), read at start.",
        labels=TABLE_LABELS,
    )
    for t in tables:
        io = t.get("io")
        if not io:
            continue
        labels = [str(t["layer"]), t["name"]]
        hits.add_metric(labels, io["hits"])
        misses.add_metric(labels, io["misses"])
        reads.add_metric(labels, io["reads"])
        read_bytes.add_metric(labels, io["read_bytes"])
        read_errors.add_metric(labels, io["read_errors"])
        hist = io["read_latency"]
        latency.add_metric(labels, _buckets(hist, READ_BUCKETS_S, 1), hist["sum_s"])
        scales.add_metric(labels, io["resident_bytes"])
    yield from (hits, misses, reads, read_bytes, read_errors, latency, scales)


def _hints(snap: Snapshot) -> Iterator[Metric]:
    """Prefetch hints, in rows, per table (``pleserver.data.hints``): received,
    read into the row cache, found cached already, dropped by reason, and the
    lookups' hits on hinted rows; the queue's rows and the hints naming no
    table, server-wide (before the serving loop runs: the tables' zeros)."""
    tables = snap["tables"]
    if tables:
        families = {
            key: CounterMetricFamily(name, help_text, labels=TABLE_LABELS)
            for key, name, help_text in (
                ("hints_received", "ple_hints_received", "Row ids received in prefetch hints."),
                ("hints_read", "ple_hints_read", "Hinted rows read into the row cache."),
                (
                    "hints_cached",
                    "ple_hints_cached",
                    "Hinted rows found in the row cache already (not read).",
                ),
                (
                    "hints_hits",
                    "ple_hints_hits",
                    "Rows hints put in the cache that a lookup then found there (each once).",
                ),
            )
        }
        dropped = CounterMetricFamily(
            "ple_hints_dropped",
            "Hinted rows dropped, not read, by reason.",
            labels=[*TABLE_LABELS, "reason"],
        )
        for t in tables:
            labels = [str(t["layer"]), t["name"]]
            counts = {
                "hints_received": t["hints_received"],
                "hints_read": t["hints_read"],
                "hints_cached": t["hints_cached"],
                "hints_hits": t["hints_hits"],
            }
            for key, family in families.items():
                family.add_metric(labels, counts[key])
            for reason, n in t["hints_dropped_by"].items():
                dropped.add_metric([*labels, reason], n)
        yield from families.values()
        yield dropped
    hints = snap.get("hints")
    if hints:
        yield GaugeMetricFamily(
            "ple_hints_queued_rows",
            "Hinted rows queued to be read (at most hint_queue_rows).",
            value=hints["queued_rows"],
        )
        yield GaugeMetricFamily(
            "ple_hints_held_requests",
            "Hint requests waiting in their slots, past hint_rate.",
            value=hints["held_requests"],
        )
        yield CounterMetricFamily(
            "ple_hints_bad_table",
            "Hinted rows refused for naming a table index the server does not have.",
            value=hints["bad_table"],
        )


def _tables(tables: list[TableSnapshot]) -> Iterator[Metric]:
    requests = CounterMetricFamily("ple_requests", "Lookups served.", labels=TABLE_LABELS)
    rows = CounterMetricFamily("ple_rows", "Rows served.", labels=TABLE_LABELS)
    nbytes = CounterMetricFamily("ple_bytes", "Row bytes served.", labels=TABLE_LABELS)
    errors = CounterMetricFamily(
        "ple_errors", "Rejected requests, by kind.", labels=[*TABLE_LABELS, "kind"]
    )
    server_time = HistogramMetricFamily(
        "ple_server_time_seconds",
        f"Seconds from taking a request to completing it; size: large from "
        f"{LARGE_REQUEST_ROWS} rows (a prefill chunk's), else small.",
        labels=[*TABLE_LABELS, "size"],
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
        "Fraction of the table in the page cache, 0 to 1 (mmap mode).",
        labels=TABLE_LABELS,
    )
    mode = GaugeMetricFamily(
        "ple_table_io_mode", "1 for the table's io mode.", labels=[*TABLE_LABELS, "io"]
    )
    for t in tables:
        labels = [str(t["layer"]), t["name"]]
        requests.add_metric(labels, t["requests"])
        rows.add_metric(labels, t["rows"])
        nbytes.add_metric(labels, t["bytes"])
        for kind in dict.fromkeys([*ERROR_KINDS, *t["errors"]]):
            errors.add_metric([*labels, kind], t["errors"].get(kind, 0))
        for request_size, h in t["server_time_by_size"].items():
            server_time.add_metric(
                [*labels, request_size], _buckets(h, BUCKETS_S, BUCKET_STEP), h["sum_s"]
            )
        queue_time.add_metric(
            labels, _buckets(t["queue_time"], BUCKETS_S, BUCKET_STEP), t["queue_time"]["sum_s"]
        )
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
        fraction = t["resident_fraction"]
        if fraction is not None:
            resident.add_metric(labels, fraction)
        for name in IO_MODES:
            mode.add_metric([*labels, name], 1 if t["io_mode"] == name else 0)
    yield from (requests, rows, nbytes, errors, server_time, queue_time, info, size)
    if resident.samples:
        yield resident
    yield mode


def _buckets(
    hist: HistogramSnapshot | ReadLatency, bounds: tuple[float, ...], step: int
) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets from a histogram snapshot over ``bounds``
    (``buckets[i]`` counts the values between ``bounds[i-1]`` and ``bounds[i]``,
    the last one the overflow), at every ``step``-th bound and the last."""
    counts = hist["buckets"]
    out: list[tuple[str, float]] = []
    seen = 0
    for i, bound in enumerate(bounds):
        seen += counts[i]
        if i % step == 0 or i == len(bounds) - 1:
            out.append((floatToGoString(bound), seen))
    out.append(("+Inf", hist["count"]))
    return out


class _EndpointCollector(Collector):
    """The endpoint's own counters."""

    def __init__(self, http: MetricsHTTPServer) -> None:
        self._http = http

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rejected = CounterMetricFamily(
            "ple_metrics_connections_rejected",
            "Connections to the metrics port closed unanswered or refused, by reason.",
            labels=["reason"],
        )
        for reason, count in self._http.rejected.items():
            rejected.add_metric([reason], count)
        yield rejected


class _YieldingRegistry(Collector):
    """A registry's families one at a time, the GIL given up between two: the
    serving loop waits for one family's formatting at most, not a whole render."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            yield family
            time.sleep(0)


class MetricsEndpoint:
    """The series above, ``/healthz`` (``alive``) and ``/readyz`` (``ready``) on
    ``address``; ``start()`` binds (raising ``MetricsError`` when it cannot),
    ``stop()`` closes it."""

    def __init__(
        self,
        address: str,
        snapshot: Callable[[], Snapshot],
        alive: Check,
        ready: Check,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        self.address = address
        try:
            host, port = parse_host_port(address)
        except ValueError as exc:
            raise MetricsError(f"metrics_address: {exc}") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        ProcessCollector(registry=self.registry)
        self.http = MetricsHTTPServer(
            address,
            host,
            port,
            self.render,
            {"/healthz": alive, "/readyz": ready},
            max_connections,
            timeout_s,
        )
        self.registry.register(_EndpointCollector(self.http))

    def render(self) -> bytes:
        """The exposition, in Prometheus' text format (on the render thread)."""
        return generate_latest(_YieldingRegistry(self.registry))

    @property
    def port(self) -> int | None:
        """The bound port (useful with port 0), or None before ``start()``."""
        return self.http.port

    def start(self) -> None:
        self.http.start()
        host, _ = parse_host_port(self.address)
        shown = f"[{host}]" if ":" in host else host
        log.info(
            "metrics on http://%s:%d/metrics (and /healthz, /readyz); at most %d "
            "connections, %g s each",
            shown,
            self.port,
            self.http.max_connections,
            self.http.timeout_s,
        )

    def set_limits(self, max_connections: int, timeout_s: float) -> None:
        """New connection limits (a reload). The I/O thread reads each once per
        connection it accepts or times: one attribute store each, so a
        connection is held to the old values or the new ones, never a mix of
        the two for one check."""
        self.http.max_connections = max_connections
        self.http.timeout_s = timeout_s

    def stop(self) -> None:
        self.http.stop()
