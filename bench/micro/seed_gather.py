"""The seed's row gather, reimplemented for the benchmark (no torch).

Source: ``vllm_ple_mmap.py`` of the shared seed material, class
``MmapPleTable`` (``__init__`` and ``gather``): one ``np.memmap`` per shard,
``np.unique(ids, return_inverse=True)``, the sorted unique ids cut into
per-shard chunks of at most ``chunk`` rows, each chunk gathered by fancy
indexing on its shard's memmap on a ``workers``-thread pool, then
``out[inverse]`` (a fresh array). Defaults as in the seed: 32 workers, chunks
of 2048 rows. The only differences: the torch dtype is gone (rows stay uint8),
and ``populate()`` (not in the seed) maps the shards' pages into this process
so the benchmark can compare every contender on populated mappings.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class SeedTable:
    """``MmapPleTable`` minus torch. ``shards``: {index: (path, offset, rows)}."""

    def __init__(
        self,
        shards: dict[int, tuple[str, int, int]],
        shard_size: int,
        row_bytes: int,
        workers: int = 32,
        chunk: int = 2048,
    ) -> None:
        if not shards:
            raise ValueError("no PLE shards")
        self.shard_size = int(shard_size)
        self.row_bytes = int(row_bytes)
        self.chunk = max(1, int(chunk))
        self.mm: list[np.memmap | None] = [None] * (max(shards) + 1)
        self.rows_total = 0
        for idx, (path, offset, rows) in shards.items():
            self.mm[idx] = np.memmap(
                path, dtype=np.uint8, mode="r", offset=offset, shape=(rows, row_bytes)
            )
            self.rows_total += rows
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(workers)))

    @classmethod
    def from_spec(cls, spec, workers: int = 32, chunk: int = 2048) -> SeedTable:
        """From a ``pleclient.checkpoint.TableSpec`` (the seed found the same
        shards with its own header parser)."""
        shards = {s.index: (s.path, s.offset, s.rows) for s in spec.shards if s.rows}
        return cls(shards, spec.shard_size, spec.row_bytes, workers, chunk)

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """ids: int64 [N] global row ids -> uint8 [N, row_bytes] (a fresh array)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return np.empty((0, self.row_bytes), dtype=np.uint8)
        uniq, inverse = np.unique(ids, return_inverse=True)
        if uniq[0] < 0 or uniq[-1] >= self.shard_size * len(self.mm):
            raise IndexError(
                f"PLE row id out of range: [{uniq[0]}, {uniq[-1]}] for {self.rows_total} rows"
            )
        shard = uniq // self.shard_size
        local = uniq - shard * self.shard_size
        out = np.empty((uniq.size, self.row_bytes), dtype=np.uint8)

        bounds = np.flatnonzero(np.diff(shard)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [uniq.size]))
        tasks: list[tuple[int, int, int]] = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            si = int(shard[s])
            for c in range(s, e, self.chunk):
                tasks.append((si, c, min(c + self.chunk, e)))

        def run(task: tuple[int, int, int]) -> None:
            si, a, b = task
            mm = self.mm[si]
            if mm is None:
                raise IndexError(f"PLE shard {si} missing")
            out[a:b] = mm[local[a:b]]

        if len(tasks) == 1:
            run(tasks[0])
        else:
            for _ in self.pool.map(run, tasks):
                pass
        return out[inverse]

    # ----------------------------------------------------- benchmark helpers
    def populate(self) -> None:
        """Map every shard's pages into this process (MADV_POPULATE_READ)."""
        for mm in self.mm:
            if mm is not None and mm._mmap is not None:
                try:
                    mm._mmap.madvise(MADV_POPULATE_READ)
                except (OSError, ValueError):
                    pass  # older kernel: the first touch of each page faults instead

    def close(self) -> None:
        """Stop the pool; the maps go with the last reference to them."""
        self.pool.shutdown(wait=True)
        self.mm = []
