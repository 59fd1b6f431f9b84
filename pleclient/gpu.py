"""GPU-driven lookups: a CUDA stream rings ple-server and waits for the rows.

Nothing here synchronizes the host with the GPU, so a lookup can sit inside a
captured CUDA graph and runs again, unchanged, on every replay::

    lookups = GpuLookups.open(socket, device="cuda:0", capacity=C, depth=D)
    lookups.ring(slot, "layer1", ids)      # ids: int64 on the GPU; enqueued
    ...                                    # other work on the stream meanwhile
    lookups.collect(slot, out)             # rows → out (uint8 [n, row_bytes])
    lookups.close()

``ring`` enqueues the ids' copy into the slot and the doorbell; ``collect``
enqueues the wait for the slot's done word, the rows' copy, the done word's
reset and a device-side check that the answer was not an error. The words, and
why each write is ordered as it is, are in ``pleclient.protocol`` ("GPU-driven
channels"; the stream's ordering edges are G1-G3 there). A slot serves one
call site: ring it again only after its ``collect`` (stream order does that
inside one graph).

Two streams run the same words:

* ``CudaStream`` — the CUDA driver's stream memory operations
  (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) and ``cuMemcpyAsync``,
  called through ``libcuda`` directly: the segment is page-locked and mapped
  for the device once (``PinnedSegment``), and every address is a device
  address of it;
* ``HostStream`` — a CPU stand-in that writes exactly those words, in that
  order, from the calling thread (``SlotView.ring`` / ``wait_done`` /
  ``reset_done``): the protocol's tests, and a way to run this code without a
  GPU.

A graph cannot raise, and a GPU waiting on a dead server would wait forever.
The ``Watchdog`` thread keeps every wait answered: a server that is gone
costs a stall (the next server adopts the channel and answers the waiting
lookups; past a short wait the watchdog reads their rows from the checkpoint
itself, when it has a ``pleclient.fallback.CheckpointReader``), and a server
that hangs, or a loss with no reader past the reconnect window, ends the
waits with an error mark (``SlotView.abandon``), so the stream's check fails
the step instead of handing out zeros or stale rows.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Protocol

import numpy as np

from pleclient import protocol as p
from pleclient.channel import RUNG_AT, SlotView
from pleclient.client import PleClient, TableInfo
from pleclient.errors import PleError, ProtocolMismatch
from pleclient.fallback import CheckpointReader

log = logging.getLogger(__name__)

__all__ = [
    "GpuLookups",
    "GpuLookupError",
    "CudaStream",
    "HostStream",
    "Watchdog",
    "stream_memops_supported",
    "DEFAULT_GPU_OPS",
    "GPU_OPS",
]

WATCH_INTERVAL_S = 0.01
"""How often the watchdog looks at the server and the rung slots."""
LOST_POLL_S = 0.01
"""While the server is away: how often the watchdog looks (for the next one)."""
FALLBACK_POLL_S = 0.0005
"""While it answers lookups from the checkpoint: how often it looks for rung
slots (what a lookup may wait on top of its read)."""
FALLBACK_AFTER_S = 1.0
"""How long rung lookups wait for the next server before the watchdog reads
their rows itself (when it has a reader)."""
RECONNECT_FIRST_S = 0.02
RECONNECT_MAX_S = 0.25
"""Tries for the next server: at once, then after 20 ms, doubling up to 250 ms
(a restart is caught within a quarter of a second of its socket listening)."""
RECONNECT_TIMEOUT_S = 2.0
"""One try's connect and handshake, at most (the watchdog answers nothing meanwhile)."""

GPU_OPS = ("memops", "kernels")
"""How a CUDA stream rings and collects: the driver's stream memory operations,
or the two kernels of ``pleclient.gpu_kernels``."""
DEFAULT_GPU_OPS = "kernels"
"""Two graph nodes a PLE layer instead of eleven: inside vLLM 0.33's default
CUDA graphs on an H100 the stream memory operations left the GPU idle about
0.27 ms a decode step (0.89–0.90 × stock resident), the kernels decoded at
1.01–1.15 × stock, identical to it (docs/BENCHMARKS.md, "The ring and collect
as kernels inside vLLM's engine"). Where the kernels cannot be built the
memops run."""

