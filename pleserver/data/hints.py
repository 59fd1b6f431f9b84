"""Prefetch hints: the server's bounded queue of hinted row ids, and the
thread that reads them into the row cache below every demand read.

A hint (``pleclient.protocol``, "Prefetch hints") arrives in a channel's slot.
The serving loop copies its ids out of shared memory, validates the copy,
answers the slot at once and ``offer``s the copy here: from then on nothing
of the hint is in memory a client can touch, and the rows it brings are read
by the server from its own files into its own buffers (``Table.fill``, the
path the hot-set refill takes), never from a slot.

``offer`` runs on the serving loop and never blocks it: it queues the ids or
drops them, counting the rows dropped by reason (``drop_early`` drops a hint
that could not be queued before its ids are even copied):

- ``no_cache``: the table has no row cache (``io = mmap``): nothing to fill;
- ``disk_busy``: every gather worker holds a demand request: the disk is
  saturated by lookups, and a hint read now would only queue behind them
  (by the time it could be read, it would be late);
- ``queue_full``: the queue holds ``hint_queue_rows`` rows already;
- ``cache_full``: the rows queued would be more than ``HINT_CACHE_SHARE`` of
  the row cache: read, they would evict each other, and the lookups' working
  set, before their use;

and the loop counts ``refused`` (a bad count or id, a table that stopped being
served; a bad table index is counted server-wide, ``bad_table``) and the
reader ``read_error``.

The queue is one ring of row keys (``table << 40 | row``, 8 bytes a row)
allocated at start for ``hint_queue_rows`` rows: a hint is copied into it
whole or dropped, so the queue's memory is that ring, whatever the hints'
sizes (a queue of one array per hint cost ≈ 184 bytes a row for hints of one
id: 11.5 MiB at the default bound, not 0.5). A reload may lower the bound; a
higher one needs a restart (``pleserver.control.reload``), as the ring was sized,
and counted in the server's memory budget, at start (``memory_bytes``).

The reader (one thread) takes at most ``HINT_SCAN_ROWS`` rows of one table
at a time and looks them up in the cache at once: rows already cached are
counted (``hints_cached``) and not read again, in one native call however
many (a flood of hints of cached rows costs no Python per row batch). It
reads the others ``HINT_BATCH_ROWS`` at a time, and only while no demand
request is with a gather worker, so a lookup's reads wait in the miss engine
behind at most one batch of hint reads, and a lookup never waits for the
hint queue.

Hits on hinted rows, the hits hints brought: the reader remembers the rows
its hints put in the cache (not those cached already) in a direct-mapped
table of row keys (``HintedRows``: one int64 a slot, as many slots as hints
may fill the cache, at most ``HINTED_SLOTS_MAX``, allocated at the first hint
read; a newer hinted row takes an older one's slot). A demand lookup, before
its gather, takes the hinted rows it asks for and counts in ``hints_hits``
those still in the cache (a hinted row evicted before it was asked for is a
miss, not a hit), within ``HINT_HIT_WINDOW_S`` of the table's last hint read.
The check is a few vectorized operations and a look at the cache per lookup,
and none for a table with no hinted row waiting (the table counts its rows
per table) or last hinted longer ago than that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from pleserver.data.tables import KEY_ROW_BITS, Table, nat
from pleserver.host import lower_priority, name_thread
from pleserver.observe.snapshot import HintCountsSnapshot, HintsSnapshot, TableHintsSnapshot

log = logging.getLogger("pleserver.hints")

HINT_BATCH_ROWS = 32
"""Rows the reader reads at a time: what a lookup arriving meanwhile may find
ahead of its own reads in the miss engine (a small part of its queue depth)."""
HINT_SCAN_ROWS = 4096
"""Rows the reader takes from the queue at a time and looks up in the cache
at once: those cached are counted and dropped there, the rest read in
``HINT_BATCH_ROWS`` batches."""
HINT_GATHER_S = 0.002
"""How long the reader lets hints gather when fewer than ``HINT_SCAN_ROWS``
rows wait: what a hint's read may wait more, against a reader that takes the
GIL for every tiny hint of a flood."""
HINT_CACHE_SHARE = 0.5
"""The part of the row cache the rows queued by hints may fill at most."""
DEMAND_POLL_S = 0.0002
"""While lookups are with the gather workers, the reader looks again this often."""
READER_NICE = 10
"""The reader thread's nice above the server's: below every lookup for the
CPU too. Probing a flood of cached hinted rows kept it busy (3.8 M rows a
second), and on two cores a lookup's client, woken behind it and the flooder,
waited for a time slice: a bystander's p99 2.8 ms beside a flood of cached
hints, 0.2 ms beside a process as busy that sends nothing."""
DROP_REASONS = ("no_cache", "disk_busy", "queue_full", "cache_full", "refused", "read_error")
HINT_HIT_WINDOW_S = 60.0
"""A hinted row looked up this long after its table's last hint read counts
as no hint's hit: a hint announces rows for the next seconds (a prompt's
prefill), and a table hinted once is not checked for hits for the rest of the
process (each answered lookup of it would pay the check)."""
HINTED_SLOTS_MAX = 1 << 20
"""Hinted rows remembered for ``hints_hits``, at most (8 MiB)."""
DEMAND_PIECE_ROWS = 4096
"""A lookup's ids are checked against the hinted rows this many at a time, so
the check's temporaries (≈ 40 bytes an id) do not grow with the lookup."""
_ROW_MASK = (1 << KEY_ROW_BITS) - 1
_TABLE_STRIDE = 0x9E3779B1  # spreads tables over the slots (row r of each apart)


