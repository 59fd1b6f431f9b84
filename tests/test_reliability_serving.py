"""Races of the serving loop, held open in-process.

A black-box test meets these only at random (the soak, about once in a few
thousand requests). Here the loop, its channels, tables and statistics are the
server's own objects; the test plays the client on a second mapping of each
segment and holds the moment open with one of the server's own locks or a
quiet spell."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from pleclient import protocol as p
from pleclient.channel import ChannelMap
from pleclient.checkpoint import discover_tables
from pleserver.config import ServerConfig
from pleserver.data.admission import CounterAdmission
from pleserver.data.plane import DataPlane, PlaneOptions
from pleserver.data.serving import Channel, ServingLoop
from pleserver.observe.stats import TableStats

CHUNKED = 16383  # under parallel_min_rows: gathered by the loop, four chunk_rows turns
HANDED = 16384  # parallel_min_rows: handed off whole to a gather worker


class Kit:
    """A serving loop over the checkpoint's tables, and channels on it."""

    def __init__(self, checkpoint, heartbeat_s: float = 1.0, start: bool = True) -> None:
        cfg = ServerConfig(io="mmap", spin_us=2000)
        self.plane = DataPlane.open(discover_tables(str(checkpoint)), PlaneOptions.from_config(cfg))
        self.tables = self.plane.tables
        self.stats = [TableStats(t.spec.name, t.spec.layer) for t in self.tables]
        self.loop = ServingLoop.from_config(
            self.tables, self.stats, cfg, hint_cache_rows=0, heartbeat_every_s=heartbeat_s
        )
        if start:  # (else the test starts it, once its channels hold their requests)
            self.loop.start()
        self.fds: list[int] = []
        self.client_maps: list[ChannelMap] = []

    def channel(self, session: int, depth: int = 1, capacity: int = HANDED):
        """(the server's Channel, the client's mapping) of a new channel."""
        layout = p.ChannelLayout(depth, capacity, max(t.row_bytes for t in self.tables))
        fd = os.memfd_create(f"ple.test.{session}", os.MFD_CLOEXEC)
        os.ftruncate(fd, layout.size)
        self.fds.append(fd)
        mapping = ChannelMap(fd, layout, format_header=True)
        channel = Channel(session, f"test {session}", mapping, admission=CounterAdmission(mapping))
        self.loop.add(channel)
        client = ChannelMap(fd, layout)
        self.client_maps.append(client)
        return channel, client

    def close(self) -> None:
        self.loop.stop()
        for client in self.client_maps:
            client.close()
        for fd in self.fds:
            os.close(fd)
        self.plane.close()


@pytest.fixture
def kit(checkpoint):
    made = []

    def make(**kwargs) -> Kit:
        made.append(Kit(checkpoint, **kwargs))
        return made[-1]

    yield make
    for k in made:
        k.close()


def submit(client: ChannelMap, slot_index: int, table: int, ids) -> None:
    """What PleClient.submit does: the slot's submit, then the doorbell."""
    sequence = client.submit_counter  # this test is the channel's only client
    client.slots[slot_index].submit(
        table, np.asarray(ids, dtype=np.int64), sequence, time.monotonic_ns()
    )
    client.publish_submit((sequence + 1) & 0xFFFFFFFF)


def answered(slot, timeout: float = 10.0) -> bool:
    """Wait for the answer to ``slot``'s request; True if it came, and was DONE."""
    return slot.wait_answered(timeout) == p.SlotState.DONE


def requests_served(k: Kit) -> int:
    return sum(s.requests for s in k.stats)


@pytest.mark.parametrize("size", [CHUNKED, HANDED], ids=["chunked", "handed-off"])
def test_a_slot_reused_the_moment_its_large_answer_lands_is_served(kit, size):
    """A large request is gathered in chunks, over several turns of the loop,
    or by a gather worker, and the client may reuse its slot the moment the
    answer is published. If the server still counted the slot as that
    request's, the new request would never be served."""
    k = kit()
    _, client = k.channel(1)
    slot = client.slots[0]
    for _ in range(20):
        submit(client, 0, 1, np.arange(size) % 10_007)
        assert answered(slot)
        slot.release()
        submit(client, 0, 0, [1, 2, 3])  # the same slot, at once
        assert answered(slot, 3.0), (
            "a request on a slot reused right after a large answer was never served"
        )
        slot.release()


