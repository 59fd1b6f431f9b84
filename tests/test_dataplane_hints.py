"""Prefetch hints (``PleClient.hint``, ``pleserver.data.hints``) against a real
direct-mode server: hinted misses are read below every lookup, dropped and
counted when the queue or the cache budget cannot take them, refused without
harm when bad, turn later lookups into hits, and cannot starve a bystander;
a client that knows nothing of hints is served as before."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest

from pleclient import PleClient
from pleclient import protocol as p
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from pleserver.observe.stats import format_human
from tests.harness import Bystander, child_report, python_child, wait_until

TABLES = (
    SyntheticTable(layer=1, rows=200_000, cols=64, dtype="F8_E4M3", parts=4, scale=0.0125),
    SyntheticTable(layer=3, rows=10_007, cols=32, dtype="BF16", parts=2),
)
HINTED = 100_000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("hints")
    write_checkpoint(str(path), TABLES, files=2)
    return path


@pytest.fixture(scope="module")
def refs(model) -> dict:
    return {t.layer: read_reference(str(model), t.name) for t in TABLES}


def serve(start_server, model, tmp_path, cache: str, *extra: str):
    return start_server(
        model, "--io", "direct", "--cache-size", cache, "--state-dir", str(tmp_path), *extra
    )


def table_stats(client, layer: int) -> dict:
    return next(t for t in client.stats()["tables"] if t["layer"] == layer)


def test_a_lookup_behind_100000_hinted_misses_does_not_wait_for_them(
    start_server, model, refs, tmp_path
):
    server = serve(start_server, model, tmp_path, "24M", "--hint-queue-rows", "131072")
    rng = np.random.default_rng(1)
    hinted = rng.permutation(HINTED)  # rows 0..99 999, none cached
    demand = rng.integers(150_000, 200_000, 16)  # rows no hint names
    with server.client(capacity=16384, depth=8) as client:
        assert client.hints_supported
        client.hint(1, hinted)
        assert client.hints_sent == HINTED and client.hints_skipped == 0
        rows = client.lookup(1, demand)  # submitted after every hint slot
        after = table_stats(client, 1)
        assert np.array_equal(rows, refs[1][demand])
        # The lookup was answered with most hinted rows still unread (hints are
        # offered after a pass's lookups, within hint_rate: 7 hints of up to
        # 16 384 ids cost 105 tokens, past the bucket's 64, so the last may
        # still wait in its slot); every hint is then taken, none dropped.
        done = after["hints_read"] + after["hints_cached"]
        assert done < HINTED // 2, after
        assert after["io"]["misses"] == len(np.unique(demand))  # hints count no lookups
        assert wait_until(lambda: table_stats(client, 1)["hints_received"] == HINTED, 30)
        assert table_stats(client, 1)["hints_dropped"] == 0, table_stats(client, 1)
        # The reader goes on once the disk is free of lookups: every hinted
        # row is read, and a lookup of them is all hits.
        assert wait_until(
            lambda: (
                (lambda t: t["hints_read"] + t["hints_cached"])(table_stats(client, 1)) == HINTED
            ),
            timeout=120,
        )
        some = hinted[:4096]
        assert np.array_equal(client.lookup(1, some), refs[1][some])
        # (a lookup's hits on hinted rows are counted just after its answer)
        assert wait_until(lambda: table_stats(client, 1)["hints_hits"] == len(some))
        final = table_stats(client, 1)
        assert final["io"]["misses"] == after["io"]["misses"]
        assert final["hints_read"] == HINTED, final


def test_hints_past_the_queue_or_the_cache_budget_are_dropped_and_counted(
    start_server, model, refs, tmp_path
):
    server = serve(start_server, model, tmp_path / "a", "24M", "--hint-queue-rows", "1000")
    with server.client(capacity=4096) as client:
        client.hint(1, np.arange(1500))  # more than the whole queue
        client.hint(1, np.arange(2000, 2600))  # fits
        assert wait_until(lambda: table_stats(client, 1)["hints_received"] == 2100)
        t = table_stats(client, 1)
        assert t["hints_dropped_by"]["queue_full"] == 1500, t
        assert t["hints_dropped"] == 1500
        assert wait_until(
            lambda: (lambda s: s["hints_read"] + s["hints_cached"])(table_stats(client, 1)) == 600
        )
        assert np.array_equal(client.lookup(1, [5, 2005]), refs[1][[5, 2005]])
    tiny = serve(start_server, model, tmp_path / "b", "256K")
    with tiny.client(capacity=4096) as client:
        stats = client.stats()
        share = stats["hints"]["cache_rows"]
        assert 0 < share <= stats["dataplane"]["cache"]["capacity_rows"] // 2
        client.hint(1, np.arange(share + 1))  # more than the cache may give hints
        assert wait_until(lambda: table_stats(client, 1)["hints_received"] == share + 1)
        t = table_stats(client, 1)
        assert t["hints_dropped_by"]["cache_full"] == share + 1, t
        assert t["hints_read"] == 0


def test_bad_hints_are_refused_and_counted_and_the_session_goes_on(
    start_server, model, refs, tmp_path
):
    server = serve(start_server, model, tmp_path, "4M")
    with server.client(capacity=1024) as client:
        client.hint(1, [0, 1, 200_000])  # one id past the table
        client.hint(3, [-1])
        assert wait_until(lambda: table_stats(client, 3)["hints_received"] == 1)
        # A table index no server table has, and a kind no server reads,
        # written into a free slot as any client could.
        channel = client.channel
        slot = client.slots.take(timeout=1.0)  # held as a ticket's, written by hand
        for table, kind, code in (
            (99, p.RequestKind.HINT, p.ErrorCode.BAD_TABLE),
            (0, 7, p.ErrorCode.BAD_MESSAGE),
        ):
            seq = client._sequence
            slot.submit(table, np.arange(5), seq, time.monotonic_ns(), kind)
            client._sequence = seq + 1
            channel.publish_submit(client._sequence)
            assert slot.wait_answered(10) == p.SlotState.ERROR
            assert slot.words[p.SL_ERROR] == code, slot.error_text()
        client.slots.release(slot.index)
        ids = np.arange(0, 200_000, 997)
        assert np.array_equal(client.lookup(1, ids), refs[1][ids])
        stats = client.stats()
    t1, t3 = (next(t for t in stats["tables"] if t["layer"] == n) for n in (1, 3))
    assert t1["hints_dropped_by"]["refused"] == 3 and t1["hints_read"] == 0, t1
    assert t3["hints_dropped_by"]["refused"] == 1, t3
    assert stats["hints"]["bad_table"] == 5
    # Refused hints are not lookups' errors: the lookups' counts stay clean.
    assert t1["error_count"] == 0 and t3["error_count"] == 0
    assert server.running and "Traceback" not in server.log()


def test_a_lookup_of_hinted_rows_is_a_hit_counted_as_a_hit_on_a_hinted_row(
    start_server, model, refs, tmp_path
):
    server = serve(start_server, model, tmp_path, "8M")
    ids = np.arange(40_000, 40_000 + 300 * 7, 7)
    with server.client(capacity=1024) as client:
        client.hint(1, ids)
        assert wait_until(lambda: table_stats(client, 1)["hints_read"] == ids.size)
        before = table_stats(client, 1)
        assert before["hints_hits"] == 0 and before["hints_cached"] == 0
        assert before["hints_tracked_rows"] == ids.size  # each waits for its lookup
        assert np.array_equal(client.lookup(1, ids), refs[1][ids])
        after = table_stats(client, 1)
        assert after["io"]["misses"] == before["io"]["misses"]  # no read for them
        assert after["io"]["hits"] == before["io"]["hits"] + ids.size
        # (a lookup's hits on hinted rows are counted before its gather)
        assert table_stats(client, 1)["hints_hits"] == ids.size
        # every hinted row was asked for: the table's lookups check nothing now
        assert table_stats(client, 1)["hints_tracked_rows"] == 0
        client.lookup(1, ids)  # counted once per hinted row
        assert wait_until(lambda: table_stats(client, 1)["requests"] == before["requests"] + 2)
        assert table_stats(client, 1)["hints_hits"] == ids.size
        client.hint(1, ids)  # cached already: counted, not read again
        assert wait_until(lambda: table_stats(client, 1)["hints_cached"] == ids.size)
        assert table_stats(client, 1)["hints_read"] == ids.size


def test_hints_hits_counts_only_the_hits_hints_brought(start_server, model, refs, tmp_path):
    """Rows cached before their hint, and hinted rows evicted before their
    lookup, are no hint's hits (issue 26, item 9)."""
    server = serve(start_server, model, tmp_path, "8M")
    cached_first = np.arange(10_000, 10_000 + 200 * 5, 5)
    evicted = np.arange(60_000, 60_000 + 300 * 7, 7)
    with server.client(capacity=4096) as client:
        client.lookup(1, cached_first)
        client.hint(1, cached_first)  # all cached: counted, not read, not remembered
        assert wait_until(lambda: table_stats(client, 1)["hints_cached"] == cached_first.size)
        assert table_stats(client, 1)["hints_tracked_rows"] == 0
        assert np.array_equal(client.lookup(1, cached_first), refs[1][cached_first])
        assert table_stats(client, 1)["hints_hits"] == 0

        client.hint(1, evicted)
        assert wait_until(lambda: table_stats(client, 1)["hints_read"] == evicted.size)
        assert table_stats(client, 1)["hints_tracked_rows"] == evicted.size
        for start in range(100_000, 200_000, 4096):  # more distinct rows than the cache holds
            client.lookup(1, np.arange(start, min(start + 4096, 200_000)))
        before = table_stats(client, 1)
        assert np.array_equal(client.lookup(1, evicted), refs[1][evicted])
        after = table_stats(client, 1)
        missed = after["io"]["misses"] - before["io"]["misses"]
        assert 0 < missed <= evicted.size, (before["io"], after["io"])  # the flood evicted some
        assert after["hints_hits"] == evicted.size - missed
        assert after["hints_tracked_rows"] == 0


