"""The data plane: one loop polls every channel, gathers rows into slots.

Threads, and why:
- **one serving loop** asks every channel's admission (``pleserver.data.admission``:
  a submit counter, or a GPU-driven channel's rung word and doorbells) whether
  a request may be waiting, one load each, so many clients never mean many
  spinning Python threads fighting for the GIL. After ``spin`` seconds
  without work (a spin only after a CPU thread's requests: ``_spinning``)
  it sleeps on all of them at once: one ``futex_waitv`` call over
  every admission's futex word and the loop's own wake word (Linux ≥ 5.16),
  and no longer than the next look that a channel whose client cannot wake it
  (a GPU) needs. Where the kernel lacks that call, or ``idle_wait = poll``
  says so, it polls every ``POLL_S`` instead;
- **gather workers** (``workers`` threads): the loop answers inline what needs
  no disk read (rows in the row cache, or mmap mode) and hands off the rest of
  a request with a cache miss, and any request of ``parallel_min_rows`` rows or
  more; the workers take hand-offs in pieces of ``chunk_rows`` rows, from the
  channels in turn (``pleserver.data.handoffs``), gather with the GIL released
  (disk reads) and complete the slot after its last piece, so one request's
  reads never hold up other channels, nor one channel's queue of large cold
  requests another channel's hand-off.
- **one hint reader** (``pleserver.data.hints``): prefetch hints, admitted by the
  loop like lookups (their ids copied and validated, their slots answered at
  once), are read into the row cache by it, only while no request is with a
  gather worker: below every demand read.

Every request: admitted by its channel's admission (which reads the words
that say it was submitted with acquire), its count and ids copied out of
shared memory, the copies validated, gathered, and answered through the
admission's ``complete`` or ``fail`` (a release of the word its client waits
on; see ``pleclient.protocol``). The loop never asks which kind of client a
channel has.

Fairness is by rows, not by requests: a deficit round robin over the channels
with work, one *turn* at a time. A turn serves at most ``chunk_rows`` rows of
one channel (a large request takes several turns, a chunk each); between two
turns the loop admits what was submitted meanwhile, at most
``ADMIT_PASS_ARRIVALS`` requests shared out among the channels with work (a
channel with more keeps them for the next pass). Hints are below lookups
there too: a hint is held in its slot when admitted, and the loop validates
and answers at most ``hint_rate`` of them a second, a channel's held hints in
turn with the others' (``_offer_hints``). A flood of tiny hints, each
resubmitted as soon as it is answered, then waits in its slots instead of
keeping the loop (and the flooder) busy. A channel that becomes
busy goes to the front (the ``fresh`` list, as in FQ-CoDel), so a small request
waits for at most the one chunk being gathered when it arrives, however much
the other channels have queued. A hand-off costs the channel's turn
``REQUEST_COST_ROWS`` (the loop does not wait for the worker); the workers take
hand-offs the same way, a piece at a time from the channels in turn.

A client owns its segment and may write anything into it, so the loop bounds
what one channel can cost it: per pass its admission reads each word once,
its sleep always has a deadline, and it makes at most one wake-up call per
answered request. An admission that finds words no protocol-following client
could write (more pending submits than slots) raises ``HostileChannel``: the
channel is dropped and ``on_drop`` tells the control plane, which answers the
client with an error and closes its session. A client that scribbles on the
words it shares with the server (its ``server sleeping`` word, its slots'
``waiters``, its rung word) can only delay its own answers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pleclient import _sync
from pleclient import protocol as p
from pleclient.channel import ChannelMap, SlotView
from pleserver.config import IDLE_WAITS, ServerConfig
from pleserver.data.admission import Admission, Arrival, HostileChannel
from pleserver.data.handoffs import HandOffs, Piece
from pleserver.data.hints import HintReader
from pleserver.data.tables import Table, nat
from pleserver.host import name_thread, punch_hole, set_timer_slack
from pleserver.observe.stats import TableStats
from pleserver.observe.trace import LookupTrace

log = logging.getLogger("pleserver.serving")

POLL_S = 0.0005
"""Without ``futex_waitv``, an idle loop looks at the submit counters this
often (what a request arriving after an idle gap may wait, at most)."""
POLL_ACTIVE_S = 0.1
POLL_IDLE_S = 0.001
"""After ``POLL_ACTIVE_S`` without a request, such a channel is looked at
every millisecond: an idle server does not keep a core awake, and neither
does a rare ring (a GPU that decodes keeps ringing faster than that, so it
keeps the fast poll)."""
TIMER_SLACK_NS = 1000
"""The serving thread's timer slack (Linux's default is 50 µs, which would
stretch every short poll of a GPU-driven channel to ≈ 100 µs)."""
SERVING_THREAD_NAME = b"ple-serving"
"""The serving loop's thread name in the kernel (``top -H``, ``/proc/PID/task/TID/comm``);
the gather workers are ``ple-gather-N``, the hint reader ``ple-hints``."""
REQUEST_COST_ROWS = 256
"""What a request costs besides its rows (validation, completion, statistics:
≈ 10 µs), in rows of gather: many small requests fill a turn too."""
ADMIT_PASS_ARRIVALS = 64
"""Requests (lookups and hints) one admission pass takes at most, shared out
among the channels with work, each at least one: the pass between two turns
stays ≈ 0.6 ms of validation however many slots a flood of tiny requests
keeps full, and every channel with work is admitted in every pass."""
HINT_KIND = int(p.RequestKind.HINT)
"""A plain int: every arrival's kind is compared with it (an enum member is slower)."""
HINT_BURST = 64
"""Hints the loop may offer at once after a quiet spell (the ``hint_rate``
bucket's size): one admission pass's worth."""
HINT_ROWS_PER_TOKEN = 1024
"""A hint costs ``hint_rate`` one token, and one more per this many ids: a
16 384-id hint costs 17."""
SMALL_REQUEST_ROWS = 64
"""Up to this many ids, the bounds check reads them as a Python list: a NumPy
reduction costs ≈ 2 µs however few the ids (a fifth of a 16-row request's
server time), a list of 64 ints well under one."""
READ_ERROR_LOG_S = 10.0
"""Failed reads are logged at most once per this many seconds (each request
that meets one gets its own error text, and stats count them all)."""


