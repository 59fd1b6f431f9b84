"""GPU-driven channels through a real ple-server, with the CPU stand-in.

``GpuLookups.open(device="cpu")`` rings and waits with ``HostStream``, which
writes exactly the words a CUDA stream writes (``SlotView.ring`` / ``wait_done``
/ ``reset_done``), so the server's polling, the done and error words, and the
watchdog are the ones a GPU meets. The CUDA side itself runs on a GPU host
(``bench/gpu/decode.py``, ``bench/gpu/channel_check.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from pleclient import PleClient, PleError, RequestError
from pleclient import protocol as p
from pleclient.channel import RUNG_AT
from pleclient.gpu import GpuLookupError, GpuLookups, HostStream
from pleclient.slots import SlotOwner
from pleserver.observe.stats import format_human
from tests.harness import (
    Bystander,
    RawSession,
    cpu_seconds,
    python_child,
    quiet_footprint,
    settles_to,
    stop_process,
    wait_until,
)


@pytest.fixture
def lookups(server):
    with GpuLookups.open(server.socket, device="cpu", capacity=2048, depth=4, timeout=2.0) as gl:
        yield gl


def rows_of(gl: GpuLookups, slot: int, layer: int, ids: np.ndarray) -> np.ndarray:
    """One lookup through ``slot``: ring, then collect (raises on an error answer)."""
    out = np.empty((ids.shape[0], gl.client.table(layer).row_bytes), dtype=np.uint8)
    gl.ring(slot, layer, ids)
    gl.collect(slot, out)
    return out


def test_the_server_offers_gpu_driven_channels(server):
    with RawSession(server.socket) as raw:
        assert p.FEATURE_GPU_DRIVEN in raw.hello()["features"]
        reply, fds = raw.open_channel(gpu_driven=True, rung_word=True)
        for fd in fds:
            os.close(fd)
        assert reply["type"] == "channel" and reply["gpu_driven"] is True


def test_a_gpu_driven_flag_that_is_not_a_boolean_is_refused(server):
    with RawSession(server.socket) as raw:
        raw.hello()
        reply, fds = raw.open_channel(gpu_driven="yes")
        assert not fds
        assert reply["type"] == "error" and reply["code"] == p.ErrorCode.BAD_MESSAGE
        assert "gpu_driven" in reply["message"]


def test_the_lookups_say_what_rings_and_an_unknown_way_is_refused(lookups, server):
    assert lookups.ops == "host"  # the CPU stand-in; memops or kernels on a GPU
    with pytest.raises(PleError, match="use one of memops, kernels"):
        GpuLookups.open(server.socket, device="cpu", ops="graphs")


def test_rung_slots_are_answered_bit_exact_replay_after_replay(lookups, references, server):
    stats = PleClient.query_stats(server.socket)
    assert (stats["channels"], stats["gpu_channels"]) == (1, 1)
    assert "(1 GPU-driven)" in format_human(stats)
    rng = np.random.default_rng(1)
    for replay in range(30):  # the same slots, as a replayed graph uses them
        pending = []
        for slot, layer in enumerate((1, 3, 1, 3)):
            ids = rng.integers(0, references[layer].shape[0], int(rng.integers(1, 2049)))
            lookups.ring(slot, layer, ids)  # all four in flight at once
            pending.append((slot, layer, ids))
        for slot, layer, ids in pending:
            out = np.empty((ids.shape[0], references[layer].shape[1]), dtype=np.uint8)
            lookups.collect(slot, out)
            assert np.array_equal(out, references[layer][ids]), (replay, slot)
    for view in lookups.client.channel.slots:  # every wait was reset for the next replay
        assert (view.doorbell, view.done, view.answers) == (
            p.Doorbell.IDLE,
            p.Done.WAITING,
            30,
        )


def test_the_loop_spins_after_cpu_driven_requests_only(server, lookups, references):
    """A decoding engine's doorbells never make the serving loop spin: they
    are polled every gpu_poll_us, and a spinning core beside vLLM slowed its
    steps. A CPU thread's requests still get the spin (spin_us, 2 ms), which
    spares its next request a futex wake-up; the stats count its seconds."""
    time.sleep(0.3)  # past any earlier CPU request's spin
    spun = PleClient.query_stats(server.socket)["spin_seconds"]
    rng = np.random.default_rng(3)
    for _ in range(60):  # a decode's rhythm: a lookup, then a gap shorter than the spin
        ids = rng.integers(0, references[1].shape[0], 64)
        assert np.array_equal(rows_of(lookups, 0, 1, ids), references[1][ids])
        time.sleep(0.001)
    time.sleep(0.05)
    after_gpu = PleClient.query_stats(server.socket)
    assert after_gpu["spin_seconds"] == spun, "the loop spun after GPU-driven requests"
    with server.client(name="cpu", capacity=64, depth=1) as cpu:
        for _ in range(20):
            ids = rng.integers(0, references[1].shape[0], 16)
            assert np.array_equal(cpu.lookup(1, ids), references[1][ids])
            time.sleep(0.005)  # past the spin: each lookup starts a spin of its own
        time.sleep(0.05)
        after_cpu = cpu.stats()
    assert after_cpu["spin_seconds"] > spun + 0.01  # ≈ 20 spins of 2 ms
    assert "s spent spinning after CPU-driven requests" in format_human(after_cpu)


def test_an_answer_leaves_the_words_a_gpu_expects(lookups, references):
    slot = lookups.client.channel.slots[2]
    ids = np.arange(100)
    lookups.ring(2, 1, ids)
    assert slot.wait_done(5.0) == p.Done.OK  # the stream's wait, without its reset
    assert slot.doorbell == p.Doorbell.IDLE  # ready for the next ring
    assert slot.words[p.SL_ERROR] == p.ErrorCode.OK and slot.answers == 1
    assert np.array_equal(slot.rows_view(100, 160), references[1][ids])
    out = np.empty((100, 160), dtype=np.uint8)
    lookups.collect(2, out)  # waits no more: done is OK; resets it
    assert slot.done == p.Done.WAITING


@pytest.mark.parametrize(
    "scribble, code, text",
    [
        ({"ids": [20_011]}, p.ErrorCode.ID_OUT_OF_RANGE, "out of range"),
        ({"table": 9}, p.ErrorCode.BAD_TABLE, "table index 9"),
        ({"count": 4096}, p.ErrorCode.BAD_COUNT, "exceeds the channel capacity"),
    ],
    ids=["bad-id", "bad-table", "bad-count"],
)
def test_a_bad_request_gets_the_error_mark_and_the_channel_goes_on(
    lookups, references, scribble, code, text
):
    slot = lookups.client.channel.slots[0]
    ids = np.array(scribble.get("ids", [5]), dtype=np.int64)
    # What a GPU writes, with the scribbled word in place of the good one.
    slot.ids[: ids.shape[0]] = ids
    slot.words[p.SL_TABLE] = scribble.get("table", 0)
    slot.words[p.SL_COUNT] = scribble.get("count", ids.shape[0])
    lookups.client.channel.sync.store(slot.word_address(p.SL_DOORBELL, 0), p.Doorbell.RUNG)
    lookups.client.channel.sync.store(RUNG_AT, p.Doorbell.RUNG)
    assert slot.wait_done(5.0) == p.Done.ERROR
    assert slot.words[p.SL_ERROR] == code and text in slot.error_text()
    assert slot.doorbell == p.Doorbell.IDLE
    slot.reset_done()
    ids = np.arange(50)
    assert np.array_equal(rows_of(lookups, 0, 1, ids), references[1][ids])


def test_an_error_answer_fails_the_collect_never_returns_rows(lookups, references):
    out = np.full((1, 160), 0xAB, dtype=np.uint8)
    lookups.ring(1, 1, np.array([references[1].shape[0]]))
    with pytest.raises(GpuLookupError, match="ID_OUT_OF_RANGE"):
        lookups.collect(1, out)
    assert lookups.failure is None  # the server answered: it is not gone
    ids = np.arange(7)
    assert np.array_equal(rows_of(lookups, 1, 1, ids), references[1][ids])


def test_a_ring_after_a_long_idle_is_answered(lookups, references, server):
    """Past its active window without doorbells the loop polls every millisecond, and
    on a quiet server it burns little CPU meanwhile."""
    rows_of(lookups, 0, 1, np.arange(10))
    time.sleep(1.5)  # past the active window: the slow poll
    before = cpu_seconds(server.pid)
    time.sleep(2.0)
    idle_cpu = (cpu_seconds(server.pid) - before) / 2.0
    ids = np.arange(300, 400)
    assert np.array_equal(rows_of(lookups, 3, 3, ids), references[3][ids])
    # Polling 1 000 times a second costs a few percent of a core; spinning, 100 %.
    assert idle_cpu < 0.3, f"an idle server with a GPU-driven channel used {idle_cpu:.0%} CPU"


def test_client_side_checks_refuse_bad_calls_before_anything_is_enqueued(lookups):
    with pytest.raises(ValueError, match=r"1\.\.2048 ids"):
        lookups.ring(0, 1, np.arange(2049))
    with pytest.raises(ValueError, match="out of range"):
        lookups.ring(4, 1, np.arange(3))
    with pytest.raises(ValueError, match="int64"):
        lookups.ring(0, 1, np.arange(3, dtype=np.int32))
    with pytest.raises(PleError, match="was not rung"):
        lookups.collect(0, np.empty((3, 160), dtype=np.uint8))
    lookups.ring(0, 1, np.arange(3))
    with pytest.raises(PleError, match="not collected"):
        lookups.ring(0, 1, np.arange(3))
    with pytest.raises(ValueError, match="out must be uint8"):
        lookups.collect(0, np.empty((4, 160), dtype=np.uint8))
    lookups.collect(0, np.empty((3, 160), dtype=np.uint8))
    with pytest.raises(PleError, match="GPU-driven"):
        lookups.client.submit(1, np.arange(3))  # the host path is not this channel's


def test_every_slot_of_a_gpu_driven_channel_belongs_to_its_stream(lookups):
    client = lookups.client
    assert [client.slots.owner(i) for i in range(client.depth)] == [SlotOwner.STREAM] * 4
    assert client.free_slots == 0  # no submit() can follow


def test_the_watchdog_ends_a_wait_on_a_server_gone_past_the_reconnect_window(server):
    """With no reader to fall back on, a server that does not come back within
    the window fails the waiting lookups (the step), and every later one."""
    gl = GpuLookups.open(
        server.socket, device="cpu", capacity=64, depth=2, timeout=30.0, reconnect_window=1.0
    )
    try:
        stop_process(server.pid)  # it will never see this doorbell
        gl.ring(0, 1, np.arange(10))
        gl.ring(1, 3, np.arange(10))
        assert gl.client.channel.slots[0].doorbell == p.Doorbell.RUNG
        started = time.monotonic()  # (before the kill: the watchdog may see it first)
        server.kill()
        with pytest.raises(GpuLookupError, match=r"SHUTTING_DOWN: .* did not come back within 1 s"):
            gl.collect(0, np.empty((10, 160), dtype=np.uint8))
        with pytest.raises(GpuLookupError, match="did not come back"):
            gl.collect(1, np.empty((10, 320), dtype=np.uint8))
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10  # the window, not the 30 s timeout
        assert "did not come back within 1 s" in (gl.failure or "")
        assert gl.watchdog.events[-1]["ended"] == "failed"
        with pytest.raises(PleError, match="have failed"):  # no new lookups either
            gl.ring(0, 1, np.arange(10))
    finally:
        gl.close()


def test_the_watchdog_ends_a_wait_the_server_never_answers(server, references):
    gl = GpuLookups.open(server.socket, device="cpu", capacity=64, depth=2, timeout=0.5)
    try:
        stop_process(server.pid)
        try:
            gl.ring(0, 1, np.arange(10))
            with pytest.raises(GpuLookupError, match=r"did not answer slot 0 within 0\.5 s"):
                gl.collect(0, np.empty((10, 160), dtype=np.uint8))
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert "did not answer" in (gl.failure or "")
    finally:
        gl.close()
    with server.client() as client:  # the server itself carries on
        assert np.array_equal(client.lookup(1, np.arange(5)), references[1][:5])


GPU_CLIENT = """
import sys
import numpy as np
from pleclient.gpu import GpuLookups
gl = GpuLookups.open(sys.argv[1], device="cpu", capacity=4096, depth=8, timeout=5.0)
out = np.empty((4096, 160), dtype=np.uint8)
for i in range(3):
    gl.ring(0, 1, np.arange(4096))
    gl.collect(0, out)
