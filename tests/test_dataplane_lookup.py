"""Rows through the native data plane, in every io mode, bit for bit: FP8,
BF16 and NVFP4 tables (an NVFP4 row: packed values, then block scales, from
two tensors) with partial last shards over several files, and a DeepSeek-V4.1
Engram table (FP8 values, then UE8M0 scales, from two unsharded tensors), ids whose row
straddles a 4 KiB block, duplicates, large requests split over native threads,
and the same ids asked for by several client processes at once."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from pleclient.checkpoint import discover_tables
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from pleserver.observe.stats import format_human
from tests.conftest import SMALL_TABLES
from tests.harness import child_report, python_child
from tests.host import require_o_direct

BLOCK = 4096
MODES = ("direct", "buffered", "mmap")
NVFP4_TABLE = SyntheticTable(layer=5, rows=15_013, cols=160, dtype="NVFP4", parts=6, scale=0.375)
ENGRAM_TABLE = SyntheticTable(layer=14, rows=20_011, cols=256, dtype="MXFP8", parts=1)
"""An Engram table of the real model's row (256 FP8 values + 8 scales)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Three files: shards of every table in each (the Engram table's values
    in one, its scales in another), at offsets that are not multiples of the
    row size (the first file starts with another tensor)."""
    path = tmp_path_factory.mktemp("dataplane")
    write_checkpoint(str(path), (*SMALL_TABLES, NVFP4_TABLE, ENGRAM_TABLE), files=3)
    return path


def straddling_ids(model, layer: int) -> np.ndarray:
    """Ids whose row (of NVFP4: values) crosses a 4 KiB boundary of its file."""
    spec = next(t for t in discover_tables(str(model)) if t.layer == layer)
    row_bytes = spec.segments[0].row_bytes
    ids = []
    for shard in spec.shards:
        start = shard.offset + np.arange(shard.rows, dtype=np.int64) * row_bytes
        crossing = np.flatnonzero(start // BLOCK != (start + row_bytes - 1) // BLOCK)
        ids.extend((shard.index * spec.shard_size + crossing[:20]).tolist())
    return np.array(ids, dtype=np.int64)


def expect_mode(client, io: str) -> None:
    plane = client.stats()["dataplane"]
    assert plane["io"] == io, plane


@pytest.mark.parametrize("io", MODES)
def test_rows_are_bit_exact_in_every_mode(start_server, model, tmp_path, io):
    if io == "direct":
        require_o_direct(model)
    server = start_server(
        model, "--io", io, "--state-dir", str(tmp_path), "--parallel-min-rows", "4096"
    )
    rng = np.random.default_rng(9)
    with server.client(capacity=20_000, depth=2) as client:
        expect_mode(client, io)
        for t in client.tables:
            ref = read_reference(str(model), t.name)
            last_shard = np.arange((t.parts - 1) * t.shard_size, t.rows)  # the partial one
            cases = {
                "one": np.array([t.rows - 1]),
                "random": rng.integers(0, t.rows, 300),
                "straddling": straddling_ids(model, t.layer),
                "partial last shard": last_shard,
                "duplicates": np.repeat(rng.integers(0, t.rows, 50), 7),
                "large, split over threads": rng.integers(0, t.rows, 12_000),
            }
            for name, ids in cases.items():
                for attempt in ("cold", "warm"):  # misses first, then cache hits
                    got = client.lookup(t.layer, ids)
                    assert np.array_equal(got, ref[ids]), (io, t.dtype, name, attempt)


COMPOSED = {
    "NVFP4": (NVFP4_TABLE, ((0, 80), (80, 90)), 0.375),
    "MXFP8": (ENGRAM_TABLE, ((0, 256), (256, 264)), None),
}
"""Tables whose row is composed from two tensors: the table, each segment's
bytes of the row, its global scale."""


SCALES = [
    ("direct", "--resident-scales"),
    ("direct", "--no-resident-scales"),
    ("buffered", "--resident-scales"),
    ("buffered", "--no-resident-scales"),
    ("mmap", "--resident-scales"),  # (mmap keeps nothing resident: the page cache serves)
]
"""Io modes, and whether a row cache's tables keep their scales in memory."""