def _first_out_of_range(unsigned: np.ndarray, rows: int) -> int:
    """Where the first id at or past ``rows`` is (ids seen unsigned, so a
    negative one is too), looked for ``SMALL_REQUEST_ROWS × 64`` ids at a
    time: the search's temporaries stay small whatever the request's size."""
    step = SMALL_REQUEST_ROWS * 64
    for at in range(0, unsigned.shape[0], step):
        past = np.flatnonzero(unsigned[at : at + step] >= np.uint64(rows))
        if past.size:
            return at + int(past[0])
    raise ValueError(f"no id at or past {rows}")  # (only called once one was seen)


class Channel:
    """The server's side of one session's channel: its segment, the admission
    chosen when it opened (``pleserver.data.admission``), and its place in the
    loop's schedule.

    ``fd`` (the segment's memfd, owned here once given) lets ``destroy`` free
    the pages even while the client keeps its mapping; ``on_destroy`` runs
    after that (the server returns the bytes to its channel memory budget)."""

    def __init__(
        self,
        session_id: int,
        peer: str,
        mapping: ChannelMap,
        fd: int | None = None,
        on_destroy: Callable[[Channel], None] | None = None,
        *,
        admission: Admission,
    ) -> None:
        self.session_id = session_id
        self.peer = peer
        self.map = mapping
        self.admission = admission
        self.size = mapping.layout.size
        self.fd = fd
        self.on_destroy = on_destroy
        self.opened_ns = time.monotonic_ns()  # older submit times are not believed
        # When the loop last admitted a lookup here: a GPU-driven channel is
        # looked at every gpu_poll_us for POLL_ACTIVE_S after one. Hints do
        # not count: best effort, offered at hint_rate, they need no fast look
        # (a flood of hint rings kept the loop waking every 50 µs).
        self.last_lookup = -POLL_ACTIVE_S
        self.queued: deque[Request] = deque()  # admitted, served by the loop's turns
        self.held_hints: deque[Arrival] = deque()  # admitted hints, offered in turn
        self.handed = 0  # requests with a gather worker (guarded by the loop's lock)
        self.deficit = 0  # rows this channel may still be served in its turn
        self.scheduled = False  # in the loop's fresh or old list
        self.closing = False
        self.free_pages = True  # on destroy: False while the client may still read rows

    def destroy(self) -> None:
        """Unmap, free the pages (``free_pages``), close the fd. A client still
        mapping the segment then sees zeros, and what it touches again is
        charged to it, not to us."""
        self.map.close()
        if self.fd is not None:
            if self.free_pages:
                try:
                    punch_hole(self.fd, self.size)
                except OSError as exc:
                    log.warning(
                        "session %d: cannot free its channel's pages: %s", self.session_id, exc
                    )
            os.close(self.fd)
            self.fd = None
        if self.on_destroy is not None:
            self.on_destroy(self)
            self.on_destroy = None


_NO_IDS = np.empty(0, dtype=np.int64)