# CUDA driver constants (cuda.h).
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # fenced (v2 refuses NO_MEMORY_BARRIER)
_CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92
_CUDA_12 = 12000  # driver version from which the memop API (v2) is always there


class GpuLookupError(PleError):
    """A GPU-driven lookup was answered with an error (on the CPU stand-in;
    on a GPU the step fails with a device-side assertion instead)."""


# ----------------------------------------------------------------- CUDA driver
_libcuda: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    """``libcuda`` with the prototypes used here (loaded once)."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
        lib.cuStreamWriteValue32_v2.argtypes = [vp, u64, u32, ctypes.c_uint]
        lib.cuStreamWaitValue32_v2.argtypes = [vp, u64, u32, ctypes.c_uint]
        lib.cuMemcpyAsync.argtypes = [u64, u64, ctypes.c_size_t, vp]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDeviceGetAttribute.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        # pleclient.gpu_kernels' module and launches
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuModuleUnload.argtypes = [vp]
        lib.cuLaunchKernel.argtypes = [vp, *[ctypes.c_uint] * 7, vp, ctypes.POINTER(vp), vp]
        _libcuda = lib
    return _libcuda


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        raise PleError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def stream_memops_supported(device) -> tuple[bool, str]:
    """Whether ``device`` (a CUDA torch device) can run the stream memory
    operations GPU-driven lookups need, and why (for the log)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"{device} is not a CUDA device"
    try:
        lib = _cuda()
    except OSError as exc:
        return False, f"libcuda cannot be loaded ({exc})"
    torch.cuda.init()  # the driver and the primary context, as torch uses them
    version = ctypes.c_int()
    _check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    if version.value >= _CUDA_12:
        return True, f"CUDA driver {version.value}: stream memory operations are always available"
    value = ctypes.c_int()
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    result = lib.cuDeviceGetAttribute(
        ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, ordinal
    )
    if result != 0 or not value.value:
        return False, (
            f"CUDA driver {version.value} on {device}: CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS "
            "is 0 (load the nvidia module with NVreg_EnableStreamMemOPs=1, or use a driver "
            "for CUDA 12 or later)"
        )
    return True, f"CUDA driver {version.value}: stream memory operations enabled"


class Stream(Protocol):
    """Enqueues one slot's half of a lookup, the way ``pleclient.protocol``
    orders the words."""

    ops: str
    """What runs the words: ``memops``, ``kernels`` (``GPU_OPS``) or ``host``."""

    def ring(
        self, slot: SlotView, table: int, ids, count: int, kind: int | None = None
    ) -> None: ...

    def collect(self, slot: SlotView, out, count: int, row_bytes: int) -> None: ...

    def close(self) -> None: ...


