"""A server restart under its clients: the next server adopts a GPU-driven
channel's segment (its waiting lookups answered, its addresses unchanged), the
client's own reads of the checkpoint answer while no server does, a CPU client
reconnects in place, and an offered segment is checked like any client memory.

Each test kills a real ``ple-server`` process (SIGKILL: nothing is said to the
clients) and starts another on the same socket, as ``systemctl restart`` or
``Restart=on-failure`` do. The GPU-driven channels run on the CPU stand-in
(``HostStream``), which writes and waits on the very words a CUDA stream does.
"""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np
import pytest

from pleclient import PleClient, ServerGone, ServerUnavailable
from pleclient import protocol as p
from pleclient.channel import ChannelMap
from pleclient.checkpoint import discover_tables
from pleclient.fallback import CheckpointReader
from pleclient.gpu import GpuLookups
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from tests.harness import RawSession, stop_process, wait_until


@pytest.fixture
def socket_path(tmp_path) -> str:
    return str(tmp_path / "ple.sock")


def collect(gl: GpuLookups, slot: int, layer: int, count: int) -> np.ndarray:
    out = np.empty((count, gl.client.table(layer).row_bytes), dtype=np.uint8)
    gl.collect(slot, out)
    return out


def segment_address(gl: GpuLookups) -> int:
    return np.frombuffer(gl.client.segment_buffer, np.uint8, count=1).ctypes.data


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ------------------------------------------------------------ adoption
def test_a_restarted_server_answers_the_lookups_a_gpu_channel_rang_before_it(
    start_server, checkpoint, references, socket_path
):
    first = start_server(checkpoint, socket_path=socket_path)
    gl = GpuLookups.open(socket_path, device="cpu", capacity=256, depth=4, timeout=30.0)
    try:
        address = segment_address(gl)  # what a captured graph holds
        stop_process(first.pid)  # it never answers these
        gl.ring(0, 1, np.arange(100))
        gl.ring(1, 3, np.arange(50, 250))
        first.kill()
        second = start_server(checkpoint, socket_path=socket_path)
        assert np.array_equal(collect(gl, 0, 1, 100), references[1][:100])
        assert np.array_equal(collect(gl, 1, 3, 200), references[3][50:250])
        assert segment_address(gl) == address  # the same segment
        # The new server answers what waits in the channel as soon as it has
        # it, before its reply to the adoption reaches the watchdog; and it
        # counts a request just after answering it: both are waited for.
        (event,) = gl.watchdog.events
        assert wait_until(lambda: event["ended"] == "adopted", 10), event
        assert event["stall_s"] < 30, event
        assert gl.failure is None and gl.watchdog.fallback_rows == 0

        def served() -> tuple[int, int]:
            stats = PleClient.query_stats(second.socket)
            return stats["gpu_channels"], sum(t["requests"] for t in stats["tables"])

        assert wait_until(lambda: served() == (1, 2), 10), served()
        assert "adopted: a segment it kept from an earlier server" in second.log()
        rng = np.random.default_rng(4)
        for _ in range(20):  # and the channel goes on as before
            ids = rng.integers(0, references[3].shape[0], 256)
            gl.ring(2, 3, ids)
            assert np.array_equal(collect(gl, 2, 3, 256), references[3][ids])
    finally:
        gl.close()


def test_without_a_server_the_watchdog_reads_rung_lookups_from_the_checkpoint(
    start_server, checkpoint, references, socket_path
):
    first = start_server(checkpoint, socket_path=socket_path)
    reader = CheckpointReader(discover_tables(str(checkpoint)))
    gl = GpuLookups.open(
        socket_path, device="cpu", capacity=512, depth=4, timeout=30.0, reader=reader,
        fallback_after=0.2,
    )  # fmt: skip
    try:
        stop_process(first.pid)
        gl.ring(0, 1, np.arange(10))
        first.kill()
        started = time.monotonic()
        assert np.array_equal(collect(gl, 0, 1, 10), references[1][:10])
        assert time.monotonic() - started >= 0.2  # it waited for a server first
        rng = np.random.default_rng(5)
        for step in range(10):  # no server at all: every lookup from the checkpoint
            layer = (1, 3)[step % 2]
            ids = rng.integers(0, references[layer].shape[0], 512)
            gl.ring(step % 4, layer, ids)
            assert np.array_equal(collect(gl, step % 4, layer, 512), references[layer][ids])
        assert gl.watchdog.fallback_rows == 10 + 10 * 512 and gl.failure is None
        second = start_server(checkpoint, socket_path=socket_path)
        assert wait_until(lambda: gl.watchdog.lost_since is None, 10)
        gl.ring(0, 3, np.arange(7))
        assert np.array_equal(collect(gl, 0, 3, 7), references[3][:7])
        assert wait_until(
            lambda: sum(t["requests"] for t in PleClient.query_stats(second.socket)["tables"]) == 1,
            10,
        )
        assert gl.watchdog.fallback_rows == 10 + 10 * 512  # back on the server
        assert [e["ended"] for e in gl.watchdog.events] == ["adopted"]
    finally:
        gl.close()
        reader.close()


