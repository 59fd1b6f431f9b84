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
from pleserver.admission import CounterAdmission
from pleserver.dataplane import DataPlane
from pleserver.serving import Channel, ServingLoop
from pleserver.stats import TableStats

CHUNKED = 16383  # under parallel_min_rows: gathered by the loop, four chunk_rows turns
HANDED = 16384  # parallel_min_rows: handed off whole to a gather worker


class Kit:
    """A serving loop over the checkpoint's tables, and channels on it."""

    def __init__(self, checkpoint, heartbeat_s: float = 1.0) -> None:
        self.plane = DataPlane.open(discover_tables(str(checkpoint)))
        self.tables = self.plane.tables
        self.stats = [TableStats(t.spec.name, t.spec.layer) for t in self.tables]
        self.loop = ServingLoop(
            self.tables, self.stats, spin_s=0.002, heartbeat_every_s=heartbeat_s
        )
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
