"""The ple-server process: its lifecycle, in one class.

Everything about the process's life is here, in ``Server``: start (tables,
metrics endpoint, channel memory budget, serving loop and reservers, control
socket — a stale one of a dead server replaced —, readiness, then prewarm or
the hot set's refill), one ``handle_<signal>`` method per signal, the control
loop (a selector over the listening socket, the sessions and a wake-up pipe
for signals and for the serving and reserver threads), configuration reloads
(SIGHUP: ``reload``; ``pleserver.control.reload`` decides what a reload may change),
and stop. What the control loop hears from clients goes to
``pleserver.control.sessions`` (the sessions
and the control protocol); the data plane lives in ``pleserver.data.serving``; its
parts (files, row cache, miss engine, tables) in ``pleserver.data.plane``; the
hot set in ``pleserver.data.hotset``; prewarm in ``pleserver.data.prewarm``; channel
segments in ``pleserver.control.segments``.

The control loop never waits on one peer (``pleserver.control.sessions`` says how)
and wakes at least every ``HOUSEKEEPING_S`` to close sessions past their
deadlines.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import signal
import socket
import stat
import time
from typing import TYPE_CHECKING

from pleclient import protocol as p
from pleclient.checkpoint import discover_tables, local_model_dir
from pleserver import __version__
from pleserver.config import SETTINGS, ConfigError, ServerConfig, parse_host_port
from pleserver.control.connections import listen_backlog
from pleserver.control.reload import (
    Change,
    ConfigSource,
    ReloadError,
    ReloadState,
    config_report,
    count,
    diff,
)
from pleserver.control.segments import Reserver
from pleserver.control.sessions import Sessions
from pleserver.data.admission import DoorbellAdmission
from pleserver.data.budget import ChannelBudget, default_channel_budget, overcommitted
from pleserver.data.hints import no_table_hints
from pleserver.data.hotset import HotSet, StateDirError
from pleserver.data.plane import DataPlane, PlaneOptions
from pleserver.data.prewarm import Prewarm, resident_bytes
from pleserver.data.serving import POLL_S, Channel, ServingLoop
from pleserver.data.tables import MappedTable, Table
from pleserver.host import memory_room
from pleserver.observe import logs
from pleserver.observe.health import HealthSocket, HealthSocketError
from pleserver.observe.snapshot import Snapshot, TableSnapshot
from pleserver.observe.stats import (
    RateMeter,
    TableStats,
    format_bytes,
    format_progress,
    io_snapshot,
)
from pleserver.ops.systemd import Notifier, watchdog_interval

if TYPE_CHECKING:
    from pleserver.observe.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

RESIDENCY_CACHE_S = 2.0
HOUSEKEEPING_S = 0.25
"""The control loop checks deadlines (hello, idle, frame) at least this often."""
HEALTH_STALE_S = 15.0
"""``/healthz`` fails once the serving or the control loop has not run for this
long (the serving loop beats at least once a second, the control loop four
times): the process is wedged, and a restart is what helps."""


class StartupError(RuntimeError):
    """The server cannot start; the message says why and what to do."""


class Server:
    """The process, from start to stop (the module docstring lists the steps)."""

    def __init__(
        self,
        config: ServerConfig,
        notifier: Notifier | None = None,
        source: ConfigSource | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        # Where ``config`` came from, for reloads (None: made in-process, no
        # file to read again).
        self.source = source
        self.reload_state = ReloadState(loaded_unix=time.time())
        self._reload_requested = False  # set by SIGHUP's handler, taken by the control loop
        self._socket_ino = 0  # the control socket file's inode, once bound
        self._config_report = config_report(source or ConfigSource(), config, self.reload_state)
        self.instance = f"{p.NAME_PREFIX}.{os.getpid()}"
        self.started = time.monotonic()
        self.sessions: Sessions | None = None  # from start() on
        self._stopping = False
        self._stop_reason = ""
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._residency: tuple[float, list[float | None]] = (0.0, [])
        self.tables: list[Table] = []
        self.plane: DataPlane | None = None
        self.loop: ServingLoop | None = None
        self._serving_stopped = False  # (_stop_serving ran)
        self.prewarm: Prewarm | None = None
        self.hotset: HotSet | None = None
        self.metrics: MetricsEndpoint | None = None
        self.health: HealthSocket | None = None
        self.budget = ChannelBudget(None)
        self.reserver = Reserver(self._wake)
        self._dropped: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._serving_status = ""
        self._ready = False  # READY=1 sent, not stopping: /readyz
        self._watchdog = False  # the serving loop's beat pings systemd's watchdog
        self._loop_beat = self._control_beat = 0.0  # when each loop last ran: /healthz

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
        """Bring the process up, in this order (a step that fails raises
        StartupError, and ``run`` closes what the steps before it opened)."""
        self._open_tables()
        self._start_metrics()  # before the socket: a bad address fails the start cleanly
        self._start_health()
        self._set_budget()
        self._start_serving()
        self._open_sessions()
        self._listen()
        self._handle_signals()
        self._announce_ready()
        # After READY=1, as documented: a unit ordered after ple-server starts
        # at once, while the tables are read into the page cache (or the row
        # cache is refilled from the hot set).
        self._start_prewarm()
        self._start_hotset()

    def _open_tables(self) -> None:
        """Discover and validate the checkpoint's tables, open the data plane
        over them, log each table."""
        cfg = self.config
        if cfg.model and (snapshot := local_model_dir(cfg.model)) != cfg.model:
            log.info(
                "model %s: its snapshot %s in the local Hugging Face cache", cfg.model, snapshot
            )
        specs = discover_tables(cfg.model) if cfg.model else []
        if not specs:
            raise StartupError(
                "no model directory given: pass --model DIR (or `model` in the config file)"
            )
        self.plane = DataPlane.open(specs, PlaneOptions.from_config(cfg))
        self.tables = self.plane.tables
        self.table_stats = [TableStats(t.spec.name, t.spec.layer) for t in self.tables]
        self._miss_rates = [RateMeter() for _ in self.tables]
        for t in self.tables:
            s = t.spec
            log.info(
                "table %s: layer %d, %d rows × %d %s (%d B/row), %d shards, %s, fingerprint %s",
                s.name,
                s.layer,
                s.rows,
                s.cols,
                s.dtype,
                s.row_bytes,
                s.parts,
                format_bytes(s.nbytes),
                s.fingerprint,
            )

    def _start_metrics(self) -> None:
        """The metrics endpoint, when ``metrics_address`` asks for one."""
        cfg = self.config
        if not cfg.metrics_address:
            return
        from pleserver.observe.metrics import MetricsEndpoint, MetricsError

        try:
            self.metrics = MetricsEndpoint(
                cfg.metrics_address,
                self.snapshot,
                alive=self.alive,
                ready=self.ready,
                max_connections=cfg.metrics_max_connections,
                timeout_s=cfg.metrics_timeout_s,
            )
            self.metrics.start()
        except MetricsError as exc:
            self.metrics = None
            raise StartupError(str(exc)) from None

    def _start_health(self) -> None:
        """The health socket, when ``health_socket`` asks for one: the exec
        probes' way to /healthz and /readyz, which no other uid can reach."""
        if not self.config.health_socket:
            return
        health = HealthSocket(
            self.config.health_socket, {"/healthz": self.alive, "/readyz": self.ready}
        )
        try:
            health.start()
        except HealthSocketError as exc:
            raise StartupError(str(exc)) from None
        self.health = health

    def _start_serving(self) -> None:
        """The serving loop (its heartbeat pings systemd's watchdog when the
        unit has one) and the reservers of channel segments; log how the
        loop waits when idle."""
        cfg = self.config
        interval = cfg.watchdog_s or watchdog_interval()
        self._watchdog = bool(interval)
        try:
            self.loop = ServingLoop.from_config(
                self.tables,
                self.table_stats,
                cfg,
                hint_cache_rows=(
                    self.plane.cache.capacity_rows
                    if self.plane is not None and self.plane.cache is not None
                    else 0
                ),
                heartbeat=self._loop_heartbeat,
                heartbeat_every_s=min(interval or 1.0, 1.0),
                on_drop=self._on_channel_dropped,
            )
        except ValueError as exc:  # idle_wait = futex_waitv on a kernel without it
            raise StartupError(str(exc)) from None
        log.info(
            "serving loop: spins %d µs after a request, then %s",
            cfg.spin_us,
            "sleeps on every channel at once (futex_waitv)"
            if self.loop.idle_wait == "futex_waitv"
            else f"polls the channels every {POLL_S * 1e3:.1f} ms (idle_wait = {cfg.idle_wait}"
            + (": futex_waitv unavailable)" if cfg.idle_wait == "auto" else ")"),
        )
        try:
            self.loop.start()
            self.reserver.start()
        except RuntimeError as exc:  # no thread to be had: at a task limit already
            raise StartupError(
                f"cannot start the serving threads ({exc}): the service is "
                "at its task limit (TasksMax=, ulimit -u); raise it"
            ) from None

    def _open_sessions(self) -> None:
        """The control sessions, over the loop, the budget and the reservers."""
        assert self.loop is not None  # (_start_serving made it)
        self.sessions = Sessions(
            self.config,
            self._selector,
            self.instance,
            self.tables,
            self.loop,
            self.budget,
            self.reserver,
            self.snapshot,
        )

    def _handle_signals(self) -> None:
        """One ``handle_<signal>`` per signal; the wake-up pipe carries them
        (and other threads' wake-ups) into the control loop."""
        for signum, handler in (
            (signal.SIGTERM, self.handle_sigterm),
            (signal.SIGINT, self.handle_sigint),
            (signal.SIGHUP, self.handle_sighup),
        ):
            signal.signal(signum, handler)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    def _announce_ready(self) -> None:
        """Log readiness and tell systemd (READY=1); ``/readyz`` says ready."""
        self._serving_status = f"serving {len(self.tables)} tables on {self.config.socket}"
        log.info("ple-server %s ready: %s", __version__, self._serving_status)
        # Ready before READY=1: whoever saw READY=1 finds /readyz true.
        self._ready = True
        self.notifier.ready(self._serving_status)

    def _start_prewarm(self) -> None:
        """``prewarm = full`` in mmap mode: read the tables into the page cache
        (other modes refill the row cache from the hot set instead)."""
        cfg = self.config
        assert self.plane is not None  # (_open_tables opened it)
        if cfg.prewarm == "full" and self.plane.mode != "mmap":
            log.info(
                "prewarm = full applies to io = mmap; with io = %s the row cache is "
                "refilled from the saved hot set instead",
                self.plane.mode,
            )
        elif cfg.prewarm == "full":
            mapped = [t for t in self.tables if isinstance(t, MappedTable)]
            self.prewarm = Prewarm(mapped, cfg.prewarm_budget, cfg.prewarm_reserve)
            self.prewarm.on_progress = self._report_prewarm
            self.prewarm.start()

    def _start_hotset(self) -> None:
        """With a row cache: the hot set, saved to ``state_dir`` and refilled
        from it, when that directory can be used."""
        cfg = self.config
        assert self.plane is not None  # (_open_tables opened it)
        if self.plane.cache is None:
            return
        try:
            self.hotset = HotSet(
                cfg.state_dir,
                self.tables,
                self.plane.cache,
                cfg.hotset_save_interval,
                self._report_hotset,
            )
        except FileNotFoundError:
            # A warning: a restart would then start cold, and an operator who
            # set state_dir expects it used.
            log.warning(
                "state_dir %s does not exist: the hot set is neither saved nor "
                "restored (the unit's StateDirectory= creates it; by hand: "
                "`install -d -m 0750 DIR` as the server's user)",
                cfg.state_dir,
            )
        except StateDirError as exc:
            log.error("hot set: %s", exc)
        except OSError as exc:
            log.error(
                "hot set: cannot open state_dir %s (%s): the hot set is neither saved nor restored",
                cfg.state_dir,
                exc.strerror or exc,
            )
        else:
            self.hotset.start()

    def _set_budget(self) -> None:
        """The memory budgets beside the row cache, from the room at start:
        first the request path's (``DataPlane.limit_request_memory``: read
        buffers, gather scratch, hints), then the channels':
        ``max_channel_memory``, else 3/4 of the room beside the row cache still
        to come and the request path (``pleserver.data.budget``)."""
        cfg = self.config
        room = memory_room()
        pending = 0
        request = None
        if self.plane is not None:
            if self.plane.cache is not None:
                committed = self.plane.cache.stats().get("populated_bytes", 0)
                pending = max(0, self.plane.budget.cache_bytes - committed)
            request = self.plane.limit_request_memory(
                room, pending, cfg.read_buffer_memory, cfg.hint_queue_rows
            )
            log.info("request path: at most %s", request.describe())
        if cfg.max_channel_memory is not None:
            self.budget = ChannelBudget(cfg.max_channel_memory)
            log.info(
                "channel memory budget: %.0f MiB (max_channel_memory)",
                cfg.max_channel_memory / 2**20,
            )
            excess = overcommitted(room, pending, request, cfg.max_channel_memory)
            if excess is not None:
                log.warning("%s", excess)
            return
        limit = default_channel_budget(room, pending, request)
        self.budget = ChannelBudget(limit)
        excess = overcommitted(room, pending, request, limit or 0)
        if excess is not None:
            log.warning("%s", excess)
        if limit is None:
            log.warning("channel memory budget: none (%s); set max_channel_memory", room.describe())
        else:
            beside = f", less the row cache's {pending / 2**20:.0f} MiB to come" if pending else ""
            if request is not None:
                beside += (
                    f", less the request path's {request.fixed / 2**20:.0f} MiB, with the "
                    "channels' id copies"
                )
            log.info(
                "channel memory budget: %.0f MiB, 3/4 of the room at start (%s%s); "
                "max_channel_memory overrides it",
                limit / 2**20,
                room.describe(),
                beside,
            )

    def _listen(self) -> None:
        """The control socket: a stale one of a dead server replaced, one a
        live server listens on refused."""
        path = self.config.socket
        # Never made here: a typo in --socket would give a server no client finds.
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.stat(folder)
        except PermissionError:
            raise StartupError(
                f"cannot reach the socket's directory {folder} (Permission denied for uid "
                f"{os.geteuid()}): let this user search every directory above it, or choose "
                "another --socket"
            ) from None
        except OSError:
            raise StartupError(
                f"the socket's directory {folder} does not exist: ple-server does not "
                "create it (a misspelt --socket would give a server no client finds). "
                + (
                    "The service's unit makes /run/ple-server (RuntimeDirectory=); to run "
                    f"by hand as uid {os.geteuid()}: `sudo install -d -o {os.geteuid()} "
                    "/run/ple-server`, or choose a --socket in a directory of your own"
                    if folder == os.path.dirname(p.DEFAULT_SOCKET)
                    else "Create it, or correct --socket"
                )
            ) from None
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise StartupError(
                f"{path} exists and is not a socket; ple-server removes only "
                "stale sockets: move it away or choose another --socket"
            )
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s (no server listens on it)", path)
                self._remove_stale_socket(path, folder)
            except PermissionError:
                raise StartupError(
                    f"socket {path} exists, belongs to uid {os.lstat(path).st_uid}, and this "
                    f"user (uid {os.geteuid()}) may not connect to it, so cannot tell whether a "
                    f"server listens there: if none does, remove it (`sudo rm {path}`); or "
                    "choose another --socket"
                ) from None
            except OSError as exc:
                raise StartupError(
                    f"socket path {path} exists and cannot be probed ({exc}); "
                    "remove it or choose another --socket"
                ) from None
            else:
                raise StartupError(
                    f"socket {path} is in use by a live ple-server; stop it "
                    "first (`systemctl stop ple-server`) or choose another "
                    "--socket"
                )
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            raise StartupError(
                f"cannot bind {path}: {exc.strerror}; check that the "
                "directory exists and this user may write it"
            ) from None
        os.chmod(path, self.config.socket_mode)
        self._socket_ino = os.lstat(path).st_ino  # a reload chmods this file only
        wanted, granted = listen_backlog()
        listener.listen(wanted)
        if granted is not None and granted < wanted:
            log.warning(
                "control socket: the kernel queues %d connections at most "
                "(net.core.somaxconn); a burst beyond that makes clients retry. "
                "Raise it: sysctl net.core.somaxconn=%d",
                granted,
                wanted,
            )
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "accept")

    @staticmethod
    def _remove_stale_socket(path: str, folder: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:  # gone meanwhile: as good
            pass
        except OSError as exc:
            owner = os.lstat(path).st_uid
            sticky = bool(os.stat(folder).st_mode & stat.S_ISVTX)
            why = (
                f"it belongs to uid {owner} and {folder} is sticky (only its owner or "
                "root may remove it)"
                if sticky and owner != os.geteuid()
                else f"this user (uid {os.geteuid()}) may not write {folder}"
            )
            raise StartupError(
                f"cannot remove the stale socket {path} ({exc.strerror}): {why}. "
                f"Remove it (`sudo rm {path}`), or choose another --socket"
            ) from None

    def handle_sigterm(self, signum, frame) -> None:
        self.request_stop("SIGTERM")

    def handle_sigint(self, signum, frame) -> None:
        self.request_stop("SIGINT")

    def handle_sighup(self, signum, frame) -> None:
        # A handler runs between any two bytecodes of the main thread, which
        # is the control loop's, perhaps in the middle of a session's message:
        # it only asks, and the loop reloads between two events (``reload``).
        # Several SIGHUPs before the loop looks are one reload.
        self._reload_requested = True
        self._wake()

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
        self._stop_serving()
        if self.sessions is not None:
            self.sessions.shut_down(self._stop_reason or "server stopping")
        self.close_resources()
        signal.set_wakeup_fd(-1)
        log.info("stopped")

    def _stop_serving(self) -> None:
        """Finish the in-flight requests and stop the serving loop, then the
        channel reserver, its reservations back to the budget. Once: ``stop``
        runs it before the clients are told, ``close_resources`` after a start
        that failed."""
        if self._serving_stopped:
            return
        self._serving_stopped = True
        if self.loop is not None:
            self.loop.stop()
            if self.loop.trace is not None:
                self.loop.trace.save()  # (every answer is in: the loop has stopped)
        for job in self.reserver.stop():
            job.discard()
            self.budget.give_back(job.layout.size)

    def close_resources(self) -> None:
        """Free what the server holds (a stopped server, or a start that
        failed part way)."""
        self._stop_serving()
        if self.prewarm is not None:
            self.prewarm.stop()
        if self.hotset is not None:
            self.hotset.stop()  # saves the hot set (the cache is still open)
        if self.metrics is not None:
            self.metrics.stop()
        if self.health is not None:
            self.health.stop()
            self.health = None
        if self.plane is not None:
            self.plane.close()
            self.plane = None

    # ---------------------------------------------------------- control loop
    def control_loop(self) -> None:
        sessions, listener = self.sessions, self._listener
        assert sessions is not None and listener is not None  # (start() made both)
        next_check = 0.0
        while not self._stopping:
            self._control_beat = time.monotonic()
            for key, events in self._selector.select(timeout=HOUSEKEEPING_S):
                if key.data == "accept":
                    sessions.accept(listener)
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                else:
                    sessions.handle(key.data, events)
            self._collect_reservations()
            self._collect_dropped()
            if self._reload_requested:
                self._reload_requested = False
                try:
                    self.reload()
                except Exception:  # a reload never takes the server down
                    log.exception(
                        "reload: internal error; serving on, perhaps with part of the new "
                        "settings applied: reload again, or restart"
                    )
                    self._reloaded(ok=False, problems=["internal error (see the log)"])
            now = time.monotonic()
            if now >= next_check:
                next_check = now + HOUSEKEEPING_S
                sessions.check_deadlines(now)
                sessions.flush_log()

    def _loop_heartbeat(self) -> None:
        """(serving thread, at least once a second) The loop runs."""
        self._loop_beat = time.monotonic()
        if self._watchdog:
            self.notifier.watchdog()

    # ---------------------------------------------------------------- health
    def alive(self) -> str | None:
        """None while the process does its work (``/healthz``), else why not:
        the serving loop ended, or one of the two loops has not run for
        ``HEALTH_STALE_S``. Starting counts as alive (``/readyz`` says more)."""
        now = time.monotonic()
        if self.loop is not None and not self.loop.thread.is_alive() and not self._stopping:
            return "the serving loop has stopped"
        for name, beat in (("serving", self._loop_beat), ("control", self._control_beat)):
            if beat and now - beat > HEALTH_STALE_S:
                return f"the {name} loop has not run for {now - beat:.0f} s"
        return None

    def ready(self) -> str | None:
        """None once the server serves (``/readyz``): tables open, serving loop
        running, control socket listening; else why not."""
        if self._stopping:
            return f"stopping ({self._stop_reason or 'exit'})"
        if not self._ready:
            return "starting: the tables are open, the control socket is not listening yet"
        return self.alive()

    def _wake(self) -> None:
        """Wake the control loop (from another thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full: it is awake already
            pass

    def _collect_reservations(self) -> None:
        assert self.sessions is not None  # (only the control loop calls this)
        while not self.reserver.results.empty():
            self.sessions.on_reserved(self.reserver.results.get_nowait())

    def _on_channel_dropped(self, channel: Channel, reason: str) -> None:
        """(serving thread) A channel broke the protocol: its session must end."""
        self._dropped.put((channel.session_id, reason))
        self._wake()

    def _collect_dropped(self) -> None:
        assert self.sessions is not None  # (only the control loop calls this)
        while not self._dropped.empty():
            session_id, reason = self._dropped.get_nowait()
            self.sessions.end_for_channel(session_id, reason)

    # ---------------------------------------------------------------- reload
    # A reload runs on the control thread, between two events of the control
    # loop, and in this order:
    #  1. the configuration a restart would run with is loaded whole (the same
    #     file, the same flags: ``self.source``) and checked; a bad one ends
    #     the reload there, and nothing has changed;
    #  2. the changes that can fail are made, and undone if one does: the
    #     socket file's mode, then the metrics endpoint (a new one is bound
    #     before the old one closes);
    #  3. the reloadable settings are stored into ``self.config``, in place.
    #     The control thread is the only one that reads them there (sessions,
    #     the connection gate), so no session sees half a reload;
    #  4. each value another thread reads is handed over by one attribute
    #     store of an immutable number, which that thread reads once per use
    #     (the serving loop's ``chunk_rows``, ``spin_s``, ``gpu_poll_s`` and
    #     ``heartbeat_every_s`` once a pass or turn; each table's
    #     ``parallel_min_rows`` and ``dedup_min_rows`` once a request; the
    #     metrics server's limits once a connection): a reader sees the old
    #     value or the new one, and no two of these values depend on each
    #     other (a request handed off under the old ``parallel_min_rows`` and
    #     gathered under the new one is only split over more or fewer native
    #     threads). The hint queue's bound is stored under the queue's lock, the
    #     channel budget's under the budget's lock, as their other readers
    #     hold them; the log level through ``logging``, which locks;
    #  5. ``reload_state`` and the stats' ``config`` report are replaced whole
    #     (one reference store each), so the metrics thread reads one reload
    #     or the next, never a mix.
    # Settings that need a restart are left as they are in ``self.config``:
    # it always holds what is in effect, and each reload compares against it.
    def reload(self) -> bool:
        """(control thread) Read the configuration again and apply what can
        change while serving; log every change, and why each one that needs a
        restart was not applied. True when the configuration was valid and
        every reloadable change was applied; False changes nothing."""
        attempt = self.reload_state.reloads + 1
        self.notifier.reloading()
        try:
            if self.source is None:
                raise ReloadError(
                    ["this server was made without a configuration source: nothing to read again"]
                )
            log.info("reload #%d (SIGHUP): reading %s", attempt, self.source.describe())
            new = self.source.load().config
            changes = diff(self.config, new)
            applied = [c for c in changes if c.reloadable]
            self._apply_fallible(new, {c.name for c in applied})
        except (ConfigError, ReloadError) as exc:
            log.error(
                "reload #%d failed; nothing changed, serving on with the configuration in "
                "effect. Fix these, then reload again:\n  %s",
                attempt,
                "\n  ".join(exc.problems),
            )
            self._reloaded(ok=False, problems=exc.problems)
            return False
        for change in applied:
            setattr(self.config, change.name, change.new)
        self._apply_live({c.name for c in applied})
        for change in applied:
            log.info("reload #%d: %s", attempt, change.describe())
        restart = [c for c in changes if not c.reloadable]
        for change in restart:
            log.warning(
                "reload #%d: %s; %s stays %s until then",
                attempt,
                change.describe(),
                change.name,
                SETTINGS[change.name].format(change.old),
            )
        log.info(
            "reload #%d done: %s",
            attempt,
            f"{count(len(applied), 'setting')} applied, {len(restart)} waiting for a restart"
            if changes
            else "no setting changed",
        )
        self._reloaded(ok=True, applied=applied, restart=restart)
        return True

    def _apply_fallible(self, new: ServerConfig, names: set[str]) -> None:
        """The changes of ``names`` that can fail, made with the new values of
        ``new``: the socket file's mode, the metrics endpoint. Raises
        ReloadError having undone them when one fails."""
        chmod_back: int | None = None
        if "socket_mode" in names:
            path = self.config.socket
            try:
                # Only the socket this server bound: a path replaced since (by
                # whoever may write its directory) is not chmod-ed.
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode) or st.st_ino != self._socket_ino:
                    raise ReloadError(
                        [
                            f"socket_mode: {path} is no longer the socket this server "
                            "bound (replaced or removed since): restart the server to "
                            "bind it again"
                        ]
                    )
                os.chmod(path, new.socket_mode)
            except OSError as exc:
                raise ReloadError(
                    [
                        f"socket_mode: cannot chmod {self.config.socket}: "
                        f"{exc.strerror or exc}; check who owns the socket file"
                    ]
                ) from None
            chmod_back = self.config.socket_mode
        if "metrics_address" in names:
            try:
                self._move_metrics(new)
            except ReloadError:
                if chmod_back is not None:
                    try:
                        os.chmod(self.config.socket, chmod_back)
                    except OSError:
                        pass
                raise

    def _move_metrics(self, new: ServerConfig) -> None:
        """The metrics endpoint on ``new.metrics_address`` (or none), the old
        one closed once the new one listens. Where the new address needs the
        old one's port, the old one closes first; if the new one then cannot
        bind, it is opened again where it was. Raises ReloadError when the
        new address cannot be served (the endpoint in effect is kept)."""
        from pleserver.observe.metrics import MetricsEndpoint, MetricsError

        old = self.metrics

        def endpoint(address: str) -> MetricsEndpoint:
            made = MetricsEndpoint(
                address,
                self.snapshot,
                alive=self.alive,
                ready=self.ready,
                max_connections=new.metrics_max_connections,
                timeout_s=new.metrics_timeout_s,
            )
            made.start()
            return made

        if new.metrics_address is None:
            if old is not None:
                old.stop()
                log.info("metrics endpoint on %s closed (metrics_address = none)", old.address)
            self.metrics = None
            return
        try:
            self.metrics = endpoint(new.metrics_address)
        except MetricsError as first:
            port = parse_host_port(new.metrics_address)[1]
            if old is None or not port or port != parse_host_port(old.address)[1]:
                raise ReloadError([f"metrics_address: {first}"]) from None
            # Perhaps only because the old endpoint holds the port (0.0.0.0:9478
            # after 127.0.0.1:9478): try again without it.
            old.stop()
            try:
                self.metrics = endpoint(new.metrics_address)
            except MetricsError as second:
                try:
                    self.metrics = endpoint(old.address)
                except MetricsError as back:
                    self.metrics = None
                    log.error(
                        "metrics endpoint: cannot open it again on %s (%s): no metrics "
                        "until a reload or restart opens it",
                        old.address,
                        back,
                    )
                raise ReloadError([f"metrics_address: {second}"]) from None
            return
        if old is not None:
            old.stop()
            log.info(
                "metrics endpoint on %s closed (moved to %s)", old.address, new.metrics_address
            )

    def _apply_live(self, names: set[str]) -> None:
        """Hand the reloaded ``names`` (already in ``self.config``) to the
        parts that read them (the comment above ``reload`` says how each is
        read consistently)."""
        cfg = self.config
        assert self.sessions is not None and self.loop is not None  # (start() made both)
        if names & {"allow_uids", "allow_gids", "max_clients", "max_clients_per_uid"}:
            gate = self.sessions.gate
            gate.reconfigure()
            kept = [
                s for s in self.sessions.by_socket.values() if not gate.allows(s.uid, s.gid, s.sock)
            ]
            if kept:
                log.info(
                    "%d open session(s) of peers the new access lists refuse (uids %s) stay "
                    "open until they close; a restart would end them",
                    len(kept),
                    ", ".join(str(u) for u in sorted({s.uid for s in kept})),
                )
        if "max_channel_memory" in names:
            self.budget.set_limit(cfg.max_channel_memory)
            if cfg.max_channel_memory is not None and self.budget.used > cfg.max_channel_memory:
                log.info(
                    "channels hold %.0f MiB, over the new max_channel_memory: no channel "
                    "opens until enough of them close",
                    self.budget.used / 2**20,
                )
        loop = self.loop
        if "chunk_rows" in names:
            loop.chunk_rows = cfg.chunk_rows
        if "gather_in_order" in names:
            loop.gather_in_order = cfg.gather_in_order
        if "spin_us" in names:
            loop.spin_s = cfg.spin_us * 1e-6
        if "gpu_poll_us" in names:
            loop.gpu_poll_s = cfg.gpu_poll_us * 1e-6
        if "watchdog_s" in names:
            interval = cfg.watchdog_s or watchdog_interval()
            loop.heartbeat_every_s = min(interval or 1.0, 1.0)
            self._watchdog = bool(interval)
        if "hint_queue_rows" in names:
            loop.hints.set_queue_rows(cfg.hint_queue_rows)
        if "hint_rate" in names:
            loop.hint_rate = cfg.hint_rate
        for table in self.tables:
            if "parallel_min_rows" in names:
                table.parallel_min_rows = cfg.parallel_min_rows
            if "dedup_min_rows" in names and isinstance(table, MappedTable):
                table.dedup_min_rows = cfg.dedup_min_rows
        if names & {"metrics_max_connections", "metrics_timeout_s"} and self.metrics is not None:
            self.metrics.set_limits(cfg.metrics_max_connections, cfg.metrics_timeout_s)
        if "log_level" in names:
            logging.getLogger().setLevel(cfg.log_level)
        if "log_format" in names:
            logs.set_format(cfg.log_format)
        loop.wake()  # a sleeping loop takes its new spin and poll times now

    def _reloaded(
        self,
        ok: bool,
        applied: list[Change] | None = None,
        restart: list[Change] | None = None,
        problems: list[str] | None = None,
    ) -> None:
        """Record a reload (stats, metrics) and tell systemd it is over."""
        before = self.reload_state
        now = time.time()
        self.reload_state = ReloadState(
            loaded_unix=now if ok else before.loaded_unix,
            reloads=before.reloads + 1,
            failed=before.failed + (not ok),
            last_unix=now,
            last_ok=ok,
            last_applied=tuple(c.name for c in applied or ()),
            last_problems=tuple(problems or ()),
            restart_pending=tuple(restart or ()) if ok else before.restart_pending,
        )
        self._config_report = config_report(
            self.source or ConfigSource(), self.config, self.reload_state
        )
        if ok:
            pending = [c.name for c in self.reload_state.restart_pending]
            outcome = "configuration reloaded" + (
                f"; waiting for a restart: {', '.join(pending)}" if pending else ""
            )
        else:
            outcome = "configuration reload failed (see the log); the previous one is in effect"
        self.notifier.ready(f"{self._serving_status}; {outcome}")

    # ----------------------------------------------------------------- stats
    def snapshot(self) -> Snapshot:
        """Every number `pleserver stats` and the metrics endpoint show
        (``pleserver.observe.snapshot``, the contract)."""
        now = time.monotonic()
        if now - self._residency[0] > RESIDENCY_CACHE_S:
            fractions: list[float | None] = []
            for t in self.tables:
                try:
                    resident: float | None = resident_bytes(t)
                except OSError:
                    resident = None
                fractions.append(
                    None if resident is None else resident / t.spec.nbytes if t.spec.nbytes else 1.0
                )
            self._residency = (now, fractions)
        tables: list[TableSnapshot] = []
        for t, st, resident, rate in zip(
            self.tables, self.table_stats, self._residency[1], self._miss_rates, strict=True
        ):
            source = t.source.stats()
            tables.append(
                {
                    **st.snapshot(),
                    # prefetch hints, in rows (pleserver.data.hints)
                    **(self.loop.hints.table_snapshot(t.key) if self.loop else no_table_hints()),
                    "dtype": t.spec.dtype,
                    "rows_total": t.spec.rows,
                    "cols": t.spec.cols,
                    "row_bytes": t.row_bytes,
                    "table_bytes": t.spec.nbytes,
                    "fingerprint": t.spec.fingerprint,
                    "resident_fraction": resident,
                    "io_mode": t.mode,
                    "io": io_snapshot(source, rate.rate(source.get("misses", 0), now)),
                }
            )
        return {
            "pid": os.getpid(),
            "version": __version__,
            "model": self.config.model,
            "socket": self.config.socket,
            "uptime_s": now - self.started,
            "clients": len(self.sessions) if self.sessions is not None else 0,
            "refused": dict(self.sessions.gate.counts) if self.sessions is not None else {},
            "channels": self.loop.channel_count if self.loop else 0,
            "gpu_channels": self.loop.channel_kinds()[DoorbellAdmission.kind] if self.loop else 0,
            "idle_wait": self.loop.idle_wait if self.loop else None,
            "spin_seconds": self.loop.spin_seconds if self.loop else 0.0,
            "prewarm": self.prewarm.snapshot() if self.prewarm else None,
            "dataplane": self.plane.snapshot() if self.plane else None,
            "hotset": self.hotset.snapshot() if self.hotset else None,
            "channel_memory": {"used_bytes": self.budget.used, "budget_bytes": self.budget.limit},
            "control_errors": self.sessions.errors_sent() if self.sessions is not None else {},
            # Channel opens skipped, their session closed before the reserver
            # came to them (``pleserver.control.segments``).
            "abandoned_channel_opens": (
                self.sessions.abandoned_opens if self.sessions is not None else 0
            ),
            "hints": self.loop.hints.snapshot(self.loop.held_hints) if self.loop else None,
            # Built on the control thread, replaced whole by a reload: read as one.
            "config": self._config_report,
            "tables": tables,
        }

    def _report_prewarm(self, prewarm: Prewarm) -> None:
        # STATUS= replaces the whole line: keep what is served in front.
        self.notifier.status(
            f"{self._serving_status}; prewarm {prewarm.state}: "
            + format_progress(prewarm.done_bytes, prewarm.target, prewarm.fraction)
        )

    def _report_hotset(self, hotset: HotSet) -> None:
        if hotset.state in ("none", "ignored"):
            return
        self.notifier.status(
            f"{self._serving_status}; hot set refill {hotset.state}: "
            f"{100 * hotset.fraction:.1f}% ({hotset.done_rows} of "
            f"{hotset.target_rows} rows)"
        )
