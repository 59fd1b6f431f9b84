"""The wire contract between ple-server and its clients — all of it, in one place.

Both sides import this module; the client never imports the server.

Control plane
=============
A Unix stream socket (default ``/run/ple-server/ple.sock``). Every message is a
frame: a 4-byte little-endian length, then a msgpack map with a ``"type"`` key.
A client's frames are at most ``MAX_REQUEST_FRAME_BYTES``, and at most
``MAX_HELLO_FRAME_BYTES`` before the server has answered ``hello``; both are
derived from the client's messages at their largest (``CLIENT_MESSAGES``), as
are the limits the server decodes them under (``BEFORE_HELLO``,
``AFTER_HELLO``: string, map and array lengths, nesting), so that no frame a
client sends costs the server more than a real message. The server's frames
are at most ``MAX_FRAME_BYTES`` (a STATS reply grows with the tables). A
frame must arrive whole within the server's ``frame_timeout_s`` of its first
byte. One exchange per request, in order::

    client                                   server
    HELLO {version, pid, name}        ─►
                                      ◄─     WELCOME {version, server, instance, pid,
                                                      tables, features}
    OPEN_CHANNEL {capacity, depth,    ─►
                  gpu_driven, rung_word,
                  adopt} [+ the kept
                  segment's fd]
                                      ◄─     CHANNEL {layout, gpu_driven, adopted}
                                                      + the segment's fd (SCM_RIGHTS;
                                                      none when adopted)
    STATS {}                          ─►
                                      ◄─     STATS {snapshot}
    BYE {}                            ─►     (session ends; closing the socket does too)
                                      ◄─     SHUTDOWN {reason}   (server stopping; unsolicited)
    any request                       ◄─     ERROR {code, message}

Data plane: one channel per session
===================================
A shared-memory segment created by the server as a sealed memfd — it has no
name at all, only the server and the session's peer (who receives its file
descriptor) can map it, and its size is sealed, so a client cannot truncate it
under the server's mapping (which would SIGBUS the daemon) — holding the
channel's synchronization words and a ring of ``depth`` slots::

    offset 0          4096                              slot_stride
    ┌────────────────┬──────────────────────────────────┬─────────────────── …
    │ channel header │ slot 0                           │ slot 1
    │ (one page)     │┌────────┬─────────┬─────┬───────┐│
    │                ││ header │ message │ ids │ rows  ││
    │                ││ 128 B  │ 384 B   │ 8·C │ R·C   ││
    │                │└────────┴─────────┴─────┴───────┘│
    └────────────────┴──────────────────────────────────┴─────────────────── …

``C`` = capacity (rows per request), ``R`` = the widest table's row bytes.
The ids area follows the 512-byte slot prelude; the rows area starts on a page
boundary (so the client can ``cudaHostRegister`` the whole segment once and DMA
from it), and every slot is a whole number of pages.

Channel header (uint32 words unless noted):
  0  magic "PLEC" · 1 protocol version · 2 depth · 3 capacity ·
  4  max row bytes · 5 header bytes · 6-7 slot stride (uint64) ·
  16 **submit counter**: the number of submits so far (mod 2³²), written by
     the client; the futex word the server sleeps on ·
  17 **server sleeping**: non-zero while the server may be asleep on the
     submit counter, written by the server ·
  18 **rung**: RUNG after a GPU rang any of the channel's doorbells, taken
     back to IDLE by the server before it reads them (GPU-driven channels
     only, below)

Slot header (uint32 words):
  0 **state** (``SlotState``): the futex word the client sleeps on ·
  1 table index · 2 row count · 3 error code · 4 request sequence ·
  5 **waiters**: how many of the client's threads sleep on ``state``, written
  by the client · 6-7 server time in ns (uint64) · 8-9 submit time,
  CLOCK_MONOTONIC ns (uint64, written by the client; the clock is system-wide,
  so the server derives queue time from it) · 10 **doorbell**, 11 **done**,
  12 answers (GPU-driven channels only, below) · 13 **kind** (``RequestKind``:
  LOOKUP 0 or HINT 1, written by the client with the request; below)
followed by the message area: a UTF-8 error text, NUL-padded.

Synchronization words (protocol 2)
----------------------------------
Four words carry all the synchronization, as two eventcounts (a value, and a
count of sleepers that tells the writer whether to make the wake-up call):
submit counter + server sleeping, and each slot's state + waiters. Both sides
operate on them through ``pleclient._sync`` (C11 atomics and raw ``futex``
calls whose flags the caller chooses: shared, never private). No libc-internal
layout is involved, and the server never trusts one of these words further
than a number: its waits are bounded, a value out of range drops the channel,
and it makes at most one wake-up call per answered request.

The writer **publishes**: payload first, then a *release* store of the word
(E1), then a *seq_cst* fence, then it reads the sleepers word and wakes the
futex if it is non-zero (E3). The waiter spins on an *acquire* load for a
while (E2), then **registers** (increments the sleepers word or sets it, then
a *seq_cst* fence: E4, or E5 for the server's sleeping word), reads the word
once more and sleeps in ``futex`` only if it is still unchanged. The two
fences guarantee that at least one side sees the other's store (no lost
wake-up); the release/acquire pair makes the payload visible with the word,
on x86-64 and on weakly ordered CPUs such as aarch64 alike.

Ordering edges
--------------
Every synchronizing pair has a name, written beside the atomic that makes it
(as DPDK's ``rte_ring_c11_pvt.h`` names its own) and cited where this
module, ``pleclient.channel`` and ``pleclient.gpu`` rely on it::

    edge  what                                          pairs with  where
    E1    publish: release store of the word            E2          native/eventcount.c
    E2    acquire load of the word (load, wait)         E1, W1      native/eventcount.c
    E3    publish: seq_cst fence, then read the         E4, E5      native/eventcount.c
          sleepers word, wake if non-zero
    E4    wait: count in the sleepers word, seq_cst     E3          native/eventcount.c
          fence, last check, futex sleep
    E5    announce: the server's sleeping word,         E3          native/eventcount.c
          seq_cst fence (then futex_waitv checks)
    W1    store: release store                          E2, D1, X1  native/sync.c
    X1    exchange: acq_rel (take the rung word)        W1, G2      native/sync.c
    D1    doorbell scan: acquire load of each doorbell  W1, G1      native/doorbell.c
    A1    add: acq_rel (the serving loop's wake count)  E2          native/sync.c
    G1    the stream's fence before its doorbell write  D1          pleclient/gpu.py
    G2    the stream's fence before its rung word write X1          pleclient/gpu.py
    G3    the stream's wait for done ≥ OK, then its     E1          pleclient/gpu.py
          copies of the rows

Slot state machine
------------------
1. FREE       → the client owns the slot: writes ids, table, count, sequence,
   submit time, then the state SUBMITTED (W1), then *publishes* the submit
   counter (+1; E1, E3) — the release that makes all of it visible to the
   server.
2. SUBMITTED  → the server owns the slot. It reads the submit counter with
   *acquire* (E2, pairs with that E1), then only slots whose sequence is
   below it; copies count and ids out, validates the copies, gathers rows
   into the rows area, writes count/error/time, then *publishes* the state
   DONE or ERROR (E1, E3: the release that makes the rows visible).
3. DONE/ERROR → the client owns the slot again. It reads the state with
   *acquire* (E2, spinning, then sleeping on the futex: E4), uses the rows,
   and stores FREE (W1) when it releases the ticket.

GPU-driven channels
-------------------
A channel opened with ``OPEN_CHANNEL {gpu_driven: true, rung_word: true}``
(offered when WELCOME lists ``"gpu_driven"`` in its ``features``) is driven by
a CUDA stream, not by a CPU thread: a GPU can write and wait on a 32-bit word
in host memory (the driver's stream memory operations,
``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) but cannot make a
``futex`` call, and a captured CUDA graph replays exactly the same operations
with exactly the same values each time. So such a channel ignores the submit
counter and the slot state; the server polls it. Each slot has three more
words (slot header words 10-12):

* **doorbell** — IDLE 0, RUNG 1 (written by the GPU), CLAIMED 2 (written by
  the server when it takes the request);
* **done** — WAITING 0 (written by the GPU after it has waited), OK 1 or
  ERROR 2 (written by the server, or by the client's watchdog);
* **answers** — how many requests the server answered in this slot, so a
  watchdog that samples the doorbell can tell one long wait from many short
  ones;

and the channel header has one (word 18), so that a poll costs the server one
load per channel, however many slots the channel has:

* **rung** — RUNG 1, written by the GPU after every doorbell it rings; IDLE 0,
  written by the server, which *takes* the word (an atomic exchange, acq_rel)
  and reads the channel's doorbells only when it took RUNG.

Written the same value on every replay, the rung word is a flag, not a count:
rings between two polls leave one RUNG, and the one scan after it sees each of
their doorbells. A ring never goes unseen: if the exchange took the RUNG
written after a doorbell, the acquire makes that doorbell visible to the scan;
if it took a value from before that RUNG, the RUNG comes after the exchange
and the next poll takes it. A client that ``OPEN_CHANNEL``s ``gpu_driven``
without ``rung_word`` (written before the word existed) is refused with
VERSION_MISMATCH: its rings would never be seen. A server bounds the
GPU-driven slots one uid holds over all its sessions (its
``max_gpu_slots_per_uid``); an OPEN_CHANNEL past that gets CHANNEL_LIMIT.

One lookup, as the stream runs it (every replay the same)::

    GPU (stream order)                         server
    ids → ids area        (async copy)
    table, count          (writes, fenced)
    doorbell = RUNG       (write, G1)
    rung = RUNG           (write, G2)      ─►  takes rung: RUNG (X1)
                                               sees RUNG (D1)
                                               doorbell = CLAIMED (W1)
                                               validates, gathers rows
                                               error word, answers + 1,
                                               doorbell = IDLE (W1)
    wait done ≥ OK        (wait, G3)       ◄─  done = OK | ERROR (E1, E3)
    rows → device         (async copy)
    done → device word    (async copy)
    done = WAITING        (write)
    assert done == OK     (kernel)

*Wait-then-reset*: the GPU itself returns ``done`` to WAITING after its wait,
so the next replay's wait waits again, and the server returned the doorbell
to IDLE before it wrote ``done``, so the next RUNG is a new request. A slot is
never rung again before the same stream has reset it (stream order), so one
slot serves one call site of the graph.

Ordering (x86-64 and aarch64 alike): ``cuStreamWriteValue32`` is preceded
by a fence scoped to the stream (like ``__threadfence_system``; the v2 API,
CUDA 12 on, has no opt-out: it refuses ``NO_MEMORY_BARRIER``): the ids copy
and the table and count words, written before it in stream order, are
visible before the doorbell (G1), and the doorbell before the rung word
(G2). The server's exchange of the rung word (X1, acquire) pairs with G2,
its acquire load of the doorbell (D1) with G1. The server writes the rows
and the error word, then publishes ``done`` (E1: a release store, ``stlr``
on aarch64), so a GPU that sees OK reads the rows written before it (G3):
the copies that follow the wait in stream order start only after the wait
is satisfied, and host memory read over PCIe or NVLink-C2C is coherent with
the CPU's caches. The CPU stand-in writes the same words with W1 and waits
with E2/E4.

Failure: a GPU waiting on a server that died would wait forever, and a
graph cannot raise. The client's watchdog (``pleclient.gpu``) watches every
slot whose doorbell is not IDLE. A request that waited longer than the
timeout on a server that is still there is ended: the error text and code,
then ``done`` = ERROR (E1); the stream's wait ends, the device-side check
traps, and the step fails (a device-side trap ends the CUDA context, so the
worker must restart; its log holds the watchdog's reason). A server that is
*gone* (its control socket closed) costs a stall instead, never the step
("A server restart under a GPU-driven channel", below).

A server restart under a GPU-driven channel
-------------------------------------------
A captured graph holds the device addresses of its channel's words and rows
areas, so a new channel would mean a new capture. Instead the client keeps
its segment's descriptor, and when its server has gone the next one *adopts*
the segment: the client connects again, checks the new server serves the
same tables at the same indexes (a replay writes the table index it was
captured with), and sends ``OPEN_CHANNEL {gpu_driven, rung_word, adopt:
true}`` with the segment's fd attached (SCM_RIGHTS; offered when WELCOME
lists ``"adopt"``). Before that it returns every slot the dead server had
CLAIMED and not answered (done still WAITING) to RUNG, and sets the rung
word, so the new server's first poll scans every doorbell: the lookups in
flight are answered by the new server, where the waiting graph finds them.

The server checks the offered segment as any client memory: an ordinary
memfd (not hugetlbfs), of exactly the layout's size for the capacity and
depth asked and its own widest row, sealed against shrinking, growing and
further seals and not against writes; it reserves the pages
(``posix_fallocate``), rewrites only the fixed header words (the layout as it
derives it) and serves the channel like a new one: every word it reads is
copied and validated first, as always. The reply says ``adopted: true`` and
carries no descriptor. Only GPU-driven segments are adopted; a CPU client
opens a new channel when it reconnects (its requests in flight are submitted
again). A descriptor that comes with any other message is closed; one before
HELLO, or a second one before the first is used, drops the session.

Meanwhile the client's watchdog may answer waiting lookups itself, from the
checkpoint's files (``pleclient.fallback``), in the server's own order:
CLAIMED, the rows into the rows area, the error word, ``answers`` + 1,
doorbell IDLE (W1), ``done`` = OK published (E1). It does that only once the
server's control socket has closed, when no server thread can touch the
slots any more (a stopping server stops its serving loop before it closes its
sessions), and it stops before it hands the segment to the next server, on
the same thread, so one slot never has two answerers. One window is left: a
server killed between its doorbell store and its ``done`` store (two adjacent
stores) leaves a slot that looks idle while its GPU waits; nothing in host
memory tells the two apart.

A client follows the protocol only if it never has more than ``depth``
submits unanswered, so the counter never runs more than ``depth`` ahead of
what the server has seen: more is proof of a scribbled header, and the server
drops the channel. The transitions themselves have one home:
``pleclient.channel.SlotView`` (``submit``, ``complete``, ``fail``,
``release``) and ``ChannelMap.publish_submit``.

Prefetch hints
--------------
A hint says "these rows of table T will be needed soon": the server reads
the ones it does not hold into its row cache, below every demand read, and
returns nothing. A hint is a request like a lookup, in a slot of the same
channel, with the slot's **kind** word HINT (a lookup's is LOOKUP, 0)::

    client                                     server
    ids, table, count, kind = HINT  (slot)
    state = SUBMITTED (W1), counter + 1 (E1) ─► admits it (E2), copies count
                                               and ids out, validates the copies
                                          ◄─  DONE (E1), at once: before any read;
                                               or ERROR (bad table, count, id)
    reclaims the slot (FREE, W1) whenever       the copy joins the server's hint
    it next looks for a free one                queue, or is dropped (counted)

Why a slot, and not a control message: a slot is where ids already go, with
the bounds, validation and fairness a lookup has; it costs no frame on the
control socket (whose thread is not the data plane's); and a CUDA stream can
ring one (a GPU-driven channel's doorbell, kind HINT) where it can write no
socket. The server answers a hint when it admits it, from the copy it made,
so the slot is the client's again within one pass of the serving loop and the
server never reads a hinted id from shared memory again. A hint the server
could not queue anyway (its hint queue or cache budget full, every gather
worker busy with lookups) is answered DONE before its ids are even copied,
and counted as dropped: DONE says "taken", not "will be read". The rows a hint
brings are read by the server from its files into its own cache: nothing of
the slot goes into the cache but the id numbers, validated.

Never blocking: ``PleClient.hint`` takes a free slot or drops the hint
(``hints_skipped``): it never waits for one. It does not wait for the
answer either: a hint's slot is reclaimed when the client next needs a slot,
as an abandoned lookup's is. A hint answered with ERROR is counted by the
server (``hints_dropped``, reason ``refused``; a bad table index in the
server's ``hints`` stats, ``bad_table``), and the session goes on.

Compatibility: a server that reads hints lists ``"hints"`` in WELCOME's
``features``. An older server never reads the kind word and would answer a
hint as a lookup, so a client skips its hints where the feature is absent
(``PleClient.hints_supported``; logged once): hints are advice, and a lookup
works either way. An older client never writes the kind word, which the
server formats LOOKUP and only a client rewrites: its requests stay lookups.
Both ways an addition either side may ignore, so the protocol version stays 2.

On a GPU-driven channel (``pleclient.gpu.GpuLookups.hint``) a slot serves
hints only, for good: the stream writes the ids, table and count, the kind
word HINT (with the slot's first hint; G1 orders it with the ids), the
doorbell and the rung word, as for a lookup, and never waits on ``done``,
which the server publishes at admission (OK, or ERROR for a refused hint)
and nobody resets. A hint slot never serves a lookup, whose wait would see
that stale OK. A ring that comes while the server holds the slot's previous
hint is lost (the server returns the doorbell to IDLE after it copied the
ids), and ids the stream rewrites while the server copies them give a torn
copy, which the server validates as any other: a hint is advice, and no
hint's bytes go anywhere but into the server's validated copy.
"""

