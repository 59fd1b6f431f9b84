"""How requests come into the serving loop and how their answers go out: one
admission per channel, chosen when the channel opens.

A channel's client is a CPU thread or a CUDA stream, and the two signal in
different words (``pleclient.protocol``):

- ``CounterAdmission`` — a CPU thread marks a slot SUBMITTED, then publishes
  the channel's submit counter, which wakes the loop if it sleeps on it; the
  answer is the slot's state DONE or ERROR, published to its sleepers;
- ``DoorbellAdmission`` — a stream rings a slot's doorbell, then the
  channel's rung word; it cannot wake a sleeper, so the loop polls the rung
  word; the answer is the slot's done word, which the stream waits on.

The serving loop (``pleserver.data.serving``) sees only this interface, as Redis's
``aeProcessEvents`` sees only ``aeApi*`` whichever backend was compiled in: one
scheduling policy, with no idea which kind of client it serves::

    pending()               one load, every pass: may a request be waiting?
    admit(limit) → [Arrival]
                            the slots holding new requests, at most ``limit``
                            (the rest wait for the next pass: ``pending``
                            stays true), each now the server's (busy) until
                            answered; HostileChannel if the words break what
                            any client could write
    complete(slot, ns)      the rows are in place: publish the answer
    fail(slot, code, text)  publish an error instead
    futex_word()            (words, offset, value last seen) for the idle
                            loop's futex_waitv, or None: the client cannot
                            wake the loop, which polls ``pending`` instead
    announce_sleep(bool)    around that sleep (the client reads it before it
                            decides to make the wake-up call)
    waiting()               exactly whether a request waits (the drain at stop)

The loop validates what ``admit`` returns (table, count, ids, copied first),
queues it, gathers it and answers it through ``complete`` or ``fail``; the
slot transitions themselves are ``pleclient.channel.SlotView``'s.

A third kind of request comes in through the same door. A prefetch hint —
rows to read into the row cache, nothing returned, served below every demand
read — is an ``Arrival`` like any other: the admission that finds it says so
in the arrival (``kind``, the slot's kind word), the loop copies and
validates its ids as a lookup's, answers it through the admission's
``complete`` at once (no rows: the slot is the client's again), and hands the
copy to the server's hint queue (``pleserver.data.hints``), which reads it into the
cache only, behind demand. No branch per kind of client in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pleclient import protocol as p
from pleclient._sync import Words
from pleclient.channel import COUNTER_AT, RUNG_AT, ChannelMap, SlotView

U32 = 0xFFFFFFFF
IDLE = int(p.Doorbell.IDLE)
"""A plain int: ``pending`` runs for every channel on every pass, and reading
an enum member costs Python 3.11 several times a word's load."""


class HostileChannel(Exception):
    """The channel's words break what any protocol-following client can write."""


@dataclass(frozen=True)
class Arrival:
    """A slot that holds a new request, now the server's until it is answered."""

    slot: SlotView
    submitted_ns: int | None
    """When the client submitted it (CLOCK_MONOTONIC ns, the client's word:
    checked before it is believed), or None where the client has no such clock."""
    kind: int = p.RequestKind.LOOKUP
    """The slot's kind word as admitted (``pleclient.protocol.RequestKind``;
    the client's word: any other value is refused by the loop)."""


class Admission(Protocol):
    """One channel's way in and out (see the module docstring)."""

    kind: str
    """What drives the channel, for stats and logs: "counter" or "doorbell"."""

    spin_after: bool
    """Whether the loop spins (``spin_us``) after this channel's requests. A
    CPU thread's next request would otherwise wait for a futex wake-up; a
    stream's doorbells are polled every ``gpu_poll_us`` anyway, and a spin
    beside a decoding engine takes a core from it (``ServingLoop._run``)."""

    in_order: bool
    """Whether the client waits for its requests in the order it made them, so
    that their disk reads go best one request after another (``gather_in_order``,
    ``pleserver.data.handoffs``)."""

    def pending(self) -> bool: ...

    def admit(self, limit: int) -> list[Arrival]: ...

    def complete(self, slot: SlotView, server_ns: int) -> None: ...

    def fail(self, slot: SlotView, code: int, text: str) -> None: ...

    def futex_word(self) -> tuple[Words, int, int] | None: ...

    def polled_word(self) -> tuple[Words, int, int] | None:
        """Where ``futex_word`` is None: the word the sleeping loop looks at
        instead, and its idle value."""
        ...

    def announce_sleep(self, sleeping: bool) -> None: ...

    def waiting(self) -> bool: ...


def open_admission(mapping: ChannelMap, gpu_driven: bool) -> Admission:
    """The admission of a channel opened with OPEN_CHANNEL's ``gpu_driven``."""
    return DoorbellAdmission(mapping) if gpu_driven else CounterAdmission(mapping)


