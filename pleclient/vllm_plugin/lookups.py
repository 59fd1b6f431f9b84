"""One PLE layer's lookups: its table, its route, its rows' encoding, its started lookup.

``LayerLookups`` is what a storage class (``storage``, ``qwen38_flash_next``)
holds per layer::

    lookups.lookup(ids, out)    # synchronous: rows of ids into out
    lookups.start(ids)          # the layer's next rows go out ...
    lookups.finish(out)         # ... and land in out, when the layer needs them

* The route (``routes``) is chosen at the layer's first lookup and kept. Where
  it is not ``capturable`` (the host route), the calls run as eager breaks
  (vLLM's ``eager_break_during_capture``, passed in as ``eager``): they write
  into caller-provided outputs and keep the started lookup here, so a replayed
  graph runs them again, in order. A break's first call is made while vLLM
  captures (``capturing``, passed in too), before the GPU has run the segment
  recorded ahead of it: the ids it would read are not computed yet (an Engram
  layer's hash ran in that segment). That call asks the server nothing and
  zeroes the output; each replay makes the real call on the step's ids.
* Routes deal in rows as served (uint8 ``[n, row_bytes]``); the layer's
  encoding turns them into the model's rows, once, here: ``StoredRows`` (the
  table's dtype, or converted to the output's) or ``nvfp4.Nvfp4Rows`` (packed
  values and block scales, decoded as stock does). The output is checked here,
  once, before any route sees it.
* One lookup is started at a time: ``start`` gives up one that was started and
  never finished (a step that failed half way), so two steps' ids never mix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pleclient.vllm_plugin.routes import Route, Routes
from pleclient.vllm_plugin.rows import TableBinding

Call = Callable[..., None]
Runner = Callable[[Call], Call]
"""Wraps a call for how it runs inside CUDA graphs (as it is, or as an eager break)."""

Fill = Callable[[torch.Tensor], None]
"""Writes the rows as served into the uint8 ``[n, row_bytes]`` tensor it is given."""


class RowEncoding(Protocol):
    """How rows as served become the model's rows."""

    def write(self, out: torch.Tensor, fill: Fill) -> None:
        """Have ``fill`` write the served rows of ``out``'s rows (contiguous,
        ``cols`` elements a row), then make them ``out``'s."""
        ...


class StoredRows:
    """Served rows are the table's rows: written straight into an output of
    the table's dtype, or staged and converted to the output's dtype."""

    def __init__(self, binding: TableBinding) -> None:
        self.dtype = binding.storage_dtype
        self.cols = binding.expected.cols
        self.row_bytes = binding.row_bytes

    def write(self, out: torch.Tensor, fill: Fill) -> None:
        rows = out.numel() // self.cols
        if out.dtype == self.dtype:
            fill(out.view(torch.uint8).view(rows, self.row_bytes))
            return
        staging = torch.empty((rows, self.cols), dtype=self.dtype, device=out.device)
        fill(staging.view(torch.uint8).view(rows, self.row_bytes))
        out.copy_(staging.view(out.shape))


def _now(call: Call) -> Call:
    return call


def _never() -> bool:
    return False


def _zero_out(*args: torch.Tensor) -> None:
    args[-1].zero_()  # (the output: last of lookup's and finish's arguments)