from __future__ import annotations

import array
import enum
import os
import socket
import struct
import time
from dataclasses import dataclass

import msgpack

PROTOCOL_VERSION = 2
"""2: the channel's own synchronization words (1 used glibc semaphores)."""
DEFAULT_SOCKET = "/run/ple-server/ple.sock"
SOCKET_ENV = "PLE_SERVER_SOCKET"

NAME_PREFIX = "ple"
"""Segments are memfds named ``ple.<server pid>.<session>`` (visible only in
/proc/<pid>/maps and fd links, for the operator's benefit)."""

FRAME_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 4 << 20
"""The largest frame a server sends (and a client accepts)."""
MAX_NAME_CHARS = 64
"""A client's name in HELLO (for logs and statistics): at most this many
characters; the client shortens a longer one."""

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CHANNEL_MAGIC = 0x43454C50  # b"PLEC" little-endian
CHANNEL_HEADER_BYTES = max(4096, PAGE)
SLOT_HEADER_BYTES = 128
SLOT_MESSAGE_BYTES = 384
SLOT_PRELUDE_BYTES = SLOT_HEADER_BYTES + SLOT_MESSAGE_BYTES
ID_BYTES = 8  # ids are int64

# Channel header word indexes (uint32).
CH_MAGIC, CH_VERSION, CH_DEPTH, CH_CAPACITY, CH_MAX_ROW_BYTES, CH_HEADER_BYTES = range(6)
CH_SLOT_STRIDE = 6  # uint64 over words 6-7
CH_SUBMIT_COUNTER = 16
CH_SERVER_SLEEPING = 17
CH_RUNG = 18  # GPU-driven channels only

