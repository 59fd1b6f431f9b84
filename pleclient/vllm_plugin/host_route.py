"""The host route: lookups over the session's channel, one round trip per request.

Taken on CPU runs, on CUDA devices without stream memory operations and with
``VLLM_PLE_SHM_GPU_PATH=off`` (``routes``). A lookup's ids come to the host (on
CUDA through a pinned buffer, which waits for the device), are split into
requests of at most the channel's capacity and submitted to the session's
slots; ``finish`` waits for each answer and copies its rows to the output. On
a CUDA device the segment is registered once (``pleclient.torch.PinnedSegment``),
rows go to the device with a ``non_blocking`` copy, and their slot is released
only after that copy's event completed (``_retire``), so the server never
overwrites rows the GPU is still reading.

Slots: ``start`` submits the lookup's first request at once (waiting for a
device copy to free a slot if need be) and more only while more than one slot
stays free, for the request that follows; ``finish`` submits the rest as slots
free up. The lookups of layers started together with the step
(``TableBinding.with_step``, see ``step``) queue instead: their requests take
free slots in start order, so that no layer holds a slot while an earlier one,
which finishes first, waits for one; whatever does not fit goes out as the
earlier layers finish (``_top_up``). A channel of PLE layers + 1 slots has
every layer's request out at once.

Host work cannot be captured in a CUDA graph: the route is not
``capturable``, so each layer runs its calls as eager breaks (``lookups``);
inside a FULL capture a lookup stops with ``_refuse_graph_capture``'s message.

A lost server: ``finish`` finishes the session's device copies, has the
session reconnect (``RowService.reconnect``) and resubmits every request of
the lookup not yet copied, prefetched ones included; while no server is back
past ``VLLM_PLE_SHM_FALLBACK_S``, it reads those rows from the checkpoint
itself (``RowService.checkpoint_reader``).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pleclient import PleError, RequestError, ServerGone, Ticket
from pleclient.torch import DeviceCopy, PinnedSegment, copy_rows
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.reconnect import TRANSIENT
from pleclient.vllm_plugin.rows import RowService, TableBinding

log = logging.getLogger("pleclient.vllm_plugin")


@dataclass(eq=False)
class _Chunk:
    start: int
    end: int
    ticket: Ticket | None = None
    generation: int = -1  # the session the ticket belongs to


@dataclass(eq=False)
class PendingLookup:
    """A lookup started on the host route; ``finish`` or ``discard`` it once."""

    binding: TableBinding
    ids: np.ndarray  # host copy, kept until finished: a reconnect resubmits it
    chunks: list[_Chunk] = field(default_factory=list)
    keepalive: object = None  # the pinned host tensor ``ids`` views, if any

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


class HostRoute:
    """Lookups over the session's channel, with the host in the loop."""

    name = "host"
    capturable = False  # a round trip per request: eager breaks in CUDA graphs

    def __init__(self, service: RowService) -> None:
        self.service = service
        self._pinned: PinnedSegment | None = None
        self._retiring: collections.deque[tuple[Ticket, DeviceCopy]] = collections.deque()
        # Lookups of step layers with requests not yet submitted, in start order.
        self._queue: collections.deque[PendingLookup] = collections.deque()

    # ---------------------------------------------------------------- lookups
    def start(self, binding: TableBinding, ids: torch.Tensor) -> PendingLookup:
        """Start a lookup; the server works on it until ``finish``. Its first
        request is always submitted; further ones only while more than one
        slot stays free (for the request that follows). A step layer's lookup
        queues behind the step's earlier ones instead (``_top_up``)."""
        _refuse_graph_capture()
        host, keepalive = _host_ids(ids)
        pending = PendingLookup(binding, host, keepalive=keepalive)
        if pending.count == 0:
            return pending
        pending.chunks = [_Chunk(0, pending.count)]
        try:
            if binding.with_step:
                self._queue.append(pending)
                self._top_up()
            else:
                self._feed(pending, first=0, reserve=1)
        except TRANSIENT as exc:  # finish() reconnects and resubmits
            if self.service.lost_since is None:  # (said once per loss, by reconnect)
                log.warning("PLE backend shm: submit failed (%s); retrying at collect", exc)
        return pending

    def finish(self, pending: PendingLookup, out: torch.Tensor) -> None:
        """Wait for ``pending`` and copy its rows into ``out`` (uint8
        ``[count, row_bytes]``, on any device)."""
        _refuse_graph_capture()
        binding = pending.binding
        failed_since: float | None = None
        index = 0
        try:
            self._top_up_or_leave_it()
            while index < len(pending.chunks):
                try:
                    self._feed(pending, first=index, reserve=0)
                    chunk = pending.chunks[index]
                    ticket = chunk.ticket
                    assert ticket is not None  # _feed submitted it
                    rows = ticket.wait(self.service.settings.lookup_timeout)
                    self._ensure_pinned(out.device)
                    copy = copy_rows(rows, out[chunk.start : chunk.end])
                    self._retiring.append((ticket, copy))
                    chunk.ticket = None
                    index += 1
                except TRANSIENT as exc:
                    failed_since = failed_since or time.monotonic()
                    self._forget_session()
                    if not self.service.reconnect(exc, failed_since):
                        self._read_from_checkpoint(pending, index, out)
                        index = len(pending.chunks)
        except RequestError as exc:
            pending.chunks[index].ticket = None  # the client freed the rejected request's slot
            self.discard(pending)
            name = binding.info.name if binding.info else binding.expected.prefix
            raise PleBackendError(
                f"ple-server rejected a lookup in {name}: {exc}. The server and vLLM "
                "disagree about the table; restart both on the same checkpoint"
            ) from None
        except BaseException:
            self.discard(pending)
            raise
        self._unqueue(pending)
        self._top_up_or_leave_it()  # the slots it held go to the step's next layers

    def _read_from_checkpoint(self, pending: PendingLookup, first: int, out: torch.Tensor) -> None:
        """No server answers: the rows of ``pending``'s chunks from ``first``
        on, read from the checkpoint by this worker, into ``out``."""
        reader = self.service.checkpoint_reader()
        info = pending.binding.info
        assert reader is not None and info is not None  # (reconnect said: read them)
        start = pending.chunks[first].start
        rows = np.empty((pending.count - start, info.row_bytes), dtype=np.uint8)
        reader.read(info.name, pending.ids[start:], rows)
        out[start:].copy_(torch.from_numpy(rows))
        self.service.fallback_rows += rows.shape[0]
        for chunk in pending.chunks[first:]:
            chunk.ticket = None

    def discard(self, pending: PendingLookup) -> None:
        """Give up a lookup: wait out its requests still in flight, free their slots."""
        self._unqueue(pending)
        for chunk in pending.chunks:
            ticket, chunk.ticket = chunk.ticket, None
            if ticket is None or chunk.generation != self.service.generation:
                continue
            try:
                ticket.wait(self.service.settings.lookup_timeout)
            except PleError:
                pass  # the session is gone or broken; the next use reconnects
            ticket.release()

    def close(self) -> None:
        """Finish the device copies and unregister the segment (before the
        session closes)."""
        self._forget_session()

    # --------------------------------------------------------------- plumbing
    def _top_up(self) -> None:
        """Submit the queued lookups' requests in start order while slots are
        free (after releasing those whose device copy finished); stop at the
        first that does not fit, so none overtakes an earlier one."""
        self._retire(block=False)
        client = self.service.client
        generation = self.service.generation
        while self._queue and client is not None and client.free_slots > 0:
            pending = self._queue[0]
            waiting = [
                i
                for i, c in enumerate(pending.chunks)
                if c.ticket is None or c.generation != generation
            ]
            if waiting:
                self._feed(pending, first=waiting[0], reserve=0)
            if _submitted(pending, generation):
                self._queue.popleft()
            else:
                return

    def _top_up_or_leave_it(self) -> None:
        try:
            self._top_up()
        except TRANSIENT:
            pass  # the lookups' own finish reconnects and resubmits

    def _unqueue(self, pending: PendingLookup) -> None:
        if pending in self._queue:
            self._queue.remove(pending)

    def _feed(self, pending: PendingLookup, *, first: int, reserve: int) -> None:
        """Submit the chunks of ``pending`` from ``first`` on that this session has
        not: ``first`` always (waiting for a device copy to free a slot if need
        be), the rest while more than ``reserve`` slots stay free."""
        client = self.service.client
        if client is None:
            raise ServerGone("no ple-server session")
        info = pending.binding.info
        assert info is not None  # a dummy binding takes the zero route
        chunks = pending.chunks
        cap = client.capacity
        if any(c.end - c.start > cap for c in chunks[first:]):
            chunks[first:] = [
                _Chunk(s, min(s + cap, pending.count))
                for s in range(chunks[first].start, pending.count, cap)
            ]
        generation = self.service.generation
        for i in range(first, len(chunks)):
            chunk = chunks[i]
            if chunk.ticket is not None and chunk.generation == generation:
                continue
            if i != first:
                if client.free_slots <= reserve:
                    self._retire(block=False)
                if client.free_slots <= reserve:
                    return
            elif client.free_slots == 0:
                self._retire(block=True)
            chunk.ticket = client.submit(info, pending.ids[chunk.start : chunk.end])
            chunk.generation = generation

    def _retire(self, *, block: bool) -> None:
        """Release slots whose device copy has finished, oldest first; with
        ``block``, wait for the oldest copy if none has finished yet."""
        released = 0
        while self._retiring:
            ticket, copy = self._retiring[0]
            if not copy.done():
                if not block or released:
                    return
                copy.wait()
            self._retiring.popleft()
            ticket.release()
            released += 1
        if block and not released:
            client = self.service.client
            raise PleBackendError(
                f"all {client.depth if client else '?'} ple-server channel "
                "slots hold lookups that were started and not yet used; raise "
                "VLLM_PLE_SHM_DEPTH"
            )

    def _ensure_pinned(self, device: torch.device) -> None:
        client = self.service.client
        if device.type != "cuda" or self._pinned is not None or client is None:
            return
        self._pinned = PinnedSegment(client.segment_buffer, device)

    def _forget_session(self) -> None:
        """Finish every device copy from the session's segment and unregister
        it: the session may close now. Its tickets are never released (the
        segment goes with the session)."""
        while self._retiring:
            _, copy = self._retiring.popleft()
            copy.wait()
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None


def _submitted(pending: PendingLookup, generation: int) -> bool:
    """Whether every request of ``pending`` (not yet finished) went to the
    session ``generation``."""
    return all(c.ticket is not None and c.generation == generation for c in pending.chunks)


def _host_ids(ids: torch.Tensor) -> tuple[np.ndarray, object]:
    """A host int64 copy of ``ids`` (flattened) the caller may keep."""
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64:
        flat = flat.to(torch.int64)
    if flat.device.type == "cpu":
        return flat.numpy().copy(), None
    host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))
    event.synchronize()  # the ids must be on the host before the server reads them
    return host.numpy(), host


def _refuse_graph_capture() -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise PleBackendError(
            "VLLM_PLE_BACKEND=shm: a PLE lookup ran inside a captured CUDA graph; host "
            "work cannot be captured. Use -cc.cudagraph_mode=PIECEWISE (breakable CUDA "
            "graphs, the default for Qwen4Exp on CUDA) or --enforce-eager; for the "
            "seed interface list vllm::ple_shm_lookup in -cc.splitting_ops"
        )


__all__ = ["HostRoute", "PendingLookup"]