def test_a_gpu_channel_is_never_handed_to_a_server_of_other_tables(
    start_server, checkpoint, socket_path, tmp_path
):
    other = tmp_path / "other"
    other.mkdir()
    write_checkpoint(str(other), (SyntheticTable(layer=1, rows=999, cols=160, dtype="BF16"),))
    first = start_server(checkpoint, socket_path=socket_path)
    client = PleClient.connect(socket_path, capacity=64, depth=2, gpu_driven=True)
    try:
        first.kill()
        start_server(other, socket_path=socket_path)
        with pytest.raises(ServerUnavailable, match="now serves other tables"):
            client.reconnect(window=0.5)
    finally:
        client.close()


def test_a_cpu_client_reconnects_in_place_and_its_old_requests_are_void(
    start_server, checkpoint, references, socket_path
):
    first = start_server(checkpoint, socket_path=socket_path)
    with PleClient.connect(socket_path, capacity=64, depth=2) as client:
        stop_process(first.pid)
        ticket = client.submit(1, np.arange(10))
        first.kill()
        start_server(checkpoint, socket_path=socket_path)
        with pytest.raises(ServerGone, match=r"PleClient\.reconnect"):
            client.lookup(1, np.arange(5))
        client.reconnect(window=10)
        with pytest.raises(ServerGone, match="submit it again"):
            ticket.wait()
        ticket.release()  # nothing to give back
        assert np.array_equal(client.lookup(1, np.arange(10)), references[1][:10])
        assert client.sessions == 2 and client.free_slots == 2


def test_reconnect_gives_up_past_its_window_naming_the_socket(start_server, checkpoint):
    server = start_server(checkpoint)
    with PleClient.connect(server.socket) as client:
        server.kill()
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match=f"{server.socket}.*within 1 s"):
            client.reconnect(window=1.0)
        assert 1.0 <= time.monotonic() - started < 5