@dataclass(eq=False)
class Request:
    """One request, from the moment its table index is known: where it came
    from and, once validated, private copies of what the client wrote and how
    far its gather got (``done_rows``)."""

    channel: Channel
    slot: SlotView
    table: Table
    stats: TableStats
    started_ns: int
    submitted_ns: int  # the client's word, checked before it is used
    # A private copy of the ids: the client may rewrite the slot meanwhile.
    ids: np.ndarray = field(default_factory=lambda: _NO_IDS)
    out: np.ndarray = field(default_factory=lambda: _NO_IDS)  # view of the slot's rows area
    done_rows: int = 0
    table_index: int = 0  # (the trace's)
    turn_ns: int = 0  # the loop began gathering it (the trace's stages)
    handed_ns: int = 0  # handed to a gather worker (0: never)

    @property
    def count(self) -> int:
        return self.ids.shape[0]


class SlotKind(NamedTuple):
    """What is a kind of slot's own, once its slot is checked
    (``ServingLoop._validate``): how a failure is counted, whether it is wanted
    before its ids are copied, and its hand-off (a queued lookup, or None once
    answered)."""

    refuse_tableless: Callable[[Channel, int], None]
    refuse: Callable[[Request, int, p.ErrorCode, str, str], None]
    wanted: Callable[[Request, int], bool]
    take: Callable[[Request, np.ndarray], Request | None]


