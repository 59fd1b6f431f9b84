"""This host as the process sees it at the moment: what memory it may still
use, and the C library's calls that Python's ``os`` lacks (thread names,
timer slack, hole punching, ``madvise``, ``mincore``): the server's Linux glue
is here, so the planes call it by what it does.

What memory this process may still use: the room under its cgroup's limit
and ``MemAvailable``, read at the moment asked.

- cgroup: the tightest limit of the process's memory cgroup and its ancestors
  (v2 ``memory.max``; v1 ``memory.limit_in_bytes``, which is the one in charge
  when both hierarchies are mounted), less what the cgroup uses that cannot be
  reclaimed (usage minus page cache);
- ``MemAvailable`` of ``/proc/meminfo``.

The budgets (``pleserver.data.budget``) are shares of the smaller of the two, and
of the box's own memory (``MemTotal``, ``pleserver.box``), which does not
change between starts.

``PLE_SERVER_MEMINFO`` names a file read instead of ``/proc/meminfo``: it
states a box's memory (``MemTotal``, ``MemAvailable``) to the server and to
``pleserver plan``, for tests and for trying one box's budgets on another. It
is not a setting, and has no place in a production unit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from dataclasses import dataclass

from pleserver.observe.stats import format_bytes

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2⁶³ − 1
CGROUP_ROOT = "/sys/fs/cgroup"
UNKNOWN = 1 << 62
"""What ``mem_available`` answers when /proc/meminfo cannot be read."""
MEMINFO = "/proc/meminfo"
MEMINFO_ENV = "PLE_SERVER_MEMINFO"
"""Names a file read instead of ``MEMINFO`` (tests; see the module's docstring)."""

log = logging.getLogger("pleserver.host")


@dataclass(frozen=True)
class MemoryRoom:
    """What the default budgets are derived from (bytes; None: no such limit)."""

    cgroup_limit: int | None
    cgroup_used: int | None  # not reclaimable: usage minus page cache
    mem_available: int | None

    @property
    def room(self) -> int | None:
        candidates = [self.mem_available] if self.mem_available is not None else []
        if self.cgroup_limit is not None:
            candidates.append(max(0, self.cgroup_limit - (self.cgroup_used or 0)))
        return min(candidates) if candidates else None

    @property
    def available(self) -> int:
        """``room``, or ``UNKNOWN`` (a very large number) when nothing is known."""
        room = self.room
        return UNKNOWN if room is None else room

    def describe(self) -> str:
        parts = []
        if self.cgroup_limit is not None:
            parts.append(
                f"cgroup limit {format_bytes(self.cgroup_limit)} with "
                f"{format_bytes(self.cgroup_used or 0)} in use"
            )
        if self.mem_available is not None:
            parts.append(f"MemAvailable {format_bytes(self.mem_available)}")
        return ", ".join(parts) or "no memory figures readable"


def memory_room(proc_cgroup: str = "/proc/self/cgroup") -> MemoryRoom:
    limit, used = _cgroup_memory(proc_cgroup)
    return MemoryRoom(limit, used, _read_mem_available())


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors
    (bytes; None: none)."""
    return _cgroup_memory(proc_cgroup)[0]


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
            return _walk(
                base,
                path,
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                ("total_cache", "cache"),
            )
    for _id, controllers, path in lines:
        if controllers == "" and os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            return _walk(CGROUP_ROOT, path, "memory.max", "memory.current", ("file",))
    return None, None


def _walk(
    base: str, path: str, limit_file: str, usage_file: str, cache_keys: tuple[str, ...]
) -> tuple[int | None, int | None]:
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


def meminfo_path() -> str:
    """The file the memory figures come from: ``MEMINFO``, unless
    ``PLE_SERVER_MEMINFO`` names another."""
    return os.environ.get(MEMINFO_ENV) or MEMINFO


def read_meminfo(key: str) -> int | None:
    """``key`` of /proc/meminfo (``MemTotal``, ``MemAvailable``) in bytes, or
    None when it cannot be read."""
    try:
        with open(meminfo_path()) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_mem_available() -> int | None:
    return read_meminfo("MemAvailable")


def mem_available() -> int:
    """MemAvailable in bytes (``UNKNOWN`` when it cannot be read)."""
    value = _read_mem_available()
    return UNKNOWN if value is None else value


# ------------------------------------------------------------------- libc
_PR_SET_NAME = 15
_PR_SET_TIMERSLACK = 29
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux ≥ 5.14
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
libc.fallocate.restype = ctypes.c_int
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.mincore.restype = ctypes.c_int
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.restype = ctypes.c_int


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def name_thread(name: bytes) -> None:
    """Name the calling thread for the kernel (at most 15 bytes are kept)."""
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by ``by`` (Linux: a thread's nice
    is its own; raising it needs no privilege), so that under contention the
    scheduler runs the process's other threads, and its clients, first. A
    refusal (a seccomp profile, say) is logged and left: the thread runs at the
    process's priority, as before."""
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
    except OSError as exc:
        log.debug("cannot lower thread %d's priority: %s", tid, exc)


def set_timer_slack(ns: int) -> None:
    """The calling thread's timer slack (Linux's default, 50 µs, stretches
    every short timed wait by as much). Raises OSError."""
    if libc.prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) != 0:
        raise _errno_error("prctl(PR_SET_TIMERSLACK)")


def punch_hole(fd: int, length: int) -> None:
    """Free the pages of ``[0, length)`` of a memfd, keeping its size: a
    process still mapping it then reads zeros. Raises OSError."""
    if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        raise _errno_error("fallocate(PUNCH_HOLE)")


def populate_read(address: int, length: int) -> bool:
    """Map the pages of a file mapping's ``[address, address + length)`` into
    the page tables (``MADV_POPULATE_READ``), with the GIL released (CPython's
    ``mmap.madvise`` holds it). False where the kernel refuses it (before
    5.14): the first touch faults the pages in instead."""
    return libc.madvise(ctypes.c_void_p(address), length, MADV_POPULATE_READ) == 0


def resident_pages(address: int, length: int, vec_address: int) -> None:
    """``mincore`` of ``[address, address + length)`` (page-aligned) into the
    byte vector at ``vec_address``, a byte a page. Raises OSError."""
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec_address) != 0:
        raise _errno_error("mincore")
