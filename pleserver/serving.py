"""The data plane: one loop polls every channel, gathers rows into slots.

Threads, and why:
- **one serving loop** polls all channels' submit counters (one load each), so
  many clients never mean many spinning Python threads fighting for the GIL.
  After ``spin`` seconds without work it blocks;
- **one waiter thread per channel**, parked while the loop spins; while the
  loop sleeps each waiter blocks on its channel's ``submit`` semaphore (no CPU)
  and hands every token it takes to the loop, then wakes it;
- **gather workers** (``workers`` threads): the loop answers inline what needs
  no disk read (every row in the row cache, or mmap mode) and hands off a
  request with cache misses, or of ``parallel_min_rows`` rows or more; the
  worker gathers with the GIL released (disk reads, native threads for large
  requests) and completes the slot, so one request's reads never hold up other
  channels.

Every request: acquire one ``submit`` token (pairs with the client's post),
copy count and ids out of shared memory, validate the copies, gather, write
the result words, set DONE or ERROR, post the slot's ``done`` semaphore.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
import queue

import numpy as np

from pleclient import protocol as p
from pleclient.channel import ChannelMap, SlotView
from pleserver.peer_semaphore import PeerSemaphore
from pleserver.stats import TableStats
from pleserver.table import Table, nat

log = logging.getLogger(__name__)

WAITER_SLICE_S = 0.25
"""A parked or blocked waiter re-checks whether it is still needed this often."""
READ_ERROR_LOG_S = 10.0
"""Failed reads are logged at most once per this many seconds (each request
that meets one gets its own error text, and stats count them all)."""


class Channel:
    """The server's side of one session's channel."""

    def __init__(self, session_id: int, peer: str, mapping: ChannelMap) -> None:
        self.session_id = session_id
        self.peer = peer
        self.map = mapping
        # The client can write anything into these: see pleserver.peer_semaphore.
        self.submit_sem = PeerSemaphore(mapping.submit_sem.address.value)
        self.done_sems = [PeerSemaphore(s.done.address.value) for s in mapping.slots]
        self.seen = 0  # submits whose token we hold (the counter starts at 0)
        self.tokens = 0  # tokens taken by the waiter thread, not yet used
        self.busy: set[int] = set()  # slots handed to gather workers
        self.closing = False
        self.lock = threading.Lock()
        self.waiter: threading.Thread | None = None
        self.waiter_done = False  # the waiter no longer touches the segment

    def take_token(self) -> bool:
        with self.lock:
            if self.tokens:
                self.tokens -= 1
                return True
        return self.submit_sem.try_acquire()

    def destroy(self) -> None:
        """Unmap; the segment is freed once the client has unmapped it too."""
        self.map.close()


class ServingLoop:
    def __init__(self, tables: list[Table], stats: list[TableStats], spin_s: float,
                 heartbeat: Callable[[], None] | None = None,
                 heartbeat_every_s: float = 1.0, workers: int = 4) -> None:
        self.tables = tables
        self.stats = stats
        self.spin_s = spin_s
        self.heartbeat = heartbeat
        self.heartbeat_every_s = heartbeat_every_s
        self.channels: list[Channel] = []  # replaced, never mutated: the loop reads it lock-free
        self._change = threading.Lock()
        self._retired: list[Channel] = []
        self._wakeup = threading.Event()
        self._sleeping = threading.Event()  # set while the loop blocks: waiters then wait on sems
        self._stop = threading.Event()
        self._draining = False
        self._inflight = 0  # handed-off requests not yet completed
        self._inflight_lock = threading.Lock()
        self._read_error_logged = -READ_ERROR_LOG_S
        # Started with the loop, all of them: a server's thread count does not
        # change with its load.
        self._handed: queue.SimpleQueue = queue.SimpleQueue()
        self.workers = [threading.Thread(target=self._worker, name=f"gather-{i}", daemon=True)
                        for i in range(max(1, workers))]
        self.thread = threading.Thread(target=self._run, name="serving", daemon=True)
        self.last_tick = time.monotonic()

    # --------------------------------------------------------------- channels
    def add(self, channel: Channel) -> None:
        channel.waiter = threading.Thread(target=self._waiter, args=(channel,),
                                          name=f"waiter-{channel.session_id}", daemon=True)
        with self._change:
            self.channels = [*self.channels, channel]
        channel.waiter.start()
        self._wakeup.set()

    def remove(self, channel: Channel) -> None:
        """Stop serving ``channel``; it is destroyed once nothing uses it."""
        if channel.closing:  # removed already (and perhaps unmapped): nothing to do
            return
        channel.closing = True
        channel.submit_sem.wake()  # its waiter, if it sleeps there
        with self._change:
            self.channels = [c for c in self.channels if c is not channel]
            self._retired.append(channel)
        self._wakeup.set()

    @property
    def channel_count(self) -> int:
        return len(self.channels)

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        self.thread.start()

    def stop(self, drain_s: float = 5.0) -> None:
        """Serve what was already submitted (up to ``drain_s``), then stop."""
        self._draining = True
        deadline = time.monotonic() + drain_s
        self._wakeup.set()
        while time.monotonic() < deadline and (self._inflight or self._pending_work()):
            time.sleep(0.005)
        self._stop.set()
        self._sleeping.set()
        self._wakeup.set()
        self.thread.join()
        for _ in self.workers:
            self._handed.put(None)
        for worker in self.workers:
            worker.join()
        for ch in self.channels:
            self.remove(ch)
        self._reap(force=True)

    def _pending_work(self) -> bool:
        return any(c.map.submit_counter != c.seen for c in self.channels)

    # ------------------------------------------------------------------- loop
    def _run(self) -> None:
        idle_since = time.monotonic()
        next_beat = 0.0
        while not self._stop.is_set():
            did = False
            for ch in self.channels:
                if ch.map.submit_counter != ch.seen and not ch.closing:
                    try:
                        did |= self._serve_channel(ch)
                    except Exception:  # one channel never stops the loop
                        log.exception("session %d (%s): serving its channel failed; "
                                      "dropping the channel", ch.session_id, ch.peer)
                        self.remove(ch)
            now = time.monotonic()
            if self._retired:
                self._reap()
            if now >= next_beat:
                self.last_tick = now
                next_beat = now + self.heartbeat_every_s
                if self.heartbeat:
                    self.heartbeat()
                for table in self.tables:  # a checkpoint file changed under us?
                    table.check_files()
            if did:
                idle_since = now
                continue
            if now - idle_since < self.spin_s and not self._draining:
                if self._inflight:
                    time.sleep(0)  # let gather workers take the GIL
                continue
            # Idle: block. Waiters now watch the semaphores and wake us. (A
            # counter that moved without a post — a broken client — must not
            # keep the loop from sleeping: the post, when it comes, wakes us.)
            self._wakeup.clear()
            self._sleeping.set()
            self._wakeup.wait(self.heartbeat_every_s if not self._draining else 0.002)
            self._sleeping.clear()
            idle_since = time.monotonic()

    def _serve_channel(self, ch: Channel) -> bool:
        did = False
        while ch.map.submit_counter != ch.seen and ch.take_token():
            ch.seen = (ch.seen + 1) & 0xFFFFFFFF
            did = True
        if not did:
            return False
        for slot in ch.map.slots:
            words = slot.words
            if words[p.SL_STATE] != p.SlotState.SUBMITTED or slot.index in ch.busy:
                continue
            # Only slots whose submit token we hold: their ids are visible.
            if ((ch.seen - words[p.SL_SEQUENCE] - 1) & 0xFFFFFFFF) >= 0x80000000:
                continue
            self._serve_slot(ch, slot)
        return True

    def _serve_slot(self, ch: Channel, slot: SlotView) -> None:
        started = time.monotonic_ns()
        words = slot.words
        table_index = words[p.SL_TABLE]
        count = words[p.SL_COUNT]  # copied once: the client may rewrite the slot
        submitted_ns = slot.words64[p.SL_SUBMIT_NS // 2]
        if table_index >= len(self.tables):
            self._fail(ch, slot, p.ErrorCode.BAD_TABLE, None, "bad_table",
                       f"table index {table_index} out of range: this server has "
                       f"{len(self.tables)} tables (indexes 0..{len(self.tables) - 1})")
            return
        table, stats = self.tables[table_index], self.stats[table_index]
        if table.problem:  # its file changed on disk: reading it could SIGBUS us
            self._fail(ch, slot, p.ErrorCode.INTERNAL, stats, "internal", table.problem)
            return
        capacity = ch.map.layout.capacity
        if count > capacity:
            self._fail(ch, slot, p.ErrorCode.BAD_COUNT, stats, "bad_count",
                       f"row count {count} exceeds the channel capacity {capacity}")
            return
        ids = slot.ids[:count].copy()
        if count:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.rows:
                bad = int(np.flatnonzero((ids < 0) | (ids >= table.rows))[0])
                self._fail(ch, slot, p.ErrorCode.ID_OUT_OF_RANGE, stats, "id_out_of_range",
                           f"id {int(ids[bad])} at position {bad} is out of range for "
                           f"{table.spec.name} ({table.rows} rows: valid ids 0..{table.rows - 1})")
                return
        out = slot.rows_view(count, table.row_bytes)
        if count < table.parallel_min_rows:
            try:
                answered = table.gather_inline(ids, out)
            except Exception as exc:
                self._gather_failed(ch, slot, stats, exc)
                return
            if answered:
                self._complete(ch, slot, table, stats, count, started, submitted_ns)
                return
        self._hand_off(ch, slot, table, stats, ids, out, count, started, submitted_ns)

    def _answer(self, ch, slot, table, stats, ids, out, count, started, submitted_ns) -> None:
        """Gather into the slot and complete it, or fail it: never raises."""
        try:
            table.gather(ids, out)
        except Exception as exc:
            self._gather_failed(ch, slot, stats, exc)
            return
        self._complete(ch, slot, table, stats, count, started, submitted_ns)

    def _gather_failed(self, ch, slot, stats, exc: Exception) -> None:
        if isinstance(exc, nat.ReadError):  # the disk or the file: the server is fine
            now = time.monotonic()
            if now - self._read_error_logged >= READ_ERROR_LOG_S:  # not one line a request
                self._read_error_logged = now
                log.error("session %d (%s): a read failed: %s", ch.session_id, ch.peer, exc)
            self._fail(ch, slot, p.ErrorCode.INTERNAL, stats, "read_error",
                       f"reading rows failed: {exc}")
            return
        log.exception("gather failed for session %d", ch.session_id)
        self._fail(ch, slot, p.ErrorCode.INTERNAL, stats, "internal",
                   f"internal error while gathering: {exc}")

    def _hand_off(self, ch, slot, table, stats, ids, out, count, started, submitted_ns) -> None:
        ch.busy.add(slot.index)
        with self._inflight_lock:
            self._inflight += 1

        def run() -> None:
            try:
                self._answer(ch, slot, table, stats, ids, out, count, started, submitted_ns)
            finally:
                # (busy was cleared before the post, in _complete/_fail: clearing it
                # here could clear the mark of a request already resubmitted there)
                with self._inflight_lock:
                    self._inflight -= 1
                if ch.closing:
                    self._wakeup.set()

        self._handed.put(run)

    def _worker(self) -> None:
        while True:
            work = self._handed.get()
            if work is None:
                return
            work()
            # The request's views of its channel die here, not when the next
            # request comes: a held view would keep a closed channel mapped.
            del work

    def _complete(self, ch, slot, table, stats, count, started, submitted_ns) -> None:
        done = time.monotonic_ns()
        words = slot.words
        words[p.SL_ERROR] = p.ErrorCode.OK
        slot.words64[p.SL_SERVER_NS // 2] = done - started
        words[p.SL_STATE] = p.SlotState.DONE
        ch.busy.discard(slot.index)  # before the post: the client may reuse the slot at once
        ch.done_sems[slot.index].post()
        stats.record(count, table.row_bytes, (done - started) * 1e-9,
                     (started - submitted_ns) * 1e-9 if submitted_ns <= started else -1)

    def _fail(self, ch, slot, code, stats, kind, text) -> None:
        slot.set_error_text(text)
        words = slot.words
        words[p.SL_ERROR] = code
        words[p.SL_STATE] = p.SlotState.ERROR
        ch.busy.discard(slot.index)  # (as in _complete)
        ch.done_sems[slot.index].post()
        if stats is not None:
            stats.record_error(kind)
        log.debug("session %d (%s): request rejected: %s", ch.session_id, ch.peer, text)

    # ----------------------------------------------------------------- waiters
    def _waiter(self, ch: Channel) -> None:
        while not ch.closing and not self._stop.is_set():
            if not self._sleeping.wait(WAITER_SLICE_S):
                continue
            if not ch.submit_sem.acquire(WAITER_SLICE_S) or ch.closing:
                continue
            with ch.lock:
                ch.tokens += 1
            self._wakeup.set()
        ch.waiter_done = True
        self._wakeup.set()  # the loop may be asleep: it unmaps the channel now, not a beat later

    def _reap(self, force: bool = False) -> None:
        with self._change:
            retired, self._retired = self._retired, []
        keep = []
        for ch in retired:
            waiter_alive = ch.waiter is not None and ch.waiter.is_alive() \
                and not ch.waiter_done
            if force and waiter_alive:
                ch.waiter.join(timeout=2 * WAITER_SLICE_S + 1)
                waiter_alive = ch.waiter.is_alive()
            if waiter_alive or (ch.busy and not force):
                keep.append(ch)  # never block the loop: try again next pass
                continue
            ch.destroy()  # (a gather still writing holds a view: the unmap waits for it)
        if keep:
            with self._change:
                self._retired.extend(keep)
