"""Typed views over one mapped channel segment (layout: ``pleclient.protocol``).

Used by both sides: the server creates and formats the segment, the client maps
the fd it received. Plain header words are ``memoryview`` casts (a Python int
per read, no NumPy scalar), ids and rows are NumPy views, so neither side
copies more than the protocol requires. The synchronization words (the submit
counter, each slot's state and their sleepers) are read and written only
through ``pleclient._sync``, and every slot transition has its one home here:
``SlotView.submit`` / ``release`` (the client's), ``SlotView.complete`` /
``fail`` (the server's), ``ChannelMap.publish_submit`` (the client's doorbell);
on GPU-driven channels ``ring`` / ``reset_done`` (what the GPU writes; its CPU
stand-in calls them), ``ChannelMap.take_rung`` / ``rung_slots``, ``claim`` /
``answer_gpu`` (the server's) and ``abandon`` (the client's watchdog). Each
names the ordering edges it relies on (E1…, W1, X1, D1: the table in
``pleclient.protocol``, "Ordering edges").
"""

from __future__ import annotations

import mmap

import numpy as np

from pleclient import protocol as p
from pleclient.errors import ProtocolMismatch

try:
    from pleclient._sync import SCAN_MAX, Words
except ImportError as exc:  # a source checkout that was never built
    raise ImportError(
        f"pleclient's native module is not built ({exc}): install the package with "
        "`pip install .` (or build in place with `python setup.py build_ext --inplace`)"
    ) from None

WORD = 4
COUNTER_AT = p.CH_SUBMIT_COUNTER * WORD
SERVER_SLEEPING_AT = p.CH_SERVER_SLEEPING * WORD
RUNG_AT = p.CH_RUNG * WORD
assert p.MAX_DEPTH <= SCAN_MAX, "a channel's doorbells are scanned in one call"