def test_hints_past_the_free_slots_are_skipped_or_with_wait_sent_as_slots_come_back(
    start_server, model, tmp_path
):
    server = serve(start_server, model, tmp_path, "24M", "--hint-queue-rows", "131072")
    ids = np.arange(0, 64 * 1024)  # 64 slots' worth through 2 slots
    with server.client(capacity=1024, depth=2) as client:
        client.hint(1, ids)  # never blocks: what finds no free slot is skipped
        assert client.hints_sent == 2 * 1024
        assert client.hints_skipped == ids.size - 2 * 1024
        client.hint(1, ids, wait=5.0)  # each slot is back at the server's admission
        assert client.hints_sent == 2 * 1024 + ids.size
        assert client.hints_skipped == ids.size - 2 * 1024
        assert wait_until(
            lambda: table_stats(client, 1)["hints_received"] == client.hints_sent, timeout=30
        )


FLOODER = """
socket, stop = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(7)
with PleClient.connect(socket, capacity=16384, depth=8, name="flooder") as client:
    while not os.path.exists(stop):
        client.hint(1, rng.integers(0, 200_000, 8 * 16384))
    print(json.dumps({"sent": client.hints_sent, "skipped": client.hints_skipped}))
"""


def test_a_client_flooding_hints_does_not_starve_a_bystander(start_server, model, refs, tmp_path):
    server = serve(start_server, model, tmp_path, "4M")
    stop = tmp_path / "stop"
    flooder = python_child(FLOODER, server.socket, str(stop))
    try:
        with server.client() as watcher:
            assert wait_until(lambda: table_stats(watcher, 1)["hints_received"] > 0, 30)
            with Bystander(server, refs) as bystander:
                bystander.wait_for_lookups(40, timeout=120)
            t = table_stats(watcher, 1)
    finally:
        stop.touch()
        out, err = flooder.communicate(timeout=60)
    import subprocess

    report = child_report(subprocess.CompletedProcess(flooder.args, flooder.returncode, out, err))
    assert flooder.returncode == 0 and report["sent"] > 0, err
    assert t["hints_received"] > 0 and t["hints_dropped"] > 0, t  # the flood was cut
    assert server.running and "Traceback" not in server.log()


