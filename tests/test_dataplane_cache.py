"""The row cache and the miss engine under pressure: eviction under a tiny
budget with several client processes, the pread-thread engine forced by
``read_engine = threads``, and a read that fails because a checkpoint file
was truncated under a direct-mode server."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from pleclient import RequestError
from pleclient.checkpoint import INDEX_FILE
from pleserver.devkit.synthetic import (
    SyntheticTable,
    read_reference,
    shard_bytes,
    write_checkpoint,
    write_safetensors,
)
from pleserver.observe.stats import format_human
from tests.conftest import SMALL_TABLES
from tests.harness import REPO, child_env, child_report, python_child, wait_until


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    write_checkpoint(str(path), SMALL_TABLES, files=2)
    return path


PRESSURE_CLIENT = """
model, socket, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(seed)
bad = requests = 0
with PleClient.connect(socket, capacity=2048) as client:
    refs = {t.layer: read_reference(model, t.name) for t in client.tables}
    for step in range(40):
        for t in client.tables:
            hot = rng.integers(0, 20, 32)  # a few rows every process keeps asking for
            ids = np.concatenate([hot, rng.integers(0, t.rows, 224)])
            requests += 1
            bad += not np.array_equal(client.lookup(t.layer, ids), refs[t.layer][ids])
print(json.dumps({"requests": requests, "bad": bad}))
"""


def run_clients(code: str, *args: str, count: int) -> list[dict]:
    children = [python_child(code, *args, str(seed)) for seed in range(count)]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=180)
        reports.append(
            child_report(subprocess.CompletedProcess(child.args, child.returncode, out, err))
        )
    return reports


def test_the_reads_in_flight_of_every_request_together_stay_within_the_queue_depth(
    start_server, model, tmp_path
):
    """Four client processes' cold lookups, each split over four gather workers:
    many batches read at once, and their reads in flight, all rings together,
    stay within queue_depth and the small requests' reserve (each ring kept
    queue_depth of its own before: four workers, four times the depth)."""
    server = start_server(
        model,
        "--io",
        "direct",
        "--cache-size",
        "256K",
        "--queue-depth",
        "8",
        "--gather-workers",
        "4",
        "--parallel-min-rows",
        "64",
        "--state-dir",
        str(tmp_path),
    )
    reports = run_clients(PRESSURE_CLIENT, str(model), server.socket, count=4)
    assert all(r["requests"] == 80 and r["bad"] == 0 for r in reports), reports
    with server.client() as client:
        stats = client.stats()
    engine = stats["dataplane"]["engine"]
    assert engine["kind"] == "io_uring", engine  # (the credits are io_uring's)
    assert engine["queue_depth"] == 8 and engine["small_reserve"] == 8, engine
    assert engine["in_flight"] == 0, engine  # every credit given back
    # reached (the clients kept the disk busy) and never passed
    assert 8 <= engine["peak_in_flight"] <= 8 + 8, engine
    assert "reads in flight 0, peak" in format_human(stats)


def test_a_tiny_cache_evicts_and_stays_exact_under_parallel_clients(start_server, model, tmp_path):
    server = start_server(
        model, "--io", "direct", "--cache-size", "256K", "--state-dir", str(tmp_path)
    )
    reports = run_clients(PRESSURE_CLIENT, str(model), server.socket, count=4)
    assert all(r["requests"] == 80 and r["bad"] == 0 for r in reports), reports
    with server.client() as client:
        stats = client.stats()
    cache = stats["dataplane"]["cache"]
    slot = max(t["row_bytes"] for t in stats["tables"])
    assert 0 < cache["capacity_rows"] <= (256 << 10) // slot  # (the index takes its share)
    assert cache["evictions"] > 0 and cache["used_rows"] <= cache["capacity_rows"], cache
    for t in stats["tables"]:
        io = t["io"]
        assert io["misses"] > 0 and io["reads"] > 0, io
        assert io["read_bytes"] >= io["reads"] * 4096 and io["read_errors"] == 0, io
        assert t["error_count"] == 0
    # Hits, certain by construction: whether the four clients above ever hit
    # depends on how their requests interleave (once, every one of their
    # 40 960 rows missed), so one client alone now asks the same rows twice.
    # 16 rows a table are fewer than one shard of this cache holds (8 shards
    # of 91 slots), and nothing else runs: the second ask hits every row.
    with server.client() as client:
        asked = {t.layer: np.arange(16, dtype=np.int64) * 97 for t in client.tables}
        for layer, ids in asked.items():
            client.lookup(layer, ids)
        before = {t["layer"]: t["io"] for t in client.stats()["tables"]}
        for layer, ids in asked.items():
            expected = read_reference(str(model), table_name(client, layer))[ids]
            np.testing.assert_array_equal(client.lookup(layer, ids), expected)
        after = {t["layer"]: t["io"] for t in client.stats()["tables"]}
    for layer in asked:
        assert after[layer]["hits"] - before[layer]["hits"] == 16, (before[layer], after[layer])
        assert after[layer]["misses"] == before[layer]["misses"], (before[layer], after[layer])
        assert 0 < after[layer]["hit_rate"] < 1, after[layer]


def table_name(client, layer: int) -> str:
    return next(t.name for t in client.tables if t.layer == layer)


def test_the_thread_engine_serves_when_chosen_and_says_so(start_server, model, tmp_path):
    server = start_server(
        model,
        "--io",
        "direct",
        "--read-engine",
        "threads",
        "--read-threads",
        "3",
        "--state-dir",
        str(tmp_path),
    )
    rng = np.random.default_rng(3)
    with server.client() as client:
        for t in client.tables:
            ids = rng.integers(0, t.rows, 2000)
            assert np.array_equal(
                client.lookup(t.layer, ids), read_reference(str(model), t.name)[ids]
            )
        stats = client.stats()
    assert stats["dataplane"]["engine"]["kind"] == "threads", stats["dataplane"]
    assert all(t["io"]["reads"] > 0 for t in stats["tables"])
    assert "miss engine: threads" in server.log()
    human = subprocess.run(
        [sys.executable, "-m", "pleserver.cli", "stats", "--socket", server.socket],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=30,
    )
    assert "miss engine threads" in human.stdout, human.stdout + human.stderr


def one_table_per_file(model_dir: str, tables) -> list[str]:
    """A checkpoint whose tables each live in a file of their own; the paths."""
    os.makedirs(model_dir)
    weight_map, paths = {}, []
    for n, table in enumerate(tables):
        filename = f"model-{n + 1:05d}-of-{len(tables):05d}.safetensors"
        tensors = [
            (
                f"{table.name}.shard_{i}.weight",
                table.dtype,
                (rows, table.cols),
                shard_bytes(table, i).tobytes(),
            )
            for i, rows in enumerate(table.shard_rows())
        ]
        if table.dtype.startswith("F8"):
            tensors.append((f"{table.name}.weight_scale", "F32", (), struct.pack("<f", 0.0125)))
        paths.append(os.path.join(model_dir, filename))
        write_safetensors(paths[-1], tensors)
        weight_map.update({name: filename for name, *_ in tensors})
    with open(os.path.join(model_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return paths


def test_a_file_truncated_under_a_direct_server_fails_its_reads_not_the_server(
    start_server, tmp_path
):
    model = str(tmp_path / "model")
    _, bf16_file = one_table_per_file(model, SMALL_TABLES)
    server = start_server(model, "--io", "direct", "--state-dir", str(tmp_path))
    fp8, bf16 = SMALL_TABLES
    refs = {t.layer: read_reference(model, t.name) for t in SMALL_TABLES}
    with server.client() as client:
        cached = np.arange(0, 100)
        assert np.array_equal(client.lookup(bf16.layer, cached), refs[bf16.layer][cached])
        os.truncate(bf16_file, os.path.getsize(bf16_file) // 2)
        past_the_end = np.arange(bf16.rows - 500, bf16.rows)
        with pytest.raises(RequestError) as failed:
            client.lookup(bf16.layer, past_the_end)
        text = str(failed.value)
        assert bf16_file in text, text
        assert "short read" in text or "changed on disk" in text, text  # the read, or the check
        # The other table, in the other file, is served as before; so is this session.
        ids = np.random.default_rng(5).integers(0, fp8.rows, 3000)
        assert np.array_equal(client.lookup(fp8.layer, ids), refs[fp8.layer][ids])
        assert wait_until(lambda: "changed on disk" in server.log())
        with pytest.raises(RequestError, match="changed on disk"):
            client.lookup(bf16.layer, cached)  # even rows in the cache: the file changed
        assert np.array_equal(client.lookup(fp8.layer, ids), refs[fp8.layer][ids])
        stats = client.stats()
    assert server.proc.poll() is None
    errors = stats["tables"][1]["errors"]
    assert errors["read_error"] + errors["internal"] == 2, errors


LOAD_CLIENT = """
socket, seconds, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(seed)
requests = 0
with PleClient.connect(socket, capacity=16384) as client:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        t = client.tables[int(rng.integers(len(client.tables)))]
        client.lookup(t.layer, rng.integers(0, t.rows, int(rng.choice([16, 2000, 16384]))))
        requests += 1