class LayerLookups:
    """One PLE layer's lookups (see the module docstring)."""

    # The calls as the layer's route runs them (set with the route).
    _lookup_now: Call
    _start_now: Call
    _finish_now: Call
    _discard_now: Call

    def __init__(
        self,
        binding: TableBinding,
        routes: Routes,
        encoding: RowEncoding,
        *,
        eager: Runner = _now,
        capturing: Callable[[], bool] = _never,
        route: Route | None = None,
    ) -> None:
        """``eager``: how calls that cannot be captured run in CUDA graphs;
        ``capturing``: whether such a call is the one made during the capture
        (no server, zeroed output); ``route``: a fixed route (default:
        ``routes.for_layer`` at the first lookup)."""
        self.binding = binding
        self._routes = routes
        self._encoding = encoding
        self._eager = eager
        self._capturing = capturing
        self._cols = binding.expected.cols
        self._route: Route | None = None
        self._pending: Any = None  # the route's handle of the started lookup
        self._pending_count = 0
        if route is not None:
            self._take(route)

    @property
    def route(self) -> Route | None:
        """The layer's route; None until its first lookup."""
        return self._route

    @property
    def in_flight(self) -> bool:
        """Whether a started lookup waits for ``finish``."""
        return self._pending is not None

    # ---------------------------------------------------------------- lookups
    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of ``ids`` into ``out`` (the model's rows: contiguous,
        ``ids.numel()`` of them); a started lookup stays started."""
        self._check(ids.numel(), out)
        self._choose(ids.device)
        self._lookup_now(ids, out)

    def start(self, ids: torch.Tensor) -> None:
        """Start the lookup of ``ids``; ``finish`` collects it."""
        self._choose(ids.device)
        self._start_now(ids)

    def finish(self, out: torch.Tensor) -> None:
        """The started lookup's rows into ``out`` (the model's rows)."""
        self._choose(out.device)
        self._finish_now(out)

    def discard(self) -> None:
        """Give up the started lookup, if any."""
        if self._route is not None:
            self._discard_now()

    # ------------------------------------------------- the route, chosen once
    def _choose(self, device: torch.device) -> None:
        if self._route is None:
            self._take(self._routes.for_layer(self.binding, device))

    def _take(self, route: Route) -> None:
        self._route = route
        if route.capturable:
            self._lookup_now, self._start_now = self._lookup, self._start
            self._finish_now, self._discard_now = self._finish, self._discard
            return
        self._lookup_now = self._eager(self._unless_capturing(self._lookup, _zero_out))
        self._start_now = self._eager(self._unless_capturing(self._start, self._discard_ids))
        self._finish_now = self._eager(self._unless_capturing(self._finish, _zero_out))
        self._discard_now = self._eager(self._discard)

    def _unless_capturing(self, call: Call, at_capture: Call) -> Call:
        def run(*args: Any) -> None:
            (at_capture if self._capturing() else call)(*args)

        return run

    def _discard_ids(self, ids: torch.Tensor) -> None:
        self._discard()  # (a start during the capture: nothing is sent)

    def _lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        route = self._route
        assert route is not None  # (chosen first)
        handle = route.start(self.binding, ids)
        self._encoding.write(out, lambda served: route.finish(handle, served))

    def _start(self, ids: torch.Tensor) -> None:
        assert self._route is not None  # (chosen first)
        self._discard()
        self._pending = self._route.start(self.binding, ids)
        self._pending_count = ids.numel()

    def _finish(self, out: torch.Tensor) -> None:
        route, handle, self._pending = self._route, self._pending, None
        assert route is not None  # (chosen first)
        if handle is None:
            raise RuntimeError(
                f"{self.binding.expected.prefix}: no shm lookup was started for these rows "
                "(vLLM's start_prefetch, or an Engram layer's prepare_embeddings, comes first)"
            )
        try:
            self._check(self._pending_count, out)
        except ValueError:
            route.discard(handle)
            raise
        self._encoding.write(out, lambda served: route.finish(handle, served))

    def _discard(self) -> None:
        handle, self._pending = self._pending, None
        if handle is not None:
            assert self._route is not None  # (it started the handle)
            self._route.discard(handle)

    def _check(self, count: int, out: torch.Tensor) -> None:
        """The one check of a lookup's output: room for exactly ``count`` rows."""
        if not out.is_contiguous():
            raise ValueError(f"{self.binding.expected.prefix}: the PLE output must be contiguous")
        if out.numel() != count * self._cols:
            raise ValueError(
                f"{self.binding.expected.prefix}: the rows of {count} ids are {count} x "
                f"{self._cols} elements; the output {tuple(out.shape)} holds {out.numel()}"
            )


__all__ = ["LayerLookups", "RowEncoding", "StoredRows"]