TINY_FLOODER = """
socket, stop = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(8)
with PleClient.connect(socket, capacity=1, depth=64, name="tiny-flooder") as client:
    while not os.path.exists(stop):
        client.hint(1, rng.integers(0, 200_000, 64))  # every free slot, one id each
        time.sleep(0.0005)
    print(json.dumps({"sent": client.hints_sent, "skipped": client.hints_skipped}))
"""


def test_hints_past_the_hint_rate_wait_in_their_slots_each_channel_in_turn(
    start_server, model, refs, tmp_path
):
    """A flood of one-id hints past ``hint_rate``: the loop takes at most the
    rate (and its burst), holds the rest in their slots, still gives another
    channel's hints their turn and answers every lookup, and answers every
    held hint once the flood stops."""
    rate = 200
    server = serve(start_server, model, tmp_path, "24M", "--hint-rate", str(rate))
    stop = tmp_path / "stop"
    flooder = python_child(TINY_FLOODER, server.socket, str(stop))
    try:
        with server.client(capacity=16, depth=4) as other:
            hints = lambda: other.stats()["hints"]  # noqa: E731
            assert wait_until(lambda: hints()["held_requests"] > 0, 60), hints()
            assert "hint requests held past hint_rate" in format_human(other.stats())
            start = table_stats(other, 1)["hints_received"]
            t0 = time.monotonic()
            for k in range(5):  # another channel's hints, each waited for
                sent = other.hints_sent
                other.hint(1, np.array([190_000 + k]), wait=30.0)
                assert other.hints_sent == sent + 1 and other.hints_skipped == 0
            ids = np.arange(160_000, 160_016)
            assert np.array_equal(other.lookup(1, ids), refs[1][ids])
            taken = table_stats(other, 1)["hints_received"] - start
            # the bucket: its rate over the time, and its burst
            assert taken <= rate * (time.monotonic() - t0) + 64 + 64, taken
    finally:
        stop.touch()
        out, err = flooder.communicate(timeout=60)
    import subprocess

    report = child_report(subprocess.CompletedProcess(flooder.args, flooder.returncode, out, err))
    assert flooder.returncode == 0 and report["sent"] > 0, err
    with server.client() as watcher:  # every held hint answered once the flood ended
        assert wait_until(lambda: watcher.stats()["hints"]["held_requests"] == 0, 60)
    assert server.running and "Traceback" not in server.log()


