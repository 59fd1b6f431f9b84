"""Channel segments: created, reserved and formatted off the control thread.

Reserving a channel's pages (``posix_fallocate``) takes 0.2–0.4 s per GiB;
on the control thread it would hold up every other client's hello, open and
statistics meanwhile. ``Reserver`` does it on threads of its own, started with
the server (so opening a channel never depends on starting a thread): one for
channels up to ``SMALL_BYTES``, one for larger ones, so that a small channel
never waits behind a large one. Each finished ``Reservation`` comes back
through ``results`` and the ``on_done`` callback (which wakes the control
loop).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pleclient import protocol as p
from pleclient.channel import ChannelMap

log = logging.getLogger(__name__)

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


@dataclass(eq=False)
class Reservation:
    """One channel to create for a session; the reserver fills in the result."""

    session_id: int
    name: str
    layout: p.ChannelLayout
    fd: int | None = None
    mapping: ChannelMap | None = None
    error: str | None = None

    def discard(self) -> None:
        """Free what was created (the session went away meanwhile)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
            try:
                job.fd, job.mapping = create_segment(job.name, job.layout)
            except OSError as exc:
                job.error = str(exc)
            except Exception as exc:  # the reserver outlives any one request
                log.exception("creating a channel segment failed")
                job.error = f"internal error while creating the channel: {exc}"
            self.results.put(job)
            self.on_done()