class ServingLoop:
    def __init__(
        self,
        tables: list[Table],
        stats: list[TableStats],
        *,
        spin_s: float,
        chunk_rows: int,
        workers: int,
        gather_in_order: bool,
        idle_wait: str,
        gpu_poll_s: float,
        hint_queue_rows: int,
        hint_cache_rows: int,
        hint_rate: float,
        trace: LookupTrace | None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_every_s: float = 1.0,
        on_drop: Callable[[Channel, str], None] | None = None,
    ) -> None:
        """The settings come from ``ServerConfig`` (``from_config``): the
        defaults are its own; ``heartbeat``, ``on_drop``: the server's hooks."""
        if idle_wait not in IDLE_WAITS:
            raise ValueError(f"idle_wait must be one of {', '.join(IDLE_WAITS)}, not {idle_wait!r}")
        if idle_wait == "futex_waitv" and not _sync.HAVE_FUTEX_WAITV:
            raise ValueError(
                f"idle_wait = futex_waitv, but this kernel ({os.uname().release}) "
                "has no futex_waitv system call (Linux 5.16 or later), or a "
                "seccomp filter refuses it: use idle_wait = auto or poll"
            )
        self.tables = tables
        self.stats = stats
        self.spin_s = spin_s
        self.heartbeat = heartbeat
        self.heartbeat_every_s = heartbeat_every_s
        # Hand-offs to the gather workers, taken in pieces of chunk_rows rows.
        self._handoffs: HandOffs[Request] = HandOffs(chunk_rows, max(1, workers))
        self.chunk_rows = chunk_rows
        self.on_drop = on_drop
        self.gpu_poll_s = gpu_poll_s
        self.gather_in_order = gather_in_order  # read by the loop; set by a reload
        self.trace = trace  # (``lookup_trace``) each answered request's stage times
        self.channels: list[Channel] = []  # replaced, never mutated: the loop reads it lock-free
        self._change = threading.Lock()
        self._retired: list[Channel] = []
        self._fresh: deque[Channel] = deque()  # became busy: served first, one turn
        self._old: deque[Channel] = deque()  # busy for longer: round robin
        # Bumped (and its futex woken) to wake the sleeping loop: word 0 the
        # count, word 1 unused by wake() (wait_while's waiters count).
        self._wake_words = _sync.Words(bytearray(8))
        self.idle_wait = (
            idle_wait
            if idle_wait != "auto"
            else ("futex_waitv" if _sync.HAVE_FUTEX_WAITV else "poll")
        )
        self._stop = threading.Event()
        self._draining = False
        self._inflight = 0  # handed-off requests not yet answered
        self._inflight_lock = threading.Lock()
        self._read_error_logged = -READ_ERROR_LOG_S
        # The last request of a channel that wants the loop to spin after it
        # (``_spinning``), and the seconds spent spinning (read by the stats).
        self._spin_arrival = -math.inf
        self.spin_seconds = 0.0
        self._hints_only = True  # the last admission pass admitted no lookup
        # Started with the loop, all of them: a server's thread count does not
        # change with its load.
        self.workers = [
            threading.Thread(target=self._worker, args=(i,), name=f"gather-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        # Small requests' own worker (``HandOffs.take_express``): never behind
        # a large request's piece.
        self.express = threading.Thread(
            target=self._express_worker, name="gather-express", daemon=True
        )
        self.thread = threading.Thread(target=self._run, name="serving", daemon=True)
        # Prefetch hints: read into the row cache (``hint_cache_rows`` rows;
        # 0: no cache) while no handed-off demand request waits.
        self.hints = HintReader(
            tables, hint_queue_rows, hint_cache_rows, lambda: self._inflight, len(self.workers)
        )
        self._kinds = self._slot_kinds()
        # Hints held in their slots (``_offer_hints``): the channels holding
        # some, in turn, and a token bucket of ``hint_rate`` a second.
        self.hint_rate = hint_rate  # read by the loop; set by a reload
        self._hinting: deque[Channel] = deque()
        self._hint_tokens = float(HINT_BURST)
        self._hint_refill = time.monotonic()
        self.held_hints = 0  # (read by the stats)

    @classmethod
    def from_config(
        cls,
        tables: list[Table],
        stats: list[TableStats],
        cfg: ServerConfig,
        *,
        hint_cache_rows: int,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_every_s: float = 1.0,
        on_drop: Callable[[Channel, str], None] | None = None,
    ) -> ServingLoop:
        """The loop of ``cfg``'s serving settings; ``hint_cache_rows``: the row
        cache's rows (0: none, so hints are not read)."""
        return cls(
            tables,
            stats,
            spin_s=cfg.spin_us * 1e-6,
            chunk_rows=cfg.chunk_rows,
            workers=cfg.gather_workers,
            gather_in_order=cfg.gather_in_order,
            idle_wait=cfg.idle_wait,
            gpu_poll_s=cfg.gpu_poll_us * 1e-6,
            hint_queue_rows=cfg.hint_queue_rows,
            hint_cache_rows=hint_cache_rows,
            hint_rate=cfg.hint_rate,
            trace=LookupTrace(cfg.lookup_trace) if cfg.lookup_trace else None,
            heartbeat=heartbeat,
            heartbeat_every_s=heartbeat_every_s,
            on_drop=on_drop,
        )

    @property
    def chunk_rows(self) -> int:
        """Rows of one channel's turn in the loop, and of one worker's piece."""
        return self._chunk_rows

    @chunk_rows.setter
    def chunk_rows(self, rows: int) -> None:  # (a reload sets it while serving)
        self._chunk_rows = rows
        self._handoffs.piece_rows = max(1, rows)

    # --------------------------------------------------------------- channels
    def add(self, channel: Channel) -> None:
        """Serve ``channel``."""
        with self._change:
            self.channels = [*self.channels, channel]
        self.wake()

    def remove(self, channel: Channel, free_pages: bool = True) -> None:
        """Stop serving ``channel``; it is destroyed once nothing uses it. Its
        pages are freed then unless ``free_pages`` is False (the server stops:
        its clients may still be reading rows of answered requests)."""
        if channel.closing:  # removed already (and perhaps unmapped): nothing to do
            return
        channel.free_pages = free_pages
        channel.closing = True
        with self._change:
            self.channels = [c for c in self.channels if c is not channel]
            self._retired.append(channel)
        self.wake()

    def wake(self) -> None:
        """Wake the loop if it sleeps (its wake word moves, so a loop about to
        sleep does not sleep either)."""
        self._wake_words.add(0, 1)
        self._wake_words.wake(0)

    @property
    def channel_count(self) -> int:
        return len(self.channels)

    def channel_kinds(self) -> Counter[str]:
        """Channels by the kind of their admission ("counter", "doorbell")."""
        return Counter(c.admission.kind for c in self.channels)

    def start(self) -> None:
        """Start the workers and the loop. Raises RuntimeError (what started is
        stopped again) when a thread cannot start."""
        try:
            for worker in self.workers:
                worker.start()
            self.express.start()
            self.hints.start()
            self.thread.start()
        except RuntimeError:
            self.hints.stop()
            self._handoffs.stop()
            raise

    def stop(self, drain_s: float = 5.0) -> None:
        """Serve what was already submitted (up to ``drain_s``), then stop."""
        self._draining = True
        deadline = time.monotonic() + drain_s
        self.wake()
        while time.monotonic() < deadline and (self._inflight or self._pending_work()):
            time.sleep(0.005)
        self._stop.set()
        self.wake()
        if self.thread.is_alive():
            self.thread.join()
        self.hints.stop()
        self._handoffs.stop()  # (the workers end once what is queued is taken)
        for worker in (*self.workers, self.express):
            if worker.is_alive():
                worker.join()
        for ch in self.channels:
            self.remove(ch, free_pages=False)
        self._reap(force=True)

    def _pending_work(self) -> bool:
        return any(c.queued or c.admission.waiting() for c in self.channels if not c.closing)

    # ------------------------------------------------------------------- loop
    def _run(self) -> None:
        name_thread(SERVING_THREAD_NAME)
        try:
            set_timer_slack(TIMER_SLACK_NS)
        except OSError as exc:
            log.debug("serving: cannot set the timer slack: %s", exc)
        idle_since = time.monotonic()
        spin_since: float | None = None  # when the current spin began
        next_beat = 0.0
        while not self._stop.is_set():
            # Read before the pass looks at anything: a wake() from here on
            # (a channel added or retired, a hand-off answered) ends the sleep.
            wake_seen = self._wake_words.load(0)
            admitted = self._admit_all()
            served = self._serve_turn()
            did = admitted | served | self._offer_hints()
            now = time.monotonic()
            if self._retired:
                self._reap()
            if now >= next_beat:
                next_beat = now + self.heartbeat_every_s
                if self.heartbeat:
                    self.heartbeat()
                for table in self.tables:  # a checkpoint file changed under us?
                    table.check_files()
            if spin_since is not None and (did or not self._spinning(now, idle_since)):
                self.spin_seconds += now - spin_since
                spin_since = None
            if did:
                idle_since = now
                if not served and self._hints_only:
                    # Only hints this pass (admitted, offered): best effort,
                    # and a flood of them keeps every pass busy. Back to back,
                    # the passes held this core while a lookup's client, woken
                    # behind the flooder on the other, waited for its slice
                    # (a bystander's p99 0.2 -> 2.9 ms on two cores).
                    os.sched_yield()
                continue
            if self._spinning(now, idle_since):
                # Spin, yielding the CPU (and the GIL) each pass: on a busy
                # machine the client, or a gather worker, may need this core.
                if spin_since is None:
                    spin_since = now
                os.sched_yield()
                continue
            # Idle: sleep (idle_since stays: a wake-up without work sleeps again
            # at once, it does not spin again).
            timeout = (
                min(self.heartbeat_every_s, max(0.0, next_beat - now))
                if not self._draining
                else 0.002
            )
            if self._hinting:  # held hints: awake for the bucket's next token
                timeout = min(timeout, self._next_hint_s())
            self._sleep(wake_seen, timeout, now)

    def _spinning(self, now: float, idle_since: float) -> bool:
        """Whether the loop, idle since ``idle_since``, spins rather than
        sleeps: for ``spin_s`` after the last request of a channel whose
        requests want a spin (``Admission.spin_after``: a CPU thread's), and
        after no other. A decoding engine's doorbells alone never make it
        spin: they are looked at every ``gpu_poll_s`` while active, and a
        spinning core beside the engine slowed its steps (docs/BENCHMARKS.md,
        "The serving loop's spin beside vLLM")."""
        return (
            now - idle_since < self.spin_s
            and now - self._spin_arrival < self.spin_s
            and not self._draining
        )

    def _sleep(self, wake_seen: int, timeout: float, now: float) -> None:
        """Sleep until an admission's futex word moves, the wake word moves
        from ``wake_seen`` (``wake``), the rung word of a channel that cannot
        wake the loop leaves IDLE, or ``timeout`` passes (in poll mode:
        ``POLL_S``). Rung words are looked at inside the native call (a look
        that finds nothing costs no pass of this loop): every ``gpu_poll_s``
        while a channel rings, every ``POLL_IDLE_S`` after. A retired channel
        a gather worker still holds does not keep the loop awake: the
        worker's answer wakes it."""
        words = [(self._wake_words, 0, wake_seen)]
        polled: list[tuple[_sync.Words, int, int]] = []
        sleepers: list[Admission] = []
        poll = POLL_IDLE_S
        for ch in self.channels:
            if ch.closing:
                continue
            word = ch.admission.futex_word()
            if word is None:  # its client cannot wake us: look again soon, sooner while active
                if now - ch.last_lookup < POLL_ACTIVE_S:
                    poll = self.gpu_poll_s
                polled_word = ch.admission.polled_word()
                if polled_word is None:  # nothing to look at but a pass
                    timeout = min(timeout, poll)
                else:
                    polled.append(polled_word)
            else:
                words.append(word)
                sleepers.append(ch.admission)
        # One call takes at most FUTEX_WAITV_MAX words, the loop's own among
        # them, and as many polled words: past 127 channels (max_clients) the
        # loop polls instead.
        if (
            self.idle_wait == "futex_waitv"
            and len(words) <= _sync.FUTEX_WAITV_MAX
            and len(polled) <= _sync.FUTEX_WAITV_MAX
        ):
            # Announce, then wait on each word at the value last read: a word
            # that moved since makes the call return at once, and a client
            # that publishes after our announcement sees it and wakes us.
            for admission in sleepers:
                admission.announce_sleep(True)
            try:
                _sync.futex_waitv(words, timeout, polled=polled, poll=poll)
            except OSError as exc:  # ENOSYS/EPERM: refused after all (seccomp)
                log.warning(
                    "futex_waitv failed (%s): the serving loop polls its channels "
                    "every %.1f ms from now on",
                    exc.strerror or exc,
                    POLL_S * 1e3,
                )
                self.idle_wait = "poll"
            finally:
                for admission in sleepers:
                    admission.announce_sleep(False)
            return
        if polled:
            timeout = min(timeout, poll)
        self._wake_words.wait_while(0, wake_seen, 4, min(timeout, POLL_S))

    def _admit_all(self) -> bool:
        """Admit, validate and queue what every channel's admission found since
        the last pass; True if any found a request."""
        self._hints_only = True  # no lookup admitted by this pass (yet)
        ready = [ch for ch in self.channels if not ch.closing and ch.admission.pending()]
        if not ready:  # (one load per channel)
            return False
        limit = max(1, ADMIT_PASS_ARRIVALS // len(ready))
        did = False
        for ch in ready:
            try:
                arrivals = ch.admission.admit(limit)
                if not arrivals:
                    continue
                did = True
                arrived = time.monotonic()
                for arrival in arrivals:
                    if arrival.kind == HINT_KIND:  # below lookups: offered after them
                        if not ch.held_hints:
                            self._hinting.append(ch)
                        ch.held_hints.append(arrival)
                        self.held_hints += 1
                        continue
                    self._hints_only = False
                    ch.last_lookup = arrived
                    if ch.admission.spin_after:
                        # A lookup's client waits for its next answer: spin
                        # after it (a hint's client waits for nothing).
                        self._spin_arrival = arrived
                    request = self._validate(ch, arrival)
                    if request is not None:
                        ch.queued.append(request)
                self._schedule_fresh(ch)
            except Exception as exc:  # one channel never stops the loop
                self._channel_failed(ch, exc, "serving its channel")
        return did

    def _channel_failed(self, ch: Channel, exc: Exception, what: str) -> None:
        """Drop ``ch`` after ``exc`` (called in its ``except`` block): with its
        own words for a channel no protocol-following client could make, with
        the traceback logged for anything else."""
        if isinstance(exc, HostileChannel):
            self._drop(ch, str(exc))
            return
        log.exception(
            "session %d (%s): %s failed; dropping the channel", ch.session_id, ch.peer, what
        )
        self._drop(ch, "internal error while serving this channel")

    def _offer_hints(self) -> bool:
        """Validate and offer held hints (each answered as it is offered), as
        many as the ``hint_rate`` bucket allows (a large hint may take it
        below zero: the next waits until it refilled), one channel's at a
        time in turn; True if any was. A closing channel's hints are left:
        its client is gone or being disconnected."""
        if not self._hinting:
            return False
        now = time.monotonic()
        self._hint_tokens = min(
            float(HINT_BURST), self._hint_tokens + (now - self._hint_refill) * self.hint_rate
        )
        self._hint_refill = now
        did = False
        while self._hinting and self._hint_tokens >= 1.0:
            ch = self._hinting.popleft()
            if ch.closing:
                self.held_hints -= len(ch.held_hints)
                ch.held_hints.clear()
                continue
            arrival = ch.held_hints.popleft()
            self.held_hints -= 1
            # One token, and one more per HINT_ROWS_PER_TOKEN ids (the client's
            # count, bounded: the copy is validated below): a bucket of rows
            # too, so large cached hints cannot keep the hint reader busy.
            count = min(arrival.slot.words[p.SL_COUNT], ch.map.layout.capacity)
            self._hint_tokens -= 1.0 + count // HINT_ROWS_PER_TOKEN
            did = True
            if ch.held_hints:
                self._hinting.append(ch)
            try:
                self._validate(ch, arrival)  # (a hint is never queued)
            except Exception as exc:  # one channel never stops the loop
                self._channel_failed(ch, exc, "a hint of its channel")
        return did

    def _next_hint_s(self) -> float:
        """Seconds until the bucket holds a hint's token, while hints are held."""
        return max(0.0, (1.0 - self._hint_tokens) / self.hint_rate)

    def _schedule_fresh(self, ch: Channel) -> None:
        """A channel with queued work that was idle goes to the front (``fresh``)."""
        if ch.queued and not ch.scheduled:
            ch.scheduled = True
            ch.deficit = 0
            self._fresh.append(ch)

    def _validate(self, ch: Channel, arrival: Arrival) -> Request | None:
        """The lookup that arrived, validated; None once the slot was answered
        (a failure, or a hint, which is answered when it is offered).

        Every kind of slot is checked alike: its kind, its table, its count
        and its ids, copied once and bounded. What follows is the kind's own
        (``SlotKind``): how a failure is counted, and the hand-off."""
        started = time.monotonic_ns()
        slot = arrival.slot
        words = slot.words
        table_index = words[p.SL_TABLE]
        count = words[p.SL_COUNT]  # copied once: the client may rewrite the slot
        kind = self._kinds.get(arrival.kind)
        if kind is None:
            self._answer_error(
                ch,
                slot,
                p.ErrorCode.BAD_MESSAGE,
                f"request kind {arrival.kind} unknown: this server reads "
                f"{', '.join(f'{k.name} {k.value}' for k in p.RequestKind)}",
            )
            return None
        if table_index >= len(self.tables):  # no table's statistics can count it
            kind.refuse_tableless(ch, count)
            self._answer_error(
                ch,
                slot,
                p.ErrorCode.BAD_TABLE,
                f"table index {table_index} out of range: this server has "
                f"{len(self.tables)} tables (indexes 0..{len(self.tables) - 1})",
            )
            return None
        table = self.tables[table_index]
        # Without the client's submit time, the queue time is not known.
        submitted = started if arrival.submitted_ns is None else arrival.submitted_ns
        r = Request(
            ch, slot, table, self.stats[table_index], started, submitted, table_index=table_index
        )
        if table.problem:  # its file changed on disk: reading it could SIGBUS us
            kind.refuse(r, count, p.ErrorCode.INTERNAL, "internal", table.problem)
            return None
        capacity = ch.map.layout.capacity
        if count > capacity:
            kind.refuse(
                r,
                count,
                p.ErrorCode.BAD_COUNT,
                "bad_count",
                f"row count {count} exceeds the channel capacity {capacity}",
            )
            return None
        if not kind.wanted(r, count):
            return None
        ids = slot.ids[:count].copy()
        if count:
            # One bound: a negative id, seen unsigned, is ≥ 2**63 > rows.
            unsigned = ids.view(np.uint64)
            top = max(unsigned.tolist()) if count <= SMALL_REQUEST_ROWS else int(unsigned.max())
            if top >= table.rows:
                bad = _first_out_of_range(unsigned, table.rows)
                kind.refuse(
                    r,
                    count,
                    p.ErrorCode.ID_OUT_OF_RANGE,
                    "id_out_of_range",
                    f"id {int(ids[bad])} at position {bad} is out of range for "
                    f"{table.spec.name} ({table.rows} rows: valid ids 0..{table.rows - 1})",
                )
                return None
        return kind.take(r, ids)

    # ------------------------------------------------------- the slots' kinds
    def _slot_kinds(self) -> dict[int, SlotKind]:
        return {
            p.RequestKind.LOOKUP: SlotKind(
                refuse_tableless=lambda ch, count: None,
                refuse=lambda r, count, code, reason, text: self._fail(r, code, reason, text),
                wanted=lambda r, count: True,
                take=self._take_lookup,
            ),
            p.RequestKind.HINT: SlotKind(
                refuse_tableless=lambda ch, count: self.hints.refused(
                    None, min(count, ch.map.layout.capacity)
                ),
                refuse=self._refuse_hint,
                wanted=self._hint_wanted,
                take=self._take_hint,
            ),
        }

    @staticmethod
    def _take_lookup(r: Request, ids: np.ndarray) -> Request:
        """A lookup is queued: the loop's turns (or a gather worker) fill its rows."""
        r.ids = ids
        r.out = r.slot.rows_view(ids.shape[0], r.table.row_bytes)
        return r

    def _refuse_hint(
        self, r: Request, count: int, code: p.ErrorCode, reason: str, text: str
    ) -> None:
        """A hint that did not validate counts as ``count`` refused hinted rows
        (at most a slot's worth: the count is the client's word)."""
        del reason  # (a lookup's error counter; a hint's are the hint counters)
        self._answer_error(r.channel, r.slot, code, text)
        self.hints.refused(r.table.key, min(count, r.channel.map.layout.capacity))

    def _hint_wanted(self, r: Request, count: int) -> bool:
        """A hint the reader would drop at once is answered before its ids are
        copied (nothing is read)."""
        if not self.hints.drop_early(r.table.key, count):
            return True
        r.channel.admission.complete(r.slot, time.monotonic_ns() - r.started_ns)
        return False

    def _take_hint(self, r: Request, ids: np.ndarray) -> None:
        """Answered from the copy, before any read: the slot is the client's
        again, and nothing of it is read from here on."""
        r.channel.admission.complete(r.slot, time.monotonic_ns() - r.started_ns)
        self.hints.offer(r.table.key, ids)

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
                if request.done_rows == 0:  # before its first gather: what hints brought
                    request.turn_ns = time.monotonic_ns()
                    self.hints.demand(request.table.key, request.ids)
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
        """Give the rest of ``r`` (from ``done_rows``) to the gather workers."""
        r.handed_ns = time.monotonic_ns()
        with self._inflight_lock:
            self._inflight += 1
            r.channel.handed += 1
        self._handoffs.put(r, in_order=self.gather_in_order and r.channel.admission.in_order)

    def _worker(self, index: int) -> None:
        name_thread(f"ple-gather-{index}".encode())
        while (piece := self._handoffs.take()) is not None:
            self._gather_piece(piece)
            # The piece's views of its channel die here, not when the next
            # piece comes: a held view would keep a closed channel mapped.
            del piece

    def _express_worker(self) -> None:
        name_thread(b"ple-gather-x")  # (ple-gather-*: the gather workers' CPU in benchmarks)
        while (piece := self._handoffs.take_express()) is not None:
            self._gather_piece(piece)
            del piece  # (as in _worker)

    def _gather_piece(self, piece: Piece[Request]) -> None:
        """Gather one piece of a handed-off request (may block on disk reads,
        GIL released); after its request's last piece, answer it: its rows,
        or the first piece's error. Never raises."""
        r = piece.job.request
        error: Exception | None = None
        if not r.channel.closing:
            try:
                r.table.gather(r.ids[piece.start : piece.stop], r.out[piece.start : piece.stop])
            except Exception as exc:
                error = exc
        job = self._handoffs.finish(piece, error)
        if job is None:
            return  # other pieces of it are still being gathered
        try:
            if r.channel.closing:
                pass
            elif job.error is not None:
                self._gather_failed(r, job.error)
            else:
                r.done_rows = r.count
                self._complete(r)
        finally:
            # (the admission cleared the slot's mark before its answer:
            # clearing it here could clear a request resubmitted there)
            with self._inflight_lock:
                self._inflight -= 1
                r.channel.handed -= 1
            if r.channel.closing:
                self.wake()  # the loop may now unmap the channel

    def _gather_failed(self, r: Request, exc: Exception) -> None:
        ch = r.channel
        if isinstance(exc, nat.ReadError):  # the disk or the file: the server is fine
            now = time.monotonic()
            if now - self._read_error_logged >= READ_ERROR_LOG_S:  # not one line a request
                self._read_error_logged = now
                log.error("session %d (%s): a read failed: %s", ch.session_id, ch.peer, exc)
            self._fail(r, p.ErrorCode.INTERNAL, "read_error", f"reading rows failed: {exc}")
            return
        log.exception("gather failed for session %d", ch.session_id)
        self._fail(r, p.ErrorCode.INTERNAL, "internal", f"internal error while gathering: {exc}")

    def _complete(self, r: Request) -> None:
        done = time.monotonic_ns()
        r.channel.admission.complete(r.slot, done - r.started_ns)
        # A submit time from before the channel opened, or after the request was
        # admitted, is not a time this client could have had: not recorded.
        believable = r.channel.opened_ns <= r.submitted_ns <= r.started_ns
        r.stats.record(
            r.count,
            r.table.row_bytes,
            (done - r.started_ns) * 1e-9,
            (r.started_ns - r.submitted_ns) * 1e-9 if believable else -1,
        )
        if self.trace is not None:
            self.trace.record(
                r.channel.session_id,
                r.slot.index,
                r.table_index,
                r.count,
                r.submitted_ns if believable and r.submitted_ns != r.started_ns else 0,
                r.started_ns,
                r.turn_ns,
                r.handed_ns,
                done,
            )

    def _fail(self, r: Request, code: p.ErrorCode, kind: str, text: str) -> None:
        """Answer ``r`` with an error, counted as ``kind`` in its table's stats."""
        self._answer_error(r.channel, r.slot, code, text)
        r.stats.record_error(kind)

    def _answer_error(self, ch: Channel, slot: SlotView, code: p.ErrorCode, text: str) -> None:
        ch.admission.fail(slot, code, text)
        log.debug("session %d (%s): request rejected: %s", ch.session_id, ch.peer, text)

    def _drop(self, ch: Channel, reason: str) -> None:
        """Stop serving a channel that broke the protocol; tell the control plane."""
        self.remove(ch)
        if self.on_drop is not None:
            self.on_drop(ch, reason)
        else:
            log.warning("session %d (%s): channel dropped: %s", ch.session_id, ch.peer, reason)

    def _reap(self, force: bool = False) -> None:
        with self._change:
            retired, self._retired = self._retired, []
        keep = []
        for ch in retired:
            if ch.handed and not force:
                keep.append(ch)  # never block the loop: try again next pass
                continue
            ch.queued.clear()
            ch.destroy()  # (with force, the workers have stopped: no gather writes)
        if keep:
            with self._change:
                self._retired.extend(keep)