class CounterAdmission:
    """A channel driven by a CPU thread: the submit counter and the slot states."""

    kind = "counter"
    spin_after = True
    in_order = False  # a CPU client's slots may be independent lookups, waited on in any order

    def __init__(self, mapping: ChannelMap) -> None:
        self.map = mapping
        self.depth = mapping.layout.depth
        self.seen = 0  # the submit counter as last read (a new channel's is 0)
        self.busy: set[int] = set()  # slots admitted and not yet answered
        self.more = False  # submitted slots left for the next pass (admit's limit)
        self._load = mapping.sync.load

    def pending(self) -> bool:
        # E2: acquire, pairs with the client's publish of the counter (E1)
        return self.more or self._load(COUNTER_AT) != self.seen

    def admit(self, limit: int) -> list[Arrival]:
        """Read the submit counter, then the slots' states in one call: the
        slots submitted since the last look, at most ``limit``."""
        # E2: acquire, pairs with the client's E1: every slot submitted before
        # the counter reached this value is visible from here on.
        counter = self.map.submit_counter
        pending = (counter - self.seen) & U32
        if pending == 0 and not self.more:
            return []
        if pending > self.depth:
            raise HostileChannel(
                f"its submit counter ran {pending} submits ahead of the server, over its "
                f"{self.depth} slots: the channel's words were overwritten"
            )
        self.seen = counter
        self.more = False
        arrivals: list[Arrival] = []
        for slot in self.map.submitted_slots():
            if slot.index in self.busy:
                continue
            # Only slots submitted before the counter we read: their ids are visible.
            if ((counter - slot.words[p.SL_SEQUENCE] - 1) & U32) >= 0x80000000:
                continue
            if len(arrivals) == limit:
                self.more = True  # still SUBMITTED: the next pass takes it
                break
            self.busy.add(slot.index)
            arrivals.append(Arrival(slot, slot.words64[p.SL_SUBMIT_NS // 2], slot.words[p.SL_KIND]))
        return arrivals

    def complete(self, slot: SlotView, server_ns: int) -> None:
        # Not busy before the answer: the client may reuse the slot at once.
        self.busy.discard(slot.index)
        slot.complete(server_ns)

    def fail(self, slot: SlotView, code: int, text: str) -> None:
        self.busy.discard(slot.index)  # (as in complete)
        slot.fail(code, text)

    def futex_word(self) -> tuple[Words, int, int]:
        """The submit counter, at the value last read: a counter that moved
        since ends the sleep at once, a publish after it wakes it."""
        return (self.map.sync, COUNTER_AT, self.seen)

    def polled_word(self) -> None:
        """None: the counter wakes the loop (``futex_word``)."""
        return None

    def announce_sleep(self, sleeping: bool) -> None:
        self.map.set_server_sleeping(sleeping)

    def waiting(self) -> bool:
        return self.pending()


class DoorbellAdmission:
    """A channel driven by a CUDA stream: the rung word and the doorbells."""

    kind = "doorbell"
    spin_after = False
    in_order = True  # a step's PLE layers, rung in the order the GPU waits for them

    def __init__(self, mapping: ChannelMap) -> None:
        self.map = mapping
        self.busy: set[int] = set()  # slots admitted and not yet answered
        self.more = False  # rung slots left for the next pass (admit's limit)
        self._load = mapping.sync.load

    def pending(self) -> bool:
        # A peek (E2); the exchange in admit (X1) is what orders the doorbells.
        return self.more or self._load(RUNG_AT) != IDLE

    def admit(self, limit: int) -> list[Arrival]:
        """Take the rung word, then read the doorbells in one call: the slots
        rung since, at most ``limit``, each claimed."""
        # X1: the doorbells rung before it (G2). Slots left by the last pass's
        # limit were seen RUNG then (D1) and still are: no rung word needed.
        if not self.map.take_rung() and not self.more:
            return []
        self.more = False
        arrivals: list[Arrival] = []
        # D1: the ids, table and count the stream wrote before each doorbell (G1).
        for slot in self.map.rung_slots():
            if slot.index in self.busy:  # rung again while admitted: a scribble
                continue
            if len(arrivals) == limit:
                self.more = True  # still RUNG: the next pass claims it
                break
            slot.claim()
            self.busy.add(slot.index)
            # (a GPU has no clock of ours)
            arrivals.append(Arrival(slot, None, slot.words[p.SL_KIND]))
        return arrivals

    def complete(self, slot: SlotView, server_ns: int) -> None:
        self.busy.discard(slot.index)  # (as in CounterAdmission.complete)
        slot.answer_gpu(p.ErrorCode.OK, "", server_ns)

    def fail(self, slot: SlotView, code: int, text: str) -> None:
        self.busy.discard(slot.index)
        slot.answer_gpu(code, text, 0)

    def futex_word(self) -> None:
        """None: a stream cannot make a futex call, so the loop polls."""
        return None

    def polled_word(self) -> tuple[Words, int, int]:
        """The word the loop polls instead (``futex_waitv``'s ``polled``): the
        rung word, idle until the stream rings."""
        return (self.map.sync, RUNG_AT, IDLE)

    def announce_sleep(self, sleeping: bool) -> None:
        """Nothing to announce: no client reads it (futex_word is None)."""

    def waiting(self) -> bool:
        return bool(self.map.rung_slots())
