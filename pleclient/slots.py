"""Who holds each slot of a client's channel: ``SlotPool``.

A slot's *state* word (``pleclient.protocol``) says where its request stands
between the client and the server, and lives in shared memory. Its *owner*
says who on the client's side may use the slot next; it is the client's alone
and lives here::

    FREE ──take──► TICKET ──release (answered)──────────────────► FREE
                     │
                     └──abandon (released before its answer)──► ABANDONED
                                                                  │
                            the server's answer arrives ──reclaim─┘──► FREE

    STREAM: every slot of a GPU-driven channel, for as long as it is open:
            rung and collected by a CUDA stream (``pleclient.gpu``), which
            owns each slot by its index; never taken for a ticket.

ABANDONED is an *unread* owner: a slot submitted with nobody to read its
answer, free again once the answer has arrived (``take`` reclaims such slots
first, and waits for the oldest when no slot is free). A prefetch hint — a
request submitted only so that the server reads its rows ahead — would be one
more unread owner, taken straight from FREE: add it to ``SlotOwner`` and to
``UNREAD``, and ``take``, ``free`` and the reclaiming serve it unchanged.

A pool is used under its client's lock, by one thread at a time.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from pleclient import protocol as p
from pleclient.channel import ChannelMap, SlotView
from pleclient.errors import PleError

LIVENESS_SLICE = 0.05
"""While blocked, check the control socket this often, so a dead server is
reported at once rather than at the end of the timeout."""


class SlotOwner(enum.Enum):
    """Who holds a slot, on the client's side."""

    FREE = "free"  # nobody: ``take`` may hand it out
    TICKET = "ticket"  # a Ticket: submitted, or answered and not released yet
    ABANDONED = "abandoned"  # released before its answer: free once answered
    HINT = "hint"  # a prefetch hint: its answer is never read, free once answered
    STREAM = "stream"  # a GPU-driven channel's: rung by a CUDA stream


UNREAD = frozenset({SlotOwner.ABANDONED, SlotOwner.HINT})
"""Owners of a submitted slot that nobody will read: the slot is free again
once the server has answered it."""


class SlotPool:
    """The owners of a channel's slots, and the waits for their answers.

    ``check_alive`` is called between slices of every wait (each at most
    ``LIVENESS_SLICE``): it raises when the session has ended, so a dead
    server ends a wait at once."""

    def __init__(
        self, channel: ChannelMap, owner: SlotOwner, check_alive: Callable[[], None]
    ) -> None:
        self._slots: list[SlotView] | None = channel.slots
        self._owners = [owner] * len(channel.slots)
        self._check_alive = check_alive

    def owner(self, index: int) -> SlotOwner:
        return self._owners[index]

    @property
    def free(self) -> int:
        """Slots that ``take`` can hand out: free, or unread (free once answered)."""
        return sum(owner is SlotOwner.FREE or owner in UNREAD for owner in self._owners)

    def take(self, timeout: float) -> SlotView | None:
        """FREE → TICKET: a slot for a new request. Unread slots whose answer
        has arrived are reclaimed first; with no slot free, the oldest unread
        one is waited for, up to ``timeout`` (None if its answer did not come).
        PleError when tickets hold every slot."""
        slots, owners = self._require(), self._owners
        self._reclaim_answered()
        for i, owner in enumerate(owners):
            if owner is SlotOwner.FREE:
                owners[i] = SlotOwner.TICKET
                return slots[i]
        unread = [i for i, owner in enumerate(owners) if owner in UNREAD]
        if unread:  # answers on their way: wait for one, not fail
            index = unread[0]
            if self.wait_answered(slots[index], timeout) == p.SlotState.SUBMITTED:
                return None
            self._free(index)
            owners[index] = SlotOwner.TICKET
            return slots[index]
        raise PleError(
            f"all {len(owners)} channel slots are held by unreleased or "
            "unanswered tickets; release tickets (or connect with a larger depth)"
        )

    def take_for_hint(self) -> SlotView | None:
        """FREE → HINT: a slot for a prefetch hint, or None when none is free
        now (never waits). Unread slots whose answer has arrived are reclaimed
        first; the hint's own slot is reclaimed the same way by a later take."""
        slots, owners = self._require(), self._owners
        self._reclaim_answered()
        for i, owner in enumerate(owners):
            if owner is SlotOwner.FREE:
                owners[i] = SlotOwner.HINT
                return slots[i]
        return None

    def release(self, index: int) -> None:
        """TICKET → FREE, once the slot was answered: the rows are read."""
        self._expect(index, SlotOwner.TICKET)
        self._free(index)

    def abandon(self, index: int) -> None:
        """TICKET → ABANDONED: released before its answer; reclaimed once it came."""
        self._expect(index, SlotOwner.TICKET)
        self._owners[index] = SlotOwner.ABANDONED

    def wait_answered(self, slot: SlotView, timeout: float, spin: float = 0.0) -> int:
        """The slot's state once the server answered it (spinning ``spin``
        seconds first), or SUBMITTED when ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            state = slot.wait_answered(max(0.0, min(LIVENESS_SLICE, remaining)), spin)
            if state != p.SlotState.SUBMITTED:
                return state
            spin = 0.0
            self._check_alive()
            if time.monotonic() >= deadline:
                return state

    def close(self) -> None:
        """The channel is unmapped: no slot can be handed out or given back."""
        self._slots = None

    def _reclaim_answered(self) -> None:
        """UNREAD → FREE for every unread slot the server has answered."""
        slots = self._require()
        for i, owner in enumerate(self._owners):
            if owner in UNREAD and slots[i].state != p.SlotState.SUBMITTED:
                self._free(i)

    def _free(self, index: int) -> None:
        self._require()[index].release()
        self._owners[index] = SlotOwner.FREE

    def _expect(self, index: int, owner: SlotOwner) -> None:
        if self._owners[index] is not owner:
            raise PleError(
                f"slot {index} is held by {self._owners[index].value}, not by {owner.value}"
            )

    def _require(self) -> list[SlotView]:
        if self._slots is None:
            raise PleError("this client is closed")
        return self._slots
