"""The native data plane's lookups (``pleserver._native``): rows bit-exact in
every mode, straddling pages, duplicates, concurrent callers, eviction under a
tiny budget, the pread fallback, large requests split over native threads, a
bound on the read buffers.

Expected rows are read from the checkpoint files with plain Python I/O."""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from pleclient.checkpoint import TableSpec, discover_tables
from pleserver import _native as nat
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint
from tests.host import require_o_direct

# FP8 rows of 160 bytes, BF16 rows of 320 bytes and NVFP4 rows of 90 (80
# bytes of packed values from one tensor, 10 of block scales from another);
# partial last shards; shards over two files, behind a small tensor, so rows
# sit at odd offsets.
TABLES = (
    SyntheticTable(layer=1, rows=20_011, cols=160, dtype="F8_E4M3", parts=8, scale=0.0125),
    SyntheticTable(layer=3, rows=10_007, cols=160, dtype="BF16", parts=4),
    SyntheticTable(layer=4, rows=12_007, cols=160, dtype="NVFP4", parts=5),
)
MODES = ("direct", "buffered", "mmap")


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[str, TableSpec]:
    model = tmp_path_factory.mktemp("native-ckpt")
    write_checkpoint(str(model), TABLES, files=2)
    return {s.dtype: s for s in discover_tables(str(model), fingerprint=False)}


def file_rows(spec: TableSpec) -> np.ndarray:
    """The whole table as uint8 [rows, row_bytes], read with plain file I/O (an
    NVFP4 row: its values, then its block scales)."""
    columns = []
    for segment in spec.segments:
        parts = []
        for shard in segment.shards:
            with open(shard.path, "rb") as f:
                f.seek(shard.offset)
                data = f.read(shard.rows * segment.row_bytes)
            parts.append(np.frombuffer(data, np.uint8).reshape(shard.rows, segment.row_bytes))
        columns.append(np.concatenate(parts))
    return np.concatenate(columns, axis=1)


class Opened:
    """A TableSource over a table in one mode, with what it needs kept alive."""

    def __init__(
        self,
        spec: TableSpec,
        mode: str,
        key: int = 1,
        cache: nat.RowCache | None = None,
        engine: nat.ReadEngine | None = None,
        cache_bytes: int = 64 << 20,
        resident: tuple[int, ...] = (),
    ) -> None:
        self.maps: list[mmap.mmap] = []
        self.views: list[np.ndarray] = []
        if mode != "mmap":
            self.cache = cache or nat.RowCache(cache_bytes, spec.row_bytes)
            self.engine = engine or nat.ReadEngine(queue_depth=64)
        else:
            self.cache = self.engine = None
        if mode == "direct":
            require_o_direct(os.path.dirname(spec.files[0]))
        flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
        fds = {p: os.open(p, flags) for p in spec.files}
        try:
            addresses = {p: 0 for p in spec.files}
            if mode == "mmap":
                for p, fd in fds.items():
                    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                    view = np.frombuffer(mm, np.uint8)
                    self.maps.append(mm)
                    self.views.append(view)
                    addresses[p] = view.ctypes.data
            shards = [
                (fds[s.path], s.offset, s.rows, s.path, addresses[s.path])
                for i in range(spec.parts)
                for s in (segment.shards[i] for segment in spec.segments)
            ]
            self.source = nat.TableSource(
                key,
                spec.row_bytes,
                spec.shard_size,
                shards,
                self.cache,
                self.engine,
                mode == "direct",
                segments=[segment.row_bytes for segment in spec.segments],
                resident=resident,
            )
        finally:
            for fd in fds.values():  # the source keeps duplicates of its own
                os.close(fd)

    def gather(self, ids, threads: int = 1) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((ids.size, self.source.row_bytes), np.uint8)
        self.source.gather(ids, out, threads)
        return out

    def close(self) -> None:
        self.source.close()
        for obj in (self.cache, self.engine):
            if obj is not None:
                obj.close()
        self.views.clear()
        for mm in self.maps:
            mm.close()


@pytest.fixture
def opened():
    made: list[Opened] = []

    def make(*args, **kwargs) -> Opened:
        made.append(Opened(*args, **kwargs))
        return made[-1]

    yield make
    for o in made:
        o.close()