for slot in range(8):  # every slot rung, none collected: then killed
    gl.ring(slot, 1, np.arange(4096))
print("rung", flush=True)
sys.stdin.read()
"""


def test_a_killed_gpu_driven_client_leaks_nothing_and_others_are_served(server, references):
    baseline = quiet_footprint(server.pid, segments=0)
    with Bystander(server, references) as bystander:
        other = GpuLookups.open(server.socket, device="cpu", capacity=512, depth=2, timeout=5.0)
        try:
            child = python_child(GPU_CLIENT, server.socket, stdin=-1)
            try:
                assert child.stdout.readline().strip() == "rung", child.stderr.read()
                assert quiet_footprint(server.pid, segments=3).segments == 3
                child.kill()
            finally:
                child.kill()
                child.communicate()
            bystander.wait_for_lookups(20)
            ids = np.random.default_rng(3).integers(0, references[3].shape[0], 512)
            for _ in range(5):  # the other GPU-driven client: served, bit-exact
                assert np.array_equal(rows_of(other, 1, 3, ids), references[3][ids])
        finally:
            other.close()
    now = settles_to(server.pid, baseline)
    assert PleClient.query_stats(server.socket)["gpu_channels"] == 0
    assert now.segments == 0 and now.fds <= baseline.fds, (baseline, now)
    assert wait_until(lambda: server.running)
    assert "Traceback" not in server.log(), server.log_tail()


def test_a_client_without_the_rung_word_is_refused_with_the_upgrade_named(server):
    """A client written before the rung word would ring doorbells this server
    never reads: it gets VERSION_MISMATCH, and the text says what to do."""
    with RawSession(server.socket) as raw:
        raw.hello()
        reply, fds = raw.open_channel(gpu_driven=True)
        assert not fds
        assert reply["type"] == "error" and reply["code"] == p.ErrorCode.VERSION_MISMATCH
        assert "rung word" in reply["message"] and "upgrade pleclient" in reply["message"]
        assert "VLLM_PLE_SHM_GPU_PATH=off" in reply["message"]
    with server.client() as client:  # the host path is not concerned
        assert client.lookup(1, np.arange(3)).shape == (3, 160)


def test_the_server_reads_a_channels_doorbells_only_once_its_rung_word_is_set(lookups, references):
    slot = lookups.client.channel.slots[1]
    ids = np.arange(40, 60)
    slot.ids[:20] = ids
    slot.words[p.SL_TABLE] = 0
    slot.words[p.SL_COUNT] = 20
    sync = lookups.client.channel.sync
    sync.store(slot.word_address(p.SL_DOORBELL, 0), p.Doorbell.RUNG)  # the doorbell alone
    assert slot.wait_done(0.3) == p.Done.WAITING and slot.doorbell == p.Doorbell.RUNG
    sync.store(RUNG_AT, p.Doorbell.RUNG)  # then the rung word, as a stream writes it
    assert slot.wait_done(5.0) == p.Done.OK
    assert np.array_equal(slot.rows_view(20, 160), references[1][ids])
    assert sync.load(RUNG_AT) == p.Doorbell.IDLE  # taken by the server
    slot.reset_done()


def test_a_uid_past_max_gpu_slots_per_uid_is_refused_and_its_slots_come_back(
    start_server, checkpoint
):
    server = start_server(checkpoint, "--max-gpu-slots-per-uid", "100")
    first = PleClient.connect(server.socket, capacity=16, depth=64, gpu_driven=True)
    try:
        with pytest.raises(RequestError) as refused:
            PleClient.connect(server.socket, capacity=16, depth=64, gpu_driven=True)
        assert refused.value.code == p.ErrorCode.CHANNEL_LIMIT
        text = str(refused.value)
        assert f"uid {os.getuid()} holds 64 GPU-driven slots in 1 channels" in text
        assert "max_gpu_slots_per_uid = 100" in text
        with PleClient.connect(server.socket, capacity=16, depth=36, gpu_driven=True):
            pass  # what is left fits
        with server.client(depth=64) as host:  # host-path channels do not count
            assert host.lookup(1, np.arange(3)).shape == (3, 160)
    finally:
        first.close()
    # The closed session's slots are free again (its close may take a moment).
    assert wait_until(lambda: _opens(server, depth=64), timeout=10)


def _opens(server, depth: int) -> bool:
    try:
        PleClient.connect(server.socket, capacity=16, depth=depth, gpu_driven=True).close()
        return True
    except RequestError:
        return False


MANY_CHANNELS, MANY_SLOTS = 120, 64


def serving_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server's serving loop (its thread is
    named ``ple-serving``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() != "ple-serving":
                continue
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    raise AssertionError(f"server {pid} has no thread named ple-serving")


class RareRinger:
    """Rings one slot of one of ``channels`` every 0.9 s (the CPU stand-in,
    another channel and slot each time) and checks the rows it gets."""

    def __init__(self, channels: list[PleClient], reference: np.ndarray) -> None:
        self.channels, self.reference = channels, reference
        self.rings = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream, rng = HostStream(wait_timeout=10.0), np.random.default_rng(7)
        out = np.empty((16, 160), dtype=np.uint8)
        try:
            while not self._stop.wait(0.9):
                channel = self.channels[int(rng.integers(len(self.channels)))].channel
                slot = channel.slots[int(rng.integers(channel.layout.depth))]
                ids = rng.integers(0, self.reference.shape[0], 16)
                stream.ring(slot, 0, ids, 16)
                stream.collect(slot, out, 16, 160)
                assert np.array_equal(out, self.reference[ids])
                self.rings += 1
        except BaseException as exc:
            self.failure = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_many_gpu_driven_channels_cost_the_loop_by_their_rings_not_their_number(
    start_server, checkpoint, references
):
    """Two servers, one with a GPU-driven channel of 64 slots, one with 120,
    each rung once every 0.9 s (the CPU stand-in). The loop reads one rung
    word per channel and scans only a channel that rang, so a bystander that
    alternates between the two servers is served about as fast beside 120
    channels as beside one (alternating, the machine's load weighs on both
    alike), and the serving thread beside 120 uses about what it uses beside
    one. (Reading all 7 680 doorbells on every pass multiplied the bystander's
    p50 and kept the thread busy most of the time.)"""
    flags = ("--max-clients", str(MANY_CHANNELS + 8))
    flags += ("--max-gpu-slots-per-uid", str(MANY_CHANNELS * MANY_SLOTS))
    few, many = start_server(checkpoint, *flags), start_server(checkpoint, *flags)
    channels: dict[str, list[PleClient]] = {"few": [], "many": []}
    ringers: list[RareRinger] = []
    try:
        for name, server, count in (("few", few, 1), ("many", many, MANY_CHANNELS)):
            for i in range(count):
                channels[name].append(
                    server.client(name=f"gpu-{i}", capacity=16, depth=MANY_SLOTS, gpu_driven=True)
                )
            ringers.append(RareRinger(channels[name], references[1]))
        latencies: dict[str, list[float]] = {"few": [], "many": []}
        rng = np.random.default_rng(8)
        with (
            few.client(name="bystander", capacity=16, depth=1) as by_few,
            many.client(name="bystander", capacity=16, depth=1) as by_many,
        ):
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                for name, bystander in (("few", by_few), ("many", by_many)):
                    ids = rng.integers(0, references[1].shape[0], 16)
                    started = time.perf_counter()
                    rows = bystander.lookup(1, ids)
                    latencies[name].append(time.perf_counter() - started)
                    assert np.array_equal(rows, references[1][ids])
                    time.sleep(0.001)
        time.sleep(0.3)  # the loop stops spinning after the bystander's last lookup
        # Both servers' serving threads over the same seconds: a loaded machine
        # weighs on both alike.
        pids = {"few": few.pid, "many": many.pid}
        before = {k: serving_thread_cpu_seconds(pid) for k, pid in pids.items()}
        started = time.monotonic()
        time.sleep(4.5)  # 5 rings each
        took = time.monotonic() - started
        cpu = {k: (serving_thread_cpu_seconds(pid) - before[k]) / took for k, pid in pids.items()}
    finally:
        for ringer in ringers:
            ringer.stop()
        for client in channels["few"] + channels["many"]:
            client.close()
    for ringer in ringers:
        assert ringer.failure is None, ringer.failure
        assert ringer.rings >= 5, ringer.rings
    beside_one, beside_many = (float(np.median(latencies[k])) for k in ("few", "many"))
    # Generous bounds: a quiet machine gives ≈ 0.1 ms either way and a few percent.
    assert beside_many < 1e-3 + 3 * beside_one, (
        f"the bystander's p50 was {beside_many * 1e3:.2f} ms beside {MANY_CHANNELS} "
        f"GPU-driven channels, {beside_one * 1e3:.2f} ms beside one"
    )
    # ≈ 13 % and 13 % of a core on a quiet machine (the polls of rung words,
    # one a millisecond, and every 50 µs for 0.1 s after each ring); a scan of
    # every doorbell on every pass took the thread beside 120 channels to 42 %.
    assert cpu["many"] < 0.05 + 2 * cpu["few"], (
        f"the serving thread used {cpu['many']:.0%} of a core beside {MANY_CHANNELS} "
        f"GPU-driven channels rung every 0.9 s, {cpu['few']:.0%} beside one"
    )


SCRIBBLER = """
import random
from pleclient.channel import WORD
path, seconds = sys.argv[1], float(sys.argv[2])
client = PleClient.connect(path, name="scribbler", capacity=64, depth=64, gpu_driven=True)
layout = client.channel.layout
words = client.channel.sync
# Every word of the channel header and of each slot's header: the rung word,
# doorbells, done and answers words, table, count, sequence, waiters, …
offsets = [WORD * i for i in range(32)] + [
    layout.slot_offset(s) + WORD * i for s in range(layout.depth) for i in range(32)
]
values = (0, 1, 2, 3, 0xFFFFFFFF, 0x80000000)
rng, writes = random.Random(5), 0
print("ready", flush=True)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    for _ in range(1000):
        value = rng.choice(values) if rng.random() < 0.7 else rng.getrandbits(32)
        words.store(rng.choice(offsets), value)
    writes += 1000
