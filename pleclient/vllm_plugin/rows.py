"""The shm row source: one ple-server session per vLLM worker, shared by its layers.

``RowService.shared()`` is the process's session. Each PLE layer ``bind``s its
table once (checked against the checkpoint, see ``identity``). On a CUDA device
with stream memory operations lookups take the GPU-driven route
(``gpu_route``: no host work per step, inside captured graphs); elsewhere the
host path below, where each layer either

* ``lookup(binding, ids, out)`` — synchronous, or
* ``submit(binding, ids)`` → ``PendingLookup``, later ``collect(pending, out)``
  — the server gathers while the GPU runs the previous decoder layer.

Requests larger than the channel capacity are split over slots. On a CUDA
device the segment is registered once (``pleclient.torch.PinnedSegment``);
rows go to the device with a ``non_blocking`` copy and their slot is released
only after the copy's event completed (``_retire``), so the server never
overwrites rows the GPU is still reading.

Failure policy
--------------
* No server at startup: ``bind`` fails at once, naming the socket and
  ``systemctl start ple-server``.
* Server gone mid-run (``ServerGone``, ``ServerUnavailable``, ``LookupTimeout``):
  reconnect with exponential backoff for ``VLLM_PLE_SHM_RECONNECT_S``
  (``reconnect.ReconnectPolicy``), check the new server's tables against the
  checkpoint again, resubmit every request not yet copied, and carry on; past
  the window raise ``PleBackendError``. Rows are never zeros or stale: a
  request is either answered by a verified server or the forward step fails.
* ``--load-format dummy`` with ``VLLM_PLE_SHM_ALLOW_DUMMY=1``: no server, zero
  rows, said once in the log.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pleclient import (
    PleClient,
    PleError,
    ProtocolMismatch,
    RequestError,
    ServerGone,
    TableInfo,
    Ticket,
)
from pleclient.checkpoint import NVFP4, TableSpec
from pleclient.torch import DeviceCopy, PinnedSegment, copy_rows
from pleclient.vllm_plugin import discovery, identity
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.gpu_route import GpuPending, GpuRoute
from pleclient.vllm_plugin.reconnect import TRANSIENT, ReconnectPolicy
from pleclient.vllm_plugin.settings import (
    ENV_ALLOW_DUMMY,
    ENV_BACKEND,
    ENV_SOCKET,
    GPU_PATH_STANDIN,
    ShmSettings,
)

log = logging.getLogger("pleclient.vllm_plugin")

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    NVFP4: torch.uint8,  # served rows: packed values, then block scales (``nvfp4``)
}


@dataclass(eq=False)
class TableBinding:
    """One PLE layer's table on the server, verified against the checkpoint."""

    expected: identity.Expected
    info: TableInfo | None  # None: dummy mode (no server)
    checkpoint: TableSpec | None = None
    checkpoint_dir: str = ""
    max_ids: int = 0  # the layer's largest lookup (0: not known)

    @property
    def dummy(self) -> bool:
        return self.info is None

    @property
    def storage_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.info.dtype if self.info else self.expected.dtypes[0]]

    @property
    def row_bytes(self) -> int:
        if self.info is not None:
            return self.info.row_bytes
        return self.expected.row_bytes(self.expected.dtypes[0])

    @property
    def row_elements(self) -> int:
        """Elements of ``storage_dtype`` per served row (NVFP4: bytes, not cols)."""
        return self.row_bytes // self.storage_dtype.itemsize


@dataclass(eq=False)
class _Chunk:
    start: int
    end: int
    ticket: Ticket | None = None
    generation: int = -1  # the session the ticket belongs to


@dataclass(eq=False)
class PendingLookup:
    """A lookup submitted ahead of use; ``collect`` or ``discard`` it once."""

    binding: TableBinding
    ids: np.ndarray  # host copy, kept until collected: a reconnect resubmits it
    chunks: list[_Chunk] = field(default_factory=list)
    keepalive: object = None  # the pinned host tensor ``ids`` views, if any

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