def straddling_ids(spec: TableSpec, count: int) -> np.ndarray:
    """Ids whose row (NVFP4: values) crosses a 4 KiB boundary of its file."""
    found = []
    row_bytes = spec.segments[0].row_bytes
    for shard in spec.shards:
        first = shard.index * spec.shard_size
        for r in range(shard.rows):
            start = shard.offset + r * row_bytes
            if start // 4096 != (start + row_bytes - 1) // 4096:
                found.append(first + r)
                if len(found) == count:
                    return np.array(found, dtype=np.int64)
    return np.array(found, dtype=np.int64)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "BF16", "NVFP4"])
@pytest.mark.parametrize("mode", MODES)
def test_rows_are_bit_exact_cold_and_warm(specs, opened, mode, dtype):
    spec = specs[dtype]
    expected = file_rows(spec)
    rng = np.random.default_rng(7)
    edges = (
        [0, spec.rows - 1]
        + [s.index * spec.shard_size for s in spec.shards]
        + [s.index * spec.shard_size + s.rows - 1 for s in spec.shards]
    )
    ids = np.concatenate([edges, rng.integers(0, spec.rows, 3000)]).astype(np.int64)
    o = opened(spec, mode)
    cold = o.gather(ids)
    warm = o.gather(ids)
    np.testing.assert_array_equal(cold, expected[ids])
    np.testing.assert_array_equal(warm, expected[ids])
    if mode != "mmap":
        stats = o.source.stats()
        assert stats["hits"] + stats["misses"] == 2 * ids.size
        assert stats["hits"] >= ids.size  # the second pass is all hits
        assert stats["reads"] > 0 and stats["read_bytes"] >= 4096 * stats["reads"] // 2


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_read_latency_histogram_counts_every_read(specs, opened, mode):
    """The histogram the metrics endpoint exports: one count per timed read,
    its sum in nanoseconds, quantiles that agree with the buckets."""
    o = opened(specs["F8_E4M3"], mode)
    o.gather(np.arange(0, 20_000, 37))
    stats = o.source.stats()
    buckets = stats["read_ns_buckets"]
    assert len(buckets) == 256 and sum(buckets) == stats["reads"] > 0
    assert stats["read_ns_sum"] >= stats["reads"]  # every read took a nanosecond or more
    # p50 is the upper edge of the bucket holding the median: 4 buckets per
    # power of two, so the reads under 2^k ns are buckets 0 .. 4k-1.
    k = stats["read_ns_p50"].bit_length()
    assert sum(buckets[: 4 * k]) * 2 > stats["reads"]
    assert sum(buckets[: 4 * (k - 1)]) * 2 <= stats["reads"]


@pytest.mark.parametrize("dtype", ["F8_E4M3", "BF16", "NVFP4"])
def test_rows_straddling_two_pages_are_exact(specs, opened, dtype):
    spec = specs[dtype]
    ids = straddling_ids(spec, 200)
    assert ids.size == 200
    o = opened(spec, "direct")
    np.testing.assert_array_equal(o.gather(ids), file_rows(spec)[ids])


def test_duplicate_ids_are_read_once_and_all_answered(specs, opened):
    spec = specs["F8_E4M3"]
    base = np.array([5, 6, 7, 4000, 4001, 19_999], dtype=np.int64)
    ids = np.concatenate([base, base[::-1], base, [5, 5, 5]])
    o = opened(spec, "direct")
    np.testing.assert_array_equal(o.gather(ids), file_rows(spec)[ids])
    stats = o.cache.stats()
    assert stats["used_rows"] == stats["inserts"] == np.unique(base).size
    # 5, 6, 7 share a block, 4000 and 4001 too: fewer reads than distinct rows.
    assert o.source.stats()["reads"] <= 4


def test_concurrent_callers_get_exact_rows(specs, opened):
    spec = specs["BF16"]
    expected = file_rows(spec)
    o = opened(spec, "direct", cache_bytes=2 << 20)  # small: misses keep coming
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                # Overlapping hot ranges: the same blocks are in flight for several callers.
                ids = rng.integers(0, 3000, 257).astype(np.int64)
                np.testing.assert_array_equal(o.gather(ids), expected[ids])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    stats = o.source.stats()
    assert stats["hits"] + stats["misses"] == 6 * 30 * 257


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_lock_free_hits_stay_exact_while_other_threads_evict(specs, opened, mode):
    """Readers look rows up without the shard locks while writers evict and
    rewrite slots: a reader that raced a writer must retry, never copy a
    half-written or foreign row."""
    spec = specs["F8_E4M3"]
    expected = file_rows(spec)
    o = opened(spec, mode, cache_bytes=400 * (spec.row_bytes + 40))
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                ids = rng.integers(0, 1500, 200).astype(np.int64)  # hot: many hits
                np.testing.assert_array_equal(o.gather(ids), expected[ids])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    c = o.cache.stats()
    assert c["hits"] > 0 and c["evictions"] > 0


