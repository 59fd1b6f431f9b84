"""The gather workers' queue: what the serving loop hands off, taken in fair turns.

The serving loop answers what needs no disk read itself and hands the rest of
a request to a gather worker: a request with a cache miss, or one of
``parallel_min_rows`` rows or more. Taken first come, first served, one
client's slots full of large cold requests held every worker for seconds
(262 144 rows at the disk's rate each), and another client's request waited
behind all of them. So hand-offs queue per channel, and a worker takes one
*piece* at a time: at most ``piece_rows`` rows of one request, from the
channels with work in turn (round robin by pieces; a channel that had none
takes the next turn). A request handed off waits
for at most one piece per busy worker to end, however much the other channels
have queued; several workers may gather pieces of one large request at once
(their rows are disjoint), so a client alone still has every worker. While
only one channel has work and every worker is free, a worker takes the whole
rest of its request (one call, the native pool's threads with it). The
last worker to take a piece while the others are busy takes a short one
(``LAST_PIECE_ROWS``): a hand-off that arrives while every worker gathers
waits for that short piece, not for a whole one (a cold piece of 4 096 rows
is about 0.1 s of a shared disk).

Small requests have a worker of their own too: the *express* worker takes
only requests of at most ``EXPRESS_ROWS`` rows, whole, channels in turn.
Behind large cold requests every worker gathers a piece for seconds' worth
of reads, and a 16-row lookup handed off then waited for the short piece of
the last free worker to end (its 256 reads at the shared disk's rate: a cold
bystander's p99 9-10 ms, max up to 62 ms); the express worker is free for it
at once. It never takes a large request's piece, so the other channels'
turns and the large requests' speed are as before.

A request is answered only when its last piece has ended: until then a worker
may still be writing into its slot, and an answer (even an error) gives the
slot back to the client. The first piece's error is the request's.

A channel's requests may be put ``in_order``: then its next request is not
begun while an earlier one still has pieces out. A GPU-driven channel rings
a step's PLE layers at the step's start, in layer order, and the GPU waits for
them in that order. Gathered side by side, the layers' misses share the disk
and every layer's rows come at the end of the step's reads (one disk serves
them all at its one rate), so the first PLE layer waits for the last one's
reads. Gathered in turn, the first layer's rows come after its own reads alone
and the later layers' reads run while the GPU computes the layers between
(one ring at ``queue_depth`` keeps the disk busy on its own). A request
still splits into pieces for several workers as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

LAST_PIECE_ROWS = 256
"""A piece taken by the only worker still free: short, so that the next
hand-off finds a worker soon (256 cold rows: a few ms of disk)."""
EXPRESS_ROWS = 256
"""The most rows left of a request the express worker takes (whole): a decode
step's lookup of up to 16 tokens, and any CPU client's small lookup."""


class Handed(Protocol):
    """What the queue needs of a request: who it came from, its rows, and
    where its gather stands (rows before ``done_rows`` are answered already)."""

    @property
    def channel(self) -> Hashable: ...

    @property
    def count(self) -> int: ...

    @property
    def done_rows(self) -> int: ...


R = TypeVar("R", bound=Handed)


class Job(Generic[R]):
    """A handed-off request and its pieces: handed out up to ``issued``,
    ``out`` of them not ended yet, the first ``error`` met."""

    __slots__ = ("error", "in_order", "issued", "out", "request")

    def __init__(self, request: R, in_order: bool) -> None:
        self.request = request
        self.in_order = in_order
        self.issued = request.done_rows
        self.out = 0
        self.error: Exception | None = None


@dataclass(frozen=True)
class Piece(Generic[R]):
    """Rows ``[start, stop)`` of ``job``'s request, for one worker (the
    express worker: ``express``)."""

    job: Job[R]
    start: int
    stop: int
    express: bool = False


class HandOffs(Generic[R]):
    """Requests handed to the gather workers, per channel, taken in pieces."""

    def __init__(self, piece_rows: int, workers: int) -> None:
        self.piece_rows = max(1, piece_rows)  # set again on a reload of chunk_rows
        self.workers = workers
        self._busy = 0  # pieces taken and not finished: workers gathering
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the workers wait here,
        self._express = threading.Condition(lock)  # the express worker here
        self._queues: dict[Hashable, deque[Job[R]]] = {}  # channels with work
        self._turns: deque[Hashable] = deque()  # those channels, in the order they take turns
        # In-order channels: the job being gathered (until its last piece
        # ends), and those whose next job waits for it (out of the turns).
        self._gathering: dict[Hashable, Job[R]] = {}
        self._parked: set[Hashable] = set()
        self._stopping = False

    def put(self, request: R, in_order: bool = False) -> None:
        """Queue the rest of ``request`` (from its ``done_rows``) for a worker;
        ``in_order``: begin it only once the channel's earlier ones have ended."""
        key = request.channel
        with self._cond:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
                # A channel that had no work goes first (as the loop's fresh
                # channels do): a small hand-off waits for no other channel's
                # turn, only for a worker; after its piece it goes last.
                self._turns.appendleft(key)
            queue.append(Job(request, in_order))
            self._cond.notify()
            if request.count <= EXPRESS_ROWS:
                self._express.notify()

    def take(self) -> Piece[R] | None:
        """The next piece, waiting for one; None once ``stop`` was called and
        nothing is left to take."""
        with self._cond:
            while True:
                while not self._turns:
                    if self._stopping:
                        return None
                    self._cond.wait()
                key = self._turns.popleft()
                job = self._queues[key][0]
                gathering = self._gathering.get(key)
                if gathering is None or gathering is job:
                    break
                self._parked.add(key)  # back in the turns when ``gathering`` ends
            queue = self._queues[key]
            if job.in_order:
                self._gathering[key] = job
            start = job.issued
            # (One worker alone is every worker: whole pieces, never short ones.)
            last_free = self.workers > 1 and self._busy >= self.workers - 1
            if last_free:
                rows = min(self.piece_rows, LAST_PIECE_ROWS)
            elif len(self._queues) == 1 and self._busy == 0:
                # One channel alone, every worker free: the whole rest in one
                # piece, gathered in one call by the native pool's threads (as
                # fast as a large request goes); the other workers, taking
                # pieces, leave the last one free for a channel that comes.
                rows = job.request.count - start
            else:
                rows = self.piece_rows
            stop = min(job.request.count, start + rows)
            self._busy += 1
            job.issued = stop
            job.out += 1
            if stop == job.request.count:
                queue.popleft()
            if queue:
                self._turns.append(key)  # its next piece after the other channels'
            else:
                del self._queues[key]
            return Piece(job, start, stop)

    def take_express(self) -> Piece[R] | None:
        """The express worker's next piece: a whole request of at most
        ``EXPRESS_ROWS`` rows (the rest of it, if a worker began it), channels
        in turn, waiting for one; None once ``stop`` was called (the workers
        take what is left)."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                for key in self._turns:
                    job = self._queues[key][0]
                    gathering = self._gathering.get(key)
                    if job.request.count <= EXPRESS_ROWS and (
                        gathering is None or gathering is job
                    ):
                        break
                else:
                    self._express.wait()
                    continue
                self._turns.remove(key)
                queue = self._queues[key]
                if job.in_order:
                    self._gathering[key] = job
                start, job.issued = job.issued, job.request.count
                job.out += 1
                queue.popleft()
                if queue:
                    self._turns.append(key)
                else:
                    del self._queues[key]
                return Piece(job, start, job.request.count, express=True)

    def finish(self, piece: Piece[R], error: Exception | None = None) -> Job[R] | None:
        """``piece`` has ended (with ``error``, if it failed): its job when that
        was the request's last piece (answer it now), else None."""
        job = piece.job
        with self._cond:
            if not piece.express:  # (the express worker is not one of ``workers``)
                self._busy -= 1
            job.out -= 1
            if error is not None and job.error is None:
                job.error = error
            last = job.out == 0 and job.issued == job.request.count
            key = job.request.channel
            if last and self._gathering.get(key) is job:
                del self._gathering[key]
                self._express.notify()  # the channel's next request, if small, may go now
                if key in self._parked:
                    self._parked.discard(key)
                    self._turns.appendleft(key)  # its next request is the step's next layer
                    self._cond.notify()
        return job if last else None

    def stop(self) -> None:
        """Let every worker end once what is queued has been taken."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._express.notify_all()


__all__ = ["EXPRESS_ROWS", "LAST_PIECE_ROWS", "HandOffs", "Handed", "Job", "Piece"]
