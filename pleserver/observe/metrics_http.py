"""The metrics port: a small HTTP server bounded the way an unauthenticated
port on a serving process must be.

Paths (``GET`` or ``HEAD``; any other method gets 405):

- ``/metrics``: the exposition ``render`` makes (Prometheus text format,
  gzip when the scraper accepts it);
- ``/healthz`` and ``/readyz``: 200 when their check returns None, else 503
  with the check's reason (the checks are the server's: alive, ready);
- anything else: 404.

The process serves lookups from a Python loop that shares the GIL with this
server, and the port has no authentication, so what any peer can make it do
is bounded, whatever the number or the behaviour of the peers:

- **two threads, always.** One I/O thread runs a selector over the listening
  socket and every connection (all non-blocking); one render thread makes the
  exposition. No thread, and no work beyond a few system calls, per
  connection;
- **a connection cap** (``max_connections``) that keeps room for whole
  requests: past it a new connection takes the place of one still sending its
  request head (of the peer address holding the most such, the longest
  held first), so half-sent heads, however many and from whatever peers,
  cannot keep out a probe or a scrape that sends its request at once. A new
  connection gets a prebuilt 503 only when every place holds a whole request;
- **a share of the places for ``/metrics``**: requests waiting for a render
  or taking its body hold at most ``max_connections`` less a quarter (at
  least one place is kept when there are two or more), one peer address at
  most half of that; a ``/metrics`` request past either gets 503. Health
  checks are answered as soon as their head is read, never wait, and so
  always find a place;
- **deadlines**: a request head must arrive whole within ``timeout_s`` of the
  connection's accept (bytes trickled in do not extend it), in at most
  ``HEAD_LIMIT`` bytes, and its response be taken within ``timeout_s`` once
  ready; past either the connection is closed. An idle or half-sent request
  therefore holds its place for ``timeout_s`` at most, and less when newer
  connections need it;
- **an accept rate** of at most ``ACCEPTS_PER_S`` (a token bucket of
  ``ACCEPT_BURST``): past it the listening socket is not read for a while, so
  a connect flood waits in, then overflows, the kernel's backlog and costs the
  process nothing;
- **one render per ``RENDER_INTERVAL_S`` at most**, off the data plane: a
  ``/metrics`` request waits for a render begun after it arrived (so a scrape
  sees every lookup answered before it) and shares it with every other request
  waiting; a scrape flood costs one render per interval, however fast it comes.
  The render yields the GIL between metric families (``render`` may do so; the
  server's does), and compresses with the GIL released.

Every response closes its connection (``Connection: close``): a scraper opens
one connection per scrape, and no idle keep-alive connection holds a place.
"""

from __future__ import annotations

import errno
import gzip
import logging
import selectors
import socket
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pleserver.observe.lograte import RateLimitedLog

log = logging.getLogger("pleserver.metrics_http")

HEAD_LIMIT = 8192
"""Bytes of request line and headers at most, the blank line that ends them
included (a scraper sends ≈ 200, the kubelet ≈ 100). Nothing past it is ever
read into the buffer: a longer head gets 431."""
ACCEPTS_PER_S = 200.0
ACCEPT_BURST = 100
"""Connections taken per second at most, and in one burst: a Prometheus pair
and the kubelet's probes make a few per second."""
RENDER_INTERVAL_S = 0.5
"""Renders begin at least this far apart (a render is a few milliseconds of
GIL per hundred tables)."""
BACKLOG = 128
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PATHS = ("/metrics", "/healthz", "/readyz")

Check = Callable[[], str | None]
"""A health check: None when healthy, else the reason it is not."""


class MetricsError(OSError):
    """The endpoint cannot start; the message names the address and the fix."""