@pytest.mark.parametrize("dtype", ["F8_E4M3", "NVFP4"])
def test_eviction_under_a_tiny_budget_keeps_rows_exact(specs, opened, dtype):
    spec = specs[dtype]
    expected = file_rows(spec)
    o = opened(spec, "direct", cache_bytes=200 * (spec.row_bytes + 40))
    capacity = o.cache.capacity_rows
    assert 0 < capacity <= 200
    rng = np.random.default_rng(3)
    requested = 0
    for _ in range(20):
        ids = rng.integers(0, spec.rows, 300).astype(np.int64)
        np.testing.assert_array_equal(o.gather(ids), expected[ids])
        requested += ids.size
    c = o.cache.stats()
    assert c["hits"] + c["misses"] == requested
    assert c["used_rows"] == capacity
    assert c["inserts"] - c["evictions"] == c["used_rows"]
    assert c["evictions"] > 0 and o.source.stats()["evictions"] == c["evictions"]
    keys = o.cache.keys()
    assert keys.dtype == np.uint64 and keys.size == capacity
    assert np.all(keys >> np.uint64(40) == 1)
    # What the cache holds is still right: served from the cache, exact.
    held = (keys & np.uint64((1 << 40) - 1)).astype(np.int64)
    out = np.empty((held.size, spec.row_bytes), np.uint8)
    assert o.source.gather_hits(held, out) == 0
    np.testing.assert_array_equal(out, expected[held])


def test_threads_fallback_forced_by_kind(specs, opened):
    spec = specs["BF16"]
    engine = nat.ReadEngine(queue_depth=16, kind="threads", threads=4)
    assert engine.kind == "threads" and "threads" in engine.fallback_reason
    o = opened(spec, "direct", engine=engine)
    ids = np.concatenate([straddling_ids(spec, 50), np.arange(9000, 9100)]).astype(np.int64)
    np.testing.assert_array_equal(o.gather(ids), file_rows(spec)[ids])
    assert o.source.stats()["reads"] > 0


@pytest.mark.parametrize("dtype", ["F8_E4M3", "NVFP4"])
@pytest.mark.parametrize("mode", MODES)
def test_large_request_split_over_native_threads_is_exact(specs, opened, mode, dtype):
    spec = specs[dtype]
    ids = np.random.default_rng(11).integers(0, spec.rows, 50_000).astype(np.int64)
    o = opened(spec, mode)
    expected = file_rows(spec)[ids]
    np.testing.assert_array_equal(o.gather(ids, threads=4), expected)
    np.testing.assert_array_equal(o.gather(ids, threads=3), expected)


def test_gather_hits_answers_only_from_the_cache(specs, opened):
    spec = specs["F8_E4M3"]
    o = opened(spec, "direct")
    ids = np.array([10, 20, 30, 40], dtype=np.int64)
    out = np.zeros((4, spec.row_bytes), np.uint8)
    assert o.source.gather_hits(ids, out) > 0
    assert o.source.stats()["reads"] == 0  # no I/O
    assert o.source.stats()["hits"] + o.source.stats()["misses"] == 0
    o.gather(ids[:3])
    assert o.source.gather_hits(ids, out) == 1  # id 40 is still a miss
    o.gather(ids[3:])
    assert o.source.gather_hits(ids, out) == 0
    np.testing.assert_array_equal(out, file_rows(spec)[ids])


@pytest.mark.parametrize("dtype", ["F8_E4M3", "NVFP4"])
def test_cached_says_which_rows_are_in_the_cache_and_changes_nothing(specs, opened, dtype):
    spec = specs[dtype]
    o = opened(spec, "direct")
    ids = np.array([10, 20, 30, 20, 40], dtype=np.int64)
    mask = np.full(ids.size, 7, np.uint8)
    assert o.source.cached(ids, mask) == 0 and list(mask) == [0] * 5
    o.gather(ids[:2])
    before = o.source.stats()
    assert o.source.cached(ids, mask) == 3 and list(mask) == [1, 1, 0, 1, 0]
    after = o.source.stats()
    assert (after["hits"], after["misses"], after["reads"]) == (
        before["hits"],
        before["misses"],
        before["reads"],
    )  # no I/O, no counters