# Slot header word indexes (uint32).
SL_STATE, SL_TABLE, SL_COUNT, SL_ERROR, SL_SEQUENCE, SL_WAITERS = range(6)
SL_SERVER_NS = 6  # uint64 over words 6-7
SL_SUBMIT_NS = 8  # uint64 over words 8-9
# GPU-driven channels only (see "GPU-driven channels" above).
SL_DOORBELL, SL_DONE, SL_ANSWERS = 10, 11, 12
SL_KIND = 13  # RequestKind (see "Prefetch hints" above)

FEATURE_GPU_DRIVEN = "gpu_driven"
"""Listed in WELCOME's ``features`` by a server that serves GPU-driven channels."""
FEATURE_HINTS = "hints"
"""Listed in WELCOME's ``features`` by a server that reads prefetch hints
(slots of kind HINT); a client sends none to a server without it."""
FEATURE_ADOPT = "adopt"
"""Listed in WELCOME's ``features`` by a server that adopts the segment of a
GPU-driven channel a client kept from an earlier server (OPEN_CHANNEL
``adopt``: "A server restart under a GPU-driven channel")."""
SERVER_FEATURES = (FEATURE_GPU_DRIVEN, FEATURE_HINTS, FEATURE_ADOPT)

# Limits the server enforces on OPEN_CHANNEL (also its defaults).
DEFAULT_CAPACITY = 16384
DEFAULT_DEPTH = 4
MAX_DEPTH = 64


