"""The data plane's parts, opened for one io mode: files, row cache, miss
engine and tables, and the numbers they report.

Modes (``io``; ``pleserver.data.budget`` picks one for ``auto`` and says why):

- ``direct``: one ``RowCache`` (the budget, anonymous memory reserved up front)
  and one ``ReadEngine`` (io_uring, else a pool of pread threads) shared by all
  tables; misses are read with ``O_DIRECT``, so the page cache does not grow
  from our reads and the daemon's memory stays within its budget. A file
  system that refuses ``O_DIRECT`` (EINVAL at open) makes it ``buffered``,
  said once in the log and in stats;
- ``buffered``: the same, with misses read through the page cache;
- ``mmap``: the files mapped; for tables that fit in memory (``prewarm``).

``limit_request_memory`` bounds what answering requests may hold beside the
channels and the row cache (``pleserver.data.budget.RequestMemory``), once, before
the first request: the read buffers' bound is set in the native module, the
other parts are bounded by construction and counted here.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import cast

from pleclient.checkpoint import TableSpec
from pleserver.box import this_box
from pleserver.config import ServerConfig
from pleserver.data import hints
from pleserver.data.budget import Budget, RequestMemory, plan, read_buffer_budget
from pleserver.data.tables import (
    CachedTable,
    CheckpointFile,
    MappedFile,
    MappedTable,
    Table,
    nat,
    scale_bytes,
)
from pleserver.host import MemoryRoom
from pleserver.observe.snapshot import CacheSnapshot, DataplaneSnapshot

log = logging.getLogger("pleserver.dataplane")

FILL_THREADS = 2
"""Threads that gather besides the gather workers and the native pool's: the
hint reader and the hot-set refill (the serving loop, in mmap mode)."""
HOTSET_KEY_COPIES = 2
"""The hot set's keys at once, 8 bytes a cached row each: the refill's, read
from the file, and a save's, taken from the cache."""


@dataclass(frozen=True)
class PlaneOptions:
    """The settings the data plane uses (``ServerConfig`` keys of the same names,
    whose defaults are the only ones: build it with ``from_config``)."""

    io: str
    cache_size: int | None
    prewarm_reserve: int
    gpu_memory: str
    cache_hugepages: bool
    cache_mlock: bool
    resident_scales: bool
    queue_depth: int
    read_engine: str
    read_threads: int
    gather_workers: int
    parallel_min_rows: int
    dedup_min_rows: int

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> PlaneOptions:
        return cls(**{name: getattr(cfg, name) for name in cls.__dataclass_fields__})