# ------------------------------------------------------- the fallback reader
@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "NVFP4"])
def test_the_fallback_reader_reads_the_rows_the_server_serves(tmp_path, dtype):
    table = SyntheticTable(layer=2, rows=5003, cols=160, dtype=dtype, parts=3)
    write_checkpoint(str(tmp_path), (table,), files=2)
    (spec,) = discover_tables(str(tmp_path))
    reference = read_reference(str(tmp_path), spec.name)
    reader = CheckpointReader([spec], threads=4)
    try:
        rng = np.random.default_rng(2)
        for count in (1, 63, 3000):  # one thread, and several
            ids = rng.integers(0, spec.rows, count)
            ids[: count // 3] = ids[0]  # duplicates are read once
            out = np.empty((count, spec.row_bytes), dtype=np.uint8)
            reader.read(spec.name, ids, out)
            assert np.array_equal(out, reference[ids])
        edges = np.array([0, spec.shard_size - 1, spec.shard_size, spec.rows - 1])
        out = np.empty((4, spec.row_bytes), dtype=np.uint8)
        reader.read(spec.name, edges, out)
        assert np.array_equal(out, reference[edges])
        with pytest.raises(ValueError, match=f"row id {spec.rows} out of range"):
            reader.read(spec.name, np.array([1, spec.rows]), np.empty((2, spec.row_bytes), "u1"))
        with pytest.raises(ValueError, match="no table 'nope'"):
            reader.read("nope", np.array([1]), np.empty((1, spec.row_bytes), "u1"))
        with pytest.raises(ValueError, match="out must be uint8"):
            reader.read(spec.name, np.array([1]), np.empty((1, 3), "u1"))
    finally:
        reader.close()


def test_a_short_checkpoint_file_is_a_read_error_naming_it(tmp_path):
    write_checkpoint(str(tmp_path), (SyntheticTable(layer=2, rows=4000, dtype="BF16"),))
    (spec,) = discover_tables(str(tmp_path))
    shard = spec.shards[3999 // spec.shard_size]  # the last row's
    path = shard.path
    os.truncate(path, shard.offset + (3999 % spec.shard_size) * spec.row_bytes + 7)
    reader = CheckpointReader([spec])
    try:
        with pytest.raises(OSError, match=f"short read of row 3999.*{path}"):
            reader.read(spec.name, np.array([3999]), np.empty((1, spec.row_bytes), "u1"))
    finally:
        reader.close()


# ------------------------------------------------------ offered segments
def sealed_memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("offered", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


GOOD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ADOPT = {"gpu_driven": True, "rung_word": True, "adopt": True, "capacity": 64, "depth": 2}


def layout_of(server_tables) -> p.ChannelLayout:
    return p.ChannelLayout(2, 64, max(t["row_bytes"] for t in server_tables))


@pytest.mark.parametrize(
    "offer, message",
    [
        ("a regular file", "not a memfd"),
        ("an unsealed memfd", "seals are 0x0"),
        ("a memfd sealed against writes", "not against writes"),
        ("a memfd that may still be sealed", "further seals"),
        ("a memfd of another size", "holds"),
    ],
)
def test_an_offered_segment_is_checked_like_any_client_memory(
    server, references, tmp_path, offer, message
):
    with RawSession(server.socket) as raw:
        layout = layout_of(raw.hello()["tables"])
        if offer == "a regular file":
            fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
            os.ftruncate(fd, layout.size)
        elif offer == "an unsealed memfd":
            fd = sealed_memfd(layout.size, 0)
        elif offer == "a memfd sealed against writes":
            fd = sealed_memfd(layout.size, GOOD_SEALS | fcntl.F_SEAL_WRITE)
        elif offer == "a memfd that may still be sealed":
            fd = sealed_memfd(layout.size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        else:
            fd = sealed_memfd(layout.size + 4096, GOOD_SEALS)
        before = open_files(server.pid)
        try:
            raw.send({"type": "open_channel", **ADOPT}, fds=[fd])
        finally:
            os.close(fd)
        reply, fds = raw.recv()
        assert not fds and reply is not None and reply["type"] == "error", reply
        assert reply["code"] == p.ErrorCode.BAD_MESSAGE and message in reply["message"], reply
    assert wait_until(lambda: open_files(server.pid) <= before, 5)  # nothing kept
    with PleClient.connect(server.socket) as client:  # and it serves on
        assert np.array_equal(client.lookup(3, np.arange(4)), references[3][:4])


@pytest.mark.parametrize(
    "fields, with_fd, message",
    [
        (ADOPT, False, "comes with exactly that segment's descriptor"),
        ({"gpu_driven": True, "rung_word": True}, True, "only such a message carries one"),
        ({**ADOPT, "gpu_driven": False}, True, "only a GPU-driven channel's segment"),
        ({**ADOPT, "adopt": 1}, True, "adopt must be true or false"),
    ],
)
def test_an_adoption_asked_wrongly_is_refused(server, fields, with_fd, message):
    with RawSession(server.socket) as raw:
        layout = layout_of(raw.hello()["tables"])
        fd = sealed_memfd(layout.size, GOOD_SEALS)
        try:
            raw.send({"type": "open_channel", **fields}, fds=[fd] if with_fd else None)
        finally:
            os.close(fd)
        reply, _ = raw.recv()
        assert reply is not None and reply["type"] == "error", reply
        assert message in reply["message"], reply


def test_a_descriptor_before_hello_ends_the_session_and_one_with_stats_is_dropped(server):
    fd = sealed_memfd(4096, GOOD_SEALS)
    try:
        with RawSession(server.socket) as raw:
            raw.send({"type": "hello", "version": p.PROTOCOL_VERSION, "pid": 1, "name": "x"}, [fd])
            assert raw.closed_by_server()
        before = open_files(server.pid)
        with RawSession(server.socket) as raw:
            raw.hello()
            raw.send({"type": "stats"}, fds=[fd])
            reply, _ = raw.recv()
            assert reply is not None and reply["type"] == "stats"
            assert open_files(server.pid) <= before + 1  # its own session's socket only
    finally:
        os.close(fd)


def test_a_well_formed_offered_segment_is_adopted_and_served(server, references):
    """A memfd a client made itself, sealed as the server seals its own, is
    served like one the server made: nothing in it is trusted beyond numbers."""
    with RawSession(server.socket) as raw:
        welcome = raw.hello()
        assert p.FEATURE_ADOPT in welcome["features"]
        layout = layout_of(welcome["tables"])
        fd = sealed_memfd(layout.size, GOOD_SEALS)
        try:
            channel = ChannelMap(fd, layout, format_header=True)
            slot = channel.slots[0]
            slot.ring(0, np.arange(20, 40))  # table 0 (layer 1), rung before the server has it
            raw.send({"type": "open_channel", **ADOPT}, fds=[fd])
            reply, fds = raw.recv()
            assert reply is not None and reply["type"] == "channel", reply
            assert reply["adopted"] is True and not fds
            assert slot.wait_done(10.0) == p.Done.OK
            assert np.array_equal(slot.rows_view(20, references[1].shape[1]), references[1][20:40])
            slot.reset_done()
            channel.close()
        finally:
            os.close(fd)
