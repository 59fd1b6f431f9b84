"""The data plane's numbers — mode, row cache, miss engine, per-table hit rate,
misses, disk reads and their latency, hot set — the same in the STATS
message, `pleserver stats` (text and --json) and the Prometheus endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from pleserver.observe.trace import load as load_trace
from tests.harness import REPO, child_env
from tests.host import require_o_direct
from tests.test_ops_metrics import Scrape, metrics_url


def pleserver_stats(socket: str, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pleserver.cli", "stats", "--socket", socket, *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_data_plane_numbers_agree_in_stats_cli_and_metrics(start_server, checkpoint, tmp_path):
    require_o_direct(checkpoint)
    server = start_server(
        checkpoint,
        "--io",
        "direct",
        "--state-dir",
        str(tmp_path),
        "--metrics-address",
        "127.0.0.1:0",
    )
    ids = np.arange(0, 3000, 3)
    with server.client() as client:
        for t in client.tables:
            client.lookup(t.layer, ids)  # misses: read from disk
            client.lookup(t.layer, ids)  # hits
        stats = client.stats()
    as_json = json.loads(pleserver_stats(server.socket, "--json"))
    scrape = Scrape(metrics_url(server))
    text = pleserver_stats(server.socket)

    plane = stats["dataplane"]
    assert plane["io"] == "direct" and plane["io_reason"] == "io setting"
    assert as_json["dataplane"]["io"] == "direct"
    assert scrape.value("ple_io_mode", io="direct") == 1
    assert scrape.value("ple_io_mode", io="mmap") == 0
    engine = plane["engine"]
    assert engine["kind"] in ("io_uring", "threads") and engine["queue_depth"] == 128
    reads = plane["read_buffers"]
    assert reads["limit_bytes"] > 0 and reads["peak_bytes"] > 0
    assert scrape.value("ple_read_buffer_limit_bytes") == reads["limit_bytes"]
    assert scrape.value("ple_read_buffer_peak_bytes") >= reads["peak_bytes"]
    assert scrape.value("ple_read_buffer_waits_total") >= reads["waits"]
    assert (
        scrape.value("ple_channel_opens_abandoned_total") == stats["abandoned_channel_opens"] == 0
    )
    assert (
        scrape.value(
            "ple_read_engine_info",
            kind=engine["kind"],
            fallback_reason=engine["fallback_reason"] or "",
        )
        == 1
    )
    assert scrape.value("ple_cache_capacity_rows") == plane["cache"]["capacity_rows"] > 0
    assert scrape.value("ple_cache_budget_bytes") == plane["cache"]["budget_bytes"]
    assert scrape.value("ple_hotset_state", state="none") == 1  # nothing saved before

    for t in stats["tables"]:
        io = t["io"]
        assert t["io_mode"] == "direct"
        assert io["misses"] >= 1000 and io["hits"] >= 1000, io  # (distinct ids: 1000)
        assert io["reads"] > 0 and io["read_bytes"] >= 4096 * io["reads"] // 2
        assert 0 < io["read_p50_s"] <= io["read_p99_s"] < 10, io
        layer = t["layer"]
        assert scrape.table("ple_cache_misses_total", layer) >= io["misses"]
        assert scrape.table("ple_cache_hits_total", layer) >= io["hits"]
        assert scrape.table("ple_disk_reads_total", layer) >= io["reads"]
        assert scrape.table("ple_disk_read_errors_total", layer) == 0
        reads = scrape.table("ple_disk_reads_total", layer)
        assert scrape.table("ple_disk_read_latency_seconds_count", layer) == reads
        assert scrape.table("ple_disk_read_latency_seconds_bucket", layer, le="+Inf") == reads
        assert scrape.table("ple_table_io_mode", layer, io="direct") == 1
        assert as_json["tables"][stats["tables"].index(t)]["io"]["misses"] >= io["misses"]

    assert "io direct (io setting)" in text
    assert f"miss engine {engine['kind']}, queue depth 128" in text
    assert "row cache " in text and "hit rate" in text and "read p99 µs" in text
    assert "hot set none: no saved file" in text


def test_the_lookup_trace_has_each_answered_request_with_its_stages(
    start_server, checkpoint, tmp_path
):
    """``--lookup-trace``: one record per answered lookup, in the host's
    CLOCK_MONOTONIC, written when the server stops; misses were handed to a
    gather worker, hits answered by the loop itself."""
    require_o_direct(checkpoint)
    trace_path = tmp_path / "lookups.npy"
    server = start_server(checkpoint, "--io", "direct", "--lookup-trace", str(trace_path))
    ids = np.arange(0, 3000, 3)
    t0 = time.monotonic_ns()
    with server.client() as client:
        tables = list(client.tables)
        for t in tables:
            client.lookup(t.layer, ids)  # misses: read from disk
            client.lookup(t.layer, ids)  # hits
    t1 = time.monotonic_ns()
    assert not trace_path.exists()  # written at stop, not before
    assert server.stop() == 0, server.log_tail()
    records = load_trace(str(trace_path))

    assert len(records) == 2 * len(tables)
    assert set(records["rows"]) == {len(ids)}
    assert len(set(records["session"])) == 1
    assert sorted(records["table"]) == sorted(2 * list(range(len(tables))))
    for r in records:
        assert t0 <= r["started_ns"] <= r["turn_ns"] <= r["done_ns"] <= t1, r
        assert r["handed_ns"] == 0 or r["turn_ns"] <= r["handed_ns"] <= r["done_ns"], r
    ordered = records[np.argsort(records["started_ns"])]
    for table in range(len(tables)):
        first, again = ordered[ordered["table"] == table]
        assert first["handed_ns"] > 0, first  # its rows came from disk
        assert again["handed_ns"] == 0, again  # from the row cache, in the loop
    assert f"lookup trace: {len(records)} requests written to {trace_path}" in server.log()


def _contract_problems(value: object, hint: object, where: str) -> list[str]:
    """Where ``value`` (JSON) leaves the shape of ``hint`` (a TypedDict of
    ``pleserver.observe.snapshot``, or a list, dict or optional of one): keys
    missing, keys not declared, and so on down every declared part."""
    import types
    import typing

    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        hints = typing.get_type_hints(hint)
        required = hint.__required_keys__  # type: ignore[union-attr]
        problems = [f"{where}.{k}: missing" for k in sorted(required - value.keys())]
        problems += [
            f"{where}.{k}: not in the contract" for k in sorted(value.keys() - hints.keys())
        ]
        for key in value.keys() & hints.keys():
            problems += _contract_problems(value[key], hints[key], f"{where}.{key}")
        return problems
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        shapes = [a for a in args if a is not type(None)]
        return _contract_problems(value, shapes[0], where) if len(shapes) == 1 else []
    if origin is list and value is not None:
        return [
            p for i, v in enumerate(value) for p in _contract_problems(v, args[0], f"{where}[{i}]")
        ]
    if origin is dict and isinstance(value, dict) and typing.is_typeddict(args[1]):
        return [p for k, v in value.items() for p in _contract_problems(v, args[1], f"{where}.{k}")]
    return []


def test_the_stats_reply_is_the_snapshot_contract_in_every_io_mode(
    start_server, checkpoint, tmp_path
):
    """Every key of a real server's STATS reply is one the contract declares,
    and every key it requires is there, down to each table and histogram: the
    native parts too (the row cache's stats, the read buffers), which mypy
    cannot see."""
    from pleserver.observe.snapshot import Snapshot

    require_o_direct(checkpoint)
    for io in ("direct", "mmap"):
        (tmp_path / io).mkdir()
        server = start_server(checkpoint, "--io", io, "--state-dir", str(tmp_path / io))
        with server.client() as client:
            for t in client.tables:
                client.lookup(t.layer, np.arange(0, 300, 3))
            stats = client.stats()
        assert stats["dataplane"]["io"] == io
        assert (stats["dataplane"]["cache"] is None) == (io == "mmap")
        assert _contract_problems(stats, Snapshot, "stats") == [], io
