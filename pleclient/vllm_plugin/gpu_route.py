"""The plugin's GPU-driven path: PLE lookups a captured CUDA graph can hold.

``RowService`` chooses it (``choose``) at the first lookup on a CUDA device
when ``VLLM_PLE_SHM_GPU_PATH`` is ``auto`` (the default), the device has
stream memory operations and the server offers GPU-driven channels; otherwise,
and on CPU runs, lookups keep the host path (a round trip per layer, eager
breaks in graphs). The log says which path is in use and why.

A replayed graph repeats the very slots it was captured with, so every PLE
layer owns fixed slots of one GPU-driven channel: ``slots_per_layer`` of them,
enough for its largest lookup (``max_ids``: vLLM's token budget × n-gram heads,
in chunks of ``capacity`` ids). ``start`` rings a layer's chunks on the
current stream and ``finish`` collects them into the output: no host sync,
nothing to release afterwards (the rows land in ``out`` on the stream).
Slots of one layer are rung again only after ``finish`` (or ``discard``),
which vLLM's order — start for layer i+1, finish it at layer i+1 — gives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from pleclient import protocol
from pleclient.gpu import GpuLookupError, GpuLookups, stream_memops_supported
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.settings import ENV_CAPACITY, ENV_GPU_PATH, GPU_PATH_STANDIN

log = logging.getLogger("pleclient.vllm_plugin")

DEFAULT_MAX_IDS = 2048 * 16
"""A layer's largest lookup when vLLM did not say (a 2 048-token prefill)."""


@dataclass(eq=False)
class GpuPending:
    """One layer's lookup, rung and not yet collected."""

    layer_slots: range
    count: int
    chunks: list[tuple[int, int, int]]  # (slot, start, end) of the ids


class GpuRoute:
    """A GPU-driven channel shared by every PLE layer of the worker."""

    def __init__(
        self, lookups: GpuLookups, layers: list[object], slots_per_layer: int, standin: bool
    ) -> None:
        self.lookups = lookups
        self.standin = standin
        self.slots_per_layer = slots_per_layer
        self._first_slot = {id(b): i * slots_per_layer for i, b in enumerate(layers)}

    @classmethod
    def choose(
        cls,
        setting: str,
        device: torch.device,
        socket: str,
        bindings: list,
        capacity: int | None,
        timeout: float,
        connect_timeout: float,
    ) -> GpuRoute | None:
        """The route for lookups on ``device``, or None for the host path (logged)."""
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
                timeout=timeout,
                name=f"vllm-gpu-{device}",
                connect_timeout=connect_timeout,
            )
        except Exception as exc:  # an older server, no locked memory, …: the host path works
            log.warning("PLE backend shm: host path: no GPU-driven channel (%s)", exc)
            return None
        log.info(
            "PLE backend shm: GPU-driven lookups%s on %s: %d PLE layers × %d slots of %d ids, "
            "no host synchronization per step",
            " (CPU stand-in)" if standin else "",
            device,
            len(bindings),
            slots_per_layer,
            capacity,
        )
        return cls(lookups, bindings, slots_per_layer, standin)

    def serves(self, binding: object, count: int) -> bool:
        """Whether this route takes a lookup of ``count`` ids for ``binding``."""
        return (
            id(binding) in self._first_slot
            and 0 < count <= self.slots_per_layer * self.lookups.capacity
        )

    def start(self, binding, ids: torch.Tensor) -> GpuPending:
        """Ring ``binding``'s slots with ``ids`` (flattened to int64) on the stream."""
        self._check()
        first = self._first_slot[id(binding)]
        flat = ids.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.to(torch.int64)
        flat = flat.contiguous()
        count = int(flat.shape[0])
        cap = self.lookups.capacity
        chunks = [
            (first + k, start, min(start + cap, count))
            for k, start in enumerate(range(0, count, cap))
        ]
        for slot, start, end in chunks:
            self.lookups.ring(slot, binding.info, flat[start:end])
        return GpuPending(range(first, first + self.slots_per_layer), count, chunks)

    def finish(self, pending: GpuPending, target: torch.Tensor) -> None:
        """Collect ``pending``'s rows into ``target`` (uint8 ``[count, row_bytes]``)."""
        chunks, pending.chunks = pending.chunks, []
        try:
            for slot, start, end in chunks:
                self.lookups.collect(slot, target[start:end])
        except GpuLookupError as exc:  # the CPU stand-in; a GPU fails the step itself
            raise PleBackendError(f"VLLM_PLE_BACKEND=shm: a PLE lookup failed: {exc}") from None
        self._check()

    def discard(self, pending: GpuPending, row_bytes: int, device: torch.device) -> None:
        """Collect a lookup nobody will use, so its slots can be rung again."""
        if not pending.chunks:
            return
        scratch = torch.empty((pending.count, row_bytes), dtype=torch.uint8, device=device)
        self.finish(pending, scratch)

    def _check(self) -> None:
        if self.lookups.failure is not None:
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: GPU-driven PLE lookups failed: {self.lookups.failure}. "
                "Restart the worker once ple-server serves again (`systemctl status ple-server`)"
            )

    def close(self) -> None:
        """Only once the stream holds no lookup of ours (the caller synchronizes)."""
        self.lookups.close()
