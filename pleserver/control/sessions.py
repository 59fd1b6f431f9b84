"""Control sessions: who may connect, the control protocol, replies, closing.

One ``Session`` per connection on the control socket; ``Sessions`` holds them
and speaks the control protocol (``pleclient.protocol``): HELLO is answered
with WELCOME and the tables, OPEN_CHANNEL with a channel segment's fd (the
segment reserved off the control thread, by ``pleserver.control.segments``), STATS with
the server's snapshot; BYE ends the session, and SHUTDOWN tells each client
the server stops. ``pleserver.server`` runs the control loop and calls in here
for every event.

A session never makes the control loop wait: replies go through a per-session
outbox on non-blocking sockets (a session past ``OUTBOX_LIMIT_BYTES`` of unread
replies is dropped); deadlines (hello, idle without a channel, incomplete
frame) close sessions that hold a slot without using it; log lines a peer can
trigger at will are rate-limited.

Access model (see docs/SECURITY.md):
- who may connect, and how often: the peer's uid and groups as the kernel
  recorded them at connect (SO_PEERCRED, SO_PEERGROUPS) against
  ``allow_uids`` / ``allow_gids`` (the server's own uid and root always may),
  decided at accept by ``pleserver.control.connections``, before a session exists;
- how many: ``max_clients`` (the last ones kept for root and the server's
  own uid), at most ``max_clients_per_uid`` sessions of any other uid;
- a session's segment is a memfd: it never has a name another process could
  open; its file descriptor goes to the peer alone (SCM_RIGHTS); its size is
  sealed, so the peer cannot shrink it under the server's mapping; its
  synchronization words (``pleclient.protocol``: shared futexes, which need
  no name) live inside it, and the server treats them as numbers only.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pleclient import protocol as p
from pleserver import __version__
from pleserver.config import ServerConfig
from pleserver.control.connections import ConnectionGate
from pleserver.control.segments import Reservation, Reserver
from pleserver.data.admission import open_admission
from pleserver.data.budget import ChannelBudget
from pleserver.data.serving import Channel, ServingLoop
from pleserver.data.tables import Table
from pleserver.observe.lograte import RateLimitedLog
from pleserver.observe.snapshot import Snapshot

# The server's logger: these lines read as they did when sessions lived in
# pleserver.server, and operators filter the journal on that name.
log = logging.getLogger("pleserver.server")

ACCEPT_BATCH = 64
"""Connections taken per wake-up of the control loop, at most (the others wait
in the kernel's queue for the next pass)."""
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
OUTBOX_LIMIT_BYTES = 1 << 20
"""Replies queued for a session that does not read them, at most; past this the
session is dropped (a STATS reply is a few KiB)."""
GPU_WITHOUT_RUNG_WORD = (
    "this client opens GPU-driven channels without the channel's rung word, "
    "which this ple-server polls instead of every doorbell: upgrade pleclient "
    f"(the vLLM plugin's package) to this server's version, {__version__}, or use the host "
    "path (VLLM_PLE_SHM_GPU_PATH=off)"
)


@dataclass(eq=False)
class Outgoing:
    """A frame (or what is left of it) waiting to be sent, and the descriptors
    that go with its first byte (owned here until sent)."""

    data: memoryview
    fds: list[int]


@dataclass(frozen=True)
class Refusal:
    """An ERROR reply to send (and whether the session ends with it)."""

    code: p.ErrorCode
    text: str
    close: bool = False


@dataclass(eq=False)
class Session:
    id: int
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    reader: p.FrameReader = field(default_factory=p.FrameReader)
    name: str = ""
    greeted: bool = False
    channel: Channel | None = None
    opening: bool = False  # its channel is being reserved
    gpu_driven: bool = False  # its channel (asked for in OPEN_CHANNEL) is GPU-driven
    gpu_slots: int = 0  # the slots of that channel when GPU-driven (max_gpu_slots_per_uid)
    offered_fd: int | None = None  # a segment the client sent to adopt (owned here until used)
    reservation: Reservation | None = None  # its channel's, while being made (``opening``)
    adopted: bool = False  # its channel is a segment it kept from an earlier server
    opened_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)  # last frame received
    outbox: deque[Outgoing] = field(default_factory=deque)
    outbox_bytes: int = 0
    writing: bool = False  # the selector watches it for EVENT_WRITE too

    @property
    def peer(self) -> str:
        return f"pid {self.pid} uid {self.uid}" + (f" ({self.name})" if self.name else "")


