"""Mapped tables in the page cache (mmap mode): prewarm, and residency.

Prewarm reads the tables into the page cache once, in a thread, within a
byte budget, because on unified-memory machines (DGX Spark, GX10) the page
cache competes with the GPU's memory; it also stops when MemAvailable falls
under a reserve. After each block, ``MADV_POPULATE_READ`` maps the pages into
the server's page tables, so the first lookup of a row does not pay a minor
fault either. (In direct and buffered modes the row cache is refilled from the
saved hot set instead: ``pleserver.data.hotset``.)

Residency (``resident_bytes``) is ``mincore`` over a table's shard ranges in
its mappings: what ``pleserver stats`` and the metrics show as resident.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from pleserver.data.tables import MappedFile, MappedTable, Table
from pleserver.host import mem_available, populate_read, resident_pages
from pleserver.observe.snapshot import PrewarmSnapshot
from pleserver.observe.stats import format_bytes, format_progress

log = logging.getLogger("pleserver.prewarm")

PREWARM_BLOCK = 8 << 20


class Prewarm:
    """Reads tables into the page cache once, within a byte budget, in a thread
    (see the module docstring); stops early below ``reserve_bytes`` of
    MemAvailable."""

    def __init__(
        self, tables: list[MappedTable], budget_bytes: int | None, reserve_bytes: int
    ) -> None:
        self.tables = tables
        self.total = sum(t.spec.nbytes for t in tables)
        self.target = self.total if budget_bytes is None else min(self.total, budget_bytes)
        self.reserve_bytes = reserve_bytes
        self.done_bytes = 0
        self.state = "pending"  # pending → running → done | budget | memory | stopped | failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_progress: Callable[[Prewarm], None] | None = None  # e.g. systemd STATUS=

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prewarm", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.target if self.target else 1.0

    def snapshot(self) -> PrewarmSnapshot:
        return {
            "state": self.state,
            "done_bytes": self.done_bytes,
            "target_bytes": self.target,
            "total_bytes": self.total,
            "fraction": round(self.fraction, 4),
        }

    def _run(self) -> None:
        self.state = "running"
        started = time.monotonic()
        last_report = 0.0
        buf = bytearray(PREWARM_BLOCK)
        log.info(
            "prewarm: reading %s of %s into the page cache",
            format_bytes(self.target),
            format_bytes(self.total),
        )
        try:
            for table in self.tables:
                complete = True
                for mapped, offset, length in table.shard_ranges():
                    assert isinstance(mapped, MappedFile)  # prewarm is for io = mmap
                    pos, end = offset, offset + length
                    while pos < end:
                        if self._stop.is_set():
                            self.state = "stopped"
                            return
                        if self.done_bytes >= self.target:
                            self.state = "budget"
                            return
                        if mem_available() < self.reserve_bytes:
                            log.warning(
                                "prewarm: stopping, MemAvailable below the %.1f GiB reserve",
                                self.reserve_bytes / 2**30,
                            )
                            self.state = "memory"
                            return
                        n = min(PREWARM_BLOCK, end - pos, self.target - self.done_bytes)
                        try:
                            got = os.preadv(mapped.fd, [memoryview(buf)[:n]], pos)
                        except OSError as exc:
                            raise OSError(
                                exc.errno,
                                f"reading {n} bytes at offset {pos} of {mapped.path}: "
                                f"{exc.strerror}",
                            ) from None
                        if got <= 0:
                            raise OSError(f"{mapped.path}: short read at {pos}")
                        _populate(mapped, pos, got)
                        pos += got
                        self.done_bytes += got
                        now = time.monotonic()
                        if now - last_report >= 2.0:
                            last_report = now
                            log.info(
                                "prewarm: %s",
                                format_progress(self.done_bytes, self.target, self.fraction),
                            )
                            if self.on_progress:
                                self.on_progress(self)
                    complete = complete and pos >= end
                table.fully_resident = complete
            self.state = "done"
        except OSError as exc:  # a disk error: said where, no traceback needed
            self.state = "failed"
            log.error("prewarm failed: %s; serving continues from disk", exc)
        except Exception:
            self.state = "failed"
            log.exception("prewarm failed; serving continues from disk")
        finally:
            if self.on_progress:
                self.on_progress(self)
            log.info(
                "prewarm %s: %s in %.1f s",
                self.state,
                format_bytes(self.done_bytes),
                time.monotonic() - started,
            )


def _populate(mapped: MappedFile, offset: int, length: int) -> None:
    """Map the pages of ``[offset, offset + length)`` into the server's page
    tables. Through ctypes, which releases the GIL for the call: CPython's
    ``mmap.madvise`` holds it, and mapping an 8 MiB block takes long enough to
    stall the serving loop for every request that arrives meanwhile (the
    prewarm runs after readiness, while clients are already served)."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    populate_read(mapped.address + start, offset + length - start)


def resident_bytes(table: Table) -> int | None:
    """Bytes of ``table`` in the page cache (mincore over its shard ranges);
    None when its files are not mapped (direct, buffered)."""
    if not isinstance(table, MappedTable):
        return None
    page = mmap.PAGESIZE
    total = 0
    for f, offset, length in table.shard_ranges():
        start = offset - offset % page
        npages = -(-(offset + length - start) // page)
        vec = np.zeros(npages, dtype=np.uint8)
        try:
            resident_pages(f.address + start, npages * page, vec.ctypes.data)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} on {f.path}") from None
        total += int(np.count_nonzero(vec & 1)) * page
    return min(total, table.spec.nbytes)
