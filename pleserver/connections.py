"""Which connections on the control socket become sessions.

Decided at accept, from the kernel's word alone (``SO_PEERCRED``), and
cheaply: a uid that connects in a loop — refused or not — must cost the
control thread no more than an accept, a ``getsockopt``, one send of a frame
encoded beforehand and a close, with no session, no message decoded and no log
line beyond the rate-limited ones. In order:

1. **rate**: a token bucket per uid, ``ACCEPT_BURST`` connections and then
   ``ACCEPT_RATE`` a second (root and the server's own uid, always admitted,
   are not limited). Past it: ``TOO_MANY_CLIENTS``, counted as
   ``rate_limited``. A vLLM host connects a few times per worker, at start;
2. **who**: the server's own uid, root, ``allow_uids``, and members of
   ``allow_gids`` (primary or supplementary groups, read from
   ``/proc/<pid>/status``). Else ``NOT_ALLOWED``;
3. **room**: ``max_clients`` sessions, plus one for ``pleserver stats``.
   Else ``TOO_MANY_CLIENTS``.

Every refusal is counted by reason (``counts``, in the server's statistics)
and gets one ERROR frame, encoded once per uid and reason, then a close. The
listen backlog (``listen_backlog``) is as long as ``net.core.somaxconn``
allows, so that a burst of connections waits in the kernel instead of
failing; clients retry a full queue (``pleclient.client``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from pleclient import protocol as p
from pleserver.config import ServerConfig

log = logging.getLogger("pleserver.server")

ACCEPT_BURST = 128
"""Connections a uid may open at once (twice the default max_clients)."""
ACCEPT_RATE = 64.0
"""Connections a second a uid may open, past its burst."""
LISTEN_BACKLOG = 4096
"""Connections the kernel may queue for accept, at most (and at most
net.core.somaxconn, which caps any listen())."""
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"
_FRAME_CACHE_MAX = 1024  # refusal frames kept (per uid and reason)
_IDLE_BUCKET_S = 60.0  # a bucket unused this long is full again: forgotten


@dataclass(frozen=True)
class Refusal:
    reason: str  # "not_allowed", "too_many_clients", "rate_limited"
    code: p.ErrorCode
    text: str
    frame: bytes  # the ERROR frame, encoded once


@dataclass
class _Bucket:
    tokens: float
    at: float


class ConnectionGate:
    """The three checks, in order, for one connection at a time (control thread)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.always = {0, os.geteuid()}
        self.counts = {"not_allowed": 0, "too_many_clients": 0, "rate_limited": 0}
        self._buckets: dict[int, _Bucket] = {}
        self._frames: dict[tuple[str, int], Refusal] = {}
        self.reconfigure()

    def reconfigure(self) -> None:
        """Take the access lists and ``max_clients`` from ``config`` again (a
        reload changed them): the next connection is checked against them.
        Both run on the control thread, so no connection sees half of it."""
        self.allowed_uids = set(self.config.allow_uids) | self.always
        self.allowed_gids = set(self.config.allow_gids)
        self._frames.clear()  # their texts name max_clients

    def allows(self, uid: int, pid: int, gid: int) -> bool:
        """Whether the access lists let this peer in."""
        return uid in self.allowed_uids or bool(
            self.allowed_gids and self.allowed_gids & groups_of(pid, gid)
        )

    def check(self, uid: int, pid: int, gid: int, sessions: int) -> Refusal | None:
        """None to admit the peer, else its refusal (counted)."""
        if uid not in self.always and not self._take_token(uid, time.monotonic()):
            return self._refuse("rate_limited", uid)
        if not self.allows(uid, pid, gid):
            return self._refuse("not_allowed", uid)
        # One session beyond max_clients, so that `pleserver stats` gets in when
        # every client slot is taken; only max_clients of them may open channels.
        if sessions >= self.config.max_clients + 1:
            return self._refuse("too_many_clients", uid)
        return None

    def forget_idle(self) -> None:
        """Drop the buckets of uids that have not connected for a while (full
        again by now): the table holds the uids connecting lately."""
        now = time.monotonic()
        for uid in [u for u, b in self._buckets.items() if now - b.at > _IDLE_BUCKET_S]:
            del self._buckets[uid]

    def _take_token(self, uid: int, now: float) -> bool:
        bucket = self._buckets.get(uid)
        if bucket is None:
            bucket = self._buckets[uid] = _Bucket(float(ACCEPT_BURST), now)
        bucket.tokens = min(float(ACCEPT_BURST), bucket.tokens + (now - bucket.at) * ACCEPT_RATE)
        bucket.at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def _refuse(self, reason: str, uid: int) -> Refusal:
        self.counts[reason] += 1
        refusal = self._frames.get((reason, uid))
        if refusal is None:
            if len(self._frames) >= _FRAME_CACHE_MAX:
                self._frames.clear()
            refusal = self._frames[(reason, uid)] = self._refusal(reason, uid)
        return refusal

    def _refusal(self, reason: str, uid: int) -> Refusal:
        cfg = self.config
        if reason == "rate_limited":
            code = p.ErrorCode.TOO_MANY_CLIENTS
            text = (
                f"uid {uid} opened connections faster than this ple-server admits "
                f"({ACCEPT_BURST} at once, then {ACCEPT_RATE:g} a second); wait and retry"
            )
        elif reason == "not_allowed":
            code = p.ErrorCode.NOT_ALLOWED
            text = (
                f"uid {uid} may not use this ple-server; add the uid to allow_uids "
                "or one of its groups to allow_gids in the server config"
            )
        else:
            code = p.ErrorCode.TOO_MANY_CLIENTS
            text = (
                f"ple-server already has {cfg.max_clients + 1} sessions (max_clients = "
                f"{cfg.max_clients}, plus one for `pleserver stats`); close idle "
                "clients or raise max_clients"
            )
        frame = p.encode_frame(
            {"type": p.MessageType.ERROR.value, "code": int(code), "message": text}
        )
        return Refusal(reason, code, text, frame)


def groups_of(pid: int, gid: int) -> set[int]:
    """The primary and supplementary groups of a live process."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return groups


def listen_backlog() -> tuple[int, int | None]:
    """The backlog to ask ``listen`` for, and what the kernel will grant (the
    smaller of it and ``net.core.somaxconn``; None where that is unreadable)."""
    try:
        with open(SOMAXCONN_PATH) as f:
            somaxconn: int | None = int(f.read().strip())
    except (OSError, ValueError):
        somaxconn = None
    return LISTEN_BACKLOG, None if somaxconn is None else min(LISTEN_BACKLOG, somaxconn)
