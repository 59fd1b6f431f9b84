"""The daemon's memory budgets: the row cache, and the channel segments.

ple-server starts before the model (the vLLM unit comes ``After=`` it), so the
memory free at start is not free for long: the model's weights and its KV
cache arrive next, and on unified-memory machines (DGX Spark, GX10) the GPU
allocates from the same RAM. So each default takes a share of the room at
start (``pleserver.memory``: ``MemAvailable``, or the room under the cgroup's
limit when that is smaller), not all of it.

- **Row cache** (``plan``): ``CACHE_SHARE`` of the room less the
  ``prewarm_reserve``, fixed at start and reserved up front. The tables are
  served from the page cache (``mmap``) only when they fit in that budget: a
  page cache that grows without limit starves the GPU allocator, a row cache
  of fixed size does not.
- **Channel segments** (``ChannelBudget``): a channel's pages are reserved
  when it opens (``posix_fallocate`` on its memfd) and charged to the server's
  memory cgroup, but they never show in its RSS. Under a memory limit
  (systemd's ``MemoryMax=``, a container's limit) one channel too many would
  get the daemon OOM-killed with nothing logged; the budget refuses that
  channel instead (``NO_RESOURCES``). Its default is ``CHANNEL_SHARE`` of the
  room once the row cache has taken its budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pleclient.checkpoint import TableSpec
from pleserver.memory import MemoryRoom, memory_room
from pleserver.stats import format_bytes

CACHE_SHARE = 0.25
"""Share of the room (less the reserve) the default row cache takes."""
MIN_CACHE_BYTES = 64 << 20
"""A default cache never smaller than this (a machine short of memory still
serves its hottest rows from the cache rather than none)."""
CHANNEL_SHARE = 0.75
"""Share of the room left beside the row cache that channels may take."""


# ---------------------------------------------------------------- row cache
@dataclass(frozen=True)
class Budget:
    """The row cache's size, the io mode, and why (both are logged and in stats)."""

    cache_bytes: int
    cache_reason: str
    io: str  # "direct" | "buffered" | "mmap"
    io_reason: str


def table_cache_bytes(specs: list[TableSpec]) -> int:
    """Bytes a cache needs to hold every row of ``specs`` (slots are as wide as
    the widest row)."""
    slot = max((s.row_bytes for s in specs), default=0)
    return sum(s.rows for s in specs) * slot


def plan(
    specs: list[TableSpec],
    io: str,
    cache_size: int | None,
    reserve: int,
    memory: MemoryRoom | None = None,
) -> Budget:
    """The cache size (``cache_size``, else the default described above) and the
    io mode (``io``, or for ``auto`` mmap when the tables fit in that size)."""
    tables_bytes = sum(s.nbytes for s in specs)
    needed = table_cache_bytes(specs)
    if cache_size is not None:
        cache_bytes = cache_size
        cache_reason = "cache_size setting"
    else:
        memory = memory or memory_room()
        share = int(max(0, memory.available - reserve) * CACHE_SHARE)
        cache_bytes = max(MIN_CACHE_BYTES, share)
        cache_reason = (
            f"default: {CACHE_SHARE:.0%} of the memory available at start "
            f"({memory.describe()}) less the {format_bytes(reserve)} reserve "
            "(prewarm_reserve)"
        )
        if cache_bytes > needed:
            cache_bytes = needed
            cache_reason += ", capped at what the tables need"
    if io != "auto":
        io_reason = "io setting"
        chosen = io
    elif tables_bytes <= cache_bytes:
        chosen = "mmap"
        io_reason = (
            f"auto: the tables ({format_bytes(tables_bytes)}) fit in the "
            f"{format_bytes(cache_bytes)} budget, so the page cache serves them"
        )
    else:
        chosen = "direct"
        io_reason = (
            f"auto: the tables ({format_bytes(tables_bytes)}) exceed the "
            f"{format_bytes(cache_bytes)} budget, so a row cache of that size "
            "serves them and misses are read with O_DIRECT"
        )
    return Budget(cache_bytes, cache_reason, chosen, io_reason)


# ----------------------------------------------------------------- channels
def default_channel_budget(room: MemoryRoom, cache_pending: int = 0) -> int | None:
    """``CHANNEL_SHARE`` of the room, less the row cache bytes not yet
    committed (``cache_pending``: the cache fills its budget in the
    background), in whole MiB; None when nothing is known."""
    if room.room is None:
        return None
    return int(max(0, room.room - cache_pending) * CHANNEL_SHARE) >> 20 << 20


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