class SlotView:
    """One slot: header words, message area, ids and rows views, and the
    slot's transitions."""

    __slots__ = (
        "index",
        "words",
        "words64",
        "message",
        "ids",
        "rows",
        "_sync",
        "_state_at",
        "_waiters_at",
        "_doorbell_at",
        "_done_at",
        "_answers_at",
    )

    def __init__(self, buf: memoryview, sync: Words, layout: p.ChannelLayout, index: int) -> None:
        base = layout.slot_offset(index)
        self.index = index
        self._sync = sync
        self._state_at = base + p.SL_STATE * WORD
        self._waiters_at = base + p.SL_WAITERS * WORD
        self._doorbell_at = base + p.SL_DOORBELL * WORD
        self._done_at = base + p.SL_DONE * WORD
        self._answers_at = base + p.SL_ANSWERS * WORD
        self.words = buf[base : base + p.SLOT_HEADER_BYTES].cast("I")
        self.words64 = buf[base : base + p.SLOT_HEADER_BYTES].cast("Q")
        self.message = buf[base + p.SLOT_HEADER_BYTES : base + p.SLOT_PRELUDE_BYTES]
        ids_at = base + layout.ids_offset
        self.ids = np.frombuffer(buf, dtype=np.int64, count=layout.capacity, offset=ids_at)
        rows_at = base + layout.rows_offset
        self.rows = np.frombuffer(
            buf, dtype=np.uint8, count=layout.capacity * layout.max_row_bytes, offset=rows_at
        )

    @property
    def state(self) -> int:
        """The state word (E2, acquire: what its writer wrote before is visible)."""
        return self._sync.load(self._state_at)

    # ------------------------------------------------------- the client's side
    def submit(
        self,
        table: int,
        ids: np.ndarray,
        sequence: int,
        submit_ns: int,
        kind: int = p.RequestKind.LOOKUP,
    ) -> None:
        """FREE → SUBMITTED: the request (``submit_ns``: CLOCK_MONOTONIC now;
        ``kind``: a lookup or a prefetch hint), then the state (W1). The
        server sees it once ``ChannelMap.publish_submit`` moved the counter
        past ``sequence`` (E1 there, pairs with the server's E2)."""
        n = ids.shape[0]
        self.ids[:n] = ids
        words = self.words
        words[p.SL_TABLE] = table
        words[p.SL_COUNT] = n
        words[p.SL_SEQUENCE] = sequence
        words[p.SL_ERROR] = p.ErrorCode.OK
        words[p.SL_KIND] = kind
        self.words64[p.SL_SUBMIT_NS // 2] = submit_ns
        self._sync.store(self._state_at, p.SlotState.SUBMITTED)

    def wait_answered(self, timeout: float, spin: float = 0.0) -> int:
        """Wait until the state is no longer SUBMITTED: spin up to ``spin``
        seconds, then sleep (at most ``timeout`` in all; E4). The state, read
        with acquire (E2, pairs with the server's E1: the rows are then
        visible); SUBMITTED on timeout."""
        return self._sync.wait_while(
            self._state_at, p.SlotState.SUBMITTED, self._waiters_at, timeout, spin
        )

    def release(self) -> None:
        """DONE/ERROR → FREE: the client is done with the rows (W1)."""
        self._sync.store(self._state_at, p.SlotState.FREE)

    # ------------------------------------------------------- the server's side
    def complete(self, server_ns: int) -> None:
        """SUBMITTED → DONE, once the rows are in place: the result words,
        then the state published (E1, release: the rows before it; E3, a wake
        call if the client sleeps)."""
        self.words[p.SL_ERROR] = p.ErrorCode.OK
        self.words64[p.SL_SERVER_NS // 2] = server_ns
        self._sync.publish(self._state_at, p.SlotState.DONE, self._waiters_at)

    def fail(self, code: int, text: str) -> None:
        """SUBMITTED → ERROR: the text and code, then the state published (E1, E3)."""
        self.message[:] = p.encode_error_text(text)
        self.words[p.SL_ERROR] = code
        self._sync.publish(self._state_at, p.SlotState.ERROR, self._waiters_at)

    # ------------------------------------------ GPU-driven slots (protocol.py)
    @property
    def doorbell(self) -> int:
        """The doorbell word (E2, acquire: a RUNG request's ids are visible)."""
        return self._sync.load(self._doorbell_at)

    @property
    def done(self) -> int:
        """The done word (E2, acquire: the rows or error text before it are visible)."""
        return self._sync.load(self._done_at)

    @property
    def answers(self) -> int:
        """How many requests the server answered in this slot (mod 2³²)."""
        return self._sync.load(self._answers_at)

    def word_address(self, word: int, base_address: int) -> int:
        """Address of header word ``word`` where the segment starts at
        ``base_address`` (a GPU writes and waits on it by address)."""
        return base_address + self._state_at + word * WORD  # (state is word 0)

    def ring(self, table: int, ids: np.ndarray, kind: int = p.RequestKind.LOOKUP) -> None:
        """IDLE → RUNG, as a GPU rings: ids, table and count, then the doorbell
        (W1, release: the request before it; the stream's G1), then the
        channel's rung word (W1: the doorbell before it; the stream's G2). The
        CPU stand-in of the stream's copy and writes (``pleclient.gpu.HostStream``)."""
        n = ids.shape[0]
        self.ids[:n] = ids
        self.words[p.SL_TABLE] = table
        self.words[p.SL_COUNT] = n
        self.words[p.SL_KIND] = kind
        self._sync.store(self._doorbell_at, p.Doorbell.RUNG)
        self._sync.store(RUNG_AT, p.Doorbell.RUNG)

    def wait_done(self, timeout: float, spin: float = 0.0) -> int:
        """Wait while the done word is WAITING (the stand-in of the stream's
        wait, G3); the word, read with acquire (E2, E4). WAITING on timeout."""
        return self._sync.wait_while(self._done_at, p.Done.WAITING, self._waiters_at, timeout, spin)

    def reset_done(self) -> None:
        """OK/ERROR → WAITING, after the wait: the next ring waits again (W1)."""
        self._sync.store(self._done_at, p.Done.WAITING)

    def claim(self) -> None:
        """RUNG → CLAIMED: the server has taken the request (W1)."""
        self._sync.store(self._doorbell_at, p.Doorbell.CLAIMED)

    def return_claimed(self) -> bool:
        """CLAIMED → RUNG for a request its server took and never answered
        (done still WAITING; the client, once that server is gone), so that
        the next server takes it (W1). Whether it was such a request."""
        if self.doorbell != p.Doorbell.CLAIMED or self.done != p.Done.WAITING:
            return False
        self._sync.store(self._doorbell_at, p.Doorbell.RUNG)
        return True

    def answer_gpu(self, code: int, text: str, server_ns: int) -> None:
        """The server's answer to a rung request, once the rows are in place
        (or ``code`` says why not): the result words, the doorbell back to
        IDLE (W1), then the done word published (E1, release: rows and words
        before it, pairs with the stream's G3; E3: a CPU stand-in sleeping on
        it is woken, a GPU polls it)."""
        if code != p.ErrorCode.OK:
            self.message[:] = p.encode_error_text(text)
        self.words[p.SL_ERROR] = code
        self.words64[p.SL_SERVER_NS // 2] = server_ns
        self._sync.add(self._answers_at, 1)
        self._sync.store(self._doorbell_at, p.Doorbell.IDLE)
        done = p.Done.OK if code == p.ErrorCode.OK else p.Done.ERROR
        self._sync.publish(self._done_at, done, self._waiters_at)

    def abandon(self, code: int, text: str) -> None:
        """The client's watchdog ends a wait the server will not answer: the
        text and code, the doorbell back to IDLE (W1), then done = ERROR
        published (E1, E3), so the stream's wait ends and its check fails the
        step."""
        self.message[:] = p.encode_error_text(text)
        self.words[p.SL_ERROR] = code
        self._sync.store(self._doorbell_at, p.Doorbell.IDLE)
        self._sync.publish(self._done_at, p.Done.ERROR, self._waiters_at)

    # ------------------------------------------------------------------ views
    def rows_view(self, count: int, row_bytes: int) -> np.ndarray:
        """The first ``count`` rows of ``row_bytes`` each, packed, as a view."""
        return self.rows[: count * row_bytes].reshape(count, row_bytes)

    def error_text(self) -> str:
        return p.decode_error_text(self.message)

    def close(self) -> None:
        """Drop this view's memoryviews (the mapping can then be closed)."""
        for view in (self.words, self.words64, self.message):
            view.release()
        self.ids = self.rows = None  # type: ignore[assignment]


class ChannelMap:
    """A mapped channel segment: its header words and ``depth`` slots."""

    def __init__(
        self,
        fd: int,
        layout: p.ChannelLayout,
        *,
        format_header: bool = False,
        adopted: bool = False,
    ) -> None:
        """Map ``fd``. The server formats a new segment (``format_header``: every
        word), or, adopting a segment a client kept from an earlier server
        (``adopted``), only its fixed header words, leaving the slots' words as
        the client left them; a client checks the header it was given."""
        self.layout = layout
        self.mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        self.sync = Words(self.mm)
        self.header = self.buf[: p.CHANNEL_HEADER_BYTES].cast("I")
        self.slots = [SlotView(self.buf, self.sync, layout, i) for i in range(layout.depth)]
        if format_header:
            self._format()
        elif adopted:
            self._format_fixed()
        elif self.header[p.CH_MAGIC] != p.CHANNEL_MAGIC:
            self.close()
            raise ProtocolMismatch("channel segment has no PLEC header: not a ple-server channel")
        elif self.header[p.CH_VERSION] != p.PROTOCOL_VERSION:
            version = self.header[p.CH_VERSION]
            self.close()
            raise ProtocolMismatch(
                f"channel segment speaks protocol {version}, this client "
                f"speaks {p.PROTOCOL_VERSION}; install matching pleserver "
                "versions"
            )

    def _format(self) -> None:
        h = self.header
        h[p.CH_SUBMIT_COUNTER] = 0
        h[p.CH_SERVER_SLEEPING] = 0
        h[p.CH_RUNG] = p.Doorbell.IDLE
        for slot in self.slots:
            slot.words[p.SL_STATE] = p.SlotState.FREE
            slot.words[p.SL_WAITERS] = 0
            slot.words[p.SL_DOORBELL] = p.Doorbell.IDLE
            slot.words[p.SL_DONE] = p.Done.WAITING
            slot.words[p.SL_ANSWERS] = 0
            slot.words[p.SL_KIND] = p.RequestKind.LOOKUP
        self._format_fixed()

    def _format_fixed(self) -> None:
        """The words that describe the layout, then the magic (W1: the header before it)."""
        h = self.header
        h[p.CH_VERSION] = p.PROTOCOL_VERSION
        h[p.CH_DEPTH] = self.layout.depth
        h[p.CH_CAPACITY] = self.layout.capacity
        h[p.CH_MAX_ROW_BYTES] = self.layout.max_row_bytes
        h[p.CH_HEADER_BYTES] = p.CHANNEL_HEADER_BYTES
        h64 = self.buf[: p.CHANNEL_HEADER_BYTES].cast("Q")
        h64[p.CH_SLOT_STRIDE // 2] = self.layout.slot_stride
        h64.release()
        self.sync.store(p.CH_MAGIC * WORD, p.CHANNEL_MAGIC)  # W1: the header before it

    # ------------------------------------------------------- the submit words
    @property
    def submit_counter(self) -> int:
        """Submits so far (E2, acquire: pairs with ``publish_submit``'s E1)."""
        return self.sync.load(COUNTER_AT)

    def publish_submit(self, counter: int) -> None:
        """The client's doorbell: the counter moved to ``counter`` (E1,
        release: the submitted slots before it), waking the server if it
        announced its sleep (E3, pairs with ``set_server_sleeping``'s E5)."""
        self.sync.publish(COUNTER_AT, counter, SERVER_SLEEPING_AT)

    # ------------------------------------------ GPU-driven channels (protocol.py)
    @property
    def rung(self) -> int:
        """The channel's rung word (E2, acquire): RUNG if a doorbell may have
        rung since the server last took it."""
        return self.sync.load(RUNG_AT)

    def take_rung(self) -> bool:
        """The server takes the rung word back to IDLE (X1, an acq_rel
        exchange, pairs with the stream's G2 or the stand-in's W1): True if it
        was set, and then every doorbell rung before it is visible to
        ``rung_slots``."""
        return self.sync.exchange(RUNG_AT, p.Doorbell.IDLE) != p.Doorbell.IDLE

    def rung_slots(self) -> list[SlotView]:
        """The slots whose doorbell is RUNG, each read once with acquire (D1,
        pairs with the stream's G1: their ids are visible), in one native call."""
        return self._slots_where(p.SL_DOORBELL, p.Doorbell.RUNG)

    def submitted_slots(self) -> list[SlotView]:
        """The slots whose state is SUBMITTED, each read once with acquire (E2,
        as ``SlotView.state``), in one native call."""
        return self._slots_where(p.SL_STATE, p.SlotState.SUBMITTED)

    def _slots_where(self, word: int, value: int) -> list[SlotView]:
        first = self.layout.slot_offset(0) + word * WORD
        mask = self.sync.scan(first, self.layout.slot_stride, self.layout.depth, value)
        found = []
        while mask:  # (set bits only: most passes find a few)
            low = mask & -mask
            found.append(self.slots[low.bit_length() - 1])
            mask ^= low
        return found

    def offer_for_adoption(self) -> None:
        """Before a GPU-driven channel's segment goes to a new server: the
        requests the old one claimed and never answered are rung again, then
        the rung word is set (W1: the doorbells before it), so that the new
        server's first poll scans every doorbell."""
        for slot in self.slots:
            slot.return_claimed()
        self.sync.store(RUNG_AT, p.Doorbell.RUNG)

    def set_server_sleeping(self, sleeping: bool) -> None:
        """The server's announcement before it sleeps on the counter (E5: then
        a full fence, pairs with the client's E3; futex_waitv re-reads the
        counter next), and its retraction after."""
        self.sync.store_fenced(SERVER_SLEEPING_AT, int(sleeping))

    def close(self) -> bool:
        """Unmap; False when a view is still held elsewhere (unmapped by the GC)."""
        try:
            for slot in self.slots:
                slot.close()
            self.slots = []
            self.header.release()
            self.sync.release()
            self.buf.release()
            self.mm.close()
            return True
        except BufferError:  # the caller still holds a rows view
            return False
