"""Typed views over one mapped channel segment (layout: ``pleclient.protocol``).

Used by both sides: the server creates and formats the segment, the client maps
the fd it received. Header words are ``memoryview`` casts (a Python int per
read, no NumPy scalar), ids and rows are NumPy views, so neither side copies
more than the protocol requires.
"""

from __future__ import annotations

import mmap

import numpy as np

from pleclient import protocol as p
from pleclient.semaphore import SharedSemaphore


class SlotView:
    """One slot: header words, message area, ids and rows views."""

    __slots__ = ("index", "words", "words64", "message", "ids", "rows", "done")

    def __init__(self, buf: memoryview, address: int, layout: p.ChannelLayout,
                 index: int) -> None:
        base = layout.slot_offset(index)
        self.index = index
        self.done = SharedSemaphore(address + base + p.SLOT_DONE_SEM_OFFSET)
        self.words = buf[base: base + p.SLOT_HEADER_BYTES].cast("I")
        self.words64 = buf[base: base + p.SLOT_HEADER_BYTES].cast("Q")
        self.message = buf[base + p.SLOT_HEADER_BYTES: base + p.SLOT_PRELUDE_BYTES]
        ids_at = base + layout.ids_offset
        self.ids = np.frombuffer(buf, dtype=np.int64, count=layout.capacity, offset=ids_at)
        rows_at = base + layout.rows_offset
        self.rows = np.frombuffer(buf, dtype=np.uint8,
                                  count=layout.capacity * layout.max_row_bytes, offset=rows_at)

    def rows_view(self, count: int, row_bytes: int) -> np.ndarray:
        """The first ``count`` rows of ``row_bytes`` each, packed, as a view."""
        return self.rows[: count * row_bytes].reshape(count, row_bytes)

    def set_error_text(self, text: str) -> None:
        self.message[:] = p.encode_error_text(text)

    def error_text(self) -> str:
        return p.decode_error_text(self.message)

    def release(self) -> None:
        for view in (self.words, self.words64, self.message):
            view.release()
        self.ids = self.rows = None  # type: ignore[assignment]


class ChannelMap:
    """A mapped channel segment: its header words and ``depth`` slots."""

    def __init__(self, fd: int, layout: p.ChannelLayout, *, format_header: bool = False) -> None:
        self.layout = layout
        self.mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        self.header = self.buf[: p.CHANNEL_HEADER_BYTES].cast("I")
        self._anchor: np.ndarray | None = np.frombuffer(self.mm, dtype=np.uint8, count=1)
        address = self._anchor.ctypes.data  # what the anchor is for
        self.submit_sem = SharedSemaphore(address + p.CH_SUBMIT_SEM_OFFSET)
        self.slots = [SlotView(self.buf, address, layout, i) for i in range(layout.depth)]
        if format_header:
            self._format()
        elif self.header[p.CH_MAGIC] != p.CHANNEL_MAGIC:
            raise ValueError("channel segment has no PLEC header: not a ple-server channel")

    def _format(self) -> None:
        h = self.header
        h[p.CH_VERSION] = p.PROTOCOL_VERSION
        h[p.CH_DEPTH] = self.layout.depth
        h[p.CH_CAPACITY] = self.layout.capacity
        h[p.CH_MAX_ROW_BYTES] = self.layout.max_row_bytes
        h[p.CH_HEADER_BYTES] = p.CHANNEL_HEADER_BYTES
        h64 = self.buf[: p.CHANNEL_HEADER_BYTES].cast("Q")
        h64[p.CH_SLOT_STRIDE // 2] = self.layout.slot_stride
        h64.release()
        h[p.CH_SUBMIT_COUNTER] = 0
        self.submit_sem.initialize(0)
        for slot in self.slots:
            slot.done.initialize(0)
        h[p.CH_MAGIC] = p.CHANNEL_MAGIC

    @property
    def submit_counter(self) -> int:
        return self.header[p.CH_SUBMIT_COUNTER]

    def close(self) -> bool:
        """Unmap; False when a view is still held elsewhere (unmapped by the GC)."""
        try:
            for slot in self.slots:
                slot.release()
            self.slots = []
            self._anchor = None
            self.header.release()
            self.buf.release()
            self.mm.close()
            return True
        except BufferError:  # the caller still holds a rows view
            return False