class SlotState(enum.IntEnum):
    FREE = 0
    SUBMITTED = 1
    DONE = 2
    ERROR = 3


class RequestKind(enum.IntEnum):
    """A slot's kind word: what the request in it asks for."""

    LOOKUP = 0  # the rows, in the slot (every client before hints wrote 0)
    HINT = 1  # nothing back: read the rows into the server's cache, below lookups


class Doorbell(enum.IntEnum):
    """A GPU-driven slot's doorbell word (and the channel's rung word, which
    is IDLE or RUNG)."""

    IDLE = 0
    RUNG = 1  # the GPU's: a request is in the slot
    CLAIMED = 2  # the server's: it is being served


class Done(enum.IntEnum):
    """A GPU-driven slot's done word."""

    WAITING = 0  # the GPU's reset after its wait
    OK = 1  # the rows are in place
    ERROR = 2  # the error word and text say why (server or watchdog)


class ErrorCode(enum.IntEnum):
    """Error codes, in ERROR messages and in a slot's error word."""

    OK = 0
    BAD_MESSAGE = 1
    VERSION_MISMATCH = 2
    NOT_ALLOWED = 3
    # No room now (max_clients, max_clients_per_uid, the accept rate): transient,
    # a client retries it where it reconnects (an older client reads it as a refusal).
    TOO_MANY_CLIENTS = 4
    BAD_TABLE = 5
    BAD_COUNT = 6
    ID_OUT_OF_RANGE = 7
    CHANNEL_LIMIT = 8
    NO_RESOURCES = 9
    INTERNAL = 10
    SHUTTING_DOWN = 11


