"""The daemon's memory budgets: the row cache, and the channel segments.

ple-server starts before the model (the vLLM unit comes ``After=`` it), so the
memory free at start is not free for long: the model's weights and its KV
cache arrive next, and on unified-memory machines (DGX Spark, GX10) the GPU
allocates from the same RAM. So each default takes a share of the room at
start (``pleserver.host``: ``MemAvailable``, or the room under the cgroup's
limit when that is smaller), not all of it.

- **Row cache** (``plan``): the box's budget (``box_cache_budget``, from
  ``pleserver.box``: what does not change between starts), at most
  ``CACHE_SHARE`` of the room at start less the ``prewarm_reserve``, fixed
  at start and reserved up front. The box's budget is ``CACHE_SHARE`` of its
  memory less the ``prewarm_reserve``; on unified memory (the GPU allocates
  from the same RAM) at most ``UNIFIED_CACHE_SHARE`` of what vLLM's default
  share (``VLLM_GPU_MEMORY_UTILIZATION`` of the box) and the system
  (``SYSTEM_RESERVE``) leave: vLLM starts after the server and refuses to
  start when less than its share is free. ``io = auto`` serves the tables
  from the page cache (``mmap``) only when they fit in the box's budget (or
  in ``cache_size``), so a restart never changes the mode with the memory
  free at that moment: a page cache that grows without limit starves the
  GPU allocator, a row cache of fixed size does not.
- **The request path** (``RequestMemory``): what answering requests may
  hold beside the channels and the cache, each part bounded when the server
  starts, so that no sequence of requests can take more: the miss path's read
  buffers (a native bound, ``nat.set_read_memory``: a round that would pass it
  waits for a buffer given back; default ``READ_SHARE`` of the room beside
  the row cache, at most what every reading thread can use), what the
  threads that gather allocate besides (their misses a piece at a time, the
  fill's chunk, mmap mode's deduplicated pieces), the hint queue's ring and
  the hinted rows' table, the hot set's keys; and, per byte of channel, the
  private copies of its requests' ids (``ids_share``: a channel holds at most
  its slots' ids, ``8 / (8 + widest row)`` of its segment).
- **Channel segments** (``ChannelBudget``): a channel's pages are reserved
  when it opens (``posix_fallocate`` on its memfd) and charged to the server's
  memory cgroup, but they never show in its RSS. Under a memory limit
  (systemd's ``MemoryMax=``, a container's limit) one channel too many would
  get the daemon OOM-killed with nothing logged; the budget refuses that
  channel instead (``NO_RESOURCES``). Its default is ``CHANNEL_SHARE`` of the
  room once the row cache and the request path have taken theirs (the
  channels' id copies counted with them); the rest is the margin for what
  grows with the process itself (sessions, replies, statistics, the
  interpreter's heap).

So under a memory limit the server's memory is at most what it used at
start, plus the row cache, the request path's parts and the channels with
their id copies: ``room ≥ cache + request.fixed + channels × (1 +
ids_share)``, with a quarter of what is left beside the cache and the request
path to spare.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pleclient.checkpoint import TableSpec
from pleserver.box import SYSTEM_RESERVE, VLLM_GPU_MEMORY_UTILIZATION, Box, this_box
from pleserver.host import MemoryRoom, memory_room
from pleserver.observe.stats import format_bytes

CACHE_SHARE = 0.25
"""Share of the box's memory, and of the room at start (each less the
reserve), the default row cache takes at most."""
UNIFIED_CACHE_SHARE = 0.5
"""Share of what vLLM's share and the system leave that the default row
cache takes on unified memory; the rest is for the server's other memory
(the hot set's keys alone are 10 % of a cache of FP8 rows) and a margin
for vLLM's check of free memory at its start."""
MIN_CACHE_BYTES = 64 << 20
"""A default cache never smaller than this (a machine short of memory still
serves its hottest rows from the cache rather than none)."""
CHANNEL_SHARE = 0.75
"""Share of the room left beside the row cache and the request path that
channels (and their id copies) may take."""
READ_SHARE = 0.25
"""Share of the room beside the row cache that the miss path's read buffers
take by default (at least ``nat.READ_MEMORY_MIN``, at most what every thread
that reads can use at once)."""


# ---------------------------------------------------------------- row cache
@dataclass(frozen=True)
class Budget:
    """The row cache's size, the io mode, and why (both are logged and in
    stats); the box they were decided for."""

    cache_bytes: int
    cache_reason: str
    io: str  # "direct" | "buffered" | "mmap"
    io_reason: str
    box: Box | None = None


def table_cache_bytes(specs: list[TableSpec]) -> int:
    """Bytes a cache needs to hold every row of ``specs`` (slots are as wide as
    the widest row)."""
    slot = max((s.row_bytes for s in specs), default=0)
    return sum(s.rows for s in specs) * slot


def unified_room(
    total: int, utilization: float = VLLM_GPU_MEMORY_UTILIZATION, system: int = SYSTEM_RESERVE
) -> int:
    """What a unified-memory box of ``total`` bytes leaves ple-server once
    vLLM took its ``utilization`` share and the system ``system`` bytes."""
    return max(0, total - int(utilization * total) - system)


def resident_words(resident: int) -> str:
    """How a budget's reason names the tables' resident scales."""
    if not resident:
        return ""
    return f" and the tables' {format_bytes(resident)} of resident scales (resident_scales)"


def box_cache_budget(box: Box, reserve: int, resident: int = 0) -> tuple[int | None, str]:
    """The default row cache's budget from the box alone (bytes, or None when
    its memory is not known; and why): ``CACHE_SHARE`` of its memory less
    ``reserve`` and the ``resident`` scales, on unified memory at most
    ``UNIFIED_CACHE_SHARE`` of what vLLM's default share, the system and the
    resident scales leave."""
    memory = box.memory
    if memory is None:
        return None, "the box's memory is not readable"
    quarter = int(max(0, memory - reserve - resident) * CACHE_SHARE)
    quarter_why = (
        f"{CACHE_SHARE:.0%} of the box's memory ({box.describe_memory()}) less the "
        f"{format_bytes(reserve)} reserve (prewarm_reserve){resident_words(resident)}"
    )
    if not box.unified or box.total is None:
        return quarter, quarter_why
    left = max(0, unified_room(box.total) - resident)
    share = int(left * UNIFIED_CACHE_SHARE)
    scales = f" − {format_bytes(resident)} of resident scales" if resident else ""
    why = (
        f"unified memory ({box.why}): {UNIFIED_CACHE_SHARE:.0%} of what vLLM's default "
        f"share and the system leave, (1 − {VLLM_GPU_MEMORY_UTILIZATION}) × "
        f"{format_bytes(box.total)} − {format_bytes(SYSTEM_RESERVE)}{scales} = "
        f"{format_bytes(left)}"
    )
    if quarter < share:
        return quarter, f"{quarter_why}, below {why}"
    return share, why


def plan(
    specs: list[TableSpec],
    io: str,
    cache_size: int | None,
    reserve: int,
    box: Box | None = None,
    memory: MemoryRoom | None = None,
    resident: int = 0,
) -> Budget:
    """The cache size (``cache_size``, else the default described above) and
    the io mode (``io``; for ``auto`` mmap when the tables fit in
    ``cache_size``, else in the box's budget) for ``box`` (default: this one,
    detected). ``resident``: bytes a row cache's tables keep in memory besides
    (``resident_scales``), counted with the reserve when the default row
    cache is sized; the io mode is chosen as without them (mmap keeps none)."""
    box = box or this_box()
    if cache_size is None:
        memory = memory or memory_room()  # one reading for both plans
    without = _plan(specs, io, cache_size, reserve, box, memory, 0)
    if not resident or without.io == "mmap":
        return without
    sized = _plan(specs, without.io, cache_size, reserve, box, memory, resident)
    return Budget(sized.cache_bytes, sized.cache_reason, without.io, without.io_reason, box)


def _plan(
    specs: list[TableSpec],
    io: str,
    cache_size: int | None,
    reserve: int,
    box: Box,
    memory: MemoryRoom | None,
    resident: int,
) -> Budget:
    """``plan`` for ``resident`` bytes beside the row cache."""
    tables_bytes = sum(s.nbytes for s in specs)
    needed = table_cache_bytes(specs)
    fixed, fixed_reason = box_cache_budget(box, reserve, resident)
    if cache_size is not None:
        cache_bytes = weighed = cache_size
        cache_reason = weighed_reason = "cache_size setting"
    else:
        memory = memory or memory_room()
        at_start = int(max(0, memory.available - reserve - resident) * CACHE_SHARE)
        start_reason = (
            f"{CACHE_SHARE:.0%} of the memory available at start ({memory.describe()}) "
            f"less the {format_bytes(reserve)} reserve (prewarm_reserve){resident_words(resident)}"
        )
        if fixed is None:  # nothing known of the box: the room at start, as it is
            weighed, weighed_reason = at_start, start_reason
            cache_bytes, cache_reason = at_start, start_reason
        elif at_start < fixed:  # never reserve more than is free now
            weighed, weighed_reason = fixed, fixed_reason
            cache_bytes = at_start
            cache_reason = f"{start_reason}, below the box's {format_bytes(fixed)}"
        else:
            weighed, weighed_reason = fixed, fixed_reason
            cache_bytes, cache_reason = fixed, fixed_reason
        cache_reason = "default: " + cache_reason
        minimum = f", raised to the {format_bytes(MIN_CACHE_BYTES)} minimum"
        if weighed < MIN_CACHE_BYTES:
            weighed, weighed_reason = MIN_CACHE_BYTES, weighed_reason + minimum
        if cache_bytes < MIN_CACHE_BYTES:
            cache_bytes, cache_reason = MIN_CACHE_BYTES, cache_reason + minimum
        if cache_bytes > needed:
            cache_bytes = needed
            cache_reason += ", capped at what the tables need"
    if io != "auto":
        io_reason = "io setting"
        chosen = io
    elif tables_bytes <= weighed:
        chosen = "mmap"
        io_reason = (
            f"auto: the tables ({format_bytes(tables_bytes)}) fit in the "
            f"{format_bytes(weighed)} budget ({weighed_reason}), so the page cache serves them"
        )
    else:
        chosen = "direct"
        io_reason = (
            f"auto: the tables ({format_bytes(tables_bytes)}) exceed the "
            f"{format_bytes(weighed)} budget ({weighed_reason}), so a row cache serves "
            "them and misses are read with O_DIRECT"
        )
    return Budget(cache_bytes, cache_reason, chosen, io_reason, box)


# ------------------------------------------------------------- request path
@dataclass(frozen=True)
class RequestMemory:
    """What answering requests may hold at most beside the channels' segments
    and the row cache (bytes; the module docstring lists the parts)."""

    read_buffers: int  # the miss path's read buffers, every thread together (0: mmap)
    read_reason: str
    scratch: int  # what the threads that gather allocate besides
    state: int  # the hint queue and hinted rows, the hot set's keys
    ids_share: float  # the channels' id copies, per byte of their segments

    @property
    def fixed(self) -> int:
        """Every part but the channels' id copies."""
        return self.read_buffers + self.scratch + self.state

    def describe(self) -> str:
        return (
            f"{format_bytes(self.fixed)}: read buffers {format_bytes(self.read_buffers)} "
            f"({self.read_reason}), gather scratch {format_bytes(self.scratch)}, hints and "
            f"hot set {format_bytes(self.state)}; and the channels' id copies, "
            f"{100 * self.ids_share:.1f} % of their size"
        )


def read_buffer_budget(
    setting: int | None, beside: int | None, full: int, minimum: int
) -> tuple[int, str]:
    """The read buffers' bound and why: ``setting`` (not below ``minimum``),
    else ``READ_SHARE`` of the room ``beside`` the row cache, between
    ``minimum`` and ``full`` (what every reading thread can use at once), or
    ``full`` when the room is not known."""
    if setting is not None:
        if setting < minimum:
            return (
                minimum,
                "read_buffer_memory setting, raised to the smallest round's "
                + format_bytes(minimum),
            )
        return setting, "read_buffer_memory setting"
    if beside is None:
        return full, "default: what every reading thread can use (no memory figures)"
    share = int(beside * READ_SHARE)
    if share >= full:
        return full, "default: what every reading thread can use"
    if share <= minimum:
        return minimum, (
            f"default: the smallest round's, above {READ_SHARE:.0%} of the room beside "
            "the row cache"
        )
    return share, f"default: {READ_SHARE:.0%} of the room beside the row cache"


# ----------------------------------------------------------------- channels
def default_channel_budget(
    room: MemoryRoom, cache_pending: int = 0, request: RequestMemory | None = None
) -> int | None:
    """``CHANNEL_SHARE`` of the room, less the row cache bytes not yet
    committed (``cache_pending``: the cache fills its budget in the
    background) and the request path's bound (``request``), with the
    channels' id copies inside the share; in whole MiB; None when nothing is
    known."""
    if room.room is None:
        return None
    fixed, ids_share = (request.fixed, request.ids_share) if request else (0, 0.0)
    beside = max(0, room.room - cache_pending - fixed)
    return int(beside * CHANNEL_SHARE / (1 + ids_share)) >> 20 << 20


class ChannelBudget:
    """Bytes of channel segments in existence (or being reserved), against a limit.
    Taken on the control thread, given back by whichever thread frees a channel."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if self.limit is not None and self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give_back(self, size: int) -> None:
        with self._lock:
            self.used -= size

    def set_limit(self, limit: int | None) -> None:
        """A new limit (a reload): channels already counted stay, even above
        it; ``take`` refuses new ones until they fit."""
        with self._lock:
            self.limit = limit


def overcommitted(
    room: MemoryRoom, cache_pending: int, request: RequestMemory | None, channels: int
) -> str | None:
    """Why the budgets may get the server OOM-killed: the row cache still to
    come, the request path and ``channels`` bytes of channels with their id
    copies past the room at start; None when they fit or the room is not
    known. (The default channel budget fits by construction, unless the row
    cache or the request path alone are more than the room.)"""
    if room.room is None:
        return None
    fixed, ids_share = (request.fixed, request.ids_share) if request else (0, 0.0)
    need = cache_pending + fixed + int(channels * (1 + ids_share))
    if need <= room.room:
        return None
    return (
        f"the memory budgets do not fit the room at start ({room.describe()}): the row "
        f"cache's {format_bytes(cache_pending)} to come, the request path's "
        f"{format_bytes(fixed)} and {format_bytes(channels)} of channels with their id "
        f"copies need {format_bytes(need)}, so the server can be OOM-killed; lower "
        "max_channel_memory, cache_size or read_buffer_memory, or raise the memory "
        "limit (MemoryMax=)"
    )