def test_a_closed_channel_is_unmapped_at_once_not_a_heartbeat_later(kit):
    """A channel closes while the loop is busy with another one, which then goes
    quiet: the loop falls asleep (here for a 5 s heartbeat) right after. The
    removal wakes it, and it unmaps the closed channel then."""
    k = kit(heartbeat_s=5.0)
    _, busy = k.channel(1, capacity=64)
    for round_ in range(3):
        closing, _ = k.channel(10 + round_, capacity=64)
        quiet, serving = threading.Event(), threading.Event()

        def keep_busy(quiet: threading.Event = quiet, serving: threading.Event = serving) -> None:
            slot = busy.slots[0]
            while not quiet.is_set():
                submit(busy, 0, 0, [1, 2, 3])
                assert answered(slot, 5.0)
                slot.release()
                serving.set()

        worker = threading.Thread(target=keep_busy)
        worker.start()
        assert serving.wait(5.0)  # the loop awake and serving the other channel
        k.loop.remove(closing)
        quiet.set()  # the loop falls asleep soon after
        worker.join()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not closing.map.mm.closed:
            time.sleep(0.01)
        assert closing.map.mm.closed, f"round {round_}: still mapped 2 s after it closed"


@pytest.mark.parametrize("size", [CHUNKED, HANDED], ids=["chunked", "handed-off"])
def test_a_large_answer_never_clears_the_busy_mark_of_the_next_request_in_its_slot(kit, size):
    """The client reuses a slot for a second large request at once, while a
    small request on another slot is served between its chunks (or while a
    worker gathers it). If the first request's completion cleared the slot's
    busy mark late, the loop would queue the second request twice and answer
    it twice: the stopped loop's statistics would count more requests than
    were submitted."""
    k = kit()
    _, client = k.channel(1, depth=2)
    big, small = client.slots
    for _ in range(20):
        submit(client, 0, 1, np.arange(size) % 10_007)
        assert answered(big)
        big.release()
        submit(client, 0, 1, (np.arange(size) * 7) % 10_007)
        submit(client, 1, 0, [1, 2, 3])
        assert answered(small) and answered(big)
        big.release()
        small.release()
    k.loop.stop()  # drains: an answer given twice is counted by now
    assert requests_served(k) == 20 * 3, f"{requests_served(k) - 60} requests were answered twice"


def test_an_admission_takes_at_most_its_limit_and_keeps_the_rest_pending(tmp_path):
    """``CounterAdmission.admit(limit)``: 64 submitted slots come in over
    several passes, each at most ``limit``, each slot once; ``pending`` stays
    true while some wait (issue 26, item 4)."""
    layout = p.ChannelLayout(64, 4, 64)
    fd = os.memfd_create("ple.test.admit", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, layout.size)
        server_side = ChannelMap(fd, layout, format_header=True)
        client = ChannelMap(fd, layout)
        admission = CounterAdmission(server_side)
        for i in range(64):
            client.slots[i].submit(0, np.array([i], dtype=np.int64), i, time.monotonic_ns())
        client.publish_submit(64)
        seen: list[int] = []
        while admission.pending():
            arrivals = admission.admit(5)
            assert 0 < len(arrivals) <= 5
            seen += [a.slot.index for a in arrivals]
        assert sorted(seen) == list(range(64))
        assert admission.admit(5) == []
        for index in seen:  # answered: the slots are the client's again
            admission.complete(server_side.slots[index], 0)
        client.slots[3].release()
        client.slots[3].submit(0, np.array([3], dtype=np.int64), 64, time.monotonic_ns())
        client.publish_submit(65)
        assert [a.slot.index for a in admission.admit(5)] == [3]
        client.close()
        server_side.close()
    finally:
        os.close(fd)


def test_a_lookup_is_admitted_beside_a_flood_of_tiny_hints_not_after_it(kit):
    """30 channels with all 64 slots holding a 1-id hint, then a bystander's
    16-row lookup: the loop admits a share of each channel per pass, so the
    lookup is answered while much of the flood still waits. Before, one pass
    admitted every slot of every channel first (1 920 hints, ≈ 20 ms). The
    loop starts once every request is in place."""
    k = kit(start=False)
    flooders = [k.channel(100 + i, depth=64, capacity=4)[1] for i in range(30)]
    _, bystander = k.channel(1, capacity=64)
    for client in flooders:
        for i in range(64):
            client.slots[i].submit(
                0, np.array([i], dtype=np.int64), i, time.monotonic_ns(), p.RequestKind.HINT
            )
    bystander.slots[0].submit(0, np.arange(16, dtype=np.int64), 0, time.monotonic_ns())
    for client in flooders:
        client.publish_submit(64)
    bystander.publish_submit(1)
    k.loop.start()
    assert answered(bystander.slots[0])
    # Before, none waited by then: the pass that admitted the lookup admitted
    # (and answered) every hint first. (How many wait depends on when this
    # thread gets the GIL back from the loop's: ≈ 1 800 when at once.)
    waiting = sum(len(client.submitted_slots()) for client in flooders)
    assert waiting > 0, "the lookup was answered only after every hint of the flood"
    for client in flooders:  # the rest are answered too
        for slot in client.slots:
            assert slot.wait_answered(10.0) == p.SlotState.DONE