print(writes, flush=True)
client.close()
"""


def test_a_client_that_scribbles_on_every_word_of_its_gpu_channel_harms_only_itself(
    server, references
):
    """Random values, at full speed, in every header word of a GPU-driven
    channel (its rung word set and cleared, doorbells rung and unrung, done
    and answers words, counts and tables): a bystander on the host path and a
    well-behaved GPU-driven client beside it get exact rows throughout, and
    the server stays up and stops on SIGTERM."""
    with Bystander(server, references) as bystander:
        good = GpuLookups.open(server.socket, device="cpu", capacity=512, depth=2, timeout=5.0)
        try:
            scribbler = python_child(SCRIBBLER, server.socket, "4")
            try:
                assert scribbler.stdout.readline().strip() == "ready", scribbler.stderr.read()
                rng = np.random.default_rng(11)
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline:
                    ids = rng.integers(0, references[3].shape[0], 300)
                    assert np.array_equal(rows_of(good, 0, 3, ids), references[3][ids])
                bystander.wait_for_lookups(10)
                out, err = scribbler.communicate(timeout=60)
            finally:
                scribbler.kill()
                scribbler.wait()
            assert scribbler.returncode == 0, err
            assert int(out.split()[-1]) > 10_000  # it did scribble
        finally:
            good.close()
    assert server.running, server.log_tail()
    assert "Traceback" not in server.log(), server.log_tail()
    started = time.monotonic()
    assert server.stop() == 0, server.log_tail()
    assert time.monotonic() - started < 10, "SIGTERM took longer than its budget"


def test_a_gpu_driven_steps_layers_are_read_from_disk_one_after_another(
    start_server, checkpoint, references, tmp_path
):
    """``gather_in_order``: a step rings its layers' lookups at once, and the
    GPU waits for them in slot order; their cache misses are read a request
    at a time in that order, so each answer comes before the next one's
    (the server's own trace says when each was answered)."""
    from pleserver.observe.trace import load as load_trace
    from tests.host import require_o_direct

    require_o_direct(checkpoint)
    trace_path = tmp_path / "lookups.npy"
    server = start_server(
        checkpoint, "--io", "direct", "--gather-workers", "4", "--lookup-trace", str(trace_path)
    )
    layers, steps, per = (1, 3, 1, 3), 6, 400
    fresh = {
        layer: np.random.default_rng(layer).permutation(references[layer].shape[0])
        for layer in (1, 3)
    }
    used = {1: 0, 3: 0}
    with GpuLookups.open(server.socket, device="cpu", capacity=per, depth=4, timeout=10.0) as gl:
        for _ in range(steps):
            pending = []
            for slot, layer in enumerate(layers):  # cold rows, never asked before
                ids = fresh[layer][used[layer] : used[layer] + per]
                used[layer] += per
                gl.ring(slot, layer, ids)
                pending.append((slot, layer, ids))
            for slot, layer, ids in pending:
                out = np.empty((per, references[layer].shape[1]), dtype=np.uint8)
                gl.collect(slot, out)
                assert np.array_equal(out, references[layer][ids])
    assert server.stop() == 0, server.log_tail()
    records = load_trace(str(trace_path))
    assert len(records) == steps * len(layers) and (records["handed_ns"] > 0).all()
    records = records[np.argsort(records["started_ns"], kind="stable")]
    for step in range(steps):  # (a step's four were answered before the next was rung)
        these = records[step * len(layers) : (step + 1) * len(layers)]
        these = these[np.argsort(these["slot"])]
        assert list(these["slot"]) == list(range(len(layers)))
        assert (np.diff(these["done_ns"]) > 0).all(), these
