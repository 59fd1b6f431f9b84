"""Counters and latency histograms, and the snapshot that ``pleserver stats``,
the STATS message and the Prometheus endpoint all read (one source of numbers).

Latencies go into fixed log-spaced buckets (recording is a bisect and two
increments under a lock, cheap enough per request); quantiles are read off the
buckets, so p50/p99 are upper bounds with ≈ 19 % resolution.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pleserver.observe.snapshot import (
    ConfigSnapshot,
    HistogramSnapshot,
    ReadLatency,
    Snapshot,
    TableCounts,
    TableIo,
)

# Bucket upper bounds in seconds: 12 per decade from 1 µs to 100 s.
BUCKETS_S: tuple[float, ...] = tuple(10 ** (-6 + i / 12) for i in range(0, 8 * 12 + 1))
# Disk read latency, from the miss engine's native histogram (4 buckets per
# power of two of nanoseconds: buckets 0 .. 4k-1 hold the reads under 2^k ns,
# pleserver/native/gather.h): one bucket per power of two, 4 µs to 17 s.
READ_BUCKET_BITS = range(12, 35)
READ_BUCKETS_S: tuple[float, ...] = tuple(2**k * 1e-9 for k in READ_BUCKET_BITS)
ERROR_KINDS = ("bad_table", "bad_count", "id_out_of_range", "read_error", "internal")
LARGE_REQUEST_ROWS = 16384
"""Requests of at least this many rows are ``large`` in the server-time
histogram: a prefill chunk's lookup, split over the gather workers
(``parallel_min_rows``' default) and reading many rows, takes tens of
milliseconds where a decode step's takes well under one; one latency alert
cannot serve both (``ple_server_time_seconds{size}``)."""
REQUEST_SIZES = ("small", "large")
RATE_WINDOW_S = 10.0


class Histogram:
    """A latency histogram over ``BUCKETS_S`` (plus +Inf)."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.total = 0
        self.sum_s = 0.0
        self.max_s = 0.0

    def record(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.total += 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def quantile(self, q: float) -> float:
        if not self.total:
            return 0.0
        rank = q * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return min(BUCKETS_S[i], self.max_s) if i < len(BUCKETS_S) else self.max_s
        return self.max_s

    def add(self, other: Histogram) -> None:
        """Count ``other``'s requests in this one too."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total
        self.sum_s += other.sum_s
        self.max_s = max(self.max_s, other.max_s)

    def snapshot(self) -> HistogramSnapshot:
        return {
            "count": self.total,
            "sum_s": self.sum_s,
            "max_s": self.max_s,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
            "buckets": list(self.counts),
        }


class RateMeter:
    """Events per second of a cumulative counter, over the last ``RATE_WINDOW_S``
    seconds (or since the previous reading, when that is longer ago)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def rate(self, count: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            samples = self._samples
            samples.append((now, count))
            while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
                samples.popleft()
            t0, c0 = samples[0]
            return (count - c0) / (now - t0) if now > t0 else 0.0


def read_latency(source: dict) -> ReadLatency:
    """The disk read latency histogram of a native source's stats, in the shape
    of ``Histogram.snapshot`` over ``READ_BUCKETS_S``: ``buckets[i]`` counts
    the reads in ``[READ_BUCKETS_S[i-1], READ_BUCKETS_S[i])``, the last one
    those of ``READ_BUCKETS_S[-1]`` and over."""
    native = source.get("read_ns_buckets") or ()
    below = list(itertools.accumulate(native))  # below[b]: reads in buckets 0..b
    total = below[-1] if below else 0
    counts, seen = [], 0
    for k in READ_BUCKET_BITS:
        under = below[min(4 * k, len(below)) - 1] if below else 0
        counts.append(under - seen)
        seen = under
    counts.append(total - seen)
    return {"count": total, "sum_s": source.get("read_ns_sum", 0) * 1e-9, "buckets": counts}


def io_snapshot(source: dict, misses_per_s: float) -> TableIo:
    """A table's row-cache and disk numbers, from its native source's stats."""
    hits, misses = source.get("hits", 0), source.get("misses", 0)
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "misses_per_s": misses_per_s,
        "reads": source.get("reads", 0),
        "read_bytes": source.get("read_bytes", 0),
        "read_errors": source.get("read_errors", 0),
        "read_p50_s": source.get("read_ns_p50", 0) * 1e-9,
        "read_p99_s": source.get("read_ns_p99", 0) * 1e-9,
        "read_latency": read_latency(source),
        "evictions": source.get("evictions"),
        "resident_bytes": source.get("resident_bytes", 0),
    }


@dataclass
class TableStats:
    """Per-table counters, updated by the serving loop and gather workers."""

    name: str
    layer: int
    requests: int = 0
    rows: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    # The server's time per request, by size (REQUEST_SIZES); ``snapshot``'s
    # ``server_time`` is both together.
    server_time_by_size: dict[str, Histogram] = field(
        default_factory=lambda: {size: Histogram() for size in REQUEST_SIZES}
    )
    queue_time: Histogram = field(default_factory=Histogram)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, rows: int, row_bytes: int, server_s: float, queue_s: float) -> None:
        size = "large" if rows >= LARGE_REQUEST_ROWS else "small"
        with self.lock:
            self.requests += 1
            self.rows += rows
            self.bytes += rows * row_bytes
            self.server_time_by_size[size].record(server_s)
            if queue_s >= 0:
                self.queue_time.record(queue_s)

    def record_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def snapshot(self) -> TableCounts:
        with self.lock:
            return {
                "name": self.name,
                "layer": self.layer,
                "requests": self.requests,
                "rows": self.rows,
                "bytes": self.bytes,
                "errors": dict(self.errors),
                "error_count": sum(self.errors.values()),
                "server_time": self._server_time().snapshot(),
                "server_time_by_size": {
                    size: h.snapshot() for size, h in self.server_time_by_size.items()
                },
                "queue_time": self.queue_time.snapshot(),
            }

    def _server_time(self) -> Histogram:
        both = Histogram()
        for h in self.server_time_by_size.values():
            both.add(h)
        return both


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps at least 1 before the point:
    ``812 B``, ``4.00 MiB``, ``29.17 GiB`` (a small table's prewarm does not
    read "0.00 GiB")."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            break
        n /= 1024
        unit = bigger
    return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"


def format_progress(done: int, target: int, fraction: float) -> str:
    """``41.5% (12.10 GiB of 29.17 GiB)``: prewarm progress in one unit each."""
    return f"{100 * fraction:.1f}% ({format_bytes(done)} of {format_bytes(target)})"


def _reload_lines(config: ConfigSnapshot | None) -> list[str]:
    """The configuration reloads (SIGHUP) of a snapshot's ``config`` part:
    nothing before the first one."""
    if not config or not config.get("reloads"):
        return []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(config["last_reload_unix"]))
    line = (
        f"config {config['file']}: {config['reloads']} reload(s), "
        f"{config['reloads_failed']} failed; the last at {when}, "
        + ("ok" if config["last_reload_ok"] else "FAILED, the previous configuration is in effect")
    )
    lines = [line]
    if not config["last_reload_ok"]:
        lines += [f"  {problem}" for problem in config.get("last_reload_problems") or ()]
    pending = config.get("restart_pending") or []
    if pending:
        from pleserver.config import SETTINGS

        def shown(name: str, value: object) -> str:
            return SETTINGS[name].format(value) if name in SETTINGS else repr(value)

        lines.append(
            "read but waiting for a restart: "
            + ", ".join(
                f"{c['setting']} {shown(c['setting'], c['old'])} → {shown(c['setting'], c['new'])}"
                for c in pending
            )
        )
    return lines