OLD_CLIENT = """
# A client of the protocol before hints: it writes no kind word, ever.
socket = sys.argv[1]
from pleclient.channel import SlotView
def submit_before_hints(self, table, ids, sequence, submit_ns, kind=None):
    n = ids.shape[0]
    self.ids[:n] = ids
    w = self.words
    w[p.SL_TABLE], w[p.SL_COUNT], w[p.SL_SEQUENCE], w[p.SL_ERROR] = table, n, sequence, 0
    self.words64[p.SL_SUBMIT_NS // 2] = submit_ns
    self._sync.store(self._state_at, p.SlotState.SUBMITTED)
SlotView.submit = submit_before_hints
with PleClient.connect(socket, capacity=512) as client:
    kinds = [s.words[p.SL_KIND] for s in client.channel.slots]
    refs = {t.layer: read_reference(sys.argv[2], t.name) for t in client.tables}
    rng = np.random.default_rng(3)
    bad = 0
    for _ in range(20):
        ids = rng.integers(0, 10_007, 300)
        bad += not np.array_equal(client.lookup(3, ids), refs[3][ids])
    print(json.dumps({"kinds": kinds, "bad": bad}))
"""


def test_a_client_that_knows_no_hints_is_served_as_before(start_server, model, tmp_path):
    server = serve(start_server, model, tmp_path, "4M")
    child = python_child(OLD_CLIENT, server.socket, str(model))
    out, err = child.communicate(timeout=120)
    import subprocess

    report = child_report(subprocess.CompletedProcess(child.args, child.returncode, out, err))
    assert report == {"kinds": [0, 0, 0, 0], "bad": 0}, err
    with server.client() as client:
        t = table_stats(client, 3)
    assert t["requests"] == 20 and t["hints_received"] == 0 and t["error_count"] == 0


def test_a_client_skips_its_hints_to_a_server_that_reads_none(
    start_server, model, refs, tmp_path, caplog
):
    """A server before hints lists no "hints" feature (it would answer a hint
    as a lookup): the client sends none, says so once, and looks up as ever."""
    server = serve(start_server, model, tmp_path, "4M")
    with server.client() as client:
        client.server_info["features"] = [p.FEATURE_GPU_DRIVEN]  # an older WELCOME
        with caplog.at_level(logging.INFO, logger="pleclient.client"):
            client.hint(1, np.arange(100))
            client.hint(1, np.arange(100))
        assert not client.hints_supported
        assert client.hints_skipped == 200 and client.hints_sent == 0
        assert sum("reads no prefetch hints" in r.message for r in caplog.records) == 1
        assert np.array_equal(client.lookup(1, [1, 2]), refs[1][[1, 2]])
        assert table_stats(client, 1)["hints_received"] == 0