class CudaStream:
    """The words written and waited on by the current CUDA stream of ``device``."""

    ops = "memops"

    def __init__(self, client: PleClient, device) -> None:
        import torch

        from pleclient.torch import PinnedSegment

        self.device = torch.device(device)
        self._torch = torch
        self._pinned = PinnedSegment(client.segment_buffer, self.device)
        dptr = ctypes.c_uint64()
        try:
            _check(
                _cuda().cuMemHostGetDevicePointer_v2(
                    ctypes.byref(dptr), ctypes.c_void_p(self._pinned.address), 0
                ),
                "cuMemHostGetDevicePointer",
            )
        except BaseException:
            self._pinned.close()
            raise
        self._base = dptr.value  # the segment's device address (its host address on UVA)
        self._layout = client.channel.layout
        self._rung_address = self._base + RUNG_AT
        # Each slot's done word as the GPU saw it, for the device-side check.
        self._seen = torch.zeros(self._layout.depth, dtype=torch.int32, device=self.device)

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self._torch.cuda.current_stream(self.device).cuda_stream)

    def _address(self, slot: SlotView, word: int) -> int:
        return slot.word_address(word, self._base)

    def ring(self, slot: SlotView, table: int, ids, count: int, kind: int | None = None) -> None:
        """``kind``: the slot's kind word, written before the doorbell (G1
        orders it with the ids), or None to leave it as it is."""
        lib, stream = _cuda(), self._stream()
        slot_base = self._base + self._layout.slot_offset(slot.index)
        _check(
            lib.cuMemcpyAsync(
                slot_base + self._layout.ids_offset, ids.data_ptr(), 8 * count, stream
            ),
            "copying the ids into the channel",
        )
        words = [(p.SL_TABLE, table), (p.SL_COUNT, count)]
        if kind is not None:
            words.append((p.SL_KIND, kind))
        for word, value in words:
            _check(
                lib.cuStreamWriteValue32_v2(
                    stream, self._address(slot, word), value, _CU_STREAM_WRITE_VALUE_DEFAULT
                ),
                "cuStreamWriteValue32",
            )
        # A fence scoped to the stream precedes every write (the v2 API has no
        # opt-out: NO_MEMORY_BARRIER is refused). G1: the ids, table and count
        # visible before the doorbell (pairs with the server's D1). G2: the
        # doorbell before the channel's rung word, the one word the server
        # polls (pairs with its X1). See pleclient.protocol, "Ordering edges".
        _check(
            lib.cuStreamWriteValue32_v2(
                stream,
                self._address(slot, p.SL_DOORBELL),
                p.Doorbell.RUNG,
                _CU_STREAM_WRITE_VALUE_DEFAULT,
            ),
            "cuStreamWriteValue32 (doorbell)",
        )
        _check(
            lib.cuStreamWriteValue32_v2(
                stream, self._rung_address, p.Doorbell.RUNG, _CU_STREAM_WRITE_VALUE_DEFAULT
            ),
            "cuStreamWriteValue32 (rung word)",
        )

    def collect(self, slot: SlotView, out, count: int, row_bytes: int) -> None:
        lib, stream = _cuda(), self._stream()
        done = self._address(slot, p.SL_DONE)
        # G3: work after the wait starts once done ≥ OK (OK or ERROR); the
        # server wrote the rows before done with a release store (E1).
        _check(
            lib.cuStreamWaitValue32_v2(stream, done, p.Done.OK, _CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue32 (done)",
        )
        rows = self._base + self._layout.slot_offset(slot.index) + self._layout.rows_offset
        _check(
            lib.cuMemcpyAsync(out.data_ptr(), rows, count * row_bytes, stream),
            "copying the rows to the device",
        )
        seen = self._seen[slot.index : slot.index + 1]
        _check(lib.cuMemcpyAsync(seen.data_ptr(), done, 4, stream), "copying the done word")
        _check(
            lib.cuStreamWriteValue32_v2(
                stream, done, p.Done.WAITING, _CU_STREAM_WRITE_VALUE_DEFAULT
            ),
            "cuStreamWriteValue32 (reset)",
        )
        # The graph cannot raise: an error answer traps here, before any kernel
        # reads ``out``, and the step fails (the watchdog's log says why).
        self._torch._assert_async(
            seen == p.Done.OK,
            "ple-server answered a GPU-driven lookup with an error, or its watchdog "
            "gave up on the server: see the pleclient.gpu log",
        )

    def close(self) -> None:
        """Unregister the segment: only once no enqueued lookup can still run."""
        self._pinned.close()


class HostStream:
    """The CPU stand-in: the same words, written and waited on by the caller's
    thread (``ids`` and ``out`` are NumPy arrays or CPU tensors)."""

    ops = "host"

    def __init__(self, wait_timeout: float) -> None:
        self._wait_timeout = wait_timeout  # past the watchdog's: only a broken one

    def ring(self, slot: SlotView, table: int, ids, count: int, kind: int | None = None) -> None:
        slot.ring(
            table,
            np.asarray(ids).reshape(-1)[:count],
            slot.words[p.SL_KIND] if kind is None else kind,
        )

    def collect(self, slot: SlotView, out, count: int, row_bytes: int) -> None:
        done = slot.wait_done(self._wait_timeout)
        if done == p.Done.WAITING:  # a GPU would wait on: the watchdog should have ended it
            raise GpuLookupError(
                f"slot {slot.index}: no answer and no watchdog mark within "
                f"{self._wait_timeout:.3g} s"
            )
        np.asarray(out).reshape(count, row_bytes)[:] = slot.rows_view(count, row_bytes)
        slot.reset_done()
        if done != p.Done.OK:
            raise GpuLookupError(
                f"slot {slot.index}: {p.ErrorCode(slot.words[p.SL_ERROR]).name}: "
                f"{slot.error_text()}"
            )

    def close(self) -> None:
        pass


class Watchdog:
    """Keeps a GPU-driven channel's waits answered, whatever happens to the server.

    Every ``interval`` it asks the session whether the server is gone, and
    looks at each slot's doorbell.

    * While the server is there, a slot rung (or claimed) with no answer for
      ``timeout`` seconds is abandoned (error INTERNAL, with that text): a hung
      server fails the step. ``failure`` holds the reason (logged once, at
      ERROR), and every later lookup fails too.
    * Once the server is gone (its control socket closed: a stop, a restart,
      a crash), nothing is abandoned: the waiting lookups cost a stall. The
      watchdog connects again with backoff, and the next server adopts the
      channel's segment (``PleClient.reconnect``): the captured graphs keep
      their addresses, and the lookups they rang are answered by the new
      server. Past ``fallback_after`` seconds without a server, the watchdog
      answers rung lookups itself, reading the rows from the checkpoint
      (``reader``, a ``pleclient.fallback.CheckpointReader``), until a server
      is back. Without a reader, past ``reconnect_window`` seconds the waits
      are abandoned (the step fails) and ``failure`` is set.

    ``events`` records each loss: when, the stall until the first answer
    (the next server's adoption or the first fallback answer), and how it
    ended."""

    def __init__(
        self,
        client: PleClient,
        timeout: float,
        interval: float = WATCH_INTERVAL_S,
        *,
        reader: CheckpointReader | None = None,
        fallback_after: float = FALLBACK_AFTER_S,
        reconnect_window: float = 30.0,
    ):
        self.client = client
        self.timeout = timeout
        self.interval = interval
        self.reader = reader
        self.fallback_after = fallback_after
        self.reconnect_window = reconnect_window
        self.failure: str | None = None
        self.lost_since: float | None = None
        """When the server went away (monotonic), while it is away."""
        self.fallback_rows = 0
        """Rows the watchdog served from the checkpoint itself."""
        self.events: list[dict] = []
        self._since: dict[int, tuple[int, float]] = {}  # slot → (answers, first seen rung)
        self._next_try = 0.0
        self._retry_delay = RECONNECT_FIRST_S
        self._scan_all = False
        self._refused = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ple-gpu-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._pause()):
            try:
                self.look()
            except Exception:  # never die silently: the GPU's waits depend on us
                log.exception("ple-server GPU watchdog: a look failed")

    def _pause(self) -> float:
        """How long until the next look: short while lookups are answered here."""
        if self.lost_since is not None and self.failure is None:
            return FALLBACK_POLL_S if self._falling_back(time.monotonic()) else LOST_POLL_S
        return self.interval

    def _falling_back(self, now: float) -> bool:
        return (
            self.reader is not None
            and self.lost_since is not None
            and now - self.lost_since >= self.fallback_after
        )

    def look(self) -> None:
        """One look at the server and the slots (the thread's loop body)."""
        now = time.monotonic()
        if self.failure is not None:
            self._abandon_waiting(self.failure)
            return
        if self.lost_since is None:
            gone = self.client.poll_gone()
            if gone is None:
                self._look_for_hangs(now)
                return
            self._lost(gone, now)
        self._recover(now)

    def _look_for_hangs(self, now: float) -> None:
        for slot in self.client.channel.slots:
            if slot.doorbell == p.Doorbell.IDLE:
                self._since.pop(slot.index, None)
                continue
            answers = slot.answers
            seen = self._since.get(slot.index)
            if seen is None or seen[0] != answers:
                self._since[slot.index] = (answers, now)
            elif now - seen[1] > self.timeout:
                self._fail(
                    f"ple-server at {self.client.socket_path} did not answer slot "
                    f"{slot.index} within {self.timeout:.3g} s"
                )
                self._since.pop(slot.index, None)
                return

    def _lost(self, why: str, now: float) -> None:
        self.lost_since = now
        self._next_try = now
        self._retry_delay = RECONNECT_FIRST_S
        self._scan_all = True
        self._since.clear()
        self.events.append({"lost": why, "at": time.time(), "stall_s": None, "ended": None})
        if self.reader is not None:
            log.warning(
                "GPU-driven PLE lookups wait for the next ple-server (%s); past %.1f s this "
                "worker reads their rows from the checkpoint itself",
                why,
                self.fallback_after,
            )
        else:
            log.warning(
                "GPU-driven PLE lookups wait for the next ple-server for up to %.0f s (%s)",
                self.reconnect_window,
                why,
            )

    def _recover(self, now: float) -> None:
        """While the server is away: try the next one, answer rung lookups
        from the checkpoint past the wait, or give up past the window."""
        assert self.lost_since is not None
        if now >= self._next_try and self._try_reconnect(now):
            return
        if self._falling_back(now):
            self._serve_rung()
        elif self.reader is None and now - self.lost_since > self.reconnect_window:
            self._fail(
                f"ple-server at {self.client.socket_path} went away "
                f"({self.events[-1]['lost']}) and did not come back within "
                f"{self.reconnect_window:.0f} s"
            )

    def _try_reconnect(self, now: float) -> bool:
        try:
            self.client.reconnect(window=0, timeout=RECONNECT_TIMEOUT_S)
        except PleError as exc:
            self._next_try = now + self._retry_delay
            self._retry_delay = min(2 * self._retry_delay, RECONNECT_MAX_S)
            last = getattr(exc, "last", exc)
            if isinstance(last, ProtocolMismatch) and str(last) != self._refused:
                self._refused = str(last)  # a server there that will not do: said once
                log.warning("GPU-driven PLE lookups cannot go back to ple-server yet: %s", last)
            else:
                log.debug("ple-server GPU watchdog: not back yet: %s", exc)
            return False
        assert self.lost_since is not None
        took = time.monotonic() - self.lost_since
        event = self.events[-1]
        if event["stall_s"] is None:
            event["stall_s"] = took
        event["ended"] = "adopted"
        log.warning(
            "GPU-driven PLE lookups are back on ple-server at %s after %.2f s (the new server "
            "adopted the channel%s)",
            self.client.socket_path,
            took,
            f"; {self.fallback_rows} rows were read from the checkpoint meanwhile"
            if self.fallback_rows
            else "",
        )
        self.lost_since = None
        return True

    def _serve_rung(self) -> None:
        """Answer every rung lookup from the checkpoint, as the server would."""
        channel = self.client.channel
        if not (channel.take_rung() or self._scan_all):
            return
        self._scan_all = False
        for slot in channel.slots:
            if slot.doorbell != p.Doorbell.IDLE and slot.done == p.Done.WAITING:
                self._serve(slot)

    def _serve(self, slot: SlotView) -> None:
        assert self.reader is not None  # (only called while falling back)
        started = time.monotonic_ns()
        slot.claim()
        if slot.words[p.SL_KIND] == p.RequestKind.HINT:  # advice: no server to read it into
            slot.answer_gpu(p.ErrorCode.OK, "", 0)
            return
        # Copied before they are used: the words are the client's own stream's,
        # but one slot's answer must never depend on what another thread rewrites.
        table, count = int(slot.words[p.SL_TABLE]), int(slot.words[p.SL_COUNT])
        tables = self.client.tables
        spec = self.reader.tables.get(tables[table].name) if table < len(tables) else None
        if spec is None or not 1 <= count <= self.client.capacity:
            slot.answer_gpu(
                p.ErrorCode.BAD_TABLE if spec is None else p.ErrorCode.BAD_COUNT,
                f"fallback read: table {table}, count {count}: not a lookup this worker rang",
                0,
            )
            return
        ids = slot.ids[:count].copy()
        try:
            self.reader.read(spec.name, ids, slot.rows_view(count, spec.row_bytes))
        except (ValueError, OSError) as exc:
            text = f"the worker's own read of {spec.name} failed: {exc}"
            self._fail(text)
            return
        self.fallback_rows += count
        event = self.events[-1]
        if event["stall_s"] is None and self.lost_since is not None:
            event["stall_s"] = time.monotonic() - self.lost_since
            log.warning(
                "GPU-driven PLE lookups: the first answered from the checkpoint %.2f s after "
                "the server went away",
                event["stall_s"],
            )
        slot.answer_gpu(p.ErrorCode.OK, "", time.monotonic_ns() - started)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("GPU-driven PLE lookups fail from now on: %s", reason)
            if self.events and self.events[-1]["ended"] is None and self.lost_since is not None:
                self.events[-1]["ended"] = "failed"
        self._abandon_waiting(reason)

    def _abandon_waiting(self, reason: str) -> None:
        """Every slot whose done word is WAITING gets the error, now and on every
        later look, so a lookup rung after the failure fails too."""
        code = p.ErrorCode.SHUTTING_DOWN if self.lost_since is not None else p.ErrorCode.INTERNAL
        for slot in self.client.channel.slots:
            if slot.done == p.Done.WAITING and (
                slot.doorbell != p.Doorbell.IDLE or self.lost_since is not None
            ):
                slot.abandon(code, reason)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _cuda_stream(client: PleClient, device, ops: str) -> Stream:
    """``ops``' stream on ``device``; the stream memory operations where the
    kernels cannot be built here (no NVRTC, an architecture it does not know),
    said in the log: the lookups are the same, only slower."""
    if ops == "kernels":
        from pleclient.gpu_kernels import KernelStream

        try:
            return KernelStream(client, device)
        except PleError as exc:
            log.warning(
                "GPU-driven lookups on %s: the ring and collect kernels are not available "
                "(%s); using the driver's stream memory operations, the same lookups with "
                "about 0.07 ms more a PLE layer a step. To have the kernels, install NVRTC for "
                "torch's CUDA (its nvidia-cuda-nvrtc wheel, or a CUDA toolkit under "
                "/usr/local/cuda); to choose the stream memory operations and silence this, set "
                "VLLM_PLE_SHM_GPU_OPS=memops",
                device,
                exc,
            )
    return CudaStream(client, device)