def format_human(stats: Snapshot) -> str:
    """The ``pleserver stats`` text view of a snapshot."""
    lines = [
        f"ple-server pid {stats['pid']}  up {stats['uptime_s']:.0f} s  "
        f"clients {stats['clients']}  channels {stats['channels']}"
        + (f" ({stats['gpu_channels']} GPU-driven)" if stats.get("gpu_channels") else "")
        + "  "
        f"model {stats['model']}"
    ]
    if stats.get("idle_wait"):
        lines.append(
            f"serving loop: idle wait {stats['idle_wait']}, "
            f"{stats['spin_seconds']:.1f} s spent spinning after CPU-driven requests"
        )
    refused = stats.get("refused") or {}
    if any(refused.values()):
        lines.append(
            "refused connections: "
            + ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in refused.items())
        )
    lines += _reload_lines(stats.get("config"))
    plane = stats.get("dataplane")
    if plane:
        box = plane.get("box")
        if box:
            memory = box["memory_bytes"]
            lines.append(
                f"box {format_bytes(memory) if memory is not None else 'memory unknown'}, "
                f"{box['gpu_memory']} GPU memory ({box['gpu_memory_reason']})"
            )
        lines.append(f"io {plane['io']} ({plane['io_reason']})")
    cache = plane.get("cache") if plane else None
    engine = plane.get("engine") if plane else None
    if cache:
        lines.append(
            f"row cache {cache['used_rows']} / {cache['capacity_rows']} rows "
            f"({100 * cache['occupancy']:.1f} %), {cache['budget_bytes'] / 2**20:.1f} "
            f"MiB, evictions {cache['evictions']}, policy {cache.get('policy', '?')}, "
            f"huge pages {'yes' if cache.get('hugepages') else 'no'}, "
            f"mlock {'yes' if cache.get('mlocked') else 'no'}"
        )
        scales = sum((t.get("io") or {}).get("resident_bytes", 0) for t in stats["tables"])
        if scales:
            lines.append(
                f"resident scales {format_bytes(scales)} (resident_scales: a missed row is "
                "one disk read)"
            )
    if engine:
        lines.append(
            f"miss engine {engine['kind']}, queue depth {engine['queue_depth']}"
            + (
                f" (+{engine['small_reserve']} for small requests), reads in flight "
                f"{engine['in_flight']}, peak {engine['peak_in_flight']}"
                if engine.get("small_reserve")
                else ""
            )
            + (
                f" (io_uring not used: {engine['fallback_reason']})"
                if engine.get("fallback_reason")
                else ""
            )
        )
    reads = plane.get("read_buffers") if plane else None
    if reads and reads.get("limit_bytes"):
        lines.append(
            f"read buffers {reads['charged_bytes'] / 2**20:.1f} / "
            f"{reads['limit_bytes'] / 2**20:.1f} MiB (peak {reads['peak_bytes'] / 2**20:.1f}), "
            f"{reads['waits']} rounds waited for room"
        )
    hs = stats.get("hotset")
    if hs:
        refill = (
            f"{hs['done_rows']} / {hs['target_rows']} rows ({100 * hs['fraction']:.1f} %)"
            if hs["state"] not in ("none", "ignored")
            else "no saved file"
            if hs["state"] == "none"
            else "saved file not trusted"
        )
        lines.append(
            f"hot set {hs['state']}: {refill}, {hs['file']}"
            + (f" in {hs['refill_seconds']:.1f} s" if hs.get("refill_seconds") is not None else "")
            + (f", last save {hs['saved_rows']} rows" if hs.get("saved_rows") is not None else "")
        )
        if hs.get("save_error"):
            tries = hs.get("save_failures", 1)
            lines.append(f"hot set NOT SAVED ({tries} failed saves): {hs['save_error']}")
    pw = stats.get("prewarm")
    if pw:
        lines.append(
            f"prewarm {pw['state']}: "
            + format_progress(pw["done_bytes"], pw["target_bytes"], pw["fraction"])
        )
    lines.append(
        f"{'layer':>5} {'requests':>10} {'rows':>12} {'GiB':>8} {'errors':>7} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'max µs':>9} {'resident':>9}  dtype"
    )
    for t in stats["tables"]:
        st = t["server_time"]
        resident = t.get("resident_fraction")
        lines.append(
            f"{t['layer']:>5} {t['requests']:>10} {t['rows']:>12} {t['bytes'] / 2**30:>8.3f} "
            f"{t['error_count']:>7} {st['p50_s'] * 1e6:>8.1f} {st['p99_s'] * 1e6:>8.1f} "
            f"{st['max_s'] * 1e6:>9.1f} "
            f"{'' if resident is None else f'{100 * resident:.1f} %':>9}  "
            f"{t['dtype']} {t['rows_total']}×{t['cols']}"
        )
    io_tables = [t for t in stats["tables"] if t.get("io")]
    if io_tables and cache:
        lines.append(
            f"{'layer':>5} {'hit rate':>9} {'misses/s':>10} {'reads':>12} "
            f"{'read GiB':>9} {'read p50 µs':>12} {'read p99 µs':>12} "
            f"{'read errors':>12}"
        )
        for t in io_tables:
            io = t["io"]
            rate = "" if io["hit_rate"] is None else f"{100 * io['hit_rate']:.2f} %"
            lines.append(
                f"{t['layer']:>5} {rate:>9} {io['misses_per_s']:>10.0f} "
                f"{io['reads']:>12} {io['read_bytes'] / 2**30:>9.3f} "
                f"{io['read_p50_s'] * 1e6:>12.1f} {io['read_p99_s'] * 1e6:>12.1f} "
                f"{io['read_errors']:>12}"
            )
    hinted = [t for t in stats["tables"] if t.get("hints_received")]
    if hinted:
        reader = stats.get("hints")
        lines.append(
            f"prefetch hints (rows): queued {reader['queued_rows'] if reader else 0} / "
            f"{reader['queue_rows'] if reader else 0}"
            + (f", {reader['bad_table']} naming no table" if reader and reader["bad_table"] else "")
            + (
                f"; {reader['held_requests']} hint requests held past hint_rate"
                if reader and reader.get("held_requests")
                else ""
            )
        )
        lines.append(
            f"{'layer':>5} {'received':>10} {'read':>10} {'cached':>10} {'hits':>10} "
            f"{'dropped':>10}  by reason"
        )
        for t in hinted:
            reasons = ", ".join(
                f"{reason.replace('_', ' ')} {n}"
                for reason, n in (t.get("hints_dropped_by") or {}).items()
                if n
            )
            lines.append(
                f"{t['layer']:>5} {t['hints_received']:>10} {t['hints_read']:>10} "
                f"{t['hints_cached']:>10} {t['hints_hits']:>10} {t['hints_dropped']:>10}  "
                f"{reasons or '-'}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------- a live view
def bucket_quantile(buckets: list[int], q: float) -> float | None:
    """The ``q`` quantile of counts over ``BUCKETS_S`` (plus +Inf): the upper
    bound, in seconds, of the bucket that holds it (None without a count;
    ``math.inf`` in the +Inf bucket)."""
    total = sum(buckets)
    if not total:
        return None
    seen = 0
    for i, c in enumerate(buckets):
        seen += c
        if c and seen >= q * total:
            return BUCKETS_S[i] if i < len(BUCKETS_S) else math.inf
    return math.inf


def interval(before: Snapshot, after: Snapshot, seconds: float) -> dict:
    """What a server did between two snapshots ``seconds`` apart, over all its
    tables: requests, rows and misses per second, the hit rate and the p99 of
    the server time of the requests answered in between. A restarted server
    (its pid changed, or a counter went back) gives ``restarted`` instead."""
    old = {t["name"]: t for t in before.get("tables", [])}
    if before.get("pid") != after.get("pid") or seconds <= 0:
        return {"restarted": True, "seconds": seconds}
    requests = rows = hits = misses = 0
    buckets = [0] * (len(BUCKETS_S) + 1)
    for t in after.get("tables", []):
        b = old.get(t["name"])
        if b is None:
            continue
        requests += t["requests"] - b["requests"]
        rows += t["rows"] - b["rows"]
        hits += t["io"]["hits"] - b["io"]["hits"]
        misses += t["io"]["misses"] - b["io"]["misses"]
        for i, (x, y) in enumerate(
            zip(t["server_time"]["buckets"], b["server_time"]["buckets"], strict=False)
        ):
            buckets[i] += x - y
    if min(requests, rows, hits, misses, *buckets) < 0:  # counters went back: a new server
        return {"restarted": True, "seconds": seconds}
    return {
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "rows_per_s": rows / seconds,
        "misses_per_s": misses / seconds,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "p99_s": bucket_quantile(buckets, 0.99),
    }


def format_interval(figures: dict) -> str:
    """One line of ``interval``'s figures, for ``pleserver stats --watch``."""
    if figures.get("restarted"):
        return "last interval: the server restarted (its counters start again)"
    hit = figures["hit_rate"]
    p99 = figures["p99_s"]
    return (
        f"last {figures['seconds']:.1f} s: {figures['requests_per_s']:,.0f} requests/s, "
        f"{figures['rows_per_s']:,.0f} rows/s, {figures['misses_per_s']:,.0f} misses/s, "
        f"hit rate {'-' if hit is None else f'{100 * hit:.1f} %'}, "
        f"p99 {'-' if p99 is None else f'{1e3 * p99:.2f} ms'}"
    )