class Sessions:
    """Every open control session, and the control protocol they speak.

    Called on the control thread only; the channels they open are served by
    ``loop``, their memory counted in ``budget``, their segments reserved by
    ``reserver``."""

    def __init__(
        self,
        config: ServerConfig,
        selector: selectors.BaseSelector,
        instance: str,
        tables: list[Table],
        loop: ServingLoop,
        budget: ChannelBudget,
        reserver: Reserver,
        snapshot: Callable[[], Snapshot],
    ) -> None:
        self.config = config
        self.instance = instance
        self.tables = tables
        self.loop = loop
        self.budget = budget
        self.reserver = reserver
        self.by_socket: dict[socket.socket, Session] = {}
        self.by_id: dict[int, Session] = {}
        self._selector = selector
        self._snapshot = snapshot
        self._next_id = 1
        self._of_uid: dict[int, int] = {}  # open sessions by uid (max_clients_per_uid)
        self._peer_log = RateLimitedLog(log)
        self.gate = ConnectionGate(config)
        self._errors_sent = dict.fromkeys(p.ErrorCode, 0)  # refusals among them
        # Channels whose session closed before the reserver came to them: not
        # made, their memory given back (stats: abandoned_channel_opens).
        self.abandoned_opens = 0

    def errors_sent(self) -> dict[str, int]:
        """ERROR replies sent so far, by code in lower case (``not_allowed``,
        ``too_many_clients``, ``no_resources``, …): stats and the metrics."""
        return {code.name.lower(): n for code, n in self._errors_sent.items() if code}

    def __len__(self) -> int:
        return len(self.by_socket)

    # ---------------------------------------------------------------- events
    def handle(self, s: Session, events: int) -> None:
        """The selector found ``s``'s socket writable and/or readable."""
        if events & selectors.EVENT_WRITE:
            self._flush(s)
        if events & selectors.EVENT_READ and s.sock in self.by_socket:
            self._on_readable(s)

    def check_deadlines(self, now: float) -> None:
        """Close sessions that hold a slot without using it: no hello in time, no
        channel and nothing said for too long, a frame that never completes."""
        cfg = self.config
        for s in list(self.by_socket.values()):
            started = s.reader.incomplete_since
            if started is not None and now - started > cfg.frame_timeout_s:
                self._reject(
                    s,
                    p.ErrorCode.BAD_MESSAGE,
                    f"a frame stayed incomplete for {now - started:.0f} s "
                    f"(frame_timeout_s = {cfg.frame_timeout_s:g})",
                    close=True,
                )
            elif not s.greeted and now - s.opened_at > cfg.hello_timeout_s:
                self._reject(
                    s,
                    p.ErrorCode.BAD_MESSAGE,
                    f"no 'hello' within {cfg.hello_timeout_s:g} s of connecting (hello_timeout_s)",
                    close=True,
                )
            elif (
                s.greeted
                and s.channel is None
                and not s.opening
                and now - s.last_active > cfg.idle_timeout_s
            ):
                self._reject(
                    s,
                    p.ErrorCode.BAD_MESSAGE,
                    f"idle for {now - s.last_active:.0f} s without a channel "
                    f"(idle_timeout_s = {cfg.idle_timeout_s:g})",
                    close=True,
                )

    def end_for_channel(self, session_id: int, reason: str) -> None:
        """The serving loop dropped this session's channel: the session ends too."""
        s = self.by_id.get(session_id)
        if s is not None:
            self._reject(s, p.ErrorCode.BAD_MESSAGE, f"channel closed: {reason}", close=True)

    def flush_log(self) -> None:
        """Report the rate-limited log lines whose window has ended (and forget
        the accept rates of uids gone quiet)."""
        self._peer_log.flush()
        self.gate.forget_idle()

    def shut_down(self, reason: str) -> None:
        """Tell every client that the server stops, and close its session."""
        for s in list(self.by_socket.values()):
            self._send(s, {"type": p.MessageType.SHUTDOWN.value, "reason": reason})
            self._close_session(s, "server stopping")

    # ------------------------------------------------------------- admission
    def accept(self, listener: socket.socket) -> None:
        """Take the connections waiting (``ACCEPT_BATCH`` at most): open a
        session for each, or refuse it (``pleserver.control.connections``) before any
        session exists: a frame encoded beforehand, then close."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving the others
                self._peer_log.log("accept-failed", logging.ERROR, "accept failed: %s", exc)
                time.sleep(0.05)
                return
            pid, uid, gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            refusal = self.gate.check(uid, gid, sock, len(self.by_socket), self._of_uid.get(uid, 0))
            if refusal is not None:
                self._errors_sent[refusal.code] += 1
                self._peer_log.log(
                    f"refused ({refusal.code.name})",
                    logging.WARNING,
                    "refused connection from pid %d uid %d: %s",
                    pid,
                    uid,
                    refusal.text,
                )
                sock.setblocking(False)  # one try: the buffer of a new socket is empty
                try:
                    sock.send(refusal.frame)
                except OSError:
                    pass
                sock.close()
                continue
            session = Session(self._next_id, sock, pid, uid, gid)
            self._next_id += 1
            sock.setblocking(False)
            self.by_socket[sock] = session
            self.by_id[session.id] = session
            self._of_uid[uid] = self._of_uid.get(uid, 0) + 1
            self._selector.register(sock, selectors.EVENT_READ, session)

    # -------------------------------------------------------------- messages
    def _on_readable(self, session: Session) -> None:
        try:
            # At most one descriptor: the segment an OPEN_CHANNEL offers to
            # adopt. The kernel closes any more than fit (MSG_CTRUNC).
            data, fds, _flags, _addr = socket.recv_fds(session.sock, 65536, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close_session(session, f"socket error: {exc}")
            return
        for fd in fds:
            if session.offered_fd is not None or not session.greeted:
                os.close(fd)
                self._reject(
                    session,
                    p.ErrorCode.BAD_MESSAGE,
                    "a file descriptor came with no OPEN_CHANNEL to adopt it",
                    close=True,
                )
                return
            session.offered_fd = fd
        if not data:
            self._close_session(session, "client closed the connection")
            return
        session.last_active = time.monotonic()
        session.reader.push(data, session.last_active)
        # One frame at a time: HELLO changes the limits the next one is read
        # under. Each decodes within them, so no frame costs more than the
        # largest real message, whatever it holds.
        while session.sock in self.by_socket:
            try:
                msg = session.reader.pop(p.AFTER_HELLO if session.greeted else p.BEFORE_HELLO)
            except p.FrameError as exc:
                self._reject(session, p.ErrorCode.BAD_MESSAGE, str(exc), close=True)
                return
            if msg is None:
                return
            try:
                self._dispatch(session, msg)
            except Exception as exc:  # one client's message never takes the server down
                log.exception(
                    "session %d (%s): error handling %r", session.id, session.peer, msg.get("type")
                )
                self._reject(session, p.ErrorCode.INTERNAL, f"internal error: {exc}", close=True)

    def _dispatch(self, s: Session, msg: dict) -> None:
        kind = msg["type"]
        if kind == p.MessageType.HELLO.value:
            return self._on_hello(s, msg)
        if not s.greeted:
            return self._reject(s, p.ErrorCode.BAD_MESSAGE, f"{kind!r} before 'hello'", close=True)
        offered, s.offered_fd = s.offered_fd, None  # only the message it came with may use it
        if kind == p.MessageType.OPEN_CHANNEL.value:
            return self._on_open_channel(s, msg, offered)
        if offered is not None:
            os.close(offered)
        if kind == p.MessageType.STATS.value:
            stats = self._snapshot()
            if s.channel is None and not s.opening:  # `pleserver stats` is not a client
                stats["clients"] = max(0, stats["clients"] - 1)
            return self._send(s, {"type": p.MessageType.STATS.value, "stats": stats})
        if kind == p.MessageType.BYE.value:
            return self._close_session(s, "bye")
        self._reject(s, p.ErrorCode.BAD_MESSAGE, f"unknown message type {kind!r}")

    def _on_hello(self, s: Session, msg: dict) -> None:
        version = msg.get("version")
        if version != p.PROTOCOL_VERSION:
            return self._reject(
                s,
                p.ErrorCode.VERSION_MISMATCH,
                f"client speaks protocol {version!r}, this ple-server "
                f"{__version__} speaks {p.PROTOCOL_VERSION}; install "
                "matching pleserver versions",
                close=True,
            )
        name = msg.get("name")
        s.name = name[: p.MAX_NAME_CHARS] if isinstance(name, str) else ""
        s.greeted = True
        self._send(
            s,
            {
                "type": p.MessageType.WELCOME.value,
                "version": p.PROTOCOL_VERSION,
                "server": __version__,
                "instance": self.instance,
                "pid": os.getpid(),
                "tables": [t.spec.info() for t in self.tables],
                "features": list(p.SERVER_FEATURES),
            },
        )

    def _on_open_channel(self, s: Session, msg: dict, offered: int | None) -> None:
        """Open the session's channel: a new segment, or (``adopt``) the one
        the client offers with the message (``offered``: owned here, handed to
        the reservation, or closed)."""
        try:
            refusal = self._channel_refusal(s, msg, offered is not None)
        except BaseException:
            if offered is not None:
                os.close(offered)
            raise
        if isinstance(refusal, Refusal):
            if offered is not None:
                os.close(offered)
            return self._reject(s, refusal.code, refusal.text, refusal.close)
        s.opening = True
        s.gpu_driven = bool(msg.get("gpu_driven", False))
        s.gpu_slots = refusal.depth if s.gpu_driven else 0
        s.adopted = offered is not None
        s.reservation = Reservation(s.id, f"{self.instance}.{s.id}", refusal, adopt_fd=offered)
        self.reserver.submit(s.reservation)

    def _channel_refusal(
        self, s: Session, msg: dict, offers_segment: bool
    ) -> Refusal | p.ChannelLayout:
        """Why the channel ``msg`` asks for may not open, or its layout (whose
        bytes are then taken from the channel budget)."""
        cfg = self.config
        if s.channel is not None or s.opening:
            return Refusal(
                p.ErrorCode.CHANNEL_LIMIT, "this session already has its channel (one per session)"
            )
        adopt = msg.get("adopt", False)
        if not isinstance(adopt, bool):
            return Refusal(p.ErrorCode.BAD_MESSAGE, f"adopt must be true or false, not {adopt!r}")
        if adopt != offers_segment:
            return Refusal(
                p.ErrorCode.BAD_MESSAGE,
                "an OPEN_CHANNEL that adopts a segment comes with exactly that segment's "
                "descriptor, and only such a message carries one",
            )
        capacity, depth = (
            msg.get("capacity", cfg.default_capacity),
            msg.get("depth", cfg.default_depth),
        )
        if not (isinstance(capacity, int) and 1 <= capacity <= cfg.max_capacity):
            return Refusal(
                p.ErrorCode.CHANNEL_LIMIT,
                f"capacity {capacity!r} out of range 1..{cfg.max_capacity}",
            )
        if not (isinstance(depth, int) and 1 <= depth <= cfg.max_depth):
            return Refusal(
                p.ErrorCode.CHANNEL_LIMIT, f"depth {depth!r} out of range 1..{cfg.max_depth}"
            )
        gpu_driven = msg.get("gpu_driven", False)
        if not isinstance(gpu_driven, bool):
            return Refusal(
                p.ErrorCode.BAD_MESSAGE, f"gpu_driven must be true or false, not {gpu_driven!r}"
            )
        if adopt and not gpu_driven:
            return Refusal(
                p.ErrorCode.BAD_MESSAGE,
                "only a GPU-driven channel's segment is adopted (a CPU client opens a new "
                "channel when it reconnects)",
            )
        if gpu_driven and msg.get("rung_word") is not True:
            return Refusal(p.ErrorCode.VERSION_MISMATCH, GPU_WITHOUT_RUNG_WORD)
        if gpu_driven and (refusal := self._gpu_slots_refusal(s, depth)) is not None:
            return Refusal(p.ErrorCode.CHANNEL_LIMIT, refusal)
        layout = p.ChannelLayout(depth, capacity, max(t.row_bytes for t in self.tables))
        if layout.size > cfg.max_channel_bytes:
            return Refusal(
                p.ErrorCode.CHANNEL_LIMIT,
                f"a channel of depth {depth} × capacity {capacity} needs "
                f"{layout.size / 2**20:.0f} MiB, over max_channel_bytes "
                f"({cfg.max_channel_bytes / 2**20:.0f} MiB)",
            )
        with_channel = sum(1 for o in self.by_socket.values() if o.channel or o.opening)
        limit = self.gate.client_limit(s.uid)
        if with_channel >= limit:
            kept = (
                f"; the last {cfg.max_clients - limit} are kept for root and the server's own uid"
                if limit < cfg.max_clients
                else ""
            )
            return Refusal(
                p.ErrorCode.TOO_MANY_CLIENTS,
                f"ple-server already has {with_channel} clients "
                f"(max_clients = {cfg.max_clients}{kept}), each with its channel; "
                "close idle clients or raise max_clients",
                close=True,
            )
        if not self.budget.take(layout.size):
            return Refusal(
                p.ErrorCode.NO_RESOURCES,
                f"no memory for a channel of {layout.size / 2**20:.1f} MiB: channels hold "
                f"{self.budget.used / 2**20:.1f} MiB of the {(self.budget.limit or 0) / 2**20:.0f} "
                "MiB budget (max_channel_memory); ask for a smaller capacity or depth, "
                "wait for other clients to close, or raise max_channel_memory (and the "
                "service's MemoryMax=)",
            )
        return layout

    def _gpu_slots_refusal(self, s: Session, depth: int) -> str | None:
        """Why ``s`` may not open a GPU-driven channel of ``depth`` slots (the
        serving loop polls them: their number is bounded per uid), or None."""
        limit = self.config.max_gpu_slots_per_uid
        mine = [o for o in self.by_socket.values() if o.uid == s.uid and (o.channel or o.opening)]
        held = sum(o.gpu_slots for o in mine)
        if held + depth <= limit:
            return None
        return (
            f"uid {s.uid} holds {held} GPU-driven slots in "
            f"{sum(1 for o in mine if o.gpu_slots)} channels; {depth} more would pass "
            f"max_gpu_slots_per_uid = {limit}: close idle GPU-driven clients, ask for "
            "fewer slots, or raise max_gpu_slots_per_uid"
        )

    def on_reserved(self, job: Reservation) -> None:
        """A channel segment is ready (or could not be made): serve it, answer."""
        s = self.by_id.get(job.session_id)
        if s is not None:
            s.reservation = None
        if job.skipped:
            self.abandoned_opens += 1
        if job.error is not None or s is None:
            job.discard()
            self.budget.give_back(job.layout.size)
            if s is not None and job.error is not None:  # (s is there: the job failed)
                s.opening = False
                log.warning(
                    "session %d (%s): cannot %s its channel: %s",
                    s.id,
                    s.peer,
                    "adopt" if s.adopted else "create",
                    job.error,
                )
                code = p.ErrorCode.BAD_MESSAGE if job.refused else p.ErrorCode.NO_RESOURCES
                self._reject(s, code, job.error)
            return
        s.opening = False
        assert job.mapping is not None and job.fd is not None  # (no error: it has both)
        channel = Channel(
            s.id,
            s.peer,
            job.mapping,
            job.fd,
            on_destroy=lambda ch: self.budget.give_back(ch.size),
            admission=open_admission(job.mapping, s.gpu_driven),
        )
        try:
            self.loop.add(channel)  # served (and logged) before the client has the fd
            # An adopted segment is the client's already: requests it rang
            # before the handover are served from here on.
            client_fds = [] if s.adopted else [os.dup(job.fd)]
        except OSError as exc:  # no descriptor left (a channel needs no thread)
            self.loop.remove(channel)
            return self._reject(
                s,
                p.ErrorCode.NO_RESOURCES,
                f"cannot serve a channel now ({exc}): the server is at its "
                "descriptor limit (LimitNOFILE=); close idle clients or "
                "raise the limit",
            )
        s.channel = channel
        layout = job.layout
        log.info(
            "session %d open: %s, %schannel depth %d × capacity %d (%.1f MiB)%s",
            s.id,
            s.peer,
            "GPU-driven " if s.gpu_driven else "",
            layout.depth,
            layout.capacity,
            layout.size / 2**20,
            ", adopted: a segment it kept from an earlier server" if s.adopted else "",
        )
        self._send(
            s,
            {
                "type": p.MessageType.CHANNEL.value,
                "layout": layout.to_wire(),
                "gpu_driven": s.gpu_driven,
                "adopted": s.adopted,
            },
            fds=client_fds,
        )

    # --------------------------------------------------------------- sending
    def _send(self, s: Session, msg: dict, fds: list[int] | None = None) -> None:
        """Queue ``msg`` (``fds`` now owned by the session) and send what the
        socket takes; never blocks. A session whose replies pile up past
        ``OUTBOX_LIMIT_BYTES`` is dropped."""
        if s.sock not in self.by_socket:
            for fd in fds or ():
                os.close(fd)
            return
        data = p.encode_frame(msg)
        s.outbox.append(Outgoing(memoryview(data), list(fds or ())))
        s.outbox_bytes += len(data)
        if s.outbox_bytes > OUTBOX_LIMIT_BYTES:
            log.warning(
                "session %d (%s): dropped: %d bytes of replies it does not read (limit %d)",
                s.id,
                s.peer,
                s.outbox_bytes,
                OUTBOX_LIMIT_BYTES,
            )
            self._close_session(s, "replies not read")
            return
        self._flush(s)

    def _flush(self, s: Session) -> None:
        while s.outbox:
            out = s.outbox[0]
            try:
                if out.fds:
                    sent = socket.send_fds(s.sock, [out.data], out.fds)
                    for fd in out.fds:
                        os.close(fd)
                    out.fds = []
                else:
                    sent = s.sock.send(out.data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close_session(s, f"cannot send to client: {exc}")
                return
            out.data = out.data[sent:]
            s.outbox_bytes -= sent
            if not len(out.data):
                s.outbox.popleft()
        want = bool(s.outbox)
        if want != s.writing and s.sock in self.by_socket:
            s.writing = want
            self._selector.modify(
                s.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), s
            )

    def _reject(self, s: Session, code: p.ErrorCode, text: str, close: bool = False) -> None:
        self._errors_sent[code] += 1
        self._peer_log.log(
            f"session error ({code.name})",
            logging.WARNING,
            "session %d (%s): %s",
            s.id,
            s.peer,
            text,
        )
        self._send(s, {"type": p.MessageType.ERROR.value, "code": int(code), "message": text})
        if close:
            self._close_session(s, text)

    def _close_session(self, s: Session, why: str) -> None:
        if self.by_socket.pop(s.sock, None) is None:
            return
        self.by_id.pop(s.id, None)
        left = self._of_uid[s.uid] - 1
        if left:
            self._of_uid[s.uid] = left
        else:
            del self._of_uid[s.uid]
        try:
            self._selector.unregister(s.sock)
        except (KeyError, ValueError):
            pass
        had_channel = s.channel is not None
        if s.channel is not None:
            self.loop.remove(s.channel)
            s.channel = None
        if s.reservation is not None:  # the reserver skips it (or discards what it made)
            s.reservation.abandoned = True
            s.reservation = None
        for out in s.outbox:
            for fd in out.fds:
                os.close(fd)
        s.outbox.clear()
        if s.offered_fd is not None:
            os.close(s.offered_fd)
            s.offered_fd = None
        s.sock.close()
        # Sessions that never opened a channel (`pleserver stats`, probes) close
        # at DEBUG: `pleserver stats --watch` must not log a line per poll.
        log.log(
            logging.INFO if had_channel else logging.DEBUG,
            "session %d closed: %s, %.1f s, %s",
            s.id,
            s.peer,
            time.monotonic() - s.opened_at,
            why,
        )