def test_fill_reads_rows_into_the_cache_only(specs, opened):
    spec = specs["BF16"]
    o = opened(spec, "buffered")
    ids = np.array([1, 2, 3, 3, 5000, 10_006], dtype=np.int64)
    assert o.source.fill(ids) == 5
    assert o.source.fill(ids) == 0  # all there already
    keys = np.sort(o.cache.keys())
    np.testing.assert_array_equal(
        keys, (np.uint64(1) << np.uint64(40)) + np.unique(ids).astype(np.uint64)
    )
    out = np.empty((ids.size, spec.row_bytes), np.uint8)
    assert o.source.gather_hits(ids, out) == 0
    np.testing.assert_array_equal(out, file_rows(spec)[ids])


def test_two_tables_share_one_cache_and_engine(specs, opened):
    cache = nat.RowCache(8 << 20, 320)
    engine = nat.ReadEngine(queue_depth=32)
    fp8 = opened(specs["F8_E4M3"], "direct", key=1, cache=cache, engine=engine)
    bf16 = opened(specs["BF16"], "direct", key=3, cache=cache, engine=engine)
    ids = np.arange(0, 10_000, 37, dtype=np.int64)
    for o, spec in ((fp8, specs["F8_E4M3"]), (bf16, specs["BF16"])):
        np.testing.assert_array_equal(o.gather(ids), file_rows(spec)[ids])
    tables = set((cache.keys() >> np.uint64(40)).tolist())
    assert tables == {1, 3}


def test_closing_the_cache_and_engine_while_a_table_uses_them_is_safe(specs, opened):
    spec = specs["F8_E4M3"]
    o = opened(spec, "direct")
    o.cache.close()
    o.engine.close()
    ids = np.arange(100, 200, dtype=np.int64)
    np.testing.assert_array_equal(o.gather(ids), file_rows(spec)[ids])
    with pytest.raises(ValueError, match="closed"):
        o.cache.stats()