def hinted_slots(cache_rows: int) -> int:
    """Slots of the hinted rows' table for hints that may fill ``cache_rows``
    rows of the row cache: a power of two, 2¹⁰ to ``HINTED_SLOTS_MAX``."""
    return min(1 << max(10, (cache_rows - 1).bit_length()), HINTED_SLOTS_MAX)


def memory_bytes(queue_rows: int, cache_rows: int) -> int:
    """What the hints hold at most (``HintReader`` over a row cache of
    ``cache_rows`` rows): the queue's ring and the hinted rows' table, 8 bytes
    a row or slot. Nothing without a row cache (hints are dropped)."""
    if cache_rows == 0:
        return 0
    return 8 * (queue_rows + hinted_slots(int(cache_rows * HINT_CACHE_SHARE)))


class HintedRows:
    """Hinted rows not yet looked up, by row key, in ``size`` (a power of two)
    direct-mapped slots: ``remember`` writes a table's rows in, ``take`` returns
    and clears the ones a lookup asked for, ``forget`` clears a table's.
    ``live[key]``: how many of table ``key``'s rows the slots hold now (0: a
    lookup of it has nothing to check). Thread-safe."""

    def __init__(self, size: int, tables: int) -> None:
        self.slots = np.full(size, -1, dtype=np.int64)
        self.mask = size - 1
        self.live = np.zeros(tables, dtype=np.int64)
        self.lock = threading.Lock()

    def _where(self, key: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keys = rows | (key << KEY_ROW_BITS)
        return keys, (rows + key * _TABLE_STRIDE) & self.mask

    def remember(self, key: int, rows: np.ndarray) -> None:
        keys, at = self._where(key, rows)
        places = np.unique(at)  # two rows of one call may share a slot: the last stays
        with self.lock:
            old = self.slots[places]
            old = old[old >= 0]
            np.subtract.at(self.live, old >> KEY_ROW_BITS, 1)  # taken over: not theirs now
            self.slots[at] = keys
            self.live[key] += places.size

    def take(self, key: int, rows: np.ndarray) -> np.ndarray:
        """The distinct hinted rows of ``rows`` that were remembered (now forgotten)."""
        keys, at = self._where(key, rows)
        with self.lock:
            hit = self.slots[at] == keys
            if not hit.any():
                return rows[:0]
            found = np.unique(at[hit])
            taken = self.slots[found] & _ROW_MASK
            self.slots[found] = -1
            self.live[key] -= found.size
        return taken

    def forget(self, key: int) -> None:
        """Clear table ``key``'s rows (one pass over the slots)."""
        with self.lock:
            if self.live[key]:
                mine = (self.slots >= 0) & ((self.slots >> KEY_ROW_BITS) == key)
                self.slots[mine] = -1
                self.live[key] = 0


class TableHints:
    """One table's hint counters (rows), and the rows hinted not yet asked for."""

    def __init__(self) -> None:
        self.received = 0
        self.cached = 0
        self.read = 0
        self.hits = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.tracked_until = 0.0  # (monotonic) its hinted rows count as hits until then
        self.lock = threading.Lock()

    def drop(self, reason: str, n: int) -> None:
        """``n`` rows the reader took and did not read, for ``reason``."""
        with self.lock:
            self.dropped[reason] += n

    def snapshot(self) -> HintCountsSnapshot:
        with self.lock:
            return {
                "hints_received": self.received,
                "hints_cached": self.cached,
                "hints_read": self.read,
                "hints_hits": self.hits,
                "hints_dropped": sum(self.dropped.values()),
                "hints_dropped_by": dict(self.dropped),
            }


def no_table_hints() -> TableHintsSnapshot:
    """A table's hint counters where no reader runs (no serving loop yet)."""
    return {**TableHints().snapshot(), "hints_tracked_rows": 0}


class HintReader:
    """The hint queue of every table, and its reader thread (module docstring).

    ``demand_in_flight``: demand requests now with a gather worker;
    ``busy_at``: how many of them make the disk saturated (the workers)."""

    def __init__(
        self,
        tables: list[Table],
        queue_rows: int,
        cache_rows: int,
        demand_in_flight: Callable[[], int],
        busy_at: int,
    ) -> None:
        self.tables = tables
        self.queue_rows = queue_rows
        self.cache_rows = int(cache_rows * HINT_CACHE_SHARE)
        self.counts = [TableHints() for _ in tables]
        self.bad_table = 0  # hints naming no table (no table's counters can hold them)
        self._demand = demand_in_flight
        self._busy_at = max(1, busy_at)
        # The queue: rows [_head, _head + _queued) of the ring, modulo its size
        # (row keys); its pages are touched only as hints fill it.
        self._ring = np.empty(queue_rows if self.cache_rows else 0, dtype=np.int64)
        self._head = 0
        self._queued = 0
        self._cond = threading.Condition()
        self._stop = False
        self._hinted: HintedRows | None = None  # at the first hint read
        self.thread = threading.Thread(target=self._run, name="hints", daemon=True)

    # ---------------------------------------------------- the serving loop's
    def _no_room(self, n: int) -> str | None:
        """Why ``n`` more hinted rows cannot be queued now, or None."""
        if self.cache_rows == 0:
            return "no_cache"
        if self._demand() >= self._busy_at:
            return "disk_busy"
        if self._queued + n > min(self.queue_rows, self._ring.size):
            return "queue_full"
        if self._queued + n > self.cache_rows:
            return "cache_full"
        return None

    def drop_early(self, key: int, n: int) -> bool:
        """Before its ids are copied: drop a hint of ``n`` rows of table
        ``key`` that could not be queued anyway, counted (True). A flood of
        hints then costs the serving loop a few loads each, not a copy (the
        look is lock-free; ``offer`` looks again under the lock)."""
        reason = self._no_room(n) if n else None
        if reason is None:
            return False
        counts = self.counts[key]
        with counts.lock:
            counts.received += n
            counts.dropped[reason] += n
        return True

    def offer(self, key: int, ids: np.ndarray) -> None:
        """Queue ``ids`` (a private, validated copy) of table ``key``, or drop
        them, counted; never blocks."""
        n = int(ids.shape[0])
        if n == 0:
            return
        counts = self.counts[key]
        with self._cond:
            reason = self._no_room(n)
            if reason is None:
                was = self._queued
                self._push(key, ids)
                # The reader sleeps on an empty queue, or lets a few rows
                # gather: woken when the first come and when a lot is full.
                if was == 0 or (was < HINT_SCAN_ROWS <= self._queued):
                    self._cond.notify()
        with counts.lock:
            counts.received += n
            if reason is not None:
                counts.dropped[reason] += n

    def refused(self, key: int | None, n: int) -> None:
        """A hint the loop refused (bad count, ids or table: ``key`` None)."""
        if key is None:
            with self._cond:
                self.bad_table += n
            return
        counts = self.counts[key]
        with counts.lock:
            counts.received += n
            counts.dropped["refused"] += n

    def _push(self, key: int, ids: np.ndarray) -> None:
        """Under the lock: append the keys of ``ids`` (validated rows of table
        ``key``, room checked) to the ring, in at most two slices."""
        size, n = self._ring.size, ids.shape[0]
        tail = (self._head + self._queued) % size
        first = min(n, size - tail)
        high = np.int64(key << KEY_ROW_BITS)
        np.bitwise_or(ids[:first], high, out=self._ring[tail : tail + first])
        if first < n:
            np.bitwise_or(ids[first:], high, out=self._ring[: n - first])
        self._queued += n

    def demand(self, key: int, ids: np.ndarray) -> None:
        """A lookup of ``ids`` is about to be gathered: count its hinted rows
        that are in the cache now (once each: the hits the hints brought; a
        hinted row evicted before this lookup is a miss, not the hint's hit)."""
        counts = self.counts[key]
        hinted = self._hinted
        # Not hinted lately, or every hinted row already asked for: no cost.
        if hinted is None or not hinted.live[key] or time.monotonic() > counts.tracked_until:
            return
        found = 0
        for at in range(0, ids.shape[0], DEMAND_PIECE_ROWS):  # (a row counted once: taken)
            taken = hinted.take(key, ids[at : at + DEMAND_PIECE_ROWS])
            if taken.size:
                found += int(np.count_nonzero(self.tables[key].cached_mask(taken)))
        if found:
            with counts.lock:
                counts.hits += found

    def table_snapshot(self, key: int) -> TableHintsSnapshot:
        """Table ``key``'s hint counters, and ``hints_tracked_rows``: its
        hinted rows still waiting for a lookup within the window (0: its
        lookups check nothing)."""
        hinted = self._hinted
        tracked = (
            int(hinted.live[key])
            if hinted is not None and time.monotonic() <= self.counts[key].tracked_until
            else 0
        )
        return {**self.counts[key].snapshot(), "hints_tracked_rows": tracked}

    # ------------------------------------------------------------ the reader
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop the reader; what is queued is forgotten (hints are advice)."""
        with self._cond:
            self._stop = True
            self._head = self._queued = 0
            self._cond.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def set_queue_rows(self, rows: int) -> None:
        """A new bound on the queue (a reload). Taken under the queue's lock,
        as ``offer`` reads it; ``drop_early``'s lock-free look may use the old
        bound once more, which only decides whether a hint is copied before
        ``offer`` looks again. Rows queued past a lower bound stay queued; a
        bound above the ring's size (the bound at start) queues no more than
        the ring holds (a reload refuses one: it needs a restart)."""
        with self._cond:
            self.queue_rows = rows

    @property
    def queued_rows(self) -> int:
        return self._queued

    def snapshot(self, held_requests: int = 0) -> HintsSnapshot:
        """The server-wide part of the stats (per table: ``counts[key].snapshot``);
        ``held_requests``: hints the serving loop holds in their slots (past
        its ``hint_rate``)."""
        with self._cond:
            return {
                "queued_rows": self._queued,
                "queue_rows": self.queue_rows,
                "cache_rows": self.cache_rows,
                "bad_table": self.bad_table,
                "held_requests": held_requests,
            }

    def _take(self) -> tuple[int, np.ndarray] | None:
        """The next rows (at most ``HINT_SCAN_ROWS`` rows of one table, in the
        order queued), once there are some; None when stopping."""
        with self._cond:
            while not self._queued and not self._stop:
                self._cond.wait()
            if self._queued < HINT_SCAN_ROWS and not self._stop:
                # A lot of a few rows costs the reader's Python as much as one
                # of thousands, on the GIL the serving loop needs: let a flood
                # of tiny hints gather for a moment (``offer`` wakes it once
                # a lot is full).
                self._cond.wait(HINT_GATHER_S)
            if self._stop:
                return None
            head = self._head
            keys = self._ring[head : head + min(HINT_SCAN_ROWS, self._queued)]
            tables = keys >> KEY_ROW_BITS
            key = int(tables[0])
            other = np.flatnonzero(tables != key)
            taken = int(other[0]) if other.size else keys.size
            rows = keys[:taken] & _ROW_MASK  # (a copy: the ring's slots are reused)
            self._head = (head + taken) % self._ring.size
            self._queued -= taken
            return key, rows

    def _run(self) -> None:
        name_thread(b"ple-hints")  # beside ple-serving and ple-gather-N in top -H
        lower_priority(READER_NICE)
        while (taken := self._take()) is not None:
            key, rows = taken
            fresh = self._not_cached(key, rows)
            for at in range(0, fresh.size, HINT_BATCH_ROWS):
                # Below every demand read: not one hint read while a lookup's are due.
                while self._demand() and not self._stop:
                    time.sleep(DEMAND_POLL_S)
                if self._stop:
                    return
                self._read(key, fresh[at : at + HINT_BATCH_ROWS])

    def _not_cached(self, key: int, rows: np.ndarray) -> np.ndarray:
        """The distinct rows of ``rows`` to read, those not in the cache; the
        others counted (``hints_cached``; ``refused`` for a table whose file
        changed). One look at the cache for the lot, so a flood of hints of
        cached rows costs no batch of Python each 32 rows."""
        counts = self.counts[key]
        if self.tables[key].problem:  # its file changed on disk: not read again
            counts.drop("refused", rows.size)
            return rows[:0]
        try:
            # The cache first, then the sort of what it lacks: a lot of cached
            # rows (a flood of them) costs the probes alone, not a sort of
            # 4 096 ids on the GIL (≈ 0.2 ms) for nothing to read.
            fresh = np.unique(rows[~self.tables[key].cached_mask(rows)])
        except Exception:  # a hint never stops the reader
            log.exception("looking hinted rows up in the cache failed")
            counts.drop("read_error", rows.size)
            return rows[:0]
        with counts.lock:  # (a row hinted twice in the lot: once read, then cached)
            counts.cached += rows.size - fresh.size
        return fresh

    def _read(self, key: int, fresh: np.ndarray) -> None:
        """Read ``fresh`` (distinct rows, not cached when looked at) into the
        cache, and remember them for ``hints_hits``."""
        counts = self.counts[key]
        if self.tables[key].problem:  # (again: its file may change while a lot is read)
            counts.drop("refused", fresh.size)
            return
        try:
            inserted = self.tables[key].fill(fresh)
        except nat.ReadError as exc:
            log.debug("a hint's read failed (the lookups of its rows will read them): %s", exc)
            counts.drop("read_error", fresh.size)
            return
        except Exception:  # a hint never stops the reader
            log.exception("reading a hint failed")
            counts.drop("read_error", fresh.size)
            return
        if self._hinted is None:
            self._hinted = HintedRows(hinted_slots(self.cache_rows), len(self.tables))
        now = time.monotonic()
        if now > counts.tracked_until:  # its earlier hints' window ended: not theirs
            self._hinted.forget(key)
        self._hinted.remember(key, fresh)
        with counts.lock:
            counts.read += inserted
            counts.cached += fresh.size - inserted  # (a lookup read it meanwhile)
            counts.tracked_until = now + HINT_HIT_WINDOW_S