@pytest.mark.parametrize("dtype", COMPOSED)
@pytest.mark.parametrize("io, scales", SCALES)
def test_a_composed_row_is_each_segments_bytes_from_the_files(
    start_server, model, tmp_path, io, scales, dtype
):
    if io == "direct":
        require_o_direct(model)
    server = start_server(model, "--io", io, scales, "--state-dir", str(tmp_path))
    table, spans, scale = COMPOSED[dtype]
    spec = next(t for t in discover_tables(str(model)) if t.dtype == dtype)
    with server.client() as client:
        expect_mode(client, io)
        info = client.table(table.layer)
        assert (info.dtype, info.cols, info.row_bytes) == (dtype, table.cols, spans[-1][1])
        assert info.scale == scale and info.fingerprint == spec.fingerprint
        resident = next(t for t in client.stats()["tables"] if t["layer"] == table.layer)
        kept = io != "mmap" and scales == "--resident-scales"
        assert resident["io"]["resident_bytes"] == (
            spec.rows * spec.segments[1].row_bytes if kept else 0
        )
        assert ("resident scales" in format_human(client.stats())) == kept
        ids = np.array([0, spec.shard_size - 1, spec.rows - 1, 7, 7], dtype=np.int64)
        for attempt in ("cold", "warm"):
            rows = client.lookup(info.layer, ids)
            for id_, row in zip(ids.tolist(), rows, strict=True):
                shard, r = divmod(id_, spec.shard_size)
                for segment, (lo, hi) in zip(spec.segments, spans, strict=True):
                    part = segment.shards[shard]
                    with open(part.path, "rb") as f:  # the bytes of each tensor's row
                        f.seek(part.offset + r * segment.row_bytes)
                        assert row[lo:hi].tobytes() == f.read(segment.row_bytes), (io, attempt)


@pytest.mark.parametrize("dtype", COMPOSED)
def test_resident_scales_make_a_missed_row_one_read(start_server, model, tmp_path, dtype):
    """The same cold rows through two servers, scales resident and not: each
    row's scales are a read of their own without (its ids lie far enough apart
    that no two scale rows share a block), and none with."""
    require_o_direct(model)
    table = COMPOSED[dtype][0]
    spec = next(t for t in discover_tables(str(model)) if t.dtype == dtype)
    ids = np.arange(0, spec.rows, 2003, dtype=np.int64)  # > 4 KiB of scales apart
    ref = read_reference(str(model), spec.name)
    reads = {}
    for scales in ("--resident-scales", "--no-resident-scales"):
        server = start_server(
            model, "--io", "direct", scales, "--state-dir", str(tmp_path / scales.strip("-"))
        )
        with server.client() as client:
            assert np.array_equal(client.lookup(table.layer, ids), ref[ids])
            io = next(t for t in client.stats()["tables"] if t["layer"] == table.layer)["io"]
            assert io["misses"] == len(ids) and io["read_errors"] == 0
            reads[scales] = io["reads"]
        server.stop()
    assert reads["--no-resident-scales"] - reads["--resident-scales"] >= len(ids), reads
    assert reads["--resident-scales"] <= 2 * len(ids)  # values only (a row may straddle)


CONCURRENT_CLIENT = """
model, socket, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
refs = {}
bad = requests = 0
with PleClient.connect(socket, capacity=4096) as client:
    for t in client.tables:
        refs[t.layer] = read_reference(model, t.name)
    shared = np.random.default_rng(1234)  # the same ids in every process
    own = np.random.default_rng(seed)
    for step in range(60):
        for t in client.tables:
            ids = np.concatenate([shared.integers(0, t.rows, 64), own.integers(0, t.rows, 64)])
            requests += 1
            bad += not np.array_equal(client.lookup(t.layer, ids), refs[t.layer][ids])
print(json.dumps({"requests": requests, "bad": bad}))
"""


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_ids_repeated_across_concurrent_clients_are_bit_exact(start_server, model, tmp_path, io):
    server = start_server(model, "--io", io, "--state-dir", str(tmp_path))
    children = [
        python_child(CONCURRENT_CLIENT, str(model), server.socket, str(seed)) for seed in range(4)
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=120)
        reports.append(
            child_report(subprocess.CompletedProcess(child.args, child.returncode, out, err))
        )
    assert all(r["requests"] == 60 * 4 and r["bad"] == 0 for r in reports), reports  # 4 tables
    with server.client() as client:
        stats = client.stats()
    assert all(t["error_count"] == 0 for t in stats["tables"]), stats["tables"]
    if io == "direct":  # the shared ids were read once and then served from the cache
        assert all(t["io"]["hits"] > 0 and t["io"]["reads"] > 0 for t in stats["tables"])


def test_auto_serves_tables_that_fit_from_the_page_cache(start_server, model, tmp_path):
    server = start_server(model, "--state-dir", str(tmp_path))
    with server.client() as client:
        plane = client.stats()["dataplane"]
    assert plane["io"] == "mmap" and plane["io_reason"].startswith("auto: the tables")
    assert plane["cache"] is None
    assert "io = mmap (auto: the tables" in server.log()


def test_auto_reads_tables_larger_than_the_cache_directly(start_server, model, tmp_path):
    require_o_direct(model)
    server = start_server(model, "--state-dir", str(tmp_path), "--cache-size", "1M")
    with server.client() as client:
        plane = client.stats()["dataplane"]
        t = client.tables[0]
        ids = np.arange(0, t.rows, 97)
        assert np.array_equal(client.lookup(t.layer, ids), read_reference(str(model), t.name)[ids])
    assert plane["io"] == "direct" and "exceed" in plane["io_reason"], plane
    assert plane["cache"]["budget_bytes"] == 1 << 20
    assert plane["cache"]["budget_reason"] == "cache_size setting"
    log = server.log()
    assert "io = direct (auto: the tables" in log and "row cache: " in log