@pytest.mark.parametrize("kind", ["auto", "threads"])
def test_request_read_in_several_rounds_is_exact(tmp_path, kind):
    """More distinct blocks than one round holds (4 096): rounds run two at a
    time and share the blocks at their boundaries."""
    rows, row_bytes, offset = 150_000, 320, 1234
    data = np.random.default_rng(5).integers(0, 256, offset + rows * row_bytes, np.uint8)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    table = data[offset:].reshape(rows, row_bytes)
    cache = nat.RowCache(2 << 20, row_bytes)  # far smaller than the request: evictions too
    engine = nat.ReadEngine(queue_depth=32, kind=kind, threads=4)
    require_o_direct(tmp_path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        src = nat.TableSource(
            0,
            row_bytes,
            40_000,
            [
                (fd, offset + i * 40_000 * row_bytes, min(40_000, rows - i * 40_000), str(path), 0)
                for i in range(4)
            ],
            cache,
            engine,
            True,
        )
    finally:
        os.close(fd)
    try:
        ids = np.random.default_rng(6).integers(0, rows, 30_000).astype(np.int64)
        ids[::7] = ids[3::7]  # duplicates across the request
        for threads in (1, 3):
            out = np.empty((ids.size, row_bytes), np.uint8)
            src.gather(ids, out, threads)
            np.testing.assert_array_equal(out, table[ids])
        assert src.stats()["reads"] > 4096
    finally:
        src.close()
        cache.close()
        engine.close()


@contextlib.contextmanager
def one_file_table(
    tmp_path, rows: int, row_bytes: int, seed: int, cache_bytes: int, threads: int, direct: bool
) -> Iterator[tuple[nat.TableSource, np.ndarray]]:
    """A source over one file of random rows (one shard), a row cache of
    ``cache_bytes`` and a miss engine of ``threads``, and the rows it holds;
    closed after."""
    data = np.random.default_rng(seed).integers(0, 256, rows * row_bytes, np.uint8)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    cache = nat.RowCache(cache_bytes, row_bytes)
    engine = nat.ReadEngine(queue_depth=32, kind="auto", threads=threads)
    if direct:
        require_o_direct(tmp_path)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        src = nat.TableSource(
            0, row_bytes, rows, [(fd, 0, rows, str(path), 0)], cache, engine, direct
        )
    finally:
        os.close(fd)
    try:
        yield src, data.reshape(rows, row_bytes)
    finally:
        src.close()
        cache.close()
        engine.close()


def test_a_split_request_whose_ranges_read_in_rounds_never_deadlocks(tmp_path):
    """A large request split over the pool's threads, each range with more
    distinct blocks than one round holds: every range reads its misses through
    the same pool (nested jobs). A caller once waited for its nested job to
    reach the head of the queue, behind the split job that could not finish
    without it, and the server hung on the first cold prefill."""
    rows, row_bytes = 400_000, 160
    # (a row cache of 2 MiB: every pass misses again)
    with one_file_table(tmp_path, rows, row_bytes, 8, 2 << 20, 4, True) as (src, table):
        rng = np.random.default_rng(9)
        failures: list[BaseException] = []

        def passes() -> None:
            try:
                for _ in range(8):
                    ids = rng.integers(0, rows, 50_000).astype(np.int64)
                    out = np.empty((ids.size, row_bytes), np.uint8)
                    src.gather(ids, out, 4)
                    np.testing.assert_array_equal(out, table[ids])
            except BaseException as exc:  # reported below, from the test's thread
                failures.append(exc)

        worker = threading.Thread(target=passes, daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "a split gather with nested read rounds hung"
        assert not failures, failures


def test_the_read_buffers_bound_holds_under_concurrent_split_cold_requests(tmp_path):
    """With the read buffers bounded at the smallest bound allowed, rounds
    shrink to fit it (512 blocks) and every round waits for the one buffer
    the bound leaves: 4 callers, each a request split over 4 threads whose
    ranges read in rounds, two at a time. No wait lasts for ever (a round
    waits only while it holds no buffer), every row is exact, and what the
    buffers held never passed the bound."""
    rows, row_bytes = 150_000, 320
    # (a row cache of 2 MiB: every pass misses again)
    with one_file_table(tmp_path, rows, row_bytes, 10, 2 << 20, 4, False) as (src, table):
        with pytest.raises(ValueError, match="below the smallest round"):
            nat.set_read_memory(nat.READ_MEMORY_MIN - 1)
        nat.set_read_memory(nat.READ_ROUND_BYTES)
        assert nat.read_memory()["round_blocks"] == 4096  # one whole round fits
        nat.set_read_memory(nat.READ_MEMORY_MIN)
        try:
            assert nat.read_memory()["round_blocks"] == 512
            failures: list[BaseException] = []

            def passes(seed: int) -> None:
                try:
                    rng = np.random.default_rng(seed)
                    for _ in range(3):
                        ids = rng.integers(0, rows, 20_000).astype(np.int64)
                        out = np.empty((ids.size, row_bytes), np.uint8)
                        src.gather(ids, out, 4)
                        np.testing.assert_array_equal(out, table[ids])
                except BaseException as exc:  # reported below, from the test's thread
                    failures.append(exc)

            callers = [threading.Thread(target=passes, args=(k,), daemon=True) for k in range(4)]
            for t in callers:
                t.start()
            for t in callers:
                t.join(300)
            assert not any(t.is_alive() for t in callers), "a gather waiting for a buffer hung"
            assert not failures, failures
            reads = nat.read_memory()
            assert 0 < reads["peak_bytes"] <= reads["limit_bytes"] == nat.READ_MEMORY_MIN, reads
        finally:
            nat.set_read_memory(0)


def test_nvfp4_rows_are_cached_whole_only_after_both_segments_arrive(specs, opened):
    """A cached NVFP4 row is the composed row (values, then block scales), so a
    hit answers exactly what a miss read from the two tensors."""
    spec = specs["NVFP4"]
    expected = file_rows(spec)
    o = opened(spec, "direct")
    ids = np.random.default_rng(5).integers(0, spec.rows, 2000).astype(np.int64)
    assert o.source.fill(ids) > 0
    out = np.zeros((ids.size, spec.row_bytes), np.uint8)
    assert o.source.gather_hits(ids, out) == 0
    np.testing.assert_array_equal(out, expected[ids])


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_resident_scales_answer_exact_rows_with_one_read_a_miss(specs, opened, mode):
    """NVFP4's block scales kept in memory: every row (cold, warm, straddling a
    block, split over threads) is the files' bytes, and a miss reads only its
    values where the same ids cost two reads a row from the files."""
    spec = specs["NVFP4"]
    expected = file_rows(spec)
    kept = opened(spec, mode, resident=(1,))
    plain = opened(spec, mode, key=2)
    assert kept.source.stats()["resident_bytes"] == spec.rows * 10
    assert plain.source.stats()["resident_bytes"] == 0
    far = np.arange(0, spec.rows, 1001, dtype=np.int64)  # scale rows > 2 blocks apart
    for o in (kept, plain):
        np.testing.assert_array_equal(o.gather(far), expected[far])
    reads = kept.source.stats()["reads"], plain.source.stats()["reads"]
    assert reads[1] - reads[0] >= far.size and reads[0] <= 2 * far.size, reads
    rng = np.random.default_rng(11)
    for ids in (
        straddling_ids(spec, 50),
        rng.integers(0, spec.rows, 3000).astype(np.int64),
        np.repeat(rng.integers(0, spec.rows, 40).astype(np.int64), 5),
    ):
        for _ in ("cold", "warm"):
            np.testing.assert_array_equal(kept.gather(ids), expected[ids])
    big = rng.integers(0, spec.rows, 9000).astype(np.int64)
    np.testing.assert_array_equal(kept.gather(big, threads=4), expected[big])
    assert kept.source.fill(rng.integers(0, spec.rows, 500).astype(np.int64)) >= 0


@pytest.mark.parametrize(
    ("mode", "resident", "message"),
    [
        ("mmap", (1,), "io mmap.*nothing to keep resident"),
        ("direct", (0, 1), "keeps at least one segment on disk"),
        ("direct", (7,), "segment 7 of a row of 2 segment"),
        ("direct", ("1",), "integer"),
    ],
)
def test_resident_segments_that_cannot_be_kept_are_refused(specs, mode, resident, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Opened(specs["NVFP4"], mode, resident=resident).close()


@pytest.mark.parametrize(
    ("segments", "shards_per_table_shard", "message"),
    [
        ([80, 9], 2, "must add up to row_bytes 90"),
        ([80, 10, 0], 3, "1..1048576"),
        ([90, 0], 2, "1..1048576"),
        ([10] * 9, 9, "1..4 segments"),
        ([80, 10], 1, "shard entries for 2 segments"),
    ],
)
def test_bad_row_segments_are_refused(specs, segments, shards_per_table_shard, message):
    spec = specs["NVFP4"]
    fd = os.open(spec.files[0], os.O_RDONLY)
    engine = nat.ReadEngine(queue_depth=4)
    try:
        shards = [(fd, 0, 1, spec.files[0], 0)] * shards_per_table_shard
        with pytest.raises(ValueError, match=message):
            nat.TableSource(1, spec.row_bytes, 1, shards, None, engine, False, segments=segments)
    finally:
        engine.close()
        os.close(fd)


def test_segments_of_one_shard_must_have_the_same_rows(specs):
    spec = specs["NVFP4"]
    fd = os.open(spec.files[0], os.O_RDONLY)
    engine = nat.ReadEngine(queue_depth=4)
    try:
        shards = [(fd, 0, 2, spec.files[0], 0), (fd, 0, 1, spec.files[0], 0)]
        with pytest.raises(ValueError, match="segment 1 has 1 rows, segment 0 2"):
            nat.TableSource(1, 90, 2, shards, None, engine, False, segments=[80, 10])
    finally:
        engine.close()
        os.close(fd)


def test_a_stream_of_two_round_requests_reuses_warm_read_buffers(tmp_path):
    """A request of more misses than one round holds (4 096 blocks) reads two
    rounds at once, each in a large buffer of its own. With only one large
    buffer kept warm between requests, the other returned its pages and the
    next request's reads faulted them in again: about one page fault (a
    zeroed 4 KiB page) per missed row, a third of the server's CPU per miss.
    Both stay warm now: after the first requests, a stream of them returns no
    page (``returned_bytes``), and faults almost nothing in (counted only
    where the allocator is glibc's: a sanitizer's keeps freed memory aside,
    and faults it in anew)."""
    rows, row_bytes = 400_000, 320  # 4 600 random rows: about as many 4 KiB blocks
    # (a row cache of 1 MiB, far below a request: every row a miss)
    with one_file_table(tmp_path, rows, row_bytes, 11, 1 << 20, 1, False) as (src, table):
        rng = np.random.default_rng(12)
        out = np.empty((4_600, row_bytes), np.uint8)
        faults, returned = [], []
        for _ in range(8):
            ids = rng.choice(rows, out.shape[0], replace=False).astype(np.int64)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            gone = nat.read_memory()["returned_bytes"]
            src.gather(ids, out, 1)  # one caller: its two rounds, two at once
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            returned.append(nat.read_memory()["returned_bytes"] - gone)
            np.testing.assert_array_equal(out, table[ids])
        assert returned[3:] == [0] * 5, f"bytes of buffer pages returned a request: {returned}"
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):
            assert max(faults[3:]) < 200, f"page faults per request of 4 600 misses: {faults}"
