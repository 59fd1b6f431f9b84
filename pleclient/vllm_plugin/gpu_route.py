"""The GPU-driven route: PLE lookups a captured CUDA graph can hold.

``routes.Routes`` opens it (``choose``) at the first lookup on a CUDA device
when ``VLLM_PLE_SHM_GPU_PATH`` is ``auto`` (the default), the device has stream
memory operations and the server offers GPU-driven channels; otherwise, and on
CPU runs, lookups take the host route (a round trip per layer, eager breaks in
graphs). The log says which route is in use and why.

A server that goes away costs a stall, never the step: the channel's
watchdog (``pleclient.gpu.Watchdog``) has the next server adopt the channel
(so the captured graphs keep their addresses and their waiting lookups are
answered), and past ``VLLM_PLE_SHM_FALLBACK_S`` it answers them itself from
the checkpoint (``RowService.checkpoint_reader``).

A replayed graph repeats the very slots it was captured with, so every PLE
layer owns fixed slots of one GPU-driven channel: ``slots_per_layer`` of them,
enough for its largest lookup (``max_ids``: vLLM's token budget × n-gram heads,
in chunks of ``capacity`` ids). ``start`` rings a layer's chunks on the
current stream and ``finish`` collects them into the output: no host sync,
nothing to release afterwards (the rows land in ``out`` on the stream). A
lookup with more chunks than its layer has slots (larger than vLLM's budget)
rings the rest during ``finish``, each once its slot's previous chunk is
collected. Slots of one layer are rung again only after ``finish`` (or
``discard``), which vLLM's order — start a layer, finish it at that layer —
gives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pleclient import protocol
from pleclient.fallback import CheckpointReader
from pleclient.gpu import GpuLookupError, GpuLookups, stream_memops_supported
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.rows import TableBinding
from pleclient.vllm_plugin.settings import (
    ENV_CAPACITY,
    ENV_FALLBACK,
    ENV_GPU_PATH,
    GPU_PATH_STANDIN,
    ShmSettings,
)

log = logging.getLogger("pleclient.vllm_plugin")

DEFAULT_MAX_IDS = 2048 * 16
"""A layer's largest lookup when vLLM did not say (a 2 048-token prefill)."""


@dataclass(eq=False)
class GpuPending:
    """One layer's lookup, rung (``rung`` of its chunks) and not yet collected."""

    binding: TableBinding
    ids: torch.Tensor  # flattened int64, kept for the chunks rung during finish
    chunks: list[tuple[int, int, int]]  # (slot, start, end) of the ids
    rung: int

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


