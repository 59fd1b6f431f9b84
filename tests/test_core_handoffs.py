"""``pleserver.data.handoffs``: the order in which the gather workers take the
serving loop's hand-offs (the end-to-end check, against a real server, is
``test_reliability_isolation.py::test_a_small_cold_lookup_takes_its_turn_beside_another_channels_large_cold_ones``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pleserver.data.handoffs import LAST_PIECE_ROWS, HandOffs


@dataclass(eq=False)
class Handed:
    channel: str
    count: int
    done_rows: int = 0


def test_pieces_come_from_the_channels_in_turn_a_new_channel_first():
    queue: HandOffs[Handed] = HandOffs(piece_rows=100, workers=8)
    big = [Handed("a", 1000) for _ in range(3)]
    other = Handed("c", 1000)
    for r in [*big, other]:
        queue.put(r)
    first = queue.take()  # ("c" came last, but had no work: its turn first)
    assert first is not None and (first.job.request, first.start, first.stop) == (other, 0, 100)
    second = queue.take()
    assert second is not None and (second.job.request, second.start, second.stop) == (
        big[0],
        0,
        100,
    )
    small = Handed("b", 16, done_rows=4)  # (rows before done_rows were answered inline)
    queue.put(small)
    third = queue.take()  # the channel that had no work goes first
    assert third is not None and (third.job.request, third.start, third.stop) == (small, 4, 16)
    fourth = queue.take()
    assert fourth is not None and (fourth.job.request, fourth.start) == (other, 100)


def test_a_channel_alone_gets_the_whole_rest_of_a_request_in_one_piece():
    queue: HandOffs[Handed] = HandOffs(piece_rows=100, workers=8)
    r = Handed("a", 100_000, done_rows=10)
    queue.put(r)
    piece = queue.take()
    assert piece is not None and (piece.start, piece.stop) == (10, 100_000)


def test_a_request_is_answered_after_its_last_piece_with_the_first_error():
    queue: HandOffs[Handed] = HandOffs(piece_rows=10, workers=8)
    r = Handed("a", 25)
    queue.put(r)
    queue.put(Handed("b", 1000))  # another channel waits: pieces, not the whole
    pieces = []
    while len(pieces) < 3:  # (b's pieces come between them, each taken in turn)
        piece = queue.take()
        assert piece is not None
        if piece.job.request is r:
            pieces.append(piece)
    assert [(p.start, p.stop) for p in pieces if p] == [(0, 10), (10, 20), (20, 25)]
    assert all(p is not None for p in pieces)
    boom = OSError("the disk")
    assert queue.finish(pieces[1], boom) is None  # others still out: not answered yet
    assert queue.finish(pieces[2]) is None
    job = queue.finish(pieces[0])
    assert job is not None and job.request is r and job.error is boom


def test_the_last_free_worker_takes_a_short_piece():
    queue: HandOffs[Handed] = HandOffs(piece_rows=4096, workers=2)
    queue.put(Handed("a", 100_000))
    queue.put(Handed("b", 100_000))
    one, two = queue.take(), queue.take()
    assert one is not None and one.stop - one.start == 4096
    assert two is not None and two.stop - two.start == LAST_PIECE_ROWS
    queue.finish(one)
    again = queue.take()  # one worker is free again beside the short piece: a whole one
    assert again is not None and again.stop - again.start == LAST_PIECE_ROWS  # (still last)
    queue.finish(two)
    queue.finish(again)
    assert (p := queue.take()) is not None and p.stop - p.start == 4096


def test_stop_ends_the_workers_once_the_queue_is_empty():
    queue: HandOffs[Handed] = HandOffs(piece_rows=10, workers=2)
    queue.put(Handed("a", 15))
    taken = []

    def worker() -> None:
        while (piece := queue.take()) is not None:
            taken.append((piece.start, piece.stop))
            queue.finish(piece)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    queue.stop()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert taken == [(0, 15)]  # what was queued was still taken (alone: whole)


def test_an_in_order_channel_begins_its_next_request_once_the_earlier_has_ended():
    """A GPU-driven channel's step: its layers' requests are read one after
    another; another channel is taken beside them as before."""
    queue: HandOffs[Handed] = HandOffs(piece_rows=100, workers=8)
    layers = [Handed("gpu", 150) for _ in range(3)]
    for r in layers:
        queue.put(r, in_order=True)
    first = queue.take()  # alone, every worker free: the whole request
    assert first is not None and (first.job.request, first.start, first.stop) == (layers[0], 0, 150)
    queue.put(Handed("cpu", 50))
    beside = queue.take()  # the next layer waits; another channel does not
    assert beside is not None and beside.job.request.channel == "cpu"
    queue.finish(beside)
    previous = first
    for layer in layers[1:]:
        taken: list = []
        waiter = threading.Thread(target=lambda taken=taken: taken.append(queue.take()))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive() and not taken  # waits for the earlier layer's rows
        assert queue.finish(previous) is not None  # answered: the next layer begins
        waiter.join(10)
        assert taken and taken[0] is not None and taken[0].job.request is layer
        previous = taken[0]
    assert queue.finish(previous) is not None


def test_in_order_requests_are_not_held_once_their_channel_is_idle():
    queue: HandOffs[Handed] = HandOffs(piece_rows=100, workers=2)
    a, b = Handed("gpu", 10), Handed("gpu", 10)
    queue.put(a, in_order=True)
    first = queue.take()
    assert first is not None and queue.finish(first) is not None
    queue.put(b, in_order=True)  # a new step: nothing of the channel is out
    second = queue.take()
    assert second is not None and second.job.request is b


def test_the_express_worker_takes_small_requests_whole_and_never_a_large_ones_piece():
    """Every worker gathers a large request's piece; a 16-row request of
    another channel is taken at once by the express worker, whole. The
    express worker leaves large requests to the workers, waits while only
    they are queued, and ends at stop; an in-order channel's next small
    request waits for its earlier one there too."""
    queue: HandOffs[Handed] = HandOffs(piece_rows=4096, workers=2)
    large = [Handed("attacker-1", 262_144), Handed("attacker-2", 262_144)]
    for r in large:
        queue.put(r)
    assert queue.take() is not None and queue.take() is not None  # both workers busy
    small = Handed("bystander", 16, done_rows=3)
    queue.put(small)
    piece = queue.take_express()
    assert (
        piece is not None
        and piece.express
        and (piece.job.request, piece.start, piece.stop)
        == (
            small,
            3,
            16,
        )
    )
    assert queue.finish(piece) is piece.job  # its only piece: answered now
    # Only the large request is queued: the express worker waits for a small one.
    taken: list = []
    express = threading.Thread(target=lambda: taken.append(queue.take_express()))
    express.start()
    express.join(0.2)
    assert express.is_alive() and not taken
    layer1, layer2 = Handed("gpu", 16), Handed("gpu", 16)
    queue.put(layer1, in_order=True)
    queue.put(layer2, in_order=True)
    express.join(5)
    assert taken[0].job.request is layer1
    express = threading.Thread(target=lambda: taken.append(queue.take_express()))
    express.start()
    express.join(0.2)
    assert express.is_alive()  # layer2 waits for layer1 to end
    assert queue.finish(taken[0]) is taken[0].job
    express.join(5)
    assert taken[1] is not None and taken[1].job.request is layer2
    queue.finish(taken[1])
    queue.stop()
    assert queue.take_express() is None
    workers_left = queue.take()  # the workers still drain the large requests
    assert workers_left is not None and workers_left.job.request in large