def test_stats_show_the_hints(start_server, model, tmp_path):
    server = serve(start_server, model, tmp_path, "4M")
    with server.client() as client:
        client.hint(1, np.arange(64))
        assert wait_until(lambda: table_stats(client, 1)["hints_read"] == 64)
    from pleserver.observe.stats import format_human

    with server.client() as client:
        text = format_human(client.stats())
    assert "hints" in text and json.dumps(64) in text, text


def test_a_gpu_driven_channel_hints_from_its_stream(start_server, model, refs, tmp_path):
    """The CPU stand-in of a CUDA stream (``HostStream``) writes the words a
    stream writes: a hint slot is rung and never waited on; its rows are read
    and a later lookup on another slot finds them cached."""
    from pleclient.gpu import GpuLookups

    server = serve(start_server, model, tmp_path, "8M")
    ids = np.arange(60_000, 60_000 + 200 * 11, 11)
    with GpuLookups.open(server.socket, device="cpu", capacity=1024, depth=4) as gl:
        gl.hint(3, 1, ids)  # slot 3 serves hints from now on
        assert gl.client.hints_sent == ids.size
        with PleClient.connect(server.socket) as watcher:
            assert wait_until(lambda: table_stats(watcher, 1)["hints_read"] == ids.size)
            before = table_stats(watcher, 1)
            gl.ring(0, 1, ids)
            out = np.empty((ids.size, refs[1].shape[1]), dtype=np.uint8)
            gl.collect(0, out)
            assert np.array_equal(out, refs[1][ids])
            after = table_stats(watcher, 1)
            assert wait_until(lambda: table_stats(watcher, 1)["hints_hits"] == ids.size)
        assert after["io"]["misses"] == before["io"]["misses"]
        with pytest.raises(Exception, match="serves hints"):
            gl.ring(3, 1, ids[:4])
        with pytest.raises(Exception, match="serves lookups"):
            gl.hint(0, 1, ids[:4])
        gl.hint(3, 1, np.array([200_000]))  # past the table: refused, nothing to wait for
        gl.ring(1, 1, ids[:8])
        out = np.empty((8, refs[1].shape[1]), dtype=np.uint8)
        gl.collect(1, out)
        assert np.array_equal(out, refs[1][ids[:8]])
        assert gl.failure is None
        with PleClient.connect(server.socket) as watcher:
            assert wait_until(lambda: table_stats(watcher, 1)["hints_dropped_by"]["refused"] == 1)


def test_hints_that_come_while_every_gather_worker_holds_a_lookup_are_dropped(
    start_server, model, refs, tmp_path
):
    """With one gather worker, a hint admitted while a lookup of 16 384 misses
    is with it finds the disk saturated by demand: dropped as ``disk_busy``,
    counted, never queued. (Hints go on arriving through the lookup's reads;
    the try is repeated on new rows should a lookup be answered first.)"""
    server = serve(start_server, model, tmp_path, "8M", "--gather-workers", "1")
    with server.client(capacity=16384, depth=8) as client:
        for attempt in range(5):
            first = 100_000 + attempt * 16384
            ids = np.arange(first, first + 16384)
            ticket = client.submit(1, ids)  # handed off whole (parallel_min_rows)
            for _ in range(500):
                client.hint(3, [attempt])
            rows = ticket.wait()
            assert np.array_equal(rows, refs[1][ids])
            ticket.release()
            if table_stats(client, 3)["hints_dropped_by"]["disk_busy"]:
                break
        t = table_stats(client, 3)
        assert t["hints_dropped_by"]["disk_busy"] > 0, t

        def accounted(t: dict) -> bool:
            return t["hints_received"] == t["hints_dropped"] + t["hints_read"] + t["hints_cached"]

        # Every hinted row is accounted for once the reader is through.
        assert wait_until(lambda: accounted(table_stats(client, 3))), table_stats(client, 3)


def test_hinted_rows_are_counted_per_table_taken_over_and_forgotten():
    """The hinted-rows table's live count per table (what lets a table's
    lookups skip the check): a row remembered, one taken by a lookup, a slot
    another table's row takes over, a table forgotten whole."""
    from pleserver.data.hints import HintedRows

    hinted = HintedRows(1024, tables=2)
    hinted.remember(0, np.arange(100))
    hinted.remember(1, np.arange(50))
    assert list(hinted.live) == [100, 50]
    assert sorted(hinted.take(0, np.arange(10))) == list(range(10))
    assert list(hinted.live) == [90, 50]
    assert hinted.take(0, np.arange(10)).size == 0  # once each
    # table 1's rows land on slots of their own until one takes table 0's place
    clash = next(
        r
        for r in range(1024)
        if hinted._where(1, np.array([r]))[1][0] == hinted._where(0, np.array([50]))[1][0]
    )
    hinted.remember(1, np.array([clash]))
    assert hinted.live[0] == 89 and hinted.live[1] in (50, 51)
    hinted.forget(0)
    assert hinted.live[0] == 0 and hinted.take(0, np.arange(100)).size == 0
    assert hinted.live[1] > 0  # the other table's stay
    assert int((hinted.slots >= 0).sum()) == hinted.live.sum()


