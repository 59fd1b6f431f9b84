"""Which connections on the control socket become sessions.

Decided at accept, from the kernel's word alone (``SO_PEERCRED``, and
``SO_PEERGROUPS`` where ``allow_gids`` needs it), and cheaply: a uid that
connects in a loop — refused or not — must cost the control thread no more
than an accept, a ``getsockopt`` or two, one send of a frame encoded
beforehand and a close, with no session, no message decoded and no log line
beyond the rate-limited ones. In order:

1. **rate**: a token bucket per uid, ``ACCEPT_BURST`` connections and then
   ``ACCEPT_RATE`` a second (root and the server's own uid, always admitted,
   are not limited). Past it: ``TOO_MANY_CLIENTS``, counted as
   ``rate_limited``. A vLLM host connects a few times per worker, at start;
2. **who**: the server's own uid, root, ``allow_uids``, and members of
   ``allow_gids``: the primary group from ``SO_PEERCRED``, the supplementary
   ones from ``SO_PEERGROUPS`` — both recorded by the kernel when the peer
   called ``connect``. Never from ``/proc/<pid>``: by accept time that pid may
   have exited and been reused by a process of an allowed group, or the
   process may have changed its groups. Else ``NOT_ALLOWED``;
3. **room**: ``max_clients`` sessions, plus one for ``pleserver stats``. The
   last ``RESERVED_CLIENTS`` of them are kept for root and the server's own
   uid, and one other uid holds at most ``max_clients_per_uid`` sessions, so
   that no allowed uid can lock out every other one, root included (with or
   without a channel: an idle session kept alive with STATS holds a slot as
   well). Else ``TOO_MANY_CLIENTS`` — transient: clients retry it
   (``pleclient.errors.TooManyClients``); past the per-uid limit it is
   counted as ``uid_limit``.

Every refusal is counted by reason (``counts``, in the server's statistics)
and gets one ERROR frame, encoded once per uid and reason, then a close. The
listen backlog (``listen_backlog``) is as long as ``net.core.somaxconn``
allows, so that a burst of connections waits in the kernel instead of
failing; clients retry a full queue (``pleclient.client``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
import struct
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
RESERVED_CLIENTS = 2
"""Client slots (sessions, and channels) of ``max_clients`` that only root
and the server's own uid may take: `pleserver stats` and a client of root's,
or two clients, get in however the other uids fill the server. At most
``max_clients - 1``, so that a server of ``max_clients = 1`` still admits
one client of any allowed uid."""
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+; 59 on x86-64 and arm64
NGROUPS_MAX = 65536  # the kernel's limit of supplementary groups per process
_GROUPS_IN_ONE_CALL = 256  # Python's getsockopt takes a buffer of 1024 bytes at most
_FRAME_CACHE_MAX = 1024  # refusal frames kept (per uid and reason)
_IDLE_BUCKET_S = 60.0  # a bucket unused this long is full again: forgotten


@dataclass(frozen=True)
class Refusal:
    reason: str  # "not_allowed", "too_many_clients", "uid_limit", "rate_limited"
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
        self.counts = {"not_allowed": 0, "too_many_clients": 0, "uid_limit": 0, "rate_limited": 0}
        self._buckets: dict[int, _Bucket] = {}
        self._frames: dict[tuple[str, int], Refusal] = {}
        self._no_peergroups_said = False
        self.reconfigure()

    def reconfigure(self) -> None:
        """Take the access lists and the limits from ``config`` again (a
        reload changed them): the next connection is checked against them.
        Both run on the control thread, so no connection sees half of it."""
        self.allowed_uids = set(self.config.allow_uids) | self.always
        self.allowed_gids = set(self.config.allow_gids)
        self._frames.clear()  # their texts name max_clients and max_clients_per_uid

    @property
    def reserved(self) -> int:
        """Slots of ``max_clients`` kept for root and the server's own uid."""
        return min(RESERVED_CLIENTS, self.config.max_clients - 1)

    def client_limit(self, uid: int) -> int:
        """How many channels may be open, all uids together, when ``uid``
        opens one: all of ``max_clients`` for root and the server's own uid,
        all but the reserved slots for any other."""
        return self.config.max_clients - (0 if uid in self.always else self.reserved)

    def allows(self, uid: int, gid: int, sock: socket.socket) -> bool:
        """Whether the access lists let in the peer of ``sock``: its uid, its
        primary group ``gid`` or its supplementary groups, all as they were
        when it connected."""
        if uid in self.allowed_uids or gid in self.allowed_gids:
            return True
        if not self.allowed_gids:
            return False
        groups = peer_groups(sock)
        if groups is None:
            if not self._no_peergroups_said:
                self._no_peergroups_said = True
                log.warning(
                    "this kernel does not tell a socket's peer's supplementary groups "
                    "(SO_PEERGROUPS, Linux 4.13+): allow_gids admits members by their "
                    "primary group only; allow their uids, or their primary group"
                )
            return False
        return bool(self.allowed_gids.intersection(groups))

    def check(
        self, uid: int, gid: int, sock: socket.socket, sessions: int, sessions_of_uid: int
    ) -> Refusal | None:
        """None to admit the peer, else its refusal (counted). ``sessions``:
        open sessions, all uids together; ``sessions_of_uid``: those of ``uid``."""
        privileged = uid in self.always
        if not privileged and not self._take_token(uid, time.monotonic()):
            return self._refuse("rate_limited", uid)
        if not self.allows(uid, gid, sock):
            return self._refuse("not_allowed", uid)
        if not privileged and sessions_of_uid >= self.config.max_clients_per_uid:
            return self._refuse("uid_limit", uid)
        # One session beyond the client slots, so that `pleserver stats` gets in
        # when every one is taken (only the slots may open channels); a uid
        # other than root and the server's own has all but the reserved ones.
        if sessions >= self.client_limit(uid) + 1:
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
                "or one of its groups to allow_gids in the server config (the groups "
                "it had when it connected count: one added later needs a new connection)"
            )
        elif reason == "uid_limit":
            code = p.ErrorCode.TOO_MANY_CLIENTS
            text = (
                f"uid {uid} already holds {cfg.max_clients_per_uid} sessions on this "
                f"ple-server (max_clients_per_uid = {cfg.max_clients_per_uid}); close "
                "idle clients of this uid, or raise max_clients_per_uid"
            )
        else:
            code = p.ErrorCode.TOO_MANY_CLIENTS
            limit = self.client_limit(uid)
            kept = (
                f", the other {cfg.max_clients - limit} kept for root and the server's own uid"
                if limit < cfg.max_clients
                else ""
            )
            text = (
                f"ple-server already has {limit + 1} sessions (max_clients = "
                f"{cfg.max_clients}, plus one for `pleserver stats`{kept}); close idle "
                "clients or raise max_clients"
            )
        frame = p.encode_frame(
            {"type": p.MessageType.ERROR.value, "code": int(code), "message": text}
        )
        return Refusal(reason, code, text, frame)


def peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    """The supplementary groups of ``sock``'s peer as the kernel recorded them
    when it called ``connect`` (``SO_PEERGROUPS``), whatever its process has
    done since; None where the kernel lacks the option (before Linux 4.13).
    Where the kernel knows none (no peer credentials), none: the groups never
    admit what the server cannot see."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _GROUPS_IN_ONE_CALL)
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return None
        if exc.errno != errno.ERANGE:  # ENODATA: no credentials recorded
            return ()
        try:  # more groups than Python's buffer holds
            return _peer_groups_unbounded(sock.fileno())
        except OSError:
            return ()
    return struct.unpack(f"{len(raw) // 4}I", raw)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.getsockopt.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint32),
]
_libc.getsockopt.restype = ctypes.c_int


def _peer_groups_unbounded(fd: int) -> tuple[int, ...]:
    """``SO_PEERGROUPS`` with a buffer for ``NGROUPS_MAX`` groups (a peer in
    more than 256: Python's ``getsockopt`` caps its buffer at 1024 bytes)."""
    buf = (ctypes.c_uint32 * NGROUPS_MAX)()
    size = ctypes.c_uint32(ctypes.sizeof(buf))
    if _libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getsockopt(SO_PEERGROUPS): {os.strerror(err)}")
    return tuple(buf[: size.value // 4])


def listen_backlog() -> tuple[int, int | None]:
    """The backlog to ask ``listen`` for, and what the kernel will grant (the
    smaller of it and ``net.core.somaxconn``; None where that is unreadable)."""
    try:
        with open(SOMAXCONN_PATH) as f:
            somaxconn: int | None = int(f.read().strip())
    except (OSError, ValueError):
        somaxconn = None
    return LISTEN_BACKLOG, None if somaxconn is None else min(LISTEN_BACKLOG, somaxconn)