print(json.dumps({"requests": requests}))
"""


def rss_anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_anonymous_memory_comes_back_after_a_load_of_misses(start_server, tmp_path):
    """Rounds of misses read into buffers of up to 16 MiB. Freed to malloc,
    glibc kept them in its per-thread arenas: here RssAnon stayed 70-76 MiB
    over its baseline after the load. The server's own pool keeps a few
    buffers warm, two of them large, and returns the pages of the others."""
    model = write_checkpoint(
        str(tmp_path / "model"),
        (
            SyntheticTable(layer=1, rows=500_009, cols=160, dtype="F8_E4M3", parts=8),
            SyntheticTable(layer=5, rows=300_007, cols=160, dtype="NVFP4", parts=4),
        ),
        files=2,
    )
    server = start_server(
        model, "--io", "direct", "--cache-size", "4M", "--state-dir", str(tmp_path)
    )
    with server.client() as client:  # warm: every thread the load uses exists
        for t in client.tables:
            client.lookup(t.layer, np.arange(0, t.rows, 97))
        assert wait_until(
            lambda: (
                (c := client.stats()["dataplane"]["cache"])["populated_bytes"]
                >= c["reserved_bytes"]
            )
        )
    before = rss_anon_mib(server.pid)
    reports = run_clients(LOAD_CLIENT, server.socket, "8", count=4)
    assert all(r["requests"] > 0 for r in reports)
    time.sleep(1)
    after = rss_anon_mib(server.pid)
    print(f"RssAnon {before:.1f} MiB before the load, {after:.1f} MiB after")
    assert after - before < 40, f"RssAnon {before:.1f} → {after:.1f} MiB after a load of misses"
