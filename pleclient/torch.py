"""PyTorch side of pleclient: pinned channel segment, rows to the device by DMA.

The channel segment is registered with CUDA once (``cudaHostRegister``), so the
slot rows the server writes are page-locked host memory: a ``non_blocking``
host→device copy from them is a DMA the GPU runs on its own, with no staging
copy through pageable memory. The slot must stay untouched until that copy has
finished, so every copy records an event and the slot is released only once
the event has completed::

    pinned = PinnedSegment(client.segment_buffer, device)
    ticket = client.submit(table, ids)
    copy = copy_rows(ticket.wait(), out_bytes)       # async on the current stream
    ...
    copy.wait(); ticket.release()                    # or: DeviceCopy.done()
    pinned.close()                                   # before client.close()

On a CPU device nothing is registered and copies are plain memcpy.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

__all__ = ["PinnedSegment", "DeviceCopy", "copy_rows", "rows_as_tensor", "buffer_address"]


def buffer_address(buffer) -> tuple[int, int]:  # any writable buffer
    """(address, size) of a writable buffer such as an mmap or memoryview of one."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    try:
        return int(array.ctypes.data), int(array.nbytes)
    finally:
        del array  # drop the buffer export, or the mmap cannot close later


class PinnedSegment:
    """A host buffer page-locked for ``device`` (no-op for non-CUDA devices)."""

    def __init__(self, buffer, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.address, self.size = buffer_address(buffer)
        self.registered = False
        if self.device.type != "cuda":
            return
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            err = cudart.cudaHostRegister(self.address, self.size, 0)
        if _code(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of the {self.size >> 20} MiB ple-server channel failed: "
                f"{cudart.cudaGetErrorString(err)}; raise the locked-memory limit "
                "(ulimit -l / LimitMEMLOCK=infinity) or lower VLLM_PLE_SHM_CAPACITY"
            )
        self.registered = True
        log.debug("pinned ple-server channel: %d MiB at %#x", self.size >> 20, self.address)

    def close(self) -> None:
        """Unregister; call only when no copy from the buffer is in flight."""
        if not self.registered:
            return
        self.registered = False
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostUnregister(self.address)
        if _code(err) != 0:
            log.warning("cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))

    def __enter__(self) -> PinnedSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rows_as_tensor(rows: np.ndarray) -> torch.Tensor:
    """A zero-copy uint8 CPU tensor over a rows view of the segment."""
    return torch.from_numpy(rows)


class DeviceCopy:
    """One host→device copy in flight; the source may be reused after ``done``."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def copy_rows(rows: np.ndarray, out: torch.Tensor) -> DeviceCopy:
    """Copy uint8 rows ``[n, row_bytes]`` into ``out`` (uint8, same shape, any
    device). On CUDA the copy is asynchronous on the current stream; the source
    must live in a pinned buffer (``PinnedSegment``), or CUDA would stage it
    through pageable memory synchronously."""
    source = rows_as_tensor(rows)
    if out.device.type != "cuda":
        out.copy_(source)
        return DeviceCopy(None)
    out.copy_(source, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(out.device))
    return DeviceCopy(event)


def _code(err) -> int:  # cudaError enum or int
    return int(getattr(err, "value", err))