def server_threads(pid: int) -> dict[int, dict]:
    """The server's threads by id: each one's name, nice and voluntary context
    switches (its sleeps ended) so far."""
    import glob
    import os

    found = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task}/status") as f:
                switches = next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
                )
        except (OSError, StopIteration):
            continue  # a thread that ended meanwhile
        found[int(os.path.basename(task))] = {
            "name": name,
            "nice": int(fields[16]),
            "switches": switches,
        }
    return found


def named(threads: dict[int, dict], name: str) -> dict:
    return next(t for t in threads.values() if t["name"] == name)


def test_hints_never_make_the_loop_spin_and_the_reader_runs_below_the_server(
    start_server, model, refs, tmp_path
):
    """The serving loop spins after a lookup (``spin_us``: the client's next
    lookup is seen without a futex wake-up), never after a hint, whose client
    waits for nothing: a flood of hints kept the loop busy beside the clients
    it serves. The hint reader thread runs at a nice 10 above the server's, so
    that on a busy machine lookups, and their clients, get the CPU first."""
    server = serve(start_server, model, tmp_path, "24M")
    with server.client(capacity=16, depth=8) as client:
        client.hint(1, np.array([5]), wait=10.0)  # the reader has begun
        time.sleep(0.1)  # past any spin of the hello's or the first hint's
        spun = client.stats()["spin_seconds"]
        for k in range(200):  # a hint every 1.5 ms, each shorter apart than a spin
            client.hint(1, np.array([10 + k]), wait=10.0)
            time.sleep(0.0015)
        time.sleep(0.05)
        assert client.stats()["spin_seconds"] == spun, "the loop spun after hints"
        for _ in range(5):
            ids = np.arange(100, 116)
            assert np.array_equal(client.lookup(1, ids), refs[1][ids])
        time.sleep(0.05)
        assert client.stats()["spin_seconds"] > spun, "no spin after lookups"
    threads = server_threads(server.pid)
    main = threads[server.pid]
    assert named(threads, "ple-hints")["nice"] == min(19, main["nice"] + 10), threads
    assert named(threads, "ple-serving")["nice"] == main["nice"], threads
    assert server.running and "Traceback" not in server.log()


def test_a_gpu_driven_channel_that_only_hints_is_looked_at_every_millisecond(
    start_server, model, refs, tmp_path
):
    """A GPU-driven channel is looked at every ``gpu_poll_us`` (50 µs) for a
    while after a lookup: a decoding engine's next step rings soon. After a
    hint it is looked at every millisecond, as an idle one: hints are best
    effort, and rings of hints alone kept the loop waking 20 000 times a
    second beside the clients it serves. The serving thread's sleeps over a
    second of hint rings say which: about 20 000 ended at the fast look, a
    few hundred at the slow one (each hint's own wake-up among them)."""
    from pleclient.gpu import GpuLookups

    server = serve(start_server, model, tmp_path, "24M")
    with GpuLookups.open(server.socket, device="cpu", capacity=64, depth=4) as gl:
        gl.hint(3, 1, np.array([7]))
        time.sleep(0.3)  # past the fast look of the channel's opening
        serving = lambda: named(server_threads(server.pid), "ple-serving")  # noqa: E731
        before, t0 = serving()["switches"], time.monotonic()
        for k in range(200):  # a ring of one hint every 5 ms
            gl.hint(3, 1, np.array([1000 + k]))
            time.sleep(0.005)
        per_s = (serving()["switches"] - before) / (time.monotonic() - t0)
        assert per_s < 4000, f"the serving thread woke {per_s:.0f} times a second"
        gl.ring(0, 1, np.arange(16))  # lookups still answered
        out = np.empty((16, refs[1].shape[1]), dtype=np.uint8)
        gl.collect(0, out)
        assert np.array_equal(out, refs[1][:16])
        assert gl.failure is None
    assert server.running and "Traceback" not in server.log()