class MessageType(enum.StrEnum):
    HELLO = "hello"
    WELCOME = "welcome"
    OPEN_CHANNEL = "open_channel"
    CHANNEL = "channel"
    STATS = "stats"
    BYE = "bye"
    SHUTDOWN = "shutdown"
    ERROR = "error"


# ------------------------------------------------------------ frame limits
_U64_MAX = 2**64 - 1
HELLO_AT_ITS_LARGEST = {
    "type": MessageType.HELLO.value,
    "version": _U64_MAX,
    "pid": _U64_MAX,
    "name": "\U0010ffff" * MAX_NAME_CHARS,  # 4 bytes a character in UTF-8
}
CLIENT_MESSAGES = (
    HELLO_AT_ITS_LARGEST,
    {
        "type": MessageType.OPEN_CHANNEL.value,
        "capacity": _U64_MAX,
        "depth": _U64_MAX,
        "gpu_driven": True,
        "rung_word": True,
        "adopt": True,
    },
    {"type": MessageType.STATS.value},
    {"type": MessageType.BYE.value},
)
"""Every message a client sends, each field at its largest: what the limits on
client frames are derived from. A new client message or field goes here."""


@dataclass(frozen=True)
class DecodeLimits:
    """What a frame may hold: its body's bytes, and what the msgpack decoder
    may build from it (string and binary bytes, array and map lengths, and how
    deep containers nest: 1 for a map of scalars). Decoding a frame within
    these costs time and memory in proportion to ``frame_bytes``, whatever its
    bytes say."""

    frame_bytes: int
    str_bytes: int
    bin_bytes: int
    array_len: int
    map_len: int
    depth: int | None  # None: as deep as msgpack itself decodes (1024)

    @classmethod
    def covering(cls, messages: tuple[dict, ...] | list[dict]) -> DecodeLimits:
        """The limits of ``messages`` at their largest, each rounded up to the
        next power of two (room, not licence: a real message is never near
        them)."""
        frame = str_bytes = bin_bytes = array_len = map_len = depth = 0
        for msg in messages:
            frame = max(frame, len(msgpack.packb(msg, use_bin_type=True)))
            for value, level in _walk(msg):
                depth = max(depth, level)
                if isinstance(value, str):
                    str_bytes = max(str_bytes, len(value.encode()))
                elif isinstance(value, bytes):
                    bin_bytes = max(bin_bytes, len(value))
                elif isinstance(value, list):
                    array_len = max(array_len, len(value))
                elif isinstance(value, dict):
                    map_len = max(map_len, len(value))
        return cls(
            frame_bytes=_room(frame),
            str_bytes=_room(str_bytes),
            bin_bytes=_room(bin_bytes),
            array_len=_room(array_len),
            map_len=_room(map_len),
            depth=depth,
        )


