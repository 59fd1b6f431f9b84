"""Lookups through a real ple-server: rows bit-exact against the files."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest

from pleclient import PleClient, PleError, RequestError, ServerUnavailable
from pleclient import protocol as p
from pleclient.client import server_socket
from pleclient.slots import SlotOwner
from pleserver.devkit.synthetic import read_reference, write_checkpoint
from tests.conftest import SMALL_TABLES
from tests.host import require_futex_waitv


@pytest.mark.parametrize("layer", [1, 3], ids=["fp8", "bf16"])
def test_random_ids_are_bit_exact(server, references, layer):
    with server.client() as client:
        table = client.table(layer)
        ids = np.random.default_rng(layer).integers(0, table.rows, 3000)
        assert np.array_equal(client.lookup(layer, ids), references[layer][ids])


def test_catalog_describes_both_tables(server):
    with server.client() as client:
        fp8, bf16 = client.table(1), client.table(3)
    assert (fp8.dtype, fp8.row_bytes, fp8.scale) == ("F8_E4M3", 160, pytest.approx(0.0125))
    assert (bf16.dtype, bf16.row_bytes, bf16.scale) == ("BF16", 320, None)
    assert fp8.rows == 20_011 and fp8.parts == 8 and len(fp8.fingerprint) == 32


def test_duplicates_cross_shard_and_last_shard_ids(server, references):
    with server.client() as client:
        t = client.table(1)
        last = t.rows - 1
        edges = [0, t.shard_size - 1, t.shard_size, 2 * t.shard_size, last - 1, last]
        ids = np.array([*edges, 5, 5, 5, last, 0, last], dtype=np.int64)
        assert np.array_equal(client.lookup(1, ids), references[t.layer][ids])


def test_empty_request_returns_no_rows(server):
    with server.client() as client:
        rows = client.lookup(3, np.array([], dtype=np.int64))
        assert rows.shape == (0, 320)
        ticket = client.submit(3, [])
        assert ticket.wait().shape == (0, 320)
        ticket.release()


def test_request_of_exactly_capacity_and_larger_than_capacity(server, references):
    with server.client(capacity=1000, depth=3) as client:
        t = client.table(3)
        ids = np.random.default_rng(0).integers(0, t.rows, 1000)
        assert np.array_equal(client.lookup(3, ids), references[t.layer][ids])
        many = np.random.default_rng(1).integers(0, t.rows, 7777)  # split over 8 requests
        assert np.array_equal(client.lookup(3, many), references[t.layer][many])
        with pytest.raises(ValueError, match="exceed the channel capacity"):
            client.submit(3, many)


def test_several_tickets_in_flight_are_zero_copy_views(server, references):
    with server.client(depth=4) as client:
        rng = np.random.default_rng(3)
        batches = [
            (layer, rng.integers(0, client.table(layer).rows, 500)) for layer in (1, 3, 1, 3)
        ]
        tickets = [client.submit(layer, ids) for layer, ids in batches]
        views = [t.wait() for t in tickets]
        for (layer, ids), view in zip(batches, views, strict=True):
            assert not view.flags.owndata  # a view into the shared segment
            assert np.array_equal(view, references[layer][ids])
        for t in tickets:
            t.release()
        with pytest.raises(PleError, match="all 4 channel slots"):
            held = [client.submit(1, [1]) for _ in range(5)]  # noqa: F841


def test_free_slots_counts_the_slots_no_unreleased_ticket_holds(server):
    with server.client(depth=3) as client:
        assert client.free_slots == 3
        first, second = client.submit(1, [1]), client.submit(3, [2])
        assert client.free_slots == 1
        first.wait()
        first.release()
        second.release()  # maybe before its answer: the next submit waits for it if need be
        assert client.free_slots == 3
        with pytest.raises(RequestError):
            client.submit(1, [client.table(1).rows]).wait()  # rejected: its slot is free
        assert client.free_slots == 3


def test_a_slot_released_before_its_answer_is_reclaimed_once_answered(server, references):
    with server.client(depth=1) as client:
        first = client.submit(1, [1])
        assert client.slots.owner(0) is SlotOwner.TICKET
        first.release()  # maybe before its answer: nobody will read it
        assert client.slots.owner(0) is SlotOwner.ABANDONED and client.free_slots == 1
        second = client.submit(3, [2])  # the answer to the first came (or is waited for)
        assert client.slots.owner(0) is SlotOwner.TICKET
        assert np.array_equal(second.wait(), references[3][[2]])
        second.release()
        assert client.slots.owner(0) is SlotOwner.FREE


def test_lookup_into_caller_buffer_and_by_name(server, references):
    with server.client() as client:
        t = client.table(1)
        out = np.zeros((10, t.row_bytes), dtype=np.uint8)
        result = client.lookup(t.name, np.arange(10), out=out)
        assert result is out and np.array_equal(out, references[t.layer][:10])


def test_out_of_range_id_is_an_error_and_the_session_keeps_working(server, references):
    with server.client() as client:
        t = client.table(3)
        # Small requests and requests over SMALL_REQUEST_ROWS are checked apart.
        large = list(range(100))
        for bad in (
            [t.rows],
            [-1],
            [0, 1, 2**40],
            [-(2**63)],
            [*large, t.rows],
            [-1, *large],
            [*large[:63], -(2**63)],
        ):
            with pytest.raises(RequestError, match="out of range"):
                client.lookup(3, np.array(bad, dtype=np.int64))
        assert np.array_equal(client.lookup(3, [7]), references[t.layer][[7]])
        assert np.array_equal(client.lookup(3, large), references[t.layer][large])
        stats = client.stats()
    bf16 = next(s for s in stats["tables"] if s["layer"] == 3)
    assert bf16["errors"]["id_out_of_range"] == 7


def test_unknown_table_is_a_client_side_error(server):
    with server.client() as client, pytest.raises(KeyError, match="serves no single table 7"):
        client.lookup(7, [0])


def _client_process(socket_path: str, model: str, seed: int, rounds: int) -> int:
    """Mixed lookups from a separate process; returns the number of mismatches."""
    rng = np.random.default_rng(seed)
    refs = {}
    bad = 0
    with PleClient.connect(socket_path, name=f"worker{seed}") as client:
        for t in client.tables:
            refs[t.name] = read_reference(model, t.name)
        for _ in range(rounds):
            t = client.tables[int(rng.integers(2))]
            ids = rng.integers(0, t.rows, int(rng.choice([1, 16, 300, 5000])))
            bad += int(not np.array_equal(client.lookup(t.layer, ids), refs[t.name][ids]))
    return bad


def test_concurrent_client_processes_get_their_own_rows(server, checkpoint):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        mismatches = pool.starmap(
            _client_process, [(server.socket, str(checkpoint), s, 150) for s in range(4)]
        )
    assert mismatches == [0, 0, 0, 0]
    with server.client() as client:
        stats = client.stats()
    assert sum(t["requests"] for t in stats["tables"]) >= 600


def test_missing_socket_names_the_service(tmp_path):
    with pytest.raises(ServerUnavailable, match="systemctl status ple-server"):
        PleClient.connect(str(tmp_path / "nothing.sock"))


def test_no_socket_given_means_the_environment_s_then_the_service_s(server, monkeypatch):
    monkeypatch.setenv(p.SOCKET_ENV, server.socket)
    with PleClient.connect() as client:  # every entry point without a path finds it
        assert client.socket_path == server.socket
    assert len(PleClient.query_tables()) == 2
    assert PleClient.query_stats()["pid"] == server.pid
    assert server_socket("/elsewhere.sock") == "/elsewhere.sock"
    monkeypatch.delenv(p.SOCKET_ENV)
    assert server_socket() == p.DEFAULT_SOCKET == "/run/ple-server/ple.sock"


def test_stats_counts_rows_and_bytes(server):
    with server.client() as client:
        client.lookup(3, np.arange(100))
        client.lookup(1, np.arange(50))
        stats = client.stats()
    by_layer = {t["layer"]: t for t in stats["tables"]}
    assert by_layer[3]["rows"] == 100 and by_layer[3]["bytes"] == 100 * 320
    assert by_layer[1]["rows"] == 50 and by_layer[1]["bytes"] == 50 * 160
    assert by_layer[3]["server_time"]["count"] == 1
    assert stats["clients"] == 1 and stats["pid"] == server.pid
    assert os.path.samefile(stats["model"], server.args[server.args.index("--model") + 1])


@pytest.mark.parametrize("files", [1, 3], ids=["one-file-contiguous", "three-files"])
@pytest.mark.parametrize("prewarm", ["none", "full"])
def test_every_gather_path_is_bit_exact(start_server, tmp_path_factory, files, prewarm):
    """Contiguous single view, several views; direct, deduplicated and parallel
    gathers (large requests, with and without a completed prewarm)."""
    model = tmp_path_factory.mktemp(f"layout{files}")
    write_checkpoint(str(model), SMALL_TABLES, files=files, extra_tensor=files > 1)
    server = start_server(model, "--prewarm", prewarm)
    rng = np.random.default_rng(files)
    if prewarm == "full":  # the prewarm over, so the fast paths run
        assert server.wait_prewarm() == "done"
    with server.client(capacity=40_000, depth=2) as client:
        for t in client.tables:
            ref = read_reference(str(model), t.name)
            for n in (1, 100, 5000, 40_000):
                ids = rng.integers(0, t.rows, n)
                if n == 5000:
                    ids[::2] = ids[0]  # many repeats: the deduplicating path
                assert np.array_equal(client.lookup(t.layer, ids), ref[ids]), (t.name, n)


def _mapped_rss(pid: int, directory: str) -> int:
    """Bytes of the files under ``directory`` mapped into the page tables of
    process ``pid`` (the Rss of their mappings in /proc/PID/smaps)."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                counting = len(fields) >= 6 and fields[5].startswith(directory)
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("prewarm", ["none", "full"])
def test_prewarm_maps_the_tables_into_the_server(start_server, tmp_path_factory, prewarm):
    """A completed prewarm has mapped every row into the server's page tables
    (its first lookups pay no minor faults); without one, nothing is mapped
    before a lookup touches it."""
    model = tmp_path_factory.mktemp("mapped")
    write_checkpoint(str(model), SMALL_TABLES, files=2)
    table_bytes = sum(t.rows * t.row_bytes for t in SMALL_TABLES)
    server = start_server(model, "--prewarm", prewarm)
    if prewarm == "full":
        assert server.wait_prewarm() == "done"
        assert _mapped_rss(server.pid, str(model)) >= table_bytes
    else:
        PleClient.query_stats(server.socket)  # the server is past its start
        assert _mapped_rss(server.pid, str(model)) < table_bytes // 2


@pytest.mark.parametrize("idle_wait", ["futex_waitv", "poll"])
def test_requests_after_idle_gaps_are_served_by_either_idle_wait(
    start_server, checkpoint, references, idle_wait
):
    """Each request comes after the loop has gone to sleep (its spin is 0):
    woken through futex_waitv on the channel's counter, or found by polling."""
    if idle_wait == "futex_waitv":
        require_futex_waitv()
    server = start_server(checkpoint, "--idle-wait", idle_wait, "--spin-us", "0")
    with server.client() as client:
        for i in range(20):
            if idle_wait == "futex_waitv":  # the window: the loop asleep on this channel
                channel = client._channel
                deadline = time.monotonic() + 10
                while channel.header[p.CH_SERVER_SLEEPING] != 1:
                    assert time.monotonic() < deadline, "the loop never slept on the channel"
                    time.sleep(0.0005)
            ids = np.arange(i, i + 16)
            assert np.array_equal(client.lookup(1, ids), references[1][ids])
        assert client.stats()["idle_wait"] == idle_wait
    assert (
        "sleeps on every channel at once"
        if idle_wait == "futex_waitv"
        else "polls the channels every 0.5 ms"
    ) in server.log()
