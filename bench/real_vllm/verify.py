"""Every PLE row an engine's steps received, checked against the checkpoint's bytes.

The check with no noise at all (issue 33, step 2): within one engine, each
lookup of every PLE layer, as the model's forward makes it, is compared bit for
bit with the rows of the same ids in the checkpoint's own tensors, the bytes
stock vLLM's loader copies into its resident table. Where the engine's output
differs from stock's for reasons of batching or kernels, this says whether the
rows ple-server served were the right ones.

``install_on_model(model, model_dir)`` wraps each shm PLE layer's lookups
(``LayerLookups.lookup``, and ``start`` / ``finish``): after the route has
written a lookup's rows, the stream is synchronised, the rows are copied to the
host and compared with ``pleclient.fallback.CheckpointReader``'s reads of the
same ids (the worker's own reader of the checkpoint files, which the fallback
uses too). A lookup inside a CUDA graph replay never reaches Python, so the
check needs an eager engine (``enforce_eager``). ``install`` is the same for
``LLM.collective_rpc``, which hands it the worker; ``report`` gives the counts.

Rows in an encoding other than the table's own (NVFP4's decoded rows) are not
compared: the check counts them as skipped.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from pleclient.checkpoint import discover_tables
from pleclient.fallback import CheckpointReader
from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows

log = logging.getLogger("bench.real_vllm.verify")

MISMATCHES_KEPT = 5


@dataclass
class RowCheck:
    """What the wrapped lookups saw, over every layer of one process."""

    layers: int = 0
    lookups: int = 0
    rows: int = 0
    mismatched_rows: int = 0
    skipped_lookups: int = 0
    mismatches: list[str] = field(default_factory=list)  # the first few, described

    def to_json(self) -> dict:
        return asdict(self)


_CHECK = RowCheck()


class _Verified:
    """One layer's lookups, each followed by the comparison."""

    def __init__(self, lookups: LayerLookups, reader: CheckpointReader, check: RowCheck) -> None:
        self.inner = lookups
        self.reader = reader
        self.check = check
        self.started: torch.Tensor | None = None
        self.compared = isinstance(lookups._encoding, StoredRows)
        self.lookup_now, self.start_now, self.finish_now = (
            lookups.lookup,
            lookups.start,
            lookups.finish,
        )

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.lookup_now(ids, out)
        self.compare(ids, out)

    def start(self, ids: torch.Tensor) -> None:
        self.started = ids.detach().clone()  # the caller may reuse its buffer
        self.start_now(ids)

    def finish(self, out: torch.Tensor) -> None:
        ids, self.started = self.started, None
        self.finish_now(out)
        if ids is not None:
            self.compare(ids, out)

    def compare(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        check = self.check
        check.lookups += 1
        if not self.compared:
            check.skipped_lookups += 1
            return
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        binding = self.inner.binding
        info = binding.info
        assert info is not None  # (bound at the engine's start)
        flat = ids.reshape(-1).to("cpu", torch.int64).numpy()
        want = np.empty((flat.size, info.row_bytes), dtype=np.uint8)
        self.reader.read(info.name, flat, want)
        # The rows as stock's table holds them, in the output's dtype.
        stored = torch.from_numpy(want).view(binding.storage_dtype)
        expected = stored.to(out.dtype).reshape(-1).view(torch.uint8)
        got = out.detach().reshape(-1).to("cpu").view(torch.uint8)
        check.rows += flat.size
        if torch.equal(got, expected):
            return
        per_row = got.numel() // max(flat.size, 1)
        bad = (got.view(flat.size, per_row) != expected.view(flat.size, per_row)).any(dim=1)
        wrong = bad.nonzero().reshape(-1).tolist()
        check.mismatched_rows += len(wrong)
        if len(check.mismatches) < MISMATCHES_KEPT:
            check.mismatches.append(
                f"{info.name}: {len(wrong)} of {flat.size} rows differ from the checkpoint "
                f"(first: position {wrong[0]}, id {int(flat[wrong[0]])})"
            )
        log.error("%s", check.mismatches[-1])


def install_on_model(model: torch.nn.Module, model_dir: str) -> RowCheck:
    """Wrap every bound shm PLE layer of ``model``; the counts go to the
    process's ``RowCheck`` (``report``)."""
    specs = discover_tables(model_dir, fingerprint=False)
    reader = CheckpointReader(specs)
    for module in model.modules():
        lookups = getattr(module, "_lookups", None)
        if not isinstance(lookups, LayerLookups):
            continue
        verified = _Verified(lookups, reader, _CHECK)
        lookups.lookup = verified.lookup  # type: ignore[method-assign]
        lookups.start = verified.start  # type: ignore[method-assign]
        lookups.finish = verified.finish  # type: ignore[method-assign]
        _CHECK.layers += 1
    if not _CHECK.layers:
        raise RuntimeError(
            "no shm PLE layer in the model: is VLLM_PLE_BACKEND=shm set, and was the "
            "model built after the plugin registered?"
        )
    log.info("checking every PLE row of %d layers against %s", _CHECK.layers, model_dir)
    return _CHECK


def _model_of(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def install(worker: Any, model_dir: str) -> int:
    """``LLM.collective_rpc(install, args=(model_dir,))``: the layers wrapped."""
    return install_on_model(_model_of(worker), model_dir).layers


def report(worker: Any = None) -> dict:
    """``LLM.collective_rpc(report)``: the counts so far."""
    return _CHECK.to_json()