def _walk(obj, level: int = 0):
    """Every object in ``obj`` (keys included), with the number of containers
    holding it (a container counts itself)."""
    if isinstance(obj, (dict, list)):
        level += 1
    yield obj, level
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(key, level)
            yield from _walk(value, level)
    elif isinstance(obj, list):
        for value in obj:
            yield from _walk(value, level)


def _room(n: int) -> int:
    """The next power of two above ``n`` (0 stays 0: nothing of that kind)."""
    return 1 << n.bit_length() if n else 0


BEFORE_HELLO = DecodeLimits.covering([HELLO_AT_ITS_LARGEST])
"""What the server decodes before it has answered HELLO (which alone may come)."""
AFTER_HELLO = DecodeLimits.covering(CLIENT_MESSAGES)
"""What the server decodes from a greeted client."""
MAX_HELLO_FRAME_BYTES = BEFORE_HELLO.frame_bytes
MAX_REQUEST_FRAME_BYTES = AFTER_HELLO.frame_bytes
FROM_SERVER = DecodeLimits(
    frame_bytes=MAX_FRAME_BYTES,
    str_bytes=MAX_FRAME_BYTES,
    bin_bytes=MAX_FRAME_BYTES,
    array_len=1 << 20,
    map_len=1 << 16,
    depth=None,
)
"""What a client decodes from the server (its peer of trust: generous bounds)."""