class DataPlane:
    """Opened by ``open``; ``close`` releases everything (tables first)."""

    def __init__(
        self,
        tables: list[Table],
        files: dict[str, CheckpointFile],
        mode: str,
        mode_reason: str,
        budget: Budget,
        cache: nat.RowCache | None,
        engine: nat.ReadEngine | None,
        queue_depth: int,
        gather_workers: int,
    ) -> None:
        self.tables = tables
        self.files = files
        self.mode = mode
        self.mode_reason = mode_reason
        self.budget = budget
        self.cache = cache
        self.engine = engine
        self.queue_depth = queue_depth if engine is not None else 0
        self.gather_workers = max(1, gather_workers)
        self.request: RequestMemory | None = None  # once limit_request_memory ran

    @classmethod
    def open(cls, specs: list[TableSpec], o: PlaneOptions) -> DataPlane:
        resident = scale_bytes(specs) if o.resident_scales else 0
        budget = plan(
            specs, o.io, o.cache_size, o.prewarm_reserve, this_box(o.gpu_memory), resident=resident
        )
        mode, reason = budget.io, budget.io_reason
        paths = list(dict.fromkeys(p for s in specs for p in s.files))
        files: dict[str, CheckpointFile] = {}
        cache = engine = None
        try:
            if mode == "direct":
                refused = _open_files(paths, CheckpointFile, files, direct=True)
                if refused:
                    mode = "buffered"
                    reason += (
                        f"; O_DIRECT refused by the file system of {refused} "
                        "(EINVAL), so misses are read through the page cache"
                    )
                    log.warning(
                        "io = direct: the file system of %s refuses O_DIRECT "
                        "(EINVAL); reading misses through the page cache instead "
                        "(io = buffered)",
                        refused,
                    )
            if mode == "buffered" and not files:
                _open_files(paths, CheckpointFile, files, direct=False)
            tables: list[Table]
            if mode == "mmap":
                _open_files(paths, MappedFile, files, direct=False)
                tables = [
                    MappedTable(
                        spec,
                        key,
                        files,
                        threads=o.gather_workers,
                        parallel_min_rows=o.parallel_min_rows,
                        dedup_min_rows=o.dedup_min_rows,
                    )
                    for key, spec in enumerate(specs)
                ]
            else:
                slot_bytes = max(s.row_bytes for s in specs)
                cache = nat.RowCache(
                    budget.cache_bytes, slot_bytes, hugepages=o.cache_hugepages, mlock=o.cache_mlock
                )
                engine = nat.ReadEngine(
                    queue_depth=o.queue_depth, kind=o.read_engine, threads=o.read_threads
                )
                tables = [
                    CachedTable(
                        spec,
                        key,
                        files,
                        mode=mode,
                        cache=cache,
                        engine=engine,
                        threads=o.gather_workers,
                        parallel_min_rows=o.parallel_min_rows,
                        resident_scales=o.resident_scales,
                    )
                    for key, spec in enumerate(specs)
                ]
        except BaseException:
            for f in files.values():
                f.close()
            if cache is not None:
                cache.close()
            if engine is not None:
                engine.close()
            raise
        plane = cls(
            tables, files, mode, reason, budget, cache, engine, o.queue_depth, o.gather_workers
        )
        plane.log_choice()
        return plane

    def log_choice(self) -> None:
        box = self.budget.box
        if box is not None:
            (log.warning if box.guessed else log.info)("box: %s", box.describe())
        log.info("io = %s (%s)", self.mode, self.mode_reason)
        if self.cache is None or self.engine is None:  # both, or neither
            return
        c = self.cache.stats()
        log.info(
            "row cache: %.1f MiB, %d rows (%s); huge pages %s, mlock %s, eviction %s",
            self.budget.cache_bytes / 2**20,
            self.cache.capacity_rows,
            self.budget.cache_reason,
            "yes" if c.get("hugepages") else "no",
            "yes" if c.get("mlocked") else "no",
            c.get("policy", "?"),
        )
        if self.engine.fallback_reason:
            log.warning(
                "miss engine: %s, queue depth %d (io_uring not used: %s)",
                self.engine.kind,
                self.queue_depth,
                self.engine.fallback_reason,
            )
        else:
            log.info("miss engine: %s, queue depth %d", self.engine.kind, self.queue_depth)

    def limit_request_memory(
        self,
        room: MemoryRoom,
        cache_pending: int,
        read_buffer_memory: int | None,
        hint_queue_rows: int,
    ) -> RequestMemory:
        """Bound what answering requests may hold (``RequestMemory``), set the
        read buffers' bound in the native module, and return the figures.
        ``cache_pending``: row cache bytes not in memory yet (they come).

        The threads that gather at once: the gather workers and the express
        worker (small requests), the native pool's (which grows to one fewer
        than the workers, at least one: split requests and their second
        round) and ``FILL_THREADS``. Each holds one
        read buffer at a time and its scratch, gathering a piece at a time; in
        mmap mode the workers and the serving loop also deduplicate a piece at
        a time."""
        workers = self.gather_workers
        threads = workers + 1 + max(workers - 1, 1) + FILL_THREADS
        scratch = threads * max(t.scratch_bytes for t in self.tables)
        scratch += (workers + 1) * max(t.dedup_scratch_bytes for t in self.tables)
        widest = max(t.row_bytes for t in self.tables)
        cache_rows = self.cache.capacity_rows if self.cache is not None else 0
        state = hints.memory_bytes(hint_queue_rows, cache_rows)
        state += HOTSET_KEY_COPIES * 8 * cache_rows
        if self.engine is None:
            read, why = 0, "none in mmap mode"
        else:
            scratch += FILL_THREADS * max(t.fill_scratch_bytes for t in self.tables)
            room_beside = None if room.room is None else max(0, room.room - cache_pending)
            read, why = read_buffer_budget(
                read_buffer_memory,
                room_beside,
                threads * nat.READ_ROUND_BYTES,
                nat.READ_MEMORY_MIN,
            )
            nat.set_read_memory(read)
        self.request = RequestMemory(read, why, scratch, state, 8 / (8 + widest))
        return self.request

    def snapshot(self) -> DataplaneSnapshot:
        """The data plane's part of ``Server.snapshot()``."""
        out: DataplaneSnapshot = {
            "io": self.mode,
            "io_reason": self.mode_reason,
            "cache": None,
            "engine": None,
        }
        if self.budget.box is not None:
            out["box"] = self.budget.box.to_json()
        if self.cache is not None and self.engine is not None:
            c = self.cache.stats()  # (native: the keys of CacheSnapshot but the budget's)
            out["cache"] = cast(
                CacheSnapshot,
                {
                    **c,
                    "budget_bytes": self.budget.cache_bytes,
                    "budget_reason": self.budget.cache_reason,
                    "occupancy": (
                        c["used_rows"] / c["capacity_rows"] if c.get("capacity_rows") else 0.0
                    ),
                },
            )
            flight = self.engine.in_flight()
            out["engine"] = {
                "kind": self.engine.kind,
                "fallback_reason": self.engine.fallback_reason,
                "queue_depth": self.queue_depth,
                "small_reserve": flight["small_reserve"],
                "in_flight": flight["in_flight"],
                "peak_in_flight": flight["peak_in_flight"],
            }
            # (limit_bytes 0: no bound was set, as before limit_request_memory)
            out["read_buffers"] = nat.read_memory()
        if self.request is not None:
            r = self.request
            out["request_memory"] = {
                "fixed_bytes": r.fixed,
                "read_buffers_bytes": r.read_buffers,
                "read_buffers_reason": r.read_reason,
                "scratch_bytes": r.scratch,
                "state_bytes": r.state,
                "ids_share": r.ids_share,
            }
        return out

    def close(self) -> None:
        if self.request is not None and self.engine is not None:
            nat.set_read_memory(0)  # (process-wide: the next plane sets its own)
        for table in self.tables:
            table.source.close()  # before the files: mmap-mode sources read the mappings
        self.tables = []
        for f in self.files.values():
            f.close()
        self.files = {}
        if self.engine is not None:
            self.engine.close()
        if self.cache is not None:
            self.cache.close()


def _open_files(
    paths: list[str], kind: type[CheckpointFile], files: dict[str, CheckpointFile], direct: bool
) -> str | None:
    """Open every path into ``files``. With ``direct``, a file system that refuses
    O_DIRECT closes what was opened and returns the refused path."""
    for path in paths:
        try:
            files[path] = kind.open(path, direct=direct)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                for f in files.values():
                    f.close()
                files.clear()
                return path
            raise
    return None
