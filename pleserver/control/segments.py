"""Channel segments: created, reserved and formatted off the control thread.

A channel's segment is either created here (``create_segment``: a sealed
memfd, formatted) or, for a GPU-driven client whose server went away, adopted
(``adopt_segment``: the segment that client kept from the server before,
whose addresses its captured CUDA graphs hold; checked as any client memory).

Reserving a channel's pages (``posix_fallocate``) takes 0.2–0.4 s per GiB;
on the control thread it would hold up every other client's hello, open and
statistics meanwhile. ``Reserver`` does it on threads of its own, started with
the server (so opening a channel never depends on starting a thread): one for
channels up to ``SMALL_BYTES``, one for larger ones, so that a small channel
never waits behind a large one. Each finished ``Reservation`` comes back
through ``results`` and the ``on_done`` callback (which wakes the control
loop). A reservation whose session closed before its turn came
(``abandoned``) is skipped, not made: a flood of opens from sessions that
close at once must not keep a lane, and the next session's open, busy with
segments nobody will take.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pleclient import protocol as p
from pleclient.channel import ChannelMap

log = logging.getLogger("pleserver.segments")

SMALL_BYTES = 64 << 20


def create_segment(name: str, layout: p.ChannelLayout) -> tuple[int, ChannelMap]:
    """A sealed memfd holding the formatted channel; raises OSError naming the
    fix and leaves nothing behind."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        try:  # reserve the pages now: no room must fail here, not SIGBUS later
            os.ftruncate(fd, layout.size)
            os.posix_fallocate(fd, 0, layout.size)
        except OSError as exc:
            limit = (
                ": over this server's file size limit (ulimit -f, LimitFSIZE=)"
                if exc.errno == errno.EFBIG
                else ""
            )
            raise OSError(
                exc.errno,
                f"cannot reserve {layout.size / 2**20:.1f} MiB for "
                f"a channel ({exc.strerror}{limit}); ask for a smaller "
                "capacity or depth, or free memory",
            ) from None
        # The client may not shrink or grow it: a shrunk segment would SIGBUS
        # the server on its next access.
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
        return fd, ChannelMap(fd, layout, format_header=True)
    except BaseException:
        os.close(fd)
        raise


# Seals an adopted segment must carry: its size fixed for good (no shrink, no
# growth, no seal added later), and none that would stop the server writing.
_SEALS_NEEDED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_SEALS_REFUSED = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _shmem_device() -> int:
    """The device of the kernel's internal tmpfs, which every ordinary memfd
    lives on (hugetlbfs memfds live elsewhere)."""
    probe = os.memfd_create("ple.probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(probe).st_dev
    finally:
        os.close(probe)


def adopt_segment(fd: int, layout: p.ChannelLayout) -> ChannelMap:
    """Check a segment a client offers (``fd``, owned by the caller) as any
    client memory, reserve its pages and map it; raises ValueError saying
    what is wrong with it, or OSError naming the fix.

    What makes it as safe as a segment of our own: an ordinary memfd (not
    hugetlbfs, whose faults SIGBUS when no huge page is free), of exactly the
    layout's size, sealed against shrinking and growing (so no access of ours
    can fall off its end) and against further seals (so nobody can seal it
    read-only under us later), not sealed against writes; its pages reserved
    now, as ``create_segment`` reserves a new one's. Its words are the
    client's, as in any channel: the serving loop copies and validates all it
    reads. Only the fixed header words are written again (the layout as this
    server derives it); slot words are left as they are, so requests rung
    before the handover are served."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_dev != _shmem_device():
        raise ValueError("the offered segment is not a memfd (of the kernel's own tmpfs)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("the offered segment cannot be sealed (not a memfd)") from None
    if seals & _SEALS_NEEDED != _SEALS_NEEDED or seals & _SEALS_REFUSED:
        raise ValueError(
            f"the offered segment's seals are {seals:#x}: it must be sealed against "
            "shrinking, growing and further seals, and not against writes"
        )
    if st.st_size != layout.size:
        raise ValueError(
            f"the offered segment holds {st.st_size} bytes; a channel of depth "
            f"{layout.depth} × capacity {layout.capacity} over rows of up to "
            f"{layout.max_row_bytes} B takes {layout.size}"
        )
    try:
        os.posix_fallocate(fd, 0, layout.size)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot reserve {layout.size / 2**20:.1f} MiB for an adopted channel "
            f"({exc.strerror}); free memory",
        ) from None
    return ChannelMap(fd, layout, adopted=True)


@dataclass(eq=False)
class Reservation:
    """One channel to create for a session, or to adopt (``adopt_fd``: the
    segment the client offered, owned here); the reserver fills in the result."""

    session_id: int
    name: str
    layout: p.ChannelLayout
    adopt_fd: int | None = None
    fd: int | None = None
    mapping: ChannelMap | None = None
    error: str | None = None
    refused: bool = False  # the offered segment is not one to adopt (``error`` says why)
    # Set by the control thread when the session closes, read by the reserver
    # before it makes the segment: a plain flag (the GIL orders it), and one
    # read too late costs only a segment made and then discarded.
    abandoned: bool = False
    skipped: bool = False  # abandoned before its turn: nothing was made

    def discard(self) -> None:
        """Free what was created (the session went away meanwhile)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.adopt_fd is not None:
            os.close(self.adopt_fd)
            self.adopt_fd = None

    def make(self) -> None:
        """Create or adopt the segment (on a reserver thread): ``fd`` and
        ``mapping``, or ``error``."""
        if self.adopt_fd is None:
            self.fd, self.mapping = create_segment(self.name, self.layout)
            return
        fd, self.adopt_fd = self.adopt_fd, None
        try:
            self.mapping = adopt_segment(fd, self.layout)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd


class Reserver:
    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done = on_done
        self.results: queue.SimpleQueue[Reservation] = queue.SimpleQueue()
        self._lanes: list[tuple[queue.SimpleQueue, threading.Thread]] = []
        for lane in ("small", "large"):
            jobs: queue.SimpleQueue[Reservation | None] = queue.SimpleQueue()
            self._lanes.append(
                (
                    jobs,
                    threading.Thread(
                        target=self._run, args=(jobs,), name=f"reserve-{lane}", daemon=True
                    ),
                )
            )

    def start(self) -> None:
        for _jobs, thread in self._lanes:
            thread.start()

    def submit(self, job: Reservation) -> None:
        jobs, _thread = self._lanes[job.layout.size > SMALL_BYTES]
        jobs.put(job)

    def stop(self) -> list[Reservation]:
        """Finish the reservations under way, then stop; every result not yet
        collected (the caller discards them)."""
        for jobs, thread in self._lanes:
            if thread.is_alive():
                jobs.put(None)
        for _jobs, thread in self._lanes:
            if thread.is_alive():
                thread.join()
        left = []
        while not self.results.empty():
            left.append(self.results.get_nowait())
        return left

    def _run(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            if job.abandoned:
                job.skipped = True
                self.results.put(job)  # (its budget goes back on the control thread)
                self.on_done()
                continue
            try:
                job.make()
            except ValueError as exc:
                job.error, job.refused = str(exc), True
            except OSError as exc:
                job.error = str(exc)
            except Exception as exc:  # the reserver outlives any one request
                log.exception("creating a channel segment failed")
                job.error = f"internal error while creating the channel: {exc}"
            self.results.put(job)
            self.on_done()