@dataclass(frozen=True)
class ChannelLayout:
    """Byte geometry of one channel segment; both sides derive it the same way."""

    depth: int
    capacity: int
    max_row_bytes: int

    @property
    def ids_offset(self) -> int:
        """Offset of the ids area inside a slot."""
        return SLOT_PRELUDE_BYTES

    @property
    def rows_offset(self) -> int:
        """Offset of the rows area inside a slot (page-aligned)."""
        return _round_up(SLOT_PRELUDE_BYTES + ID_BYTES * self.capacity, PAGE)

    @property
    def rows_bytes(self) -> int:
        return _round_up(self.capacity * self.max_row_bytes, PAGE)

    @property
    def slot_stride(self) -> int:
        return self.rows_offset + self.rows_bytes

    @property
    def size(self) -> int:
        return CHANNEL_HEADER_BYTES + self.depth * self.slot_stride

    def slot_offset(self, slot: int) -> int:
        return CHANNEL_HEADER_BYTES + slot * self.slot_stride

    def to_wire(self) -> dict:
        return {
            "depth": self.depth,
            "capacity": self.capacity,
            "max_row_bytes": self.max_row_bytes,
            "size": self.size,
            "slot_stride": self.slot_stride,
            "rows_offset": self.rows_offset,
        }

    @classmethod
    def from_wire(cls, msg: dict) -> ChannelLayout:
        layout = cls(int(msg["depth"]), int(msg["capacity"]), int(msg["max_row_bytes"]))
        for key in ("size", "slot_stride", "rows_offset"):
            if int(msg[key]) != getattr(layout, key):
                raise ValueError(
                    f"channel layout disagrees on {key}: server says {msg[key]}, "
                    f"this client computes {getattr(layout, key)}"
                )
        return layout


def encode_error_text(text: str) -> bytes:
    """An error text truncated to fit a slot's message area, NUL-terminated."""
    raw = text.encode("utf-8", "replace")[: SLOT_MESSAGE_BYTES - 1]
    return raw + b"\0" * (SLOT_MESSAGE_BYTES - len(raw))


