"""The stats snapshot: the second contract of the project (the first, the wire,
is ``pleclient.protocol``).

``Server.snapshot`` assembles it from its producers (the tables' counters, the
data plane, the hint reader, the prewarm, the hot set, the control plane), and
everything that shows a figure reads it: the STATS reply and ``pleserver
stats --json`` (this, as JSON), ``pleserver stats``'s text
(``pleserver.observe.stats.format_human``) and the metric families
(``pleserver.observe.metrics``). Each part is a ``TypedDict``, so mypy checks
every key a producer writes and a reader reads; the JSON is the dicts as they
are. A figure is added here first, then in its producer, then where it shows.

Sizes are bytes, times seconds (``_s``), Unix times ``_unix``; a figure that is
not known is None.
"""

# (no ``from __future__ import annotations``: TypedDict reads NotRequired from
# the annotations themselves, which postponed evaluation turns into strings)
from typing import Any, NotRequired, TypedDict


class HistogramSnapshot(TypedDict):
    """``pleserver.observe.stats.Histogram``: counts over ``BUCKETS_S`` (+Inf)."""

    count: int
    sum_s: float
    max_s: float
    p50_s: float
    p99_s: float
    buckets: list[int]


class ReadLatency(TypedDict):
    """A table's disk reads, counted over ``READ_BUCKETS_S`` (+Inf)."""

    count: int
    sum_s: float
    buckets: list[int]


class TableIo(TypedDict):
    """A table's row-cache and disk figures (``io_snapshot``); zeros in mmap mode."""

    hits: int
    misses: int
    hit_rate: float | None
    misses_per_s: float
    reads: int
    read_bytes: int
    read_errors: int
    read_p50_s: float
    read_p99_s: float
    read_latency: ReadLatency
    evictions: int | None
    resident_bytes: int  # its segments kept in memory (resident_scales)


class TableCounts(TypedDict):
    """What a table served (``TableStats.snapshot``)."""

    name: str
    layer: int
    requests: int
    rows: int
    bytes: int
    errors: dict[str, int]
    error_count: int
    server_time: HistogramSnapshot
    server_time_by_size: dict[str, HistogramSnapshot]  # "small" | "large"
    queue_time: HistogramSnapshot


class HintCountsSnapshot(TypedDict):
    """A table's prefetch hints, in rows (``pleserver.data.hints.TableHintsSnapshot``)."""

    hints_received: int
    hints_cached: int
    hints_read: int
    hints_hits: int
    hints_dropped: int
    hints_dropped_by: dict[str, int]


class TableHintsSnapshot(HintCountsSnapshot):
    hints_tracked_rows: int  # hinted rows a lookup may still count as a hint's hit


class TableSnapshot(TableCounts, TableHintsSnapshot):
    """One table: its counters, its geometry, its io and its hints."""

    dtype: str
    rows_total: int
    cols: int
    row_bytes: int
    table_bytes: int
    fingerprint: str
    resident_fraction: float | None  # in the page cache (mmap mode), else None
    io_mode: str
    io: TableIo


class PrewarmSnapshot(TypedDict):
    state: str  # pleserver.observe.metrics.PREWARM_STATES
    done_bytes: int
    target_bytes: int
    total_bytes: int
    fraction: float


class HotsetSnapshot(TypedDict):
    state: str  # pleserver.observe.metrics.HOTSET_STATES
    file: str
    target_rows: int
    done_rows: int
    fraction: float
    refill_seconds: float | None
    saved_rows: int | None
    saved_unix: float | None
    save_error: str | None
    save_failures: int
    save_interval_s: float


class BoxSnapshot(TypedDict):
    """``pleserver.box.Box``: the memory the budgets were taken from."""

    memory_bytes: int | None
    total_bytes: int | None
    cgroup_limit_bytes: int | None
    gpu_memory: str
    gpu_memory_reason: str


class CacheSnapshot(TypedDict):
    """The row cache (its native stats) and its budget."""

    capacity_rows: int
    used_rows: int
    hits: int
    misses: int
    inserts: int
    evictions: int
    reserved_bytes: int
    populated_bytes: int
    hugepages: bool
    hugepage_kind: str
    mlocked: bool
    policy: str
    shards: int
    budget_bytes: int
    budget_reason: str
    occupancy: float


class EngineSnapshot(TypedDict):
    kind: str
    fallback_reason: str | None
    queue_depth: int  # reads in flight at most, every request together
    small_reserve: int  # and beyond it, for requests of at most 64 reads (io_uring)
    in_flight: int
    peak_in_flight: int  # since start


class ReadBuffers(TypedDict):
    """The miss path's read buffers (``nat.read_memory``; limit 0: no bound set)."""

    limit_bytes: int
    charged_bytes: int
    peak_bytes: int
    waits: int
    returned_bytes: int  # charges of buffers given back to the kernel (≥ the pages returned)
    round_blocks: int


class RequestMemorySnapshot(TypedDict):
    """``pleserver.data.plane.RequestMemory``: what answering requests may hold."""

    fixed_bytes: int
    read_buffers_bytes: int
    read_buffers_reason: str
    scratch_bytes: int
    state_bytes: int
    ids_share: float


class DataplaneSnapshot(TypedDict):
    io: str
    io_reason: str
    cache: CacheSnapshot | None  # None (and no engine) in mmap mode
    engine: EngineSnapshot | None
    box: NotRequired[BoxSnapshot]
    read_buffers: NotRequired[ReadBuffers]
    request_memory: NotRequired[RequestMemorySnapshot]


class HintsSnapshot(TypedDict):
    """The hint reader, server-wide (per table: ``TableHintsSnapshot``)."""

    queued_rows: int
    queue_rows: int
    cache_rows: int
    bad_table: int
    held_requests: int  # hint slots the serving loop holds past its hint_rate


class ChannelMemory(TypedDict):
    used_bytes: int
    budget_bytes: int | None


class ChangeSnapshot(TypedDict):
    """A setting a reload changed or left for a restart."""

    setting: str
    old: Any
    new: Any
    applies: str  # "reload" | "restart"
    note: str


class ReloadSnapshot(TypedDict):
    """``pleserver.control.reload.ReloadState``."""

    loaded_unix: float
    reloads: int
    reloads_failed: int
    last_reload_unix: float | None
    last_reload_ok: bool | None
    last_reload_applied: list[str]
    last_reload_problems: list[str]
    restart_pending: list[ChangeSnapshot]


class ConfigSnapshot(ReloadSnapshot):
    """Where the configuration comes from, every setting in effect, the reloads."""

    file: str | None
    file_named: bool
    flags: dict[str, Any]
    env: dict[str, str]
    settings: dict[str, Any]


class Snapshot(TypedDict):
    """Every number ``pleserver stats`` and the metrics endpoint show."""

    pid: int
    version: str
    model: str
    socket: str
    uptime_s: float
    clients: int
    refused: dict[str, int]  # sessions refused at accept, by reason
    channels: int
    gpu_channels: int
    idle_wait: str | None
    spin_seconds: float  # the serving loop's time spent spinning (spin_us), since start
    prewarm: PrewarmSnapshot | None
    dataplane: DataplaneSnapshot | None
    hotset: HotsetSnapshot | None
    channel_memory: ChannelMemory
    control_errors: dict[str, int]  # ERROR replies sent, by code
    abandoned_channel_opens: int
    hints: HintsSnapshot | None
    config: ConfigSnapshot
    tables: list[TableSnapshot]