class RowService:
    """The worker's ple-server session and its pinned segment; a lost server
    is waited for as its ``ReconnectPolicy`` says."""

    _shared: RowService | None = None

    @classmethod
    def shared(cls) -> RowService:
        service = cls._shared
        if service is None or service._pid != os.getpid():
            service = cls._shared = cls(ShmSettings.from_env())
            atexit.register(service.close)
        return service

    def __init__(self, settings: ShmSettings) -> None:
        self.settings = settings
        self._pid = os.getpid()
        self._client: PleClient | None = None
        self._generation = 0
        self._pinned: PinnedSegment | None = None
        self._retiring: collections.deque[tuple[Ticket, DeviceCopy]] = collections.deque()
        self._bindings: list[TableBinding] = []
        self._dummy_warned = False
        self._route: GpuRoute | None = None
        self._route_chosen = False

    @property
    def generation(self) -> int:
        """Counts sessions: it changes on every (re)connect."""
        return self._generation

    # ------------------------------------------------------------------ setup
    def bind(self, expected: identity.Expected, max_ids: int = 0) -> TableBinding:
        """Find and verify this layer's table; fails fast without a server.
        ``max_ids``: the layer's largest lookup (sizes its GPU-driven slots)."""
        fmt = identity.load_format()
        if fmt == "dummy" and self.settings.allow_dummy:
            if not self._dummy_warned:
                log.warning(
                    "PLE backend shm with --load-format dummy and %s=1: no "
                    "ple-server is used, every PLE row is zero",
                    ENV_ALLOW_DUMMY,
                )
                self._dummy_warned = True
            binding = TableBinding(expected, None)
            self._bindings.append(binding)
            return binding
        model_dir = identity.checkpoint_dir(self.settings.checkpoint)
        spec = identity.select(
            identity.checkpoint_tables(model_dir), expected.table_suffix, model_dir
        )
        if self.settings.socket is None:  # several servers per host: ask them
            self.settings = dataclasses.replace(
                self.settings,
                socket=discovery.find_socket(
                    model_dir, self.settings.socket_dir, self.settings.connect_timeout
                ),
            )
        client = self._client or self._connect_at_startup(fmt)
        info = identity.select(
            client.tables, expected.table_suffix, f"ple-server at {client.socket_path}"
        )
        identity.verify(info, client.socket_path, spec, model_dir, expected)
        binding = TableBinding(expected, info, spec, model_dir, max_ids)
        self._bindings.append(binding)
        log.info(
            "PLE backend shm: %s <- ple-server table %s (%d rows x %d B, %s, fingerprint %s)",
            expected.prefix,
            info.name,
            info.rows,
            info.row_bytes,
            info.dtype,
            info.fingerprint,
        )
        return binding

    def _connect_at_startup(self, fmt: str | None) -> PleClient:
        try:
            return self._connect()
        except TRANSIENT as exc:
            hint = (
                f" (or, with --load-format dummy, set {ENV_ALLOW_DUMMY}=1 to run without PLE rows)"
                if fmt == "dummy"
                else ""
            )
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: no ple-server on {self.settings.socket}: {exc}. "
                f"Start it with `systemctl start ple-server`, or point {ENV_SOCKET} at "
                f"the socket it listens on, or unset {ENV_BACKEND} to keep the table in "
                f"vLLM{hint}."
            ) from None
        except ProtocolMismatch as exc:
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: ple-server on {self.settings.socket} speaks "
                f"another protocol ({exc}); install the same pleserver version in vLLM's "
                "environment and on the server"
            ) from None

    def _connect(self) -> PleClient:
        s = self.settings
        client = PleClient.connect(
            s.socket,
            timeout=s.connect_timeout,
            name=f"vllm-pid{os.getpid()}",
            capacity=s.capacity,
            depth=s.depth,
        )
        client.timeout = s.lookup_timeout
        self._client = client
        self._generation += 1
        return client

    # ------------------------------------------------------- the GPU-driven path
    @property
    def path(self) -> str:
        """Which path lookups take: "gpu-driven", its "CPU stand-in", or "host"."""
        if self._route is None:
            return "host"
        return "gpu-driven" + (" (CPU stand-in)" if self._route.standin else "")

    def gpu_route(self, binding: TableBinding, device: torch.device, count: int) -> GpuRoute | None:
        """The GPU-driven route for a lookup of ``count`` ids on ``device``, or
        None for the host path. Chosen (and logged) at the first lookup on a
        CUDA device, once every layer is bound; CPU runs keep the host path
        unless ``VLLM_PLE_SHM_GPU_PATH=standin``."""
        if binding.dummy:
            return None
        if not self._route_chosen:
            standin = self.settings.gpu_path == GPU_PATH_STANDIN
            if device.type != "cuda" and not standin:
                return None
            if self._client is None:
                return None  # no session yet: the host path connects first
            self._route_chosen = True
            self._route = GpuRoute.choose(
                self.settings.gpu_path,
                device,
                self._client.socket_path,
                [b for b in self._bindings if not b.dummy],
                self.settings.capacity,
                self.settings.lookup_timeout,
                self.settings.connect_timeout,
            )
        route = self._route
        if route is None or not route.serves(binding, count):
            return None
        return route

    def finish_gpu(
        self, route: GpuRoute, binding: TableBinding, pending: GpuPending, out: torch.Tensor
    ) -> None:
        """Enqueue the collection of ``pending``'s rows into ``out`` (the model's
        row dtype; converted from the table's on the stream if they differ)."""
        n = pending.count
        if out.numel() != n * binding.row_elements:
            route.discard(pending, binding.row_bytes, out.device)
            raise ValueError(
                f"PLE rows for {n} ids need {n * binding.row_elements} "
                f"elements, the output holds {out.numel()}"
            )
        target, staging = _byte_target(out, binding)
        route.finish(pending, target)
        if staging is not None:
            out.copy_(staging.view(out.shape))

    # ---------------------------------------------------------------- lookups
    def lookup(self, binding: TableBinding, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of ``ids`` (any shape, int64) into ``out`` (``ids.numel()`` rows)."""
        self.collect(self.submit(binding, ids, reserve=0), out)

    def submit(
        self, binding: TableBinding, ids: torch.Tensor, *, reserve: int = 1
    ) -> PendingLookup:
        """Start a lookup; the server works on it until ``collect``. Its first
        chunk is always submitted; further chunks only while more than
        ``reserve`` slots stay free (for the request that follows)."""
        _refuse_graph_capture()
        host, keepalive = _host_ids(ids)
        pending = PendingLookup(binding, host, keepalive=keepalive)
        if binding.dummy or pending.count == 0:
            return pending
        pending.chunks = [_Chunk(0, pending.count)]
        try:
            self._feed(pending, first=0, reserve=reserve)
        except TRANSIENT as exc:  # collect() reconnects and resubmits
            log.warning("PLE backend shm: submit failed (%s); retrying at collect", exc)
        return pending

    def collect(self, pending: PendingLookup, out: torch.Tensor) -> None:
        """Wait for ``pending`` and copy its rows into ``out`` (contiguous, the
        model's row dtype, any device, ``count * cols`` elements; NVFP4: uint8,
        ``count * row_bytes``)."""
        _refuse_graph_capture()
        binding = pending.binding
        n = pending.count
        if out.numel() != n * binding.row_elements:
            raise ValueError(
                f"PLE rows for {n} ids need {n * binding.row_elements} "
                f"elements, the output holds {out.numel()}"
            )
        if binding.info is None:  # dummy
            out.zero_()
            return
        if n == 0:
            return
        target, staging = _byte_target(out, binding)
        failed_since: float | None = None
        index = 0
        try:
            while index < len(pending.chunks):
                try:
                    self._feed(pending, first=index, reserve=0)
                    chunk = pending.chunks[index]
                    ticket = chunk.ticket
                    assert ticket is not None  # _feed submitted it
                    rows = ticket.wait(self.settings.lookup_timeout)
                    self._ensure_pinned(target.device)
                    copy = copy_rows(rows, target[chunk.start : chunk.end])
                    self._retiring.append((ticket, copy))
                    chunk.ticket = None
                    index += 1
                except TRANSIENT as exc:
                    failed_since = failed_since or time.monotonic()
                    self._reconnect(exc, failed_since)
        except RequestError as exc:
            pending.chunks[index].ticket = None  # the client freed the rejected request's slot
            self.discard(pending)
            raise PleBackendError(
                f"ple-server rejected a lookup in {binding.info.name}: {exc}. The server "
                "and vLLM disagree about the table; restart both on the same "
                "checkpoint"
            ) from None
        except BaseException:
            self.discard(pending)
            raise
        if staging is not None:
            out.copy_(staging.view(out.shape))
        self._retire(block=False)

    def discard(self, pending: PendingLookup) -> None:
        """Give up a lookup: wait out its requests still in flight, free their slots."""
        for chunk in pending.chunks:
            ticket, chunk.ticket = chunk.ticket, None
            if ticket is None or chunk.generation != self._generation:
                continue
            try:
                ticket.wait(self.settings.lookup_timeout)
            except PleError:
                pass  # the session is gone or broken; the next use reconnects
            ticket.release()

    # --------------------------------------------------------------- plumbing
    def _feed(self, pending: PendingLookup, *, first: int, reserve: int) -> None:
        """Submit the chunks of ``pending`` from ``first`` on that this session has
        not: ``first`` always (waiting for a device copy to free a slot if need
        be), the rest while more than ``reserve`` slots stay free."""
        client = self._client
        if client is None:
            raise ServerGone("no ple-server session")
        info = pending.binding.info
        assert info is not None  # a dummy binding is never fed
        chunks = pending.chunks
        cap = client.capacity
        if any(c.end - c.start > cap for c in chunks[first:]):
            chunks[first:] = [
                _Chunk(s, min(s + cap, pending.count))
                for s in range(chunks[first].start, pending.count, cap)
            ]
        for i in range(first, len(chunks)):
            chunk = chunks[i]
            if chunk.ticket is not None and chunk.generation == self._generation:
                continue
            if i != first:
                if client.free_slots <= reserve:
                    self._retire(block=False)
                if client.free_slots <= reserve:
                    return
            elif client.free_slots == 0:
                self._retire(block=True)
            chunk.ticket = client.submit(info, pending.ids[chunk.start : chunk.end])
            chunk.generation = self._generation

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
            raise PleBackendError(
                f"all {self._client.depth if self._client else '?'} ple-server channel "
                "slots hold lookups that were started and not yet used; raise "
                "VLLM_PLE_SHM_DEPTH"
            )

    def _ensure_pinned(self, device: torch.device) -> None:
        if device.type != "cuda" or self._pinned is not None or self._client is None:
            return
        self._pinned = PinnedSegment(self._client.segment_buffer, device)

    def _drop_session(self) -> None:
        """Forget the current session: finish device copies, unpin, close. Its
        tickets become stale (another generation) and are never touched again."""
        self._generation += 1
        while self._retiring:
            _, copy = self._retiring.popleft()
            copy.wait()
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _reconnect(self, cause: Exception, failed_since: float) -> None:
        """Reconnect within the window (counted from the first failure) and
        verify the new server, or raise."""
        socket = self.settings.socket
        log.warning(
            "PLE backend shm: lost ple-server at %s (%s); reconnecting for up to %.0f s",
            socket,
            cause,
            self.settings.reconnect_window,
        )
        self._drop_session()
        # The policy of the settings in force now (they may be replaced).
        policy = ReconnectPolicy(self.settings.reconnect_window)
        client = policy.reconnect(
            self._connect, socket=socket, cause=cause, failed_since=failed_since
        )
        self._verify_again(client)
        log.warning(
            "PLE backend shm: reconnected to ple-server at %s after %.1f s",
            socket,
            time.monotonic() - failed_since,
        )

    def _verify_again(self, client: PleClient) -> None:
        """A restarted server must still serve the checkpoint every layer loaded."""
        try:
            for binding in self._bindings:
                if binding.dummy or binding.checkpoint is None:  # a bound table has its spec
                    continue
                info = identity.select(
                    client.tables,
                    binding.expected.table_suffix,
                    f"ple-server at {client.socket_path}",
                )
                identity.verify(
                    info,
                    client.socket_path,
                    binding.checkpoint,
                    binding.checkpoint_dir,
                    binding.expected,
                )
                binding.info = info
        except PleBackendError:
            self._drop_session()
            raise

    def close(self) -> None:
        """End the session (at exit, or in tests)."""
        if self._pid != os.getpid():
            return
        try:
            if self._route is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # no lookup of ours may still be enqueued
                self._route.close()
                self._route = None
            self._drop_session()
        except Exception as exc:  # at exit, report and go on
            log.debug("PLE backend shm: close: %s", exc)
        if RowService._shared is self:
            RowService._shared = None


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


def _byte_target(
    out: torch.Tensor, binding: TableBinding
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The uint8 ``[n, row_bytes]`` tensor rows are copied into: ``out`` itself when
    it has the table's dtype, else a staging tensor converted afterwards."""
    if not out.is_contiguous():
        raise ValueError("the PLE output tensor must be contiguous")
    rows = out.numel() // binding.row_elements
    if out.dtype == binding.storage_dtype:
        return out.view(torch.uint8).view(rows, binding.row_bytes), None
    staging = torch.empty(
        (rows, binding.row_elements), dtype=binding.storage_dtype, device=out.device
    )
    return staging.view(torch.uint8).view(rows, binding.row_bytes), staging


def _refuse_graph_capture() -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise PleBackendError(
            "VLLM_PLE_BACKEND=shm: a PLE lookup ran inside a captured CUDA graph; host "
            "work cannot be captured. Use -cc.cudagraph_mode=PIECEWISE (breakable CUDA "
            "graphs, the default for Qwen4Exp on CUDA) or --enforce-eager; for the "
            "seed interface list vllm::ple_shm_lookup in -cc.splitting_ops"
        )


__all__ = ["RowService", "TableBinding", "PendingLookup", "TORCH_DTYPES"]
