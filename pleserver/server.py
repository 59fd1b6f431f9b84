"""The ple-server process: lifecycle, control socket, sessions and channels.

Everything about the process's life is here, in ``Server``: start (tables,
stale-name cleanup, channel memory budget, socket, serving loop, reservers,
prewarm, hot set, readiness), one ``handle_<signal>`` method per signal, the
control loop (a selector over the listening socket, the sessions and a wake-up
pipe for signals and for the serving and reserver threads), and stop. The data
plane lives in ``pleserver.serving``; its parts (files, row cache, miss engine,
tables) in ``pleserver.dataplane``; the hot set in ``pleserver.hotset``;
channel segments in ``pleserver.segments``.

The control loop never waits on one peer: replies go through a per-session
outbox on non-blocking sockets; channel segments are reserved off this thread;
deadlines (hello, idle without a channel, incomplete frame) are checked every
``HOUSEKEEPING_S``; log lines a peer can trigger at will are rate-limited.

Access model (see docs/SECURITY.md):
- who may connect: the peer's SO_PEERCRED uid/gids against ``allow_uids`` /
  ``allow_gids`` (the server's own uid and root always may);
- a session's segment is a memfd: it never has a name another process could
  open; its file descriptor goes to the peer alone (SCM_RIGHTS); its size is
  sealed, so the peer cannot shrink it under the server's mapping; its
  semaphores are unnamed and live inside it.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import signal
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pleclient import protocol as p
from pleclient.checkpoint import discover_tables
from pleserver import __version__
from pleserver.budget import ChannelBudget, default_channel_budget
from pleserver.config import ServerConfig
from pleserver.dataplane import DataPlane, PlaneOptions
from pleserver.hotset import HotSet
from pleserver.lograte import RateLimitedLog
from pleserver.memory import memory_room
from pleserver.prewarm import Prewarm
from pleserver.segments import Reservation, Reserver
from pleserver.serving import Channel, ServingLoop
from pleserver.stats import RateMeter, TableStats, format_bytes, format_progress, io_snapshot
from pleserver.systemd import Notifier, watchdog_interval
from pleserver.table import Table

if TYPE_CHECKING:
    from pleserver.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

RESIDENCY_CACHE_S = 2.0
OUTBOX_LIMIT_BYTES = 1 << 20
"""Replies queued for a session that does not read them, at most; past this the
session is dropped (a STATS reply is a few KiB)."""
HOUSEKEEPING_S = 0.25
"""The control loop checks deadlines (hello, idle, frame) at least this often."""


@dataclass(eq=False)
class Outgoing:
    """A frame (or what is left of it) waiting to be sent, and the descriptors
    that go with its first byte (owned here until sent)."""

    data: memoryview
    fds: list[int]


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
    opened_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)  # last frame received
    outbox: deque[Outgoing] = field(default_factory=deque)
    outbox_bytes: int = 0
    writing: bool = False  # the selector watches it for EVENT_WRITE too

    @property
    def peer(self) -> str:
        return f"pid {self.pid} uid {self.uid}" + (f" ({self.name})" if self.name else "")


class StartupError(RuntimeError):
    """The server cannot start; the message says why and what to do."""


class Server:
    def __init__(self, config: ServerConfig, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.instance = f"{p.NAME_PREFIX}.{os.getpid()}"
        self.started = time.monotonic()
        self.sessions: dict[socket.socket, Session] = {}
        self.by_id: dict[int, Session] = {}
        self._next_session = 1
        self._stopping = False
        self._stop_reason = ""
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._residency: tuple[float, list[float | None]] = (0.0, [])
        self.tables: list[Table] = []
        self.plane: DataPlane | None = None
        self.loop: ServingLoop | None = None
        self.prewarm: Prewarm | None = None
        self.hotset: HotSet | None = None
        self.metrics: MetricsEndpoint | None = None
        self.budget = ChannelBudget(None)
        self.reserver = Reserver(self._wake)
        self._dropped: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._peer_log = RateLimitedLog(log)
        self._serving_status = ""

    # ------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop cleanly. Returns the exit code."""
        try:
            self.start()
        except StartupError as exc:
            log.error("%s", exc)
            self.close_resources()
            return 2
        try:
            self.control_loop()
        finally:
            self.stop()
        return 0

    def start(self) -> None:
        cfg = self.config
        if cfg.model and os.path.isdir(cfg.model) and not os.access(cfg.model, os.R_OK | os.X_OK):
            raise StartupError(f"cannot read the model directory {cfg.model} (Permission "
                               f"denied for uid {os.geteuid()}): let the server's user read "
                               "it and its files")
        specs = discover_tables(cfg.model) if cfg.model else []
        if not specs:
            raise StartupError("no model directory given: pass --model DIR (or `model` in "
                               "the config file)")
        self.plane = DataPlane.open(specs, PlaneOptions.from_config(cfg))
        self.tables = self.plane.tables
        self.table_stats = [TableStats(t.spec.name, t.spec.layer) for t in self.tables]
        self._miss_rates = [RateMeter() for _ in self.tables]
        for t in self.tables:
            s = t.spec
            log.info("table %s: layer %d, %d rows × %d %s (%d B/row), %d shards, %s, "
                     "fingerprint %s", s.name, s.layer, s.rows, s.cols, s.dtype, s.row_bytes,
                     s.parts, format_bytes(s.nbytes), s.fingerprint)
        if cfg.metrics_address:  # before the socket: a bad address fails the start cleanly
            from pleserver.metrics import MetricsEndpoint, MetricsError
            self.metrics = MetricsEndpoint(cfg.metrics_address, self.snapshot)
            try:
                self.metrics.start()
            except MetricsError as exc:
                self.metrics = None
                raise StartupError(str(exc)) from None
        self._set_budget()
        interval = cfg.watchdog_s or watchdog_interval()
        self.loop = ServingLoop(self.tables, self.table_stats, cfg.spin_us * 1e-6,
                                heartbeat=self.notifier.watchdog if interval else None,
                                heartbeat_every_s=min(interval or 1.0, 1.0),
                                chunk_rows=cfg.chunk_rows, on_drop=self._on_channel_dropped,
                                workers=cfg.gather_workers)
        try:
            self.loop.start()
            self.reserver.start()
        except RuntimeError as exc:  # no thread to be had: at a task limit already
            raise StartupError(f"cannot start the serving threads ({exc}): the service is "
                               "at its task limit (TasksMax=, ulimit -u); raise it") from None
        self._listen()
        for signum, handler in ((signal.SIGTERM, self.handle_sigterm),
                                (signal.SIGINT, self.handle_sigint),
                                (signal.SIGHUP, self.handle_sighup)):
            signal.signal(signum, handler)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._serving_status = f"serving {len(self.tables)} tables on {cfg.socket}"
        log.info("ple-server %s ready: %s", __version__, self._serving_status)
        self.notifier.ready(self._serving_status)
        # After READY=1, as documented: a unit ordered after ple-server starts
        # at once, while the tables are read into the page cache (or the row
        # cache is refilled from the hot set).
        if cfg.prewarm == "full" and self.plane.mode != "mmap":
            log.info("prewarm = full applies to io = mmap; with io = %s the row cache is "
                     "refilled from the saved hot set instead", self.plane.mode)
        elif cfg.prewarm == "full":
            self.prewarm = Prewarm(self.tables, cfg.prewarm_budget, cfg.prewarm_reserve)
            self.prewarm.on_progress = self._report_prewarm
            self.prewarm.start()
        if self.plane.cache is not None:
            if os.path.isdir(cfg.state_dir):
                self.hotset = HotSet(cfg.state_dir, self.tables, self.plane.cache,
                                     cfg.hotset_save_interval, self._report_hotset)
                self.hotset.start()
            else:
                log.info("state_dir %s does not exist: the hot set is neither saved nor "
                         "restored (the unit's StateDirectory= creates it)", cfg.state_dir)

    def _set_budget(self) -> None:
        cfg = self.config
        if cfg.max_channel_memory is not None:
            self.budget = ChannelBudget(cfg.max_channel_memory)
            log.info("channel memory budget: %.0f MiB (max_channel_memory)",
                     cfg.max_channel_memory / 2**20)
            return
        room = memory_room()
        pending = 0
        if self.plane is not None and self.plane.cache is not None:
            committed = self.plane.cache.stats().get("populated_bytes", 0)
            pending = max(0, self.plane.budget.cache_bytes - committed)
        limit = default_channel_budget(room, pending)
        self.budget = ChannelBudget(limit)
        if limit is None:
            log.warning("channel memory budget: none (%s); set max_channel_memory",
                        room.describe())
        else:
            beside = f", less the row cache's {pending / 2**20:.0f} MiB to come" if pending else ""
            log.info("channel memory budget: %.0f MiB, 3/4 of the room at start (%s%s); "
                     "max_channel_memory overrides it", limit / 2**20, room.describe(), beside)

    def _listen(self) -> None:
        path = self.config.socket
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise StartupError(f"{path} exists and is not a socket; ple-server removes only "
                               "stale sockets: move it away or choose another --socket")
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s (no server listens on it)", path)
                os.unlink(path)
            except OSError as exc:
                raise StartupError(f"socket path {path} exists and cannot be probed ({exc}); "
                                   "remove it or choose another --socket") from None
            else:
                raise StartupError(f"socket {path} is in use by a live ple-server; stop it "
                                   "first (`systemctl stop ple-server`) or choose another "
                                   "--socket")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            raise StartupError(f"cannot bind {path}: {exc.strerror}; check that the "
                               "directory exists and this user may write it") from None
        os.chmod(path, self.config.socket_mode)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "accept")

    def handle_sigterm(self, signum, frame) -> None:
        self.request_stop("SIGTERM")

    def handle_sigint(self, signum, frame) -> None:
        self.request_stop("SIGINT")

    def handle_sighup(self, signum, frame) -> None:
        log.info("SIGHUP: configuration reload is not supported; restart the service "
                 "to apply changes")

    def request_stop(self, reason: str) -> None:
        self._stopping = True
        self._stop_reason = reason
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def stop(self) -> None:
        """Stop accepting, finish in-flight requests, tell clients, free everything."""
        log.info("stopping (%s): finishing in-flight requests", self._stop_reason or "exit")
        self.notifier.stopping()
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket)
            except FileNotFoundError:
                pass
        if self.loop is not None:
            self.loop.stop()
        for job in self.reserver.stop():
            job.discard()
            self.budget.give_back(job.layout.size)
        for session in list(self.sessions.values()):
            self._send(session, {"type": p.MessageType.SHUTDOWN.value,
                                 "reason": self._stop_reason or "server stopping"})
            self._close_session(session, "server stopping")
        self.close_resources()
        signal.set_wakeup_fd(-1)
        log.info("stopped")

    def close_resources(self) -> None:
        if self.loop is not None and self.loop.thread.is_alive():  # a start that failed
            self.loop.stop()
        for job in self.reserver.stop():
            job.discard()
        if self.prewarm is not None:
            self.prewarm.stop()
        if self.hotset is not None:
            self.hotset.stop()  # saves the hot set (the cache is still open)
        if self.metrics is not None:
            self.metrics.stop()
        if self.plane is not None:
            self.plane.close()
            self.plane = None

    # ---------------------------------------------------------- control loop
    def control_loop(self) -> None:
        next_check = 0.0
        while not self._stopping:
            for key, events in self._selector.select(timeout=HOUSEKEEPING_S):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                else:
                    session = key.data
                    if events & selectors.EVENT_WRITE:
                        self._flush(session)
                    if events & selectors.EVENT_READ and session.sock in self.sessions:
                        self._on_readable(session)
            self._collect_reservations()
            self._collect_dropped()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + HOUSEKEEPING_S
                self._check_deadlines(now)
                self._peer_log.flush()

    def _wake(self) -> None:
        """Wake the control loop (from another thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full: it is awake already
            pass

    def _accept(self) -> None:
        if self._listener is None:
            return
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and friends: keep serving the others
            self._peer_log.log("accept-failed", logging.ERROR, "accept failed: %s", exc)
            time.sleep(0.05)
            return
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        session = Session(self._next_session, sock, pid, uid, gid)
        self._next_session += 1
        reason = self._refusal(session)
        if reason:
            code, text = reason
            self._peer_log.log(f"refused ({code.name})", logging.WARNING,
                               "refused connection from %s: %s", session.peer, text)
            sock.setblocking(False)  # one try: the buffer of a new socket is empty
            try:
                sock.send(p.encode_frame({"type": p.MessageType.ERROR.value,
                                          "code": int(code), "message": text}))
            except OSError:
                pass
            sock.close()
            return
        sock.setblocking(False)
        self.sessions[sock] = session
        self.by_id[session.id] = session
        self._selector.register(sock, selectors.EVENT_READ, session)

    def _refusal(self, s: Session) -> tuple[p.ErrorCode, str] | None:
        cfg = self.config
        if not (s.uid in (0, os.geteuid()) or s.uid in cfg.allow_uids
                or (cfg.allow_gids and set(cfg.allow_gids) & _groups_of(s.pid, s.gid))):
            return (p.ErrorCode.NOT_ALLOWED,
                    f"uid {s.uid} (pid {s.pid}) may not use this ple-server; add the uid "
                    "to allow_uids or one of its groups to allow_gids in the server config")
        # One session beyond max_clients, so that `pleserver stats` gets in when
        # every client slot is taken; only max_clients of them may open channels.
        if len(self.sessions) >= cfg.max_clients + 1:
            return (p.ErrorCode.TOO_MANY_CLIENTS,
                    f"ple-server already has {len(self.sessions)} sessions (max_clients = "
                    f"{cfg.max_clients}, plus one for `pleserver stats`); close idle "
                    "clients or raise max_clients")
        return None

    def _on_readable(self, session: Session) -> None:
        try:
            data = session.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close_session(session, f"socket error: {exc}")
            return
        if not data:
            self._close_session(session, "client closed the connection")
            return
        session.last_active = time.monotonic()
        try:
            messages = session.reader.feed(
                data, session.last_active,
                p.MAX_FRAME_BYTES if session.greeted else p.MAX_HELLO_FRAME_BYTES)
        except p.FrameError as exc:
            self._reject(session, p.ErrorCode.BAD_MESSAGE, str(exc), close=True)
            return
        for msg in messages:
            if session.sock not in self.sessions:
                return
            try:
                self._dispatch(session, msg)
            except Exception as exc:  # one client's message never takes the server down
                log.exception("session %d (%s): error handling %r", session.id,
                              session.peer, msg.get("type"))
                self._reject(session, p.ErrorCode.INTERNAL, f"internal error: {exc}",
                             close=True)

    def _check_deadlines(self, now: float) -> None:
        """Close sessions that hold a slot without using it: no hello in time, no
        channel and nothing said for too long, a frame that never completes."""
        cfg = self.config
        for s in list(self.sessions.values()):
            started = s.reader.incomplete_since
            if started is not None and now - started > cfg.frame_timeout_s:
                self._reject(s, p.ErrorCode.BAD_MESSAGE,
                             f"a frame stayed incomplete for {now - started:.0f} s "
                             f"(frame_timeout_s = {cfg.frame_timeout_s:g})", close=True)
            elif not s.greeted and now - s.opened_at > cfg.hello_timeout_s:
                self._reject(s, p.ErrorCode.BAD_MESSAGE,
                             f"no 'hello' within {cfg.hello_timeout_s:g} s of connecting "
                             "(hello_timeout_s)", close=True)
            elif (s.greeted and s.channel is None and not s.opening
                    and now - s.last_active > cfg.idle_timeout_s):
                self._reject(s, p.ErrorCode.BAD_MESSAGE,
                             f"idle for {now - s.last_active:.0f} s without a channel "
                             f"(idle_timeout_s = {cfg.idle_timeout_s:g})", close=True)

    def _dispatch(self, s: Session, msg: dict) -> None:
        kind = msg["type"]
        if kind == p.MessageType.HELLO.value:
            return self._on_hello(s, msg)
        if not s.greeted:
            return self._reject(s, p.ErrorCode.BAD_MESSAGE,
                                f"{kind!r} before 'hello'", close=True)
        if kind == p.MessageType.OPEN_CHANNEL.value:
            return self._on_open_channel(s, msg)
        if kind == p.MessageType.STATS.value:
            return self._send(s, {"type": p.MessageType.STATS.value, "stats": self.snapshot()})
        if kind == p.MessageType.BYE.value:
            return self._close_session(s, "bye")
        self._reject(s, p.ErrorCode.BAD_MESSAGE, f"unknown message type {kind!r}")

    def _on_hello(self, s: Session, msg: dict) -> None:
        version = msg.get("version")
        if version != p.PROTOCOL_VERSION:
            return self._reject(s, p.ErrorCode.VERSION_MISMATCH,
                                f"client speaks protocol {version!r}, this ple-server "
                                f"{__version__} speaks {p.PROTOCOL_VERSION}; install "
                                "matching pleserver versions", close=True)
        name = msg.get("name")
        s.name = name[:64] if isinstance(name, str) else ""
        s.greeted = True
        self._send(s, {"type": p.MessageType.WELCOME.value, "version": p.PROTOCOL_VERSION,
                       "server": __version__, "instance": self.instance, "pid": os.getpid(),
                       "tables": [t.spec.info() for t in self.tables]})

    def _on_open_channel(self, s: Session, msg: dict) -> None:
        cfg = self.config
        if s.channel is not None or s.opening:
            return self._reject(s, p.ErrorCode.CHANNEL_LIMIT,
                                "this session already has its channel (one per session)")
        capacity, depth = msg.get("capacity", cfg.default_capacity), \
            msg.get("depth", cfg.default_depth)
        if not (isinstance(capacity, int) and 1 <= capacity <= cfg.max_capacity):
            return self._reject(s, p.ErrorCode.CHANNEL_LIMIT,
                                f"capacity {capacity!r} out of range 1..{cfg.max_capacity}")
        if not (isinstance(depth, int) and 1 <= depth <= cfg.max_depth):
            return self._reject(s, p.ErrorCode.CHANNEL_LIMIT,
                                f"depth {depth!r} out of range 1..{cfg.max_depth}")
        layout = p.ChannelLayout(depth, capacity, max(t.row_bytes for t in self.tables))
        if layout.size > cfg.max_channel_bytes:
            return self._reject(s, p.ErrorCode.CHANNEL_LIMIT,
                                f"a channel of depth {depth} × capacity {capacity} needs "
                                f"{layout.size / 2**20:.0f} MiB, over max_channel_bytes "
                                f"({cfg.max_channel_bytes / 2**20:.0f} MiB)")
        with_channel = sum(1 for o in self.sessions.values() if o.channel or o.opening)
        if with_channel >= cfg.max_clients:
            return self._reject(s, p.ErrorCode.TOO_MANY_CLIENTS,
                                f"ple-server already has {with_channel} clients "
                                f"(max_clients = {cfg.max_clients}), each with its channel; "
                                "close idle clients or raise max_clients", close=True)
        if not self.budget.take(layout.size):
            return self._reject(
                s, p.ErrorCode.NO_RESOURCES,
                f"no memory for a channel of {layout.size / 2**20:.1f} MiB: channels hold "
                f"{self.budget.used / 2**20:.1f} MiB of the {(self.budget.limit or 0) / 2**20:.0f} "
                "MiB budget (max_channel_memory); ask for a smaller capacity or depth, "
                "wait for other clients to close, or raise max_channel_memory (and the "
                "service's MemoryMax=)")
        s.opening = True
        self.reserver.submit(Reservation(s.id, f"{self.instance}.{s.id}", layout))

    def _collect_reservations(self) -> None:
        while not self.reserver.results.empty():
            self._on_reserved(self.reserver.results.get_nowait())

    def _on_reserved(self, job: Reservation) -> None:
        """A channel segment is ready (or could not be made): serve it, answer."""
        s = self.by_id.get(job.session_id)
        if job.error is not None or s is None:
            job.discard()
            self.budget.give_back(job.layout.size)
            if s is not None and job.error is not None:  # (s is there: the job failed)
                s.opening = False
                log.warning("session %d (%s): cannot create its channel: %s", s.id, s.peer,
                            job.error)
                self._reject(s, p.ErrorCode.NO_RESOURCES, job.error)
            return
        s.opening = False
        # A job without an error has its mapping and fd; a session with a channel, a loop.
        assert job.mapping is not None and job.fd is not None and self.loop is not None
        channel = Channel(s.id, s.peer, job.mapping, job.fd,
                          on_destroy=lambda ch: self.budget.give_back(ch.size))
        try:
            self.loop.add(channel)  # served (and logged) before the client has the fd
            client_fd = os.dup(job.fd)
        except (RuntimeError, OSError) as exc:  # no thread or no descriptor left
            if channel in self.loop.channels:
                self.loop.remove(channel)
            else:
                channel.destroy()
            return self._reject(s, p.ErrorCode.NO_RESOURCES,
                                f"cannot serve a channel now ({exc}): the server is at its "
                                "thread or descriptor limit (TasksMax=, LimitNOFILE=); "
                                "close idle clients or raise the limit")
        s.channel = channel
        layout = job.layout
        log.info("session %d open: %s, channel depth %d × capacity %d (%.1f MiB)", s.id,
                 s.peer, layout.depth, layout.capacity, layout.size / 2**20)
        self._send(s, {"type": p.MessageType.CHANNEL.value, "layout": layout.to_wire()},
                   fds=[client_fd])

    def _on_channel_dropped(self, channel: Channel, reason: str) -> None:
        """(serving thread) A channel broke the protocol: its session must end."""
        self._dropped.put((channel.session_id, reason))
        self._wake()

    def _collect_dropped(self) -> None:
        while not self._dropped.empty():
            session_id, reason = self._dropped.get_nowait()
            s = self.by_id.get(session_id)
            if s is not None:
                self._reject(s, p.ErrorCode.BAD_MESSAGE,
                             f"channel closed: {reason}", close=True)

    # ---------------------------------------------------------------- sending
    def _send(self, s: Session, msg: dict, fds: list[int] | None = None) -> None:
        """Queue ``msg`` (``fds`` now owned by the session) and send what the
        socket takes; never blocks. A session whose replies pile up past
        ``OUTBOX_LIMIT_BYTES`` is dropped."""
        if s.sock not in self.sessions:
            for fd in fds or ():
                os.close(fd)
            return
        data = p.encode_frame(msg)
        s.outbox.append(Outgoing(memoryview(data), list(fds or ())))
        s.outbox_bytes += len(data)
        if s.outbox_bytes > OUTBOX_LIMIT_BYTES:
            log.warning("session %d (%s): dropped: %d bytes of replies it does not read "
                        "(limit %d)", s.id, s.peer, s.outbox_bytes, OUTBOX_LIMIT_BYTES)
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
        if want != s.writing and s.sock in self.sessions:
            s.writing = want
            self._selector.modify(s.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if want else 0), s)

    def _reject(self, s: Session, code: p.ErrorCode, text: str, close: bool = False) -> None:
        self._peer_log.log(f"session error ({code.name})", logging.WARNING,
                           "session %d (%s): %s", s.id, s.peer, text)
        self._send(s, {"type": p.MessageType.ERROR.value, "code": int(code), "message": text})
        if close:
            self._close_session(s, text)

    def _close_session(self, s: Session, why: str) -> None:
        if self.sessions.pop(s.sock, None) is None:
            return
        self.by_id.pop(s.id, None)
        try:
            self._selector.unregister(s.sock)
        except (KeyError, ValueError):
            pass
        had_channel = s.channel is not None
        if s.channel is not None:
            assert self.loop is not None  # a channel is only ever added to a loop
            self.loop.remove(s.channel)
            s.channel = None
        for out in s.outbox:
            for fd in out.fds:
                os.close(fd)
        s.outbox.clear()
        s.sock.close()
        # Sessions that never opened a channel (`pleserver stats`, probes) close
        # at DEBUG: `pleserver stats --watch` must not log a line per poll.
        log.log(logging.INFO if had_channel else logging.DEBUG,
                "session %d closed: %s, %.1f s, %s", s.id, s.peer,
                time.monotonic() - s.opened_at, why)

    # ----------------------------------------------------------------- stats
    def snapshot(self) -> dict:
        """Every number `pleserver stats` and the metrics endpoint show."""
        now = time.monotonic()
        if now - self._residency[0] > RESIDENCY_CACHE_S:
            fractions: list[float | None] = []
            for t in self.tables:
                try:
                    resident: float | None = t.resident_bytes()
                except OSError:
                    resident = None
                fractions.append(None if resident is None else
                                 resident / t.spec.nbytes if t.spec.nbytes else 1.0)
            self._residency = (now, fractions)
        tables = []
        for t, st, resident, rate in zip(self.tables, self.table_stats, self._residency[1],
                                         self._miss_rates, strict=True):
            snap = st.snapshot()
            source = t.source.stats()
            snap.update(dtype=t.spec.dtype, rows_total=t.spec.rows, cols=t.spec.cols,
                        row_bytes=t.row_bytes, table_bytes=t.spec.nbytes,
                        fingerprint=t.spec.fingerprint, resident_fraction=resident,
                        io_mode=t.mode,
                        io=io_snapshot(source, rate.rate(source.get("misses", 0), now)))
            tables.append(snap)
        return {"pid": os.getpid(), "version": __version__, "model": self.config.model,
                "socket": self.config.socket, "uptime_s": now - self.started,
                "clients": len(self.sessions),
                "channels": self.loop.channel_count if self.loop else 0,
                "prewarm": self.prewarm.snapshot() if self.prewarm else None,
                "dataplane": self.plane.snapshot() if self.plane else None,
                "hotset": self.hotset.snapshot() if self.hotset else None,
                "tables": tables}

    def _report_prewarm(self, prewarm: Prewarm) -> None:
        # STATUS= replaces the whole line: keep what is served in front.
        self.notifier.status(f"{self._serving_status}; prewarm {prewarm.state}: "
                             + format_progress(prewarm.done_bytes, prewarm.target,
                                               prewarm.fraction))

    def _report_hotset(self, hotset: HotSet) -> None:
        if hotset.state in ("none", "ignored"):
            return
        self.notifier.status(f"{self._serving_status}; hot set refill {hotset.state}: "
                             f"{100 * hotset.fraction:.1f}% ({hotset.done_rows} of "
                             f"{hotset.target_rows} rows)")


def _groups_of(pid: int, gid: int) -> set[int]:
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