class GpuRoute:
    """A GPU-driven channel shared by every PLE layer of the worker."""

    capturable = True  # stream operations only: no host work per lookup

    def __init__(
        self,
        lookups: GpuLookups,
        layers: list[TableBinding],
        slots_per_layer: int,
        standin: bool,
    ) -> None:
        self.lookups = lookups
        self.standin = standin
        self.name = "gpu-driven" + (" (CPU stand-in)" if standin else "")
        self.slots_per_layer = slots_per_layer
        self._first_slot = {id(b): i * slots_per_layer for i, b in enumerate(layers)}

    @classmethod
    def choose(
        cls,
        settings: ShmSettings,
        device: torch.device,
        socket: str,
        bindings: list[TableBinding],
        reader: CheckpointReader | None,
    ) -> GpuRoute | None:
        """The route for lookups on ``device``, or None for the host route
        (logged). ``reader``: the worker's own reads of the checkpoint, which
        answer rung lookups while no server does (``settings.fallback_after``)."""
        setting, capacity = settings.gpu_path, settings.capacity
        if setting == "off":
            log.info("PLE backend shm: host path (%s=off)", ENV_GPU_PATH)
            return None
        standin = setting == GPU_PATH_STANDIN
        if not standin:
            supported, why = stream_memops_supported(device)
            if not supported:
                log.info("PLE backend shm: host path, with eager breaks in CUDA graphs (%s)", why)
                return None
        capacity = capacity or protocol.DEFAULT_CAPACITY
        max_ids = max(b.max_ids or DEFAULT_MAX_IDS for b in bindings)
        slots_per_layer = math.ceil(max_ids / capacity)
        depth = slots_per_layer * len(bindings)
        if depth > protocol.MAX_DEPTH:
            log.warning(
                "PLE backend shm: host path: %d PLE layers × %d slots of %d ids (for "
                "lookups of up to %d ids) exceed a channel's %d slots; raise %s",
                len(bindings),
                slots_per_layer,
                capacity,
                max_ids,
                protocol.MAX_DEPTH,
                ENV_CAPACITY,
            )
            return None
        try:
            lookups = GpuLookups.open(
                socket,
                device="cpu" if standin else device,
                capacity=capacity,
                depth=depth,
                timeout=settings.lookup_timeout,
                name=f"vllm-gpu-{device}",
                connect_timeout=settings.connect_timeout,
                reader=reader,
                fallback_after=settings.fallback_after or 0.0,
                reconnect_window=settings.reconnect_window,
                ops=settings.gpu_ops,
            )
        except Exception as exc:  # an older server, no locked memory, …: the host path works
            log.warning("PLE backend shm: host path: no GPU-driven channel (%s)", exc)
            return None
        log.info(
            "PLE backend shm: GPU-driven lookups%s on %s (%s): %d PLE layers × %d slots of %d "
            "ids, no host synchronization per step",
            " (CPU stand-in)" if standin else "",
            device,
            lookups.ops,
            len(bindings),
            slots_per_layer,
            capacity,
        )
        return cls(lookups, bindings, slots_per_layer, standin)

    def serves(self, binding: TableBinding) -> bool:
        """Whether ``binding``'s layer has slots here (it was bound before the
        route opened)."""
        return id(binding) in self._first_slot

    def start(self, binding: TableBinding, ids: torch.Tensor) -> GpuPending:
        """Ring ``binding``'s slots with ``ids`` (flattened to int64) on the stream."""
        self._check()
        info = binding.info
        assert info is not None  # a dummy binding takes the zero route
        first = self._first_slot[id(binding)]
        flat = ids.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.to(torch.int64)
        flat = flat.contiguous()
        cap = self.lookups.capacity
        chunks = [
            (first + k % self.slots_per_layer, start, min(start + cap, flat.shape[0]))
            for k, start in enumerate(range(0, flat.shape[0], cap))
        ]
        pending = GpuPending(binding, flat, chunks, rung=min(len(chunks), self.slots_per_layer))
        for slot, start, end in chunks[: pending.rung]:
            self.lookups.ring(slot, info, flat[start:end])
        return pending

    def finish(self, pending: GpuPending, out: torch.Tensor) -> None:
        """Enqueue the collection of ``pending``'s rows into ``out`` (uint8
        ``[count, row_bytes]``, on the device)."""
        self._collect(pending, out)

    def discard(self, pending: GpuPending) -> None:
        """Collect a lookup nobody will use, so its slots can be rung again."""
        if pending.rung:
            row_bytes = pending.binding.row_bytes
            device = pending.ids.device
            scratch = torch.empty((pending.count, row_bytes), dtype=torch.uint8, device=device)
            del pending.chunks[pending.rung :]  # never rung: nothing to collect
            self._collect(pending, scratch)

    def _collect(self, pending: GpuPending, target: torch.Tensor) -> None:
        chunks, pending.chunks = pending.chunks, []
        rung, pending.rung = pending.rung, 0
        info = pending.binding.info
        assert info is not None  # (start rang it)
        try:
            for k, (slot, start, end) in enumerate(chunks):
                if k >= rung:  # its slot's previous chunk was collected just now
                    self._check()
                    self.lookups.ring(slot, info, pending.ids[start:end])
                self.lookups.collect(slot, target[start:end])
        except GpuLookupError as exc:  # the CPU stand-in; a GPU fails the step itself
            raise PleBackendError(f"VLLM_PLE_BACKEND=shm: a PLE lookup failed: {exc}") from None
        self._check()

    def _check(self) -> None:
        if self.lookups.failure is not None:
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: GPU-driven PLE lookups failed: {self.lookups.failure}. "
                "Restart the worker once ple-server serves again (`systemctl status ple-server`); "
                f"a server that goes away costs a stall instead where the worker may read rows "
                f"itself ({ENV_FALLBACK})"
            )

    def close(self) -> None:
        """Only once the stream holds no lookup of ours (the caller synchronizes)."""
        self.lookups.close()
