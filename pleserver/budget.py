"""The channel memory budget: how many bytes of channel segments may exist at once.

A channel's pages are reserved when it opens (``posix_fallocate`` on its memfd)
and are charged to the server's memory cgroup, but they never show in its RSS.
Under a memory limit (systemd's ``MemoryMax=``, a container's limit) one channel
too many would get the daemon OOM-killed, with nothing logged; the budget
refuses that channel instead (``NO_RESOURCES``).

The default (``max_channel_memory`` unset) is ``DEFAULT_SHARE`` of the smaller
of two figures read at start:

- the room left under the memory limit of the server's cgroup (v2
  ``memory.max``, v1 ``memory.limit_in_bytes``; the tightest of it and its
  ancestors), less what the cgroup already uses that cannot be reclaimed
  (usage minus page cache);
- ``MemAvailable`` of ``/proc/meminfo``.

The rest is left for the server's own growth and for page cache (the tables).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_SHARE = 0.75
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2⁶³ − 1
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class MemoryRoom:
    """What the default budget is derived from (bytes; None: no such limit)."""

    cgroup_limit: int | None
    cgroup_used: int | None  # not reclaimable: usage minus page cache
    mem_available: int | None

    @property
    def room(self) -> int | None:
        candidates = [self.mem_available] if self.mem_available is not None else []
        if self.cgroup_limit is not None:
            candidates.append(max(0, self.cgroup_limit - (self.cgroup_used or 0)))
        return min(candidates) if candidates else None

    def describe(self) -> str:
        parts = []
        if self.cgroup_limit is not None:
            parts.append(f"cgroup limit {self.cgroup_limit / 2**20:.0f} MiB with "
                         f"{(self.cgroup_used or 0) / 2**20:.0f} MiB in use")
        if self.mem_available is not None:
            parts.append(f"MemAvailable {self.mem_available / 2**20:.0f} MiB")
        return ", ".join(parts) or "no memory figures readable"


def memory_room(proc_cgroup: str = "/proc/self/cgroup") -> MemoryRoom:
    limit, used = _cgroup_memory(proc_cgroup)
    return MemoryRoom(limit, used, _mem_available())


def default_budget(room: MemoryRoom) -> int | None:
    """``DEFAULT_SHARE`` of the room, whole MiB; None when nothing is known."""
    if room.room is None:
        return None
    return int(room.room * DEFAULT_SHARE) >> 20 << 20


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


# ------------------------------------------------------------------ reading
def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _stat_value(path: str, keys: tuple[str, ...]) -> int | None:
    try:
        with open(path) as f:
            stats = dict(line.split() for line in f if len(line.split()) == 2)
    except OSError:
        return None
    for key in keys:
        if key in stats:
            return int(stats[key])
    return None


def _cgroup_memory(proc_cgroup: str) -> tuple[int | None, int | None]:
    """(tightest limit over the cgroup and its ancestors, unreclaimable usage)."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None, None
    for _id, controllers, path in lines:  # v1 memory controller first: it is the one in charge
        if "memory" in controllers.split(","):
            base = os.path.join(CGROUP_ROOT, "memory")
            return _walk(base, path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                         ("total_cache", "cache"))
    for _id, controllers, path in lines:
        if controllers == "" and os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            return _walk(CGROUP_ROOT, path, "memory.max", "memory.current", ("file",))
    return None, None


def _walk(base: str, path: str, limit_file: str, usage_file: str,
          cache_keys: tuple[str, ...]) -> tuple[int | None, int | None]:
    leaf = os.path.join(base, path.lstrip("/"))
    limit = None
    here = leaf
    while True:
        value = _read_int(os.path.join(here, limit_file))
        if value is not None:
            limit = value if limit is None else min(limit, value)
        if os.path.normpath(here) == os.path.normpath(base):
            break
        here = os.path.dirname(here)
    if limit is None:
        return None, None
    usage = _read_int(os.path.join(leaf, usage_file)) or 0
    cache = _stat_value(os.path.join(leaf, "memory.stat"), cache_keys) or 0
    return limit, max(0, usage - cache)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