class GpuLookups:
    """A GPU-driven channel: lookups enqueued on a stream, watched over."""

    def __init__(
        self,
        client: PleClient,
        stream: Stream,
        timeout: float = 30.0,
        *,
        reader: CheckpointReader | None = None,
        fallback_after: float = FALLBACK_AFTER_S,
        reconnect_window: float = 30.0,
    ) -> None:
        if not client.gpu_driven:
            raise PleError("GpuLookups needs a client whose channel is GPU-driven")
        self.client = client
        self.stream = stream
        self.watchdog = Watchdog(
            client,
            timeout,
            reader=reader,
            fallback_after=fallback_after,
            reconnect_window=reconnect_window,
        )
        self._rung: list[tuple[int, int] | None] = [None] * client.depth  # (count, row_bytes)
        # What each slot serves once used: LOOKUP or HINT, for good (a hint
        # slot's done word is never waited on, so it never serves a lookup).
        self._kind: list[int | None] = [None] * client.depth

    @classmethod
    def open(
        cls,
        socket_path: str | None = None,
        *,
        device="cuda",
        capacity: int | None = None,
        depth: int | None = None,
        timeout: float = 30.0,
        name: str | None = None,
        connect_timeout: float = 10.0,
        reader: CheckpointReader | None = None,
        fallback_after: float = FALLBACK_AFTER_S,
        reconnect_window: float = 30.0,
        ops: str = DEFAULT_GPU_OPS,
    ) -> GpuLookups:
        """Connect with a GPU-driven channel. ``device`` "cpu" gives the CPU
        stand-in (``HostStream``); a CUDA device needs stream memory
        operations (``stream_memops_supported``). ``ops``: how the stream
        rings and collects on a CUDA device, one of ``GPU_OPS``: the driver's
        stream memory operations (``CudaStream``) or two kernels of our own
        (``pleclient.gpu_kernels.KernelStream``). ``timeout``: how long the
        watchdog lets one lookup wait for a server that is there. A server
        that goes away costs a stall (``Watchdog``): the next one adopts the
        channel; past ``fallback_after`` s the watchdog reads rung lookups'
        rows from the checkpoint with ``reader``, if given, else past
        ``reconnect_window`` s the lookups fail."""
        if ops not in GPU_OPS:
            raise PleError(f"GPU-driven lookups: ops={ops!r}: use one of {', '.join(GPU_OPS)}")
        client = PleClient.connect(
            socket_path,
            connect_timeout,
            name=name,
            capacity=capacity,
            depth=depth,
            gpu_driven=True,
        )
        try:
            stream: Stream
            if str(device) == "cpu":
                stream = HostStream(wait_timeout=timeout * 4)
            else:
                supported, why = stream_memops_supported(device)
                if not supported:
                    raise PleError(f"GPU-driven lookups cannot run on {device}: {why}")
                stream = _cuda_stream(client, device, ops)
            return cls(
                client,
                stream,
                timeout,
                reader=reader,
                fallback_after=fallback_after,
                reconnect_window=reconnect_window,
            )
        except BaseException:
            client.close()
            raise

    @property
    def tables(self) -> list[TableInfo]:
        return self.client.tables

    @property
    def ops(self) -> str:
        """What rings and collects in fact: ``memops`` or ``kernels`` on a CUDA
        device (``kernels`` asked for and not available runs ``memops``), ``host``
        for the CPU stand-in."""
        return self.stream.ops

    @property
    def capacity(self) -> int:
        return self.client.capacity

    @property
    def depth(self) -> int:
        return self.client.depth

    @property
    def failure(self) -> str | None:
        """Why lookups fail (the watchdog's first reason), or None."""
        return self.watchdog.failure

    def _request(
        self, slot: int, table: str | int | TableInfo, ids, what: str
    ) -> tuple[SlotView, TableInfo, int]:
        """The checks a ring and a hint share: the channel alive, the slot, the
        table, and ids that are 1..capacity contiguous int64."""
        if self.watchdog.failure is not None:
            raise PleError(f"GPU-driven PLE lookups have failed: {self.watchdog.failure}")
        view = self._slot(slot)
        info = table if isinstance(table, TableInfo) else self.client.table(table)
        count = int(ids.numel() if hasattr(ids, "numel") else np.asarray(ids).size)
        if not 1 <= count <= self.capacity:
            raise ValueError(
                f"a GPU-driven {what} takes 1..{self.capacity} ids (the channel "
                f"capacity), not {count}: split it over slots"
            )
        if getattr(ids, "dtype", None) is not None and str(ids.dtype) not in (
            "torch.int64",
            "int64",
        ):
            raise ValueError(f"ids must be int64, not {ids.dtype}")
        if hasattr(ids, "is_contiguous") and not ids.is_contiguous():
            raise ValueError("ids must be contiguous")
        return view, info, count

    def ring(self, slot: int, table: str | int | TableInfo, ids) -> None:
        """Enqueue: ``ids`` (int64, contiguous; at most ``capacity``) into
        ``slot`` of ``table``, then its doorbell."""
        view, info, count = self._request(slot, table, ids, "lookup")
        if self._rung[slot] is not None:
            raise PleError(f"slot {slot} was rung and not collected: collect it first")
        self._use(slot, p.RequestKind.LOOKUP)
        self.stream.ring(view, self.client.table_index(info), ids, count)
        self._rung[slot] = (count, info.row_bytes)

    def hint(self, slot: int, table: str | int | TableInfo, ids) -> None:
        """Enqueue a prefetch hint: ``ids`` (int64, contiguous; at most
        ``capacity``) of ``table`` into ``slot``, a slot that serves hints
        only, then its doorbell: no wait, nothing to collect, so the stream
        never waits on it. The server copies the ids, answers at once and
        reads the rows into its cache below every lookup
        (``pleclient.protocol``, "Prefetch hints"). A ring that comes while
        the server still holds the slot's previous hint is lost, and one
        whose ids the stream rewrites while the server copies them hints
        other valid rows or is refused: a hint is advice, and the server
        validates its copy. Skipped (logged once by the client) where the
        server reads no hints."""
        view, info, count = self._request(slot, table, ids, "hint")
        first = self._use(slot, p.RequestKind.HINT)
        if not self.client.hints_supported:
            self.client.skip_hints(count)
            return
        self.client.hints_sent += count
        # The kind word is written with the first hint only: a slot keeps its kind.
        self.stream.ring(
            view, self.client.table_index(info), ids, count, p.RequestKind.HINT if first else None
        )

    def _use(self, slot: int, kind: p.RequestKind) -> bool:
        """Mark ``slot`` as serving ``kind`` (True the first time); PleError
        if it serves the other kind."""
        used = self._kind[slot]
        if used is None:
            self._kind[slot] = kind
            return True
        if used != kind:
            raise PleError(
                f"slot {slot} serves {p.RequestKind(used).name.lower()}s: "
                f"a slot serves lookups or hints, never both (a hint slot's answer "
                "is never waited for); use another slot"
            )
        return False

    def collect(self, slot: int, out) -> None:
        """Enqueue: wait for ``slot``'s answer, its rows into ``out`` (uint8,
        contiguous, ``[count, row_bytes]`` of the ring), the reset, the check."""
        view = self._slot(slot)
        rung = self._rung[slot]
        if rung is None:
            raise PleError(f"slot {slot} was not rung: nothing to collect")
        count, row_bytes = rung
        shape = tuple(out.shape)
        if shape != (count, row_bytes) or str(out.dtype) not in ("torch.uint8", "uint8"):
            raise ValueError(
                f"out must be uint8 {(count, row_bytes)} for slot {slot}, got {out.dtype} {shape}"
            )
        if hasattr(out, "is_contiguous") and not out.is_contiguous():
            raise ValueError("out must be contiguous")
        self._rung[slot] = None
        self.stream.collect(view, out, count, row_bytes)

    def _slot(self, slot: int) -> SlotView:
        if not 0 <= slot < self.depth:
            raise ValueError(f"slot {slot} out of range: the channel has {self.depth} slots")
        return self.client.channel.slots[slot]

    def close(self) -> None:
        """Stop the watchdog, unregister the segment, end the session. Only
        once nothing enqueued can still run (synchronize the stream first)."""
        self.watchdog.stop()
        self.stream.close()
        self.client.close()

    def __enter__(self) -> GpuLookups:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