def decode_error_text(raw: bytes | memoryview) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode("utf-8", "replace")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------- framing
class FrameError(ValueError):
    """A control frame that is not a msgpack map with a known ``type``."""


def encode_frame(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return FRAME_HEADER.pack(len(body)) + body


def decode_body(body: bytes, limits: DecodeLimits = FROM_SERVER) -> dict:
    """A frame's body as a message; FrameError when it is not a msgpack map
    with a string ``type``, or holds more than ``limits`` allow (the decoder
    stops at the first string, array or map over them)."""
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.str_bytes,
            max_bin_len=limits.bin_bytes,
            max_array_len=limits.array_len,
            max_map_len=limits.map_len,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"undecodable msgpack body: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise FrameError("a message must be a msgpack map with a string 'type'")
    if limits.depth is not None and _deeper_than(msg, limits.depth):
        raise FrameError(f"a message nests containers deeper than {limits.depth}")
    return msg


def _deeper_than(obj, depth: int) -> bool:
    """Whether containers in ``obj`` nest more than ``depth`` deep (the walk
    is bounded by the objects decoded, which the frame's size bounds)."""
    if not isinstance(obj, (dict, list)):
        return False
    if depth <= 0:
        return True
    values = obj.values() if isinstance(obj, dict) else obj
    return any(_deeper_than(v, depth - 1) for v in values)


def send_message(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    """Send one frame (blocking), with file descriptors attached if any."""
    data = encode_frame(msg)
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_message(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """Receive one frame (blocking); (None, []) when the peer closed the socket."""
    fds: list[int] = []
    header = _recv_exact(sock, FRAME_HEADER.size, fds)
    if header is None:
        return None, fds
    (length,) = FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    body = _recv_exact(sock, length, fds)
    if body is None:
        return None, fds
    return decode_body(body), fds


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    chunks, got = [], 0
    fd_space = socket.CMSG_SPACE(4 * array.array("i").itemsize)
    while got < n:
        data, ancdata, _flags, _addr = sock.recvmsg(n - got, fd_space)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[: len(cdata) - len(cdata) % arr.itemsize])
                fds.extend(arr)
        if not data:
            return None
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


class FrameReader:
    """Reassembles frames from a non-blocking stream: ``push`` what arrives,
    ``pop`` one message at a time under the limits that apply to it (the
    server's change once it has answered HELLO)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pushed_at = 0.0
        self.incomplete_since: float | None = None
        """When the frame now incomplete began to arrive (caller's clock)."""

    def push(self, data: bytes, now: float | None = None) -> None:
        """Add received bytes (at ``now``, default ``time.monotonic()``)."""
        now = time.monotonic() if now is None else now
        if not self._buf:
            self.incomplete_since = now
        self._buf += data
        self._pushed_at = now

    def pop(self, limits: DecodeLimits) -> dict | None:
        """The next complete message, or None. Raises FrameError on a frame
        over ``limits`` — as soon as its length is seen, before its body is
        waited for — or one that does not decode within them (the caller
        drops the session)."""
        if len(self._buf) < FRAME_HEADER.size:
            return None
        (length,) = FRAME_HEADER.unpack_from(self._buf)
        if length > limits.frame_bytes:
            raise FrameError(
                f"frame of {length} bytes exceeds the {limits.frame_bytes}-byte limit"
                + (" before 'hello'" if limits is BEFORE_HELLO else "")
            )
        end = FRAME_HEADER.size + length
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[FRAME_HEADER.size : end])
        del self._buf[:end]
        self.incomplete_since = self._pushed_at if self._buf else None
        return decode_body(body, limits)

    def feed(
        self, data: bytes, now: float | None = None, limits: DecodeLimits = FROM_SERVER
    ) -> list[dict]:
        """``push``, then every complete message (all under ``limits``)."""
        self.push(data, now)
        out = []
        while (msg := self.pop(limits)) is not None:
            out.append(msg)
        return out
