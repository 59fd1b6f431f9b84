"""The data plane: one loop polls every channel, gathers rows into slots.

Threads, and why:
- **one serving loop** polls all channels' submit counters (one load each), so
  many clients never mean many spinning Python threads fighting for the GIL.
  After ``spin`` seconds without work it blocks;
- **one waiter thread per channel**, parked while the loop spins; while the
  loop sleeps each waiter blocks on its channel's ``submit`` semaphore (no CPU)
  and hands the tokens it takes to the loop, then wakes it;
- **gather workers** (``workers`` threads): the loop answers inline what needs
  no disk read (rows in the row cache, or mmap mode) and hands off the rest of
  a request with a cache miss, and any request of ``parallel_min_rows`` rows or
  more; a worker gathers with the GIL released (disk reads, native threads for
  large requests) and completes the slot, so one request's reads never hold up
  other channels.

Every request: acquire one ``submit`` token (pairs with the client's post),
copy count and ids out of shared memory, validate the copies, gather, write
the result words, set DONE or ERROR, post the slot's ``done`` semaphore.

Fairness is by rows, not by requests: a deficit round robin over the channels
with work, one *turn* at a time. A turn serves at most ``chunk_rows`` rows of
one channel (a large request takes several turns, a chunk each); between two
turns the loop admits whatever was submitted meanwhile. A channel that becomes
busy goes to the front (the ``fresh`` list, as in FQ-CoDel), so a small request
waits for at most the one chunk being gathered when it arrives, however much
the other channels have queued. A hand-off costs the channel's turn
``REQUEST_COST_ROWS`` (the loop does not wait for the worker); the workers take
hand-offs in order.

A client owns its segment and may write anything into it, so the loop bounds
what one channel can cost it: per pass it takes at most ``depth`` tokens and
reads each slot once. More pending submits than the channel has slots, or
more tokens than submits, cannot come from a client that follows the protocol
(each submit needs a free slot, and is posted once): such a channel is dropped
and ``on_drop`` tells the control plane, which answers the client with an error
and closes its session.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from pleclient import protocol as p
from pleclient.channel import ChannelMap, SlotView
from pleserver.peer_semaphore import PeerSemaphore
from pleserver.stats import TableStats
from pleserver.table import Table, nat

log = logging.getLogger(__name__)

WAITER_SLICE_S = 0.25
"""A parked or blocked waiter re-checks whether it is still needed this often."""
DEFAULT_CHUNK_ROWS = 4096
"""Rows gathered in one turn: ≈ 0.2 ms of page-cache reads for 320-byte rows."""
REQUEST_COST_ROWS = 256
"""What a request costs besides its rows (validation, completion, statistics:
≈ 10 µs), in rows of gather: many small requests fill a turn too."""
U32 = 0xFFFFFFFF
READ_ERROR_LOG_S = 10.0
"""Failed reads are logged at most once per this many seconds (each request
that meets one gets its own error text, and stats count them all)."""

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


class Channel:
    """The server's side of one session's channel.

    ``fd`` (the segment's memfd, owned here once given) lets ``destroy`` free
    the pages even while the client keeps its mapping; ``on_destroy`` runs
    after that (the server returns the bytes to its channel memory budget)."""

    def __init__(self, session_id: int, peer: str, mapping: ChannelMap, fd: int | None = None,
                 on_destroy: Callable[[Channel], None] | None = None) -> None:
        self.session_id = session_id
        self.peer = peer
        self.map = mapping
        self.depth = mapping.layout.depth
        self.size = mapping.layout.size
        self.fd = fd
        self.on_destroy = on_destroy
        self.opened_ns = time.monotonic_ns()  # older submit times are not believed
        # The client can write anything into these: see pleserver.peer_semaphore.
        # (A c_void_p's value is None only for NULL, which no semaphore in a mapping is.)
        self.submit_sem = PeerSemaphore(cast(int, mapping.submit_sem.address.value))
        self.done_sems = [PeerSemaphore(cast(int, s.done.address.value)) for s in mapping.slots]
        self.seen = 0  # submits whose token we hold (the counter starts at 0)
        self.tokens = 0  # tokens taken by the waiter thread, not yet used
        self.queued: deque[Request] = deque()  # admitted, served by the loop's turns
        self.busy: set[int] = set()  # slots of the queued and handed-off requests
        self.handed = 0  # requests with a gather worker (guarded by the loop's lock)
        self.deficit = 0  # rows this channel may still be served in its turn
        self.scheduled = False  # in the loop's fresh or old list
        self.closing = False
        self.free_pages = True  # on destroy: False while the client may still read rows
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
        """Unmap, free the pages (``free_pages``), close the fd. A client still
        mapping the segment then sees zeros, and what it touches again is
        charged to it, not to us."""
        self.map.close()
        if self.fd is not None:
            if self.free_pages and _libc.fallocate(
                    self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, self.size) != 0:
                log.warning("session %d: cannot free its channel's pages: %s", self.session_id,
                            os.strerror(ctypes.get_errno()))
            os.close(self.fd)
            self.fd = None
        if self.on_destroy is not None:
            self.on_destroy(self)
            self.on_destroy = None


@dataclass(eq=False)
class Request:
    """One admitted request: validated copies of what the client wrote, and
    how far its gather got (``done_rows``)."""

    channel: Channel
    slot: SlotView
    table: Table
    stats: TableStats
    ids: np.ndarray  # private copy: the client may rewrite the slot meanwhile
    out: np.ndarray  # view of the slot's rows area
    started_ns: int
    submitted_ns: int  # the client's word, checked before it is used
    done_rows: int = 0

    @property
    def count(self) -> int:
        return self.ids.shape[0]


class HostileChannel(Exception):
    """The channel's words break what any protocol-following client can write."""


class ServingLoop:
    def __init__(self, tables: list[Table], stats: list[TableStats], spin_s: float,
                 heartbeat: Callable[[], None] | None = None,
                 heartbeat_every_s: float = 1.0, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 on_drop: Callable[[Channel, str], None] | None = None,
                 workers: int = 4) -> None:
        self.tables = tables
        self.stats = stats
        self.spin_s = spin_s
        self.heartbeat = heartbeat
        self.heartbeat_every_s = heartbeat_every_s
        self.chunk_rows = chunk_rows
        self.on_drop = on_drop
        self.channels: list[Channel] = []  # replaced, never mutated: the loop reads it lock-free
        self._change = threading.Lock()
        self._retired: list[Channel] = []
        self._fresh: deque[Channel] = deque()  # became busy: served first, one turn
        self._old: deque[Channel] = deque()  # busy for longer: round robin
        self._wakeup = threading.Event()
        self._sleeping = threading.Event()  # set while the loop blocks: waiters then wait on sems
        self._stop = threading.Event()
        self._draining = False
        self._inflight = 0  # handed-off requests not yet answered
        self._inflight_lock = threading.Lock()
        self._read_error_logged = -READ_ERROR_LOG_S
        # Started with the loop, all of them: a server's thread count does not
        # change with its load.
        self._handed: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self.workers = [threading.Thread(target=self._worker, name=f"gather-{i}", daemon=True)
                        for i in range(max(1, workers))]
        self.thread = threading.Thread(target=self._run, name="serving", daemon=True)
        self.last_tick = time.monotonic()

    # --------------------------------------------------------------- channels
    def add(self, channel: Channel) -> None:
        """Serve ``channel``. Raises RuntimeError (the channel untouched and not
        served) when its waiter thread cannot start."""
        channel.waiter = threading.Thread(target=self._waiter, args=(channel,),
                                          name=f"waiter-{channel.session_id}", daemon=True)
        channel.waiter.start()  # first: a channel without its waiter is never published
        with self._change:
            self.channels = [*self.channels, channel]
        self._wakeup.set()

    def remove(self, channel: Channel, free_pages: bool = True) -> None:
        """Stop serving ``channel``; it is destroyed once nothing uses it. Its
        pages are freed then unless ``free_pages`` is False (the server stops:
        its clients may still be reading rows of answered requests)."""
        if channel.closing:  # removed already (and perhaps unmapped): nothing to do
            return
        channel.free_pages = free_pages
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
        """Start the workers and the loop. Raises RuntimeError (what started is
        stopped again) when a thread cannot start."""
        try:
            for worker in self.workers:
                worker.start()
            self.thread.start()
        except RuntimeError:
            for worker in self.workers:
                if worker.is_alive():
                    self._handed.put(None)
            raise

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
        if self.thread.is_alive():
            self.thread.join()
        for worker in self.workers:
            if worker.is_alive():
                self._handed.put(None)
        for worker in self.workers:
            if worker.is_alive():
                worker.join()
        for ch in self.channels:
            self.remove(ch, free_pages=False)
        self._reap(force=True)

    def _pending_work(self) -> bool:
        return any(c.queued or c.map.submit_counter != c.seen
                   for c in self.channels if not c.closing)

    # ------------------------------------------------------------------- loop
    def _run(self) -> None:
        idle_since = time.monotonic()
        next_beat = 0.0
        while not self._stop.is_set():
            did = self._admit_all()
            did |= self._serve_turn()
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
            # A token a waiter took after our last pass woke us before clear():
            # that wake-up is gone, the token is not.
            if not any(c.tokens for c in self.channels if not c.closing):
                self._wakeup.wait(self.heartbeat_every_s if not self._draining else 0.002)
            self._sleeping.clear()
            idle_since = time.monotonic()

    def _admit_all(self) -> bool:
        """Admit what every channel submitted since the last pass; True if any."""
        did = False
        for ch in self.channels:
            if ch.closing or (ch.map.submit_counter == ch.seen and not ch.tokens):
                continue
            try:
                did |= self._admit(ch)
            except HostileChannel as exc:
                self._drop(ch, str(exc))
            except Exception:  # one channel never stops the loop
                log.exception("session %d (%s): serving its channel failed; "
                              "dropping the channel", ch.session_id, ch.peer)
                self._drop(ch, "internal error while serving this channel")
        return did

    def _admit(self, ch: Channel) -> bool:
        """Take the tokens of ``ch``'s new submits (at most ``depth``), then read
        each slot once: validate and queue the requests whose token we hold."""
        # Tokens first: the client moves the counter before it posts, so a token
        # taken by then is always counted in the counter read after it.
        tokens = ch.tokens
        pending = (ch.map.submit_counter - ch.seen) & U32
        if pending > ch.depth:
            raise HostileChannel(
                f"its submit counter ran {pending} submits ahead of the server, over its "
                f"{ch.depth} slots: the channel's words were overwritten")
        if tokens > pending:
            raise HostileChannel(
                f"its submit semaphore was posted more often than it submitted "
                f"({tokens} tokens for {pending} new submits)")
        took = False
        while pending and ch.take_token():
            ch.seen = (ch.seen + 1) & U32
            pending -= 1
            took = True
        if not took:
            return False
        for slot in ch.map.slots:
            words = slot.words
            if words[p.SL_STATE] != p.SlotState.SUBMITTED or slot.index in ch.busy:
                continue
            # Only slots whose submit token we hold: their ids are visible.
            if ((ch.seen - words[p.SL_SEQUENCE] - 1) & U32) >= 0x80000000:
                continue
            request = self._validate(ch, slot)
            if request is None:
                continue
            ch.busy.add(slot.index)
            ch.queued.append(request)
        if ch.queued and not ch.scheduled:
            ch.scheduled = True
            ch.deficit = 0
            self._fresh.append(ch)
        return True

    def _validate(self, ch: Channel, slot: SlotView) -> Request | None:
        """The request in ``slot`` as a ``Request``, or None once it was failed."""
        started = time.monotonic_ns()
        words = slot.words
        table_index = words[p.SL_TABLE]
        count = words[p.SL_COUNT]  # copied once: the client may rewrite the slot
        submitted_ns = slot.words64[p.SL_SUBMIT_NS // 2]
        if table_index >= len(self.tables):
            self._fail(ch, slot, p.ErrorCode.BAD_TABLE, None, "bad_table",
                       f"table index {table_index} out of range: this server has "
                       f"{len(self.tables)} tables (indexes 0..{len(self.tables) - 1})")
            return None
        table, stats = self.tables[table_index], self.stats[table_index]
        if table.problem:  # its file changed on disk: reading it could SIGBUS us
            self._fail(ch, slot, p.ErrorCode.INTERNAL, stats, "internal", table.problem)
            return None
        capacity = ch.map.layout.capacity
        if count > capacity:
            self._fail(ch, slot, p.ErrorCode.BAD_COUNT, stats, "bad_count",
                       f"row count {count} exceeds the channel capacity {capacity}")
            return None
        ids = slot.ids[:count].copy()
        if count:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.rows:
                bad = int(np.flatnonzero((ids < 0) | (ids >= table.rows))[0])
                self._fail(ch, slot, p.ErrorCode.ID_OUT_OF_RANGE, stats, "id_out_of_range",
                           f"id {int(ids[bad])} at position {bad} is out of range for "
                           f"{table.spec.name} ({table.rows} rows: valid ids 0..{table.rows - 1})")
                return None
        return Request(ch, slot, table, stats, ids, slot.rows_view(count, table.row_bytes),
                       started, submitted_ns)

    # -------------------------------------------------------------- scheduling
    def _serve_turn(self) -> bool:
        """One channel's turn: at most ``chunk_rows`` rows of its queued
        requests (deficit round robin, fresh channels first). False if none
        had work."""
        while self._fresh or self._old:
            fresh = bool(self._fresh)
            ch = self._fresh.popleft() if fresh else self._old.popleft()
            if ch.closing or not ch.queued:
                ch.scheduled = False
                continue
            ch.deficit += self.chunk_rows
            while ch.queued and ch.deficit > 0 and not ch.closing:
                request = ch.queued[0]
                cost = REQUEST_COST_ROWS if request.done_rows == 0 else 0
                if request.count >= request.table.parallel_min_rows:
                    ch.deficit -= cost
                    ch.queued.popleft()
                    self._hand_off(request)
                    continue
                rows = min(request.count - request.done_rows, max(ch.deficit - cost, 1))
                ch.deficit -= rows + cost
                if self._gather_inline(request, rows):
                    ch.queued.popleft()
            if ch.queued and not ch.closing:
                self._old.append(ch)  # its deficit carries over: fair by rows
            else:
                ch.scheduled = False
                ch.deficit = 0
            return True
        return False

    def _gather_inline(self, r: Request, rows: int) -> bool:
        """Gather the next ``rows`` rows of ``r`` if no disk read is needed, and
        complete ``r`` when that was the last of them; else hand the rest of
        ``r`` off to a worker. True once ``r`` left the queue; never raises."""
        a, b = r.done_rows, r.done_rows + rows
        try:
            answered = r.table.gather_inline(r.ids[a:b], r.out[a:b])
        except Exception as exc:
            self._gather_failed(r, exc)
            return True
        if not answered:  # a cache miss: the reads are a worker's
            self._hand_off(r)
            return True
        r.done_rows = b
        if b < r.count:
            return False
        self._complete(r)
        return True

    def _hand_off(self, r: Request) -> None:
        """Give the rest of ``r`` (from ``done_rows``) to a gather worker."""
        with self._inflight_lock:
            self._inflight += 1
            r.channel.handed += 1
        self._handed.put(r)

    def _worker(self) -> None:
        while True:
            r = self._handed.get()
            if r is None:
                return
            try:
                if not r.channel.closing:
                    self._answer(r)
            finally:
                # (busy was cleared before the post, in _complete/_fail: clearing
                # it here could clear the mark of a request resubmitted there)
                with self._inflight_lock:
                    self._inflight -= 1
                    r.channel.handed -= 1
                if r.channel.closing:
                    self._wakeup.set()  # the loop may now unmap the channel
            # The request's views of its channel die here, not when the next
            # request comes: a held view would keep a closed channel mapped.
            del r

    def _answer(self, r: Request) -> None:
        """Gather the rest of ``r`` (may block on disk reads, GIL released) and
        complete it, or fail it: never raises."""
        a = r.done_rows
        try:
            r.table.gather(r.ids[a:], r.out[a:])
        except Exception as exc:
            self._gather_failed(r, exc)
            return
        r.done_rows = r.count
        self._complete(r)

    def _gather_failed(self, r: Request, exc: Exception) -> None:
        ch = r.channel
        if isinstance(exc, nat.ReadError):  # the disk or the file: the server is fine
            now = time.monotonic()
            if now - self._read_error_logged >= READ_ERROR_LOG_S:  # not one line a request
                self._read_error_logged = now
                log.error("session %d (%s): a read failed: %s", ch.session_id, ch.peer, exc)
            self._fail(ch, r.slot, p.ErrorCode.INTERNAL, r.stats, "read_error",
                       f"reading rows failed: {exc}")
            return
        log.exception("gather failed for session %d", ch.session_id)
        self._fail(ch, r.slot, p.ErrorCode.INTERNAL, r.stats, "internal",
                   f"internal error while gathering: {exc}")

    def _complete(self, r: Request) -> None:
        done = time.monotonic_ns()
        ch, slot = r.channel, r.slot
        words = slot.words
        words[p.SL_ERROR] = p.ErrorCode.OK
        slot.words64[p.SL_SERVER_NS // 2] = done - r.started_ns
        words[p.SL_STATE] = p.SlotState.DONE
        ch.busy.discard(slot.index)  # before the post: the client may reuse the slot at once
        ch.done_sems[slot.index].post()
        # A submit time from before the channel opened, or after the request was
        # admitted, is not a time this client could have had: not recorded.
        believable = ch.opened_ns <= r.submitted_ns <= r.started_ns
        r.stats.record(r.count, r.table.row_bytes, (done - r.started_ns) * 1e-9,
                       (r.started_ns - r.submitted_ns) * 1e-9 if believable else -1)

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

    def _drop(self, ch: Channel, reason: str) -> None:
        """Stop serving a channel that broke the protocol; tell the control plane."""
        self.remove(ch)
        if self.on_drop is not None:
            self.on_drop(ch, reason)
        else:
            log.warning("session %d (%s): channel dropped: %s", ch.session_id, ch.peer, reason)

    # ----------------------------------------------------------------- waiters
    def _waiter(self, ch: Channel) -> None:
        while not ch.closing and not self._stop.is_set():
            if not self._sleeping.wait(WAITER_SLICE_S):
                continue
            if ch.tokens > ch.depth:  # proof enough of a flood: the loop drops it
                self._wakeup.set()
                time.sleep(WAITER_SLICE_S)
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
            if force and waiter_alive and ch.waiter is not None:
                ch.waiter.join(timeout=2 * WAITER_SLICE_S + 1)
                waiter_alive = ch.waiter.is_alive()
            if waiter_alive or (ch.handed and not force):
                keep.append(ch)  # never block the loop: try again next pass
                continue
            ch.queued.clear()
            ch.destroy()  # (with force, the workers have stopped: no gather writes)
        if keep:
            with self._change:
                self._retired.extend(keep)
