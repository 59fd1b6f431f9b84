"""The lookup trace: when each answered request reached each stage, for
finding where a client's step waits (``lookup_trace``, off by default).

The histograms of ``stats`` say how long lookups took; they cannot say which
lookup of which step was late, or why. With ``lookup_trace = PATH`` the
serving loop keeps one record per answered request in a preallocated array —
its session, slot, table, rows and five CLOCK_MONOTONIC times — and the server
writes the array to ``PATH`` (NumPy ``.npy``) when it stops. CLOCK_MONOTONIC
is the host's, so a harness on the same host lines the records up with its
own ``time.monotonic_ns()`` marks.

The stages of one request:

* ``submitted_ns``: the client's own submit time (a CPU client's word, checked
  as the stats check it); 0 where there is none (a GPU stream writes no time);
* ``started_ns``: the serving loop admitted it (saw the slot or the doorbell);
* ``turn_ns``: its channel's turn came and the loop began gathering it (the
  time between the two is queueing behind other channels and requests);
* ``handed_ns``: handed to a gather worker because a row missed the cache or
  the request is large (0: answered from the cache by the loop itself);
* ``done_ns``: its rows were in place and the answer published.

Past ``capacity`` records the trace keeps the first ones and counts the rest
(``dropped``): a trace is for a run of minutes, not a server's life.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

log = logging.getLogger("pleserver.trace")

RECORD = np.dtype(
    [
        ("session", np.uint32),
        ("slot", np.uint32),
        ("table", np.uint32),
        ("rows", np.uint32),
        ("submitted_ns", np.int64),
        ("started_ns", np.int64),
        ("turn_ns", np.int64),
        ("handed_ns", np.int64),
        ("done_ns", np.int64),
    ]
)
"""One answered request (the fields named in the module's text)."""

DEFAULT_CAPACITY = 4_000_000
"""Records kept at most: 48 bytes each, 192 MB once full (pages are taken as
the records fill them)."""


class LookupTrace:
    """The records of one server's life, written to ``path`` by ``save``."""

    def __init__(self, path: str, capacity: int = DEFAULT_CAPACITY) -> None:
        self.path = path
        self.records = np.zeros(capacity, dtype=RECORD)
        self.count = 0
        self.dropped = 0
        self._lock = threading.Lock()  # the loop and the gather workers both answer

    def record(
        self,
        session: int,
        slot: int,
        table: int,
        rows: int,
        submitted_ns: int,
        started_ns: int,
        turn_ns: int,
        handed_ns: int,
        done_ns: int,
    ) -> None:
        with self._lock:
            at = self.count
            if at >= len(self.records):
                self.dropped += 1
                return
            self.count = at + 1
        self.records[at] = (
            session,
            slot,
            table,
            rows,
            submitted_ns,
            started_ns,
            turn_ns,
            handed_ns,
            done_ns,
        )

    def save(self) -> None:
        """Write the records so far to ``path`` (replaced whole: a reader never
        sees half a file). Never raises: a trace that cannot be written is
        logged, and the server's stop goes on."""
        with self._lock:
            kept = self.records[: self.count].copy()
            dropped = self.dropped
        partial = f"{self.path}.{os.getpid()}.partial"
        try:
            with open(partial, "wb") as f:
                np.save(f, kept)
            os.replace(partial, self.path)
        except OSError as exc:
            log.error("lookup trace: cannot write %s: %s", self.path, exc)
            return
        log.info(
            "lookup trace: %d requests written to %s%s",
            len(kept),
            self.path,
            f" ({dropped} past its {len(self.records)} records not kept)" if dropped else "",
        )


def load(path: str) -> np.ndarray:
    """A trace written by ``LookupTrace.save``."""
    records = np.load(path)
    if records.dtype != RECORD:
        raise ValueError(f"{path}: not a ple-server lookup trace (dtype {records.dtype})")
    return records