def response(status: str, body: bytes, head_only: bool = False, **headers: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection."""
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else body)


BUSY = response(
    "503 Service Unavailable",
    b"too many connections to the metrics port\n",
    Content_Type="text/plain; charset=utf-8",
    Retry_After="1",
)
SCRAPES_BUSY = response(
    "503 Service Unavailable",
    b"too many /metrics requests waiting on the metrics port (from this address, or in all)\n",
    Content_Type="text/plain; charset=utf-8",
    Retry_After="1",
)


def scrape_places(max_connections: int) -> tuple[int, int]:
    """(in all, per peer address): ``/metrics`` requests held at most at once.
    A quarter of the places (at least one, when there are two or more) is
    kept for heads and health checks, so that requests waiting for a render
    or slow to take their body never fill the port; one address may hold half
    of the rest, so that one peer's scrapes cannot refuse another's."""
    kept = max(1, max_connections // 4) if max_connections >= 2 else 0
    total = max_connections - kept
    return total, max(1, total // 2)


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    deadline: float
    peer: str = ""  # the peer's address: places are shared out by it
    accepted: float = 0.0
    routed: bool = False  # its whole head was read: it is being answered
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the response, once known; what is left of it
    gzip: bool = False  # the request accepts a gzip body
    head_only: bool = False  # HEAD
    wants_render: int = 0  # /metrics: the first render generation that may answer it


@dataclass
class Rendered:
    generation: int
    body: bytes = b""
    gzipped: bytes = b""
    error: str | None = None


class MetricsHTTPServer:
    """``start()`` binds (raising ``MetricsError``) and starts both threads;
    ``stop()`` closes every connection and joins them."""

    def __init__(
        self,
        address: str,
        host: str,
        port: int,
        render: Callable[[], bytes],
        checks: dict[str, Check],
        max_connections: int = 32,
        timeout_s: float = 5.0,
    ) -> None:
        self.address = address
        self._host, self._port = host, port
        self._render = render
        self._checks = checks
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.rejected = dict.fromkeys(("connection_cap", "evicted", "timeout", "bad_request"), 0)
        """Connections turned away, by reason (exported as a counter)."""
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._connections: dict[socket.socket, Connection] = {}
        self._waiting: list[Connection] = []  # /metrics requests waiting for a render
        # /metrics requests held (waiting for a render or taking its body), by
        # peer address, and in all: scrape_places bounds both.
        self._scrapes: Counter[str] = Counter()
        self._scrape_count = 0
        self._stop = threading.Event()
        self._tokens = float(ACCEPT_BURST)
        self._tokens_at = time.monotonic()
        self._listening = False
        self._peer_log = RateLimitedLog(log)
        # Between the two threads, under _render_lock: the generation of the
        # render begun last, whether a later one is wanted, the last result.
        self._render_lock = threading.Condition()
        self._started_generation = 0
        self._render_wanted = False
        self._rendered = Rendered(0)
        self._threads = [
            threading.Thread(target=self._serve, name="metrics-http", daemon=True),
            threading.Thread(target=self._render_loop, name="metrics-render", daemon=True),
        ]

    @property
    def port(self) -> int | None:
        return self._listener.getsockname()[1] if self._listener is not None else None

    def start(self) -> None:
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
        except OSError as exc:
            raise self._cannot(exc) from None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            listener.listen(BACKLOG)
        except OSError as exc:
            listener.close()
            raise self._cannot(exc) from None
        listener.setblocking(False)
        self._listener = listener
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listen(True)
        for thread in self._threads:
            thread.start()

    def _cannot(self, exc: OSError) -> MetricsError:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        return MetricsError(
            f"cannot serve metrics on {self.address}: {exc.strerror or exc}; choose a "
            "free port or another address for metrics_address (or leave it out)"
        )

    def stop(self) -> None:
        self._stop.set()
        with self._render_lock:
            self._render_lock.notify_all()
        self._wake()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5.0)
        for conn in list(self._connections.values()):
            self._close(conn)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full: the I/O thread is awake already
            pass

    # ------------------------------------------------------------ I/O thread
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_once()
            except Exception:  # a bug here must not silence the port, nor spin
                self._peer_log.log(
                    "internal", logging.ERROR, "metrics port: %s", traceback.format_exc()
                )
                time.sleep(0.1)

    def _serve_once(self) -> None:
        """Wait for events or the next deadline; handle them; close the
        connections past their deadlines."""
        now = time.monotonic()
        timeout = 1.0
        if not self._listening:
            timeout = min(timeout, max(0.0, (1 - self._tokens) / ACCEPTS_PER_S))
        for conn in self._connections.values():
            timeout = min(timeout, max(0.0, conn.deadline - now))
        for key, events in self._selector.select(timeout):
            if key.fileobj is self._wake_r:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            elif key.fileobj is self._listener:
                self._accept()
            elif events & selectors.EVENT_READ:
                self._read(key.data)
            else:
                self._write(key.data)
        self._answer_waiting()
        self._refill()
        now = time.monotonic()
        for conn in [c for c in self._connections.values() if now >= c.deadline]:
            if conn.out is None and conn.wants_render == 0:
                self.rejected["timeout"] += 1
            self._close(conn)

    def _listen(self, on: bool) -> None:
        assert self._listener is not None
        if on and not self._listening:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        elif not on and self._listening:
            self._selector.unregister(self._listener)
        self._listening = on

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(ACCEPT_BURST, self._tokens + (now - self._tokens_at) * ACCEPTS_PER_S)
        self._tokens_at = now
        if self._tokens >= 1 and not self._listening:
            self._listen(True)

    def _accept(self) -> None:
        assert self._listener is not None
        # At most half the cap per pass: every connection accepted is read
        # (the next select) before half the places have changed hands, so a
        # request that arrives just after its connection is read before
        # newer connections could push it out.
        for _ in range(max(1, self.max_connections // 2)):
            if self._tokens < 1:
                break
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: leave the backlog be a while
                self._peer_log.log("accept", logging.ERROR, "metrics port: accept failed: %s", exc)
                self._tokens = 1 - ACCEPTS_PER_S * 0.1 if exc.errno == errno.EMFILE else 0.0
                break
            self._tokens -= 1
            sock.setblocking(False)
            now = time.monotonic()
            conn = Connection(sock, now + self.timeout_s, str(address[0]), now)
            self._connections[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            # A probe or a scraper sends its request with the connection: read
            # it now, and a health check is answered before it needs a place.
            self._read(conn)
            if sock in self._connections and len(self._connections) > self.max_connections:
                self._make_room(conn)
        if self._tokens < 1:
            self._listen(False)

    def _make_room(self, newcomer: Connection) -> None:
        """One connection too many, ``newcomer`` the last: close the one that
        has been sending its head the longest, among those of the peer address
        holding the most heads; when every other place holds a whole request,
        turn the newcomer away with a 503."""
        heads = [c for c in self._connections.values() if not c.routed and c is not newcomer]
        if heads:
            held = Counter(c.peer for c in heads)
            most = max(held.values())
            victim = min((c for c in heads if held[c.peer] == most), key=lambda c: c.accepted)
            self.rejected["evicted"] += 1
            self._peer_log.log(
                "evicted",
                logging.WARNING,
                "metrics port: %d connections open (metrics_max_connections): for each "
                "new one, the one sending its request head longest is closed (now one "
                "of %s, which holds %d)",
                len(self._connections) - 1,
                victim.peer,
                most,
            )
            self._close(victim)
            return
        self.rejected["connection_cap"] += 1
        self._peer_log.log(
            "busy",
            logging.WARNING,
            "metrics port: %d connections open (metrics_max_connections), each with a "
            "whole request; new ones get 503 until some close",
            len(self._connections) - 1,
        )
        if newcomer.out is None:
            try:
                newcomer.sock.send(BUSY)  # one try: a new socket's send buffer is empty
            except OSError:
                pass
        self._close(newcomer)

    def _read(self, conn: Connection) -> None:
        have = len(conn.head)
        try:
            # Never more than the limit: a head that does not end within
            # HEAD_LIMIT bytes is refused without reading on.
            data = conn.sock.recv(HEAD_LIMIT - have)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return self._close(conn)
        if not data:
            return self._close(conn)
        conn.head += data
        end = conn.head.find(b"\r\n\r\n", max(0, have - 3))
        if end < 0:
            if len(conn.head) >= HEAD_LIMIT:
                conn.routed = True
                self.rejected["bad_request"] += 1
                self._respond(conn, response("431 Request Header Fields Too Large", b""))
            return
        conn.routed = True
        self._selector.unregister(conn.sock)
        self._route(conn, bytes(conn.head[:end]))

    def _route(self, conn: Connection, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.rejected["bad_request"] += 1
            return self._respond(conn, response("400 Bad Request", b"bad request line\n"))
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return self._respond(
                conn, response("405 Method Not Allowed", b"GET or HEAD\n", Allow="GET, HEAD")
            )
        conn.head_only = method == "HEAD"
        path = target.split("?", 1)[0]
        if path not in PATHS:
            return self._respond(
                conn,
                response(
                    "404 Not Found",
                    b"not found: the paths are /metrics, /healthz and /readyz\n",
                    conn.head_only,
                    Content_Type="text/plain; charset=utf-8",
                ),
            )
        if path != "/metrics":
            reason = self._checks[path]()
            status, body = (
                ("200 OK", b"ok\n")
                if reason is None
                else ("503 Service Unavailable", f"{reason}\n".encode())
            )
            return self._respond(
                conn,
                response(status, body, conn.head_only, Content_Type="text/plain; charset=utf-8"),
            )
        conn.gzip = any(
            line.lower().startswith("accept-encoding:") and "gzip" in line.lower()
            for line in lines[1:]
        )
        total, per_peer = scrape_places(self.max_connections)
        if self._scrape_count >= total or self._scrapes[conn.peer] >= per_peer:
            self.rejected["connection_cap"] += 1
            self._peer_log.log(
                "scrapes",
                logging.WARNING,
                "metrics port: %d /metrics requests held, %d of them from %s (at most "
                "%d, %d per address, from metrics_max_connections); more get 503",
                self._scrape_count,
                self._scrapes[conn.peer],
                conn.peer,
                total,
                per_peer,
            )
            return self._respond(conn, SCRAPES_BUSY)
        self._scrapes[conn.peer] += 1
        self._scrape_count += 1
        with self._render_lock:
            conn.wants_render = self._started_generation + 1
            self._render_wanted = True
            self._render_lock.notify()
        # It waits for that render (its deadline moves with it: the render may
        # wait up to RENDER_INTERVAL_S for the one before).
        conn.deadline = time.monotonic() + self.timeout_s + RENDER_INTERVAL_S
        self._waiting.append(conn)

    def _answer_waiting(self) -> None:
        if not self._waiting:
            return
        with self._render_lock:
            done = self._rendered
        still = []
        for conn in self._waiting:
            if conn.sock not in self._connections:
                continue
            if conn.wants_render > done.generation:
                still.append(conn)
            elif done.error is not None:
                self._respond(
                    conn,
                    response(
                        "500 Internal Server Error",
                        f"cannot collect the metrics: {done.error}\n".encode(),
                        conn.head_only,
                    ),
                )
            else:
                body = done.gzipped if conn.gzip else done.body
                headers = {"Content_Type": CONTENT_TYPE}
                if conn.gzip:
                    headers["Content_Encoding"] = "gzip"
                self._respond(conn, response("200 OK", body, conn.head_only, **headers))
        self._waiting = still

    def _respond(self, conn: Connection, data: bytes) -> None:
        conn.out = memoryview(data)
        conn.deadline = time.monotonic() + self.timeout_s
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._write(conn)
        if conn.sock in self._connections and conn.out is not None and len(conn.out):
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _write(self, conn: Connection) -> None:
        assert conn.out is not None
        try:
            while len(conn.out):
                conn.out = conn.out[conn.sock.send(conn.out) :]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        if self._connections.pop(conn.sock, None) is None:
            return
        if conn.wants_render:
            self._scrape_count -= 1
            self._scrapes[conn.peer] -= 1
            if not self._scrapes[conn.peer]:
                del self._scrapes[conn.peer]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:  # unread bytes would turn the close into a reset that can eat the response
            conn.sock.recv(HEAD_LIMIT)
        except OSError:
            pass
        conn.sock.close()

    # --------------------------------------------------------- render thread
    def _render_loop(self) -> None:
        last_start = -RENDER_INTERVAL_S
        while True:
            with self._render_lock:
                while not self._render_wanted and not self._stop.is_set():
                    self._render_lock.wait()
                if self._stop.is_set():
                    return
            if self._stop.wait(max(0.0, last_start + RENDER_INTERVAL_S - time.monotonic())):
                return
            with self._render_lock:
                self._started_generation += 1
                self._render_wanted = False
                result = Rendered(self._started_generation)
            last_start = time.monotonic()
            try:
                result.body = self._render()
                # zlib releases the GIL while it compresses.
                result.gzipped = gzip.compress(result.body, compresslevel=1)
            except Exception as exc:  # a bug in a collector: say so, keep serving
                log.exception("metrics: rendering the exposition failed")
                result.error = str(exc) or type(exc).__name__
            with self._render_lock:
                self._rendered = result
            self._wake()
