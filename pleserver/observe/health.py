"""The health socket: ``/healthz`` and ``/readyz`` for exec probes
(``pleserver health``), on a Unix socket that only root and the server's own
uid can connect to.

The metrics port answers the same paths, but it is a TCP port every local
user can reach, with one connection cap and one accept rate for everyone: a
connect flood past its accept rate overflows the kernel's backlog, and then
the kubelet's probes wait or are dropped with the flood. No limit of the port
can tell a probe from a flood that comes from the same address, so the
probes that restart or unready the server take a path the flood cannot
reach:

- the socket file is created with mode 0600 before it listens: the kernel
  refuses any other uid's connect (``EACCES``) before it reaches the backlog;
- every connection's uid is checked again (``SO_PEERCRED``): root and the
  server's own uid are answered, any other is closed at once;
- one thread answers one connection at a time, each within ``TIMEOUT_S``:
  only a peer already as privileged as the server can make it wait.

The request is an HTTP/1.1 ``GET`` of ``/healthz`` or ``/readyz`` (so ``curl
--unix-socket PATH http://ple-server/healthz`` works too); the answer is the
metrics port's: 200 ``ok``, or 503 and the check's reason.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time

from pleserver.observe.lograte import RateLimitedLog
from pleserver.observe.metrics_http import Check, response

log = logging.getLogger("pleserver.health")

TIMEOUT_S = 1.0
"""A request must arrive whole within this long of its connection (an exec
probe sends it at once; the kubelet's own timeout is seconds)."""
HEAD_LIMIT = 1024
"""Bytes of request at most: ``GET /readyz HTTP/1.1`` and a few headers."""
BACKLOG = 16
PATHS = ("/healthz", "/readyz")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class HealthSocketError(OSError):
    """The health socket cannot be opened; the message names the path and the fix."""


def peer_uid(sock: socket.socket) -> int:
    """The connecting process's uid, as the kernel recorded it at connect."""
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


class HealthSocket:
    """``start()`` binds ``path`` (raising ``HealthSocketError``) and starts
    the thread that answers on it; ``stop()`` closes it and removes the file
    (when it is still this server's)."""

    def __init__(self, path: str, checks: dict[str, Check]) -> None:
        self.path = path
        self._checks = checks
        self.refused = 0
        """Connections of a uid other than root's and the server's, closed."""
        self._allowed = {0, os.geteuid()}
        self._listener: socket.socket | None = None
        self._ino = 0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._log = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._serve, name="health-socket", daemon=True)

    def start(self) -> None:
        path = self.path
        if os.path.lexists(path):
            self._remove_stale()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(path)
            # Before listen(): until then a connect is refused whatever the mode.
            os.chmod(path, 0o600)
            self._ino = os.lstat(path).st_ino
            listener.listen(BACKLOG)
        except OSError as exc:
            listener.close()
            self._release()
            raise HealthSocketError(
                f"health_socket: cannot listen on {path}: {exc.strerror or exc}; check "
                "that its directory exists and the server's user may write it, or "
                "choose another path"
            ) from None
        listener.setblocking(False)  # a connection reset before accept() must not block it
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()
        log.info("health socket on %s (/healthz, /readyz: `pleserver health %s`)", path, path)

    def _remove_stale(self) -> None:
        """A socket file a dead server left is removed; anything else there
        (a live server's socket, a file that is not a socket) is an error."""
        path = self.path
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            self._release()
            raise HealthSocketError(
                f"health_socket: {path} exists and is not a socket; ple-server removes "
                "only stale sockets: move it away or choose another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale health socket %s (no server listens on it)", path)
            os.unlink(path)
            return
        except OSError as exc:
            self._release()
            raise HealthSocketError(
                f"health_socket: {path} exists and cannot be probed ({exc}); remove it "
                "or choose another path"
            ) from None
        finally:
            probe.close()
        self._release()
        raise HealthSocketError(
            f"health_socket: {path} is in use by a live ple-server; stop it first or "
            "give each server its own health_socket"
        )

    def stop(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:  # only our own file: a server started since may have replaced it
                if os.lstat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            except OSError:
                pass
        self._release()

    def _release(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(1.0):
                if key.fileobj is self._wake_r:
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                    continue
                if self._listener is None:
                    continue
                try:
                    sock, _ = self._listener.accept()
                except OSError:
                    continue
                try:
                    self._answer(sock)
                except Exception:  # a bug here must not end the probes' thread
                    log.exception("health socket: answering a probe failed")
                finally:
                    sock.close()

    def _answer(self, sock: socket.socket) -> None:
        uid = peer_uid(sock)
        if uid not in self._allowed:
            # Only a changed mode or directory lets another uid this far.
            self.refused += 1
            self._log.log(
                "refused",
                logging.WARNING,
                "health socket %s: uid %d refused (only root and uid %d are answered; "
                "keep the file's mode 0600)",
                self.path,
                uid,
                os.geteuid(),
            )
            return
        head = bytearray()
        deadline = time.monotonic() + TIMEOUT_S
        while b"\r\n\r\n" not in head and len(head) < HEAD_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            try:
                data = sock.recv(HEAD_LIMIT - len(head))
            except OSError:  # timed out, or reset
                return
            if not data:
                return
            head += data
        sock.settimeout(TIMEOUT_S)
        parts = bytes(head).split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        path = parts[1].split("?", 1)[0] if len(parts) == 3 else ""
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD") or path not in PATHS:
            body = b"ask GET /healthz or GET /readyz (`pleserver health [--ready] PATH`)\n"
            answer = response("400 Bad Request", body, Content_Type="text/plain; charset=utf-8")
        else:
            reason = self._checks[path]()
            status, body = (
                ("200 OK", b"ok\n")
                if reason is None
                else ("503 Service Unavailable", f"{reason}\n".encode())
            )
            answer = response(
                status, body, parts[0] == "HEAD", Content_Type="text/plain; charset=utf-8"
            )
        try:
            sock.sendall(answer)
        except OSError:
            pass


def ask(path: str, ready: bool = False, timeout: float = 5.0) -> tuple[bool, str]:
    """(healthy, what to print): one probe of the health socket at ``path``
    (``/readyz`` when ``ready``, else ``/healthz``). Never raises for a server
    that is down, slow or absent: that is an unhealthy answer, named."""
    which = "/readyz" if ready else "/healthz"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(f"GET {which} HTTP/1.1\r\nHost: ple-server\r\n\r\n".encode())
            reply = bytearray()
            while len(reply) < 65536:
                data = sock.recv(4096)
                if not data:
                    break
                reply += data
    except PermissionError:
        return False, (
            f"cannot connect to the health socket {path}: permission denied; only root "
            "and the server's own user may (run the probe as that user)"
        )
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        return False, (
            f"cannot connect to the health socket {path}: {exc.strerror}; is ple-server "
            f"running with health_socket = {path!r}?"
        )
    except TimeoutError:
        return False, f"the health socket {path} did not answer within {timeout:g} s"
    except OSError as exc:
        return False, f"cannot ask the health socket {path}: {exc}"
    status_line, _, rest = bytes(reply).partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2].decode("utf-8", "replace").strip()
    fields = status_line.split(b" ", 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/"):
        return False, f"the health socket {path} closed without an answer"
    return fields[1] == b"200", body or status_line.decode("latin-1")
