"""The memory budget: how big the row cache is, and which io mode serves.

ple-server starts before the model (the vLLM unit comes ``After=`` it), so the
memory free at start is not free for long: the model's weights and its KV
cache arrive next, and on unified-memory machines (DGX Spark, GX10) the GPU
allocates from the same RAM. So the default row cache takes a share of what is
available, not all of it, and the tables are served from the page cache
(``mmap``) only when they fit in that budget: a page cache that grows without
limit starves the GPU allocator, a row cache of fixed size does not.

Available memory is ``MemAvailable`` (/proc/meminfo), or the room left under
this process's cgroup limit (``memory.max`` less ``memory.current``, cgroup v2;
``memory.limit_in_bytes`` less ``memory.usage_in_bytes``, v1) when that is
smaller: a unit's ``MemoryMax=`` or a container's limit binds first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pleclient.checkpoint import TableSpec
from pleserver.stats import format_bytes

log = logging.getLogger(__name__)

CACHE_SHARE = 0.25
"""Share of the available memory (less the reserve) the default cache takes."""
MIN_CACHE_BYTES = 64 << 20
"""A default cache never smaller than this (a machine short of memory still
serves its hottest rows from the cache rather than none)."""


@dataclass(frozen=True)
class MemoryView:
    """What this process may still use, and where the number came from."""

    available: int
    source: str  # e.g. "MemAvailable 20.1 GiB" or "cgroup limit 8.0 GiB, 2.1 GiB used"


@dataclass(frozen=True)
class Budget:
    """The row cache's size, the io mode, and why (both are logged and in stats)."""

    cache_bytes: int
    cache_reason: str
    io: str  # "direct" | "buffered" | "mmap"
    io_reason: str


def memory_view() -> MemoryView:
    mem_available = _meminfo("MemAvailable")
    view = MemoryView(mem_available, f"MemAvailable {format_bytes(mem_available)}")
    room = _cgroup_room()
    if room is not None and room[0] < view.available:
        limit, used = room[1], room[2]
        view = MemoryView(room[0], f"cgroup limit {format_bytes(limit)}, "
                                   f"{format_bytes(used)} used")
    return view


def table_cache_bytes(specs: list[TableSpec]) -> int:
    """Bytes a cache needs to hold every row of ``specs`` (slots are as wide as
    the widest row)."""
    slot = max((s.row_bytes for s in specs), default=0)
    return sum(s.rows for s in specs) * slot


def plan(specs: list[TableSpec], io: str, cache_size: int | None, reserve: int,
         memory: MemoryView | None = None) -> Budget:
    """The cache size (``cache_size``, else the default described above) and the
    io mode (``io``, or for ``auto`` mmap when the tables fit in that size)."""
    tables_bytes = sum(s.nbytes for s in specs)
    needed = table_cache_bytes(specs)
    if cache_size is not None:
        cache_bytes = cache_size
        cache_reason = "cache_size setting"
    else:
        memory = memory or memory_view()
        share = int(max(0, memory.available - reserve) * CACHE_SHARE)
        cache_bytes = max(MIN_CACHE_BYTES, share)
        cache_reason = (f"default: {CACHE_SHARE:.0%} of the memory available at start "
                        f"({memory.source}) less the {format_bytes(reserve)} reserve "
                        "(prewarm_reserve)")
        if cache_bytes > needed:
            cache_bytes = needed
            cache_reason += ", capped at what the tables need"
    if io != "auto":
        io_reason = "io setting"
        chosen = io
    elif tables_bytes <= cache_bytes:
        chosen = "mmap"
        io_reason = (f"auto: the tables ({format_bytes(tables_bytes)}) fit in the "
                     f"{format_bytes(cache_bytes)} budget, so the page cache serves them")
    else:
        chosen = "direct"
        io_reason = (f"auto: the tables ({format_bytes(tables_bytes)}) exceed the "
                     f"{format_bytes(cache_bytes)} budget, so a row cache of that size "
                     "serves them and misses are read with O_DIRECT")
    return Budget(cache_bytes, cache_reason, chosen, io_reason)


def mem_available() -> int:
    """MemAvailable in bytes (a very large number when it cannot be read)."""
    return _meminfo("MemAvailable")


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _cgroup_room() -> tuple[int, int, int] | None:
    """(room, limit, used) under this process's cgroup memory limit, or None
    when there is no limit (or no cgroup file to read)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            base = f"/sys/fs/cgroup{path.rstrip('/')}"
            limit = _read_int(f"{base}/memory.max")
            used = _read_int(f"{base}/memory.current")
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path.rstrip('/')}"
            limit = _read_int(f"{base}/memory.limit_in_bytes")
            used = _read_int(f"{base}/memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < (1 << 60):  # v1 writes "no limit" as ~2^63
            used = used or 0
            return max(0, limit - used), limit, used
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit
