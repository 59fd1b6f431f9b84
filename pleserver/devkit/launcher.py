"""One way to start a ``pleserver serve`` process: for tests, benchmarks and the demo.

    launcher = ServerLauncher(model, "--prewarm", "full", log_level="INFO")
    with launcher.start() as server:    # returns once the server said READY=1
        with server.client() as client:
            client.lookup(1, [0, 1, 2])
        server.wait_prewarm()           # STATUS= says when the prewarm ended
    # here the process is reaped and its notify socket and log are gone

Readiness is the server's own word, as systemd hears it (``Type=notify``): each
launch binds a private datagram socket in a temporary directory and hands it
to the child as ``NOTIFY_SOCKET``; the server sends ``READY=1`` once its tables
are open and its socket listens (``pleserver.ops.systemd``). Waiting is a
``select`` on that socket and on a pidfd of the child, so a server that exits
first fails the start at once, with its exit code and the tail of its log:
nothing polls the control socket. Like ``NotifyAccess=main``, only datagrams
from the launched process count (``SO_PASSCRED``); the socket accepts them from
any uid, since a test may run the server as another user.

A launched server is always reaped: ``stop`` sends SIGTERM (or a signal of the
caller's choice) and SIGKILLs it after a grace period; ``close`` (also on
leaving the ``with`` block, whatever raised) stops it if it still runs and
removes the temporary directory: notify socket, control socket and the log
(a ``log_path`` of the caller's is the caller's to keep).

Defaults that keep a launch reproducible: the host's service configuration is
never read (``PLE_SERVER_CONFIG=/dev/null`` unless ``env`` names another file),
nor are the settings of the caller's environment (``PLE_SERVER_<KEY>``: only
those ``env`` gives), the package this module comes from is first on the child's ``PYTHONPATH``, and
the child's stdin is ``/dev/null``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pleclient import PleClient
from pleserver.config import SETTINGS

log = logging.getLogger("pleserver.launcher")

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # holds pleserver/ and pleclient/
PREWARM_ENDED = re.compile(r"; prewarm (done|budget|memory|stopped|failed):")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """The server exited, or stayed silent, before it sent what was awaited
    (``READY=1``, or another notification); the message holds its exit code
    and the tail of its log."""


class NotifyListener:
    """The datagram socket systemd would listen on, private to one launch.

    Collects every message of the launched process (``accept_pid``) as its
    fields (``READY=1``, ``STATUS=…``); messages of other processes are
    dropped and counted in ``ignored``."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        # Sendable by any uid (a server run as another user); only the launched
        # process's datagrams are believed, by their kernel-checked sender pid.
        os.chmod(directory, 0o711)
        os.chmod(self.path, 0o722)
        self.accept_pid: int | None = None
        self.messages: list[tuple[float, list[str]]] = []  # (arrival, fields)
        self.ignored: list[int] = []  # sender pids of dropped messages

    def receive(self, timeout: float | None) -> list[str] | None:
        """One message of the launched process, or None after ``timeout``."""
        self.sock.settimeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(_UCRED.size))
            except (TimeoutError, BlockingIOError):
                return None
            pid = next(
                (
                    _UCRED.unpack_from(cdata)[0]
                    for level, kind, cdata in ancdata
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                ),
                None,
            )
            if pid is not None and pid == self.accept_pid:
                fields = data.decode(errors="replace").split("\n")
                self.messages.append((time.monotonic(), fields))
                return fields
            log.debug(
                "notify socket %s: dropped a message of pid %s (not pid %s)",
                self.path,
                pid,
                self.accept_pid,
            )
            self.ignored.append(-1 if pid is None else pid)
            if deadline is not None:  # past it: what is queued still counts
                self.sock.settimeout(max(0.0, deadline - time.monotonic()))

    def drain(self) -> None:
        """Receive every message queued now, without waiting."""
        while self.receive(0) is not None:
            pass

    def collect(self, seconds: float) -> None:
        """Receive whatever comes for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.receive(left)

    def fields(self, prefix: str = "") -> list[str]:
        """Every field received so far that starts with ``prefix``, in order."""
        return [f for _, fields in self.messages for f in fields if f.startswith(prefix)]

    def close(self) -> None:
        self.sock.close()


class LaunchedServer:
    """A ``pleserver serve`` process started by ``ServerLauncher.start``."""

    def __init__(
        self,
        argv: list[str],
        socket_path: str,
        workdir: str,
        env: dict[str, str],
        cwd: str | None,
        log_path: str | None,
        tie_to_parent: bool,
    ) -> None:
        self.args = argv
        self.socket = socket_path
        self._workdir = workdir
        self._owns_log = log_path is None
        self.log_path = Path(log_path or os.path.join(workdir, "server.log"))
        self._closed_log = ""  # the log's text, kept when close() removes the file
        self.notify = NotifyListener(workdir)
        self.ready_fields: list[str] | None = None
        self.ready_at: float | None = None  # time.monotonic() when READY=1 arrived
        self._log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env={**env, "NOTIFY_SOCKET": self.notify.path},
                preexec_fn=die_with_parent if tie_to_parent else None,
            )
        except BaseException:
            self._log.close()
            self.notify.close()
            raise
        self.notify.accept_pid = self.proc.pid
        self._pidfd = _pidfd(self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    # ----------------------------------------------------------------- waiting
    def _next_message(self, deadline: float, awaited: str) -> list[str] | None:
        """The server's next message; None once ``deadline`` (monotonic) has
        passed. Raises ServerStartError when the process has exited and every
        message it sent before has been read."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.notify.sock, selectors.EVENT_READ)
            if self._pidfd is not None:
                sel.register(self._pidfd, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0:
                # Without a pidfd (a kernel before 5.3, or refused), look at
                # the process every 0.1 s instead.
                events = sel.select(left if self._pidfd is not None else min(left, 0.1))
                if any(key.fileobj is self.notify.sock for key, _ in events):
                    fields = self.notify.receive(0)
                    if fields is not None:
                        return fields
                    continue  # another process's datagram, dropped
                if self.proc.poll() is not None:
                    fields = self.notify.receive(0)  # what it sent before it went
                    if fields is not None:
                        return fields
                    raise ServerStartError(
                        f"ple-server (pid {self.pid}) exited with {self.proc.returncode} "
                        f"before sending {awaited}; its log ends:\n{self._log_excerpt()}"
                    )
        return None

    def _timed_out(self, awaited: str, timeout: float) -> ServerStartError:
        ignored = (
            f"; dropped messages of other processes (pids "
            f"{sorted(set(self.notify.ignored))}: does the command prefix fork?)"
            if self.notify.ignored
            else ""
        )
        return ServerStartError(
            f"ple-server (pid {self.pid}) sent no {awaited} within {timeout:.0f} s{ignored}; "
            f"on a loaded machine raise the timeout. Its log ends:\n{self._log_excerpt()}"
        )

    def wait_for(self, prefix: str, timeout: float = 60.0) -> list[str]:
        """The first message, received already or yet to come, with a field
        that starts with ``prefix``. Raises ServerStartError when the process
        exits first or ``timeout`` passes."""
        for _, seen in self.notify.messages:
            if any(f.startswith(prefix) for f in seen):
                return seen
        deadline = time.monotonic() + timeout
        while (fields := self._next_message(deadline, repr(prefix))) is not None:
            if any(f.startswith(prefix) for f in fields):
                return fields
        raise self._timed_out(repr(prefix), timeout)

    def wait_ready(self, timeout: float = 60.0) -> list[str]:
        """Until the server sent ``READY=1``: that message's fields."""
        if self.ready_fields is None:
            self.ready_fields = self.wait_for("READY=1", timeout)
            self.ready_at = next(
                t for t, fields in self.notify.messages if fields is self.ready_fields
            )
            log.debug("ple-server pid %d ready on %s", self.pid, self.socket)
        return self.ready_fields

    def wait_status(self, pattern: str | re.Pattern[str], timeout: float = 60.0) -> str:
        """The first ``STATUS=`` text that ``pattern`` matches anywhere
        (``re.search``), received already or yet to come."""
        pattern = re.compile(pattern)

        def matching(fields: list[str]) -> str | None:
            return next(
                (
                    f[len("STATUS=") :]
                    for f in fields
                    if f.startswith("STATUS=") and pattern.search(f[len("STATUS=") :])
                ),
                None,
            )

        for _, seen in self.notify.messages:
            if (text := matching(seen)) is not None:
                return text
        deadline = time.monotonic() + timeout
        awaited = f"a STATUS= matching {pattern.pattern!r}"
        while (fields := self._next_message(deadline, awaited)) is not None:
            if (text := matching(fields)) is not None:
                return text
        raise self._timed_out(awaited, timeout)

    def wait_prewarm(self, timeout: float = 600.0) -> str:
        """Until the prewarm (``--prewarm full`` in mmap mode) has ended: its
        final state (``done``, ``budget``, …), or ``none`` when none runs."""
        self.wait_ready()
        # The prewarm object exists before the first query is answered.
        if PleClient.query_stats(self.socket).get("prewarm") is None:
            return "none"
        status = self.wait_status(PREWARM_ENDED, timeout)
        ended = PREWARM_ENDED.search(status)
        assert ended is not None  # (wait_status returned a text it matches)
        return ended.group(1)

    # ---------------------------------------------------------------- using it
    def client(self, **kwargs) -> PleClient:
        """A ``PleClient`` connected to this server (keyword arguments as
        ``PleClient.connect``)."""
        return PleClient.connect(self.socket, **kwargs)

    def log(self) -> str:
        """Everything the server wrote so far (stdout and stderr)."""
        if self._log.closed and not self.log_path.exists():
            return self._closed_log
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def _log_excerpt(self) -> str:
        return self.log_tail() or "(empty)"

    # ---------------------------------------------------------------- stopping
    def exit_code(self, timeout: float = 30.0) -> int:
        """Wait for the process to end on its own; its exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"ple-server (pid {self.pid}) still runs after {timeout:.0f} s; "
                f"its log ends:\n{self._log_excerpt()}"
            ) from None
        self._log.close()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` (unless it has exited), reap it — SIGKILL after
        ``timeout`` seconds — and return its exit code (negative: the signal
        that ended it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "ple-server (pid %d) still runs %.0f s after signal %d: SIGKILL",
                    self.pid,
                    timeout,
                    sig,
                )
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL and reap; the exit code."""
        return self.stop(signal.SIGKILL)

    def close(self) -> None:
        """Stop it if it runs, and remove what the launch made (idempotent)."""
        try:
            self.stop()
        finally:
            self.notify.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            if self._owns_log and self.log_path.exists():
                self._closed_log = self.log_path.read_text(errors="replace")
            shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> LaunchedServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServerLauncher:
    """How to start a ``pleserver serve`` process; ``start`` starts one (again
    and again, for restarts on the same ``socket_path``).

    ``extra_args`` go after ``serve --model MODEL --socket PATH``; ``prefix``
    runs the command under another (``prlimit … --``, ``unshare …``): it must
    exec the server in its own process, whose pid is the one whose
    notifications count. ``program`` replaces ``python -m pleserver.cli``.
    Without ``socket_path`` each launch listens in its temporary directory.
    ``die_with_parent`` sets ``PR_SET_PDEATHSIG``: the server gets SIGTERM
    when the *thread* that started it ends, so use it from the main thread.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *extra_args: str,
        socket_path: str | None = None,
        log_level: str | None = None,
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
        program: Sequence[str] | None = None,
        die_with_parent: bool = False,
        ready_timeout: float = 60.0,
    ) -> None:
        self.model = str(model)
        self.extra_args = [str(a) for a in extra_args]
        self.socket_path = socket_path
        self.log_level = log_level
        self.log_path = None if log_path is None else str(log_path)
        self.env = dict(env or {})
        self.cwd = None if cwd is None else str(cwd)
        self.prefix = list(prefix)
        self.program = list(program) if program else [sys.executable, "-m", "pleserver.cli"]
        self.die_with_parent = die_with_parent
        self.ready_timeout = ready_timeout

    def argv(self, socket_path: str) -> list[str]:
        return [
            *self.prefix,
            *self.program,
            "serve",
            "--model",
            self.model,
            "--socket",
            socket_path,
            *(["--log-level", self.log_level] if self.log_level else []),
            *self.extra_args,
        ]

    def child_env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        # The host's /etc/ple-server/config.toml is for its service, not for us;
        # so are the settings a shell exported (a launch says its own).
        ours = {k: v for k, v in os.environ.items() if k not in {s.env for s in SETTINGS.values()}}
        return {**ours, "PYTHONPATH": path, "PLE_SERVER_CONFIG": os.devnull, **self.env}

    def start(self, wait: bool = True, timeout: float | None = None) -> LaunchedServer:
        """Start a server; with ``wait``, return once it sent ``READY=1``. A
        server that fails to start is reaped and cleaned up before the
        ServerStartError reaches the caller."""
        workdir = tempfile.mkdtemp(prefix="ple-launch-")  # short: sun_path ≤ 107 bytes
        socket_path = self.socket_path or os.path.join(workdir, "ple.sock")
        try:
            server = LaunchedServer(
                self.argv(socket_path),
                socket_path,
                workdir,
                self.child_env(),
                self.cwd,
                self.log_path,
                self.die_with_parent,
            )
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        if wait:
            try:
                server.wait_ready(self.ready_timeout if timeout is None else timeout)
            except BaseException:
                server.close()
                raise
        return server


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd_open: wait_for looks every 0.1 s
        return None


_libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec


def die_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGTERM when the thread that started it
    ends (``PR_SET_PDEATHSIG``), so no server a benchmark started outlives it."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
