"""PleClient: connect to a ple-server, look rows up over a shared-memory channel.

::

    with PleClient.connect() as client:
        rows = client.lookup(3, ids)             # uint8 [len(ids), row_bytes]
        ticket = client.submit("…layers.3…", ids)
        view = ticket.wait()                     # zero-copy view of the slot
        ...                                      # use it (DMA it to the GPU)
        ticket.release()
        client.hint(3, later_ids)               # read ahead into the server's cache

A client is used by one thread at a time (vLLM workers are single-threaded per
rank); ``submit``/``wait`` pairs may overlap up to the channel depth.
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass

import numpy as np

from pleclient import protocol as p
from pleclient.channel import ChannelMap, SlotView
from pleclient.errors import (
    AccessDenied,
    LookupTimeout,
    PleError,
    ProtocolMismatch,
    RequestError,
    ServerGone,
    ServerUnavailable,
    TooManyClients,
)
from pleclient.reconnect import DEFAULT_WINDOW_S, reconnect_within
from pleclient.slots import SlotOwner, SlotPool

log = logging.getLogger(__name__)

SPIN_SECONDS = 200e-6
"""How long ``wait`` spins on the slot's state word (yielding the CPU between
loads) before it sleeps on the word's futex: a round trip through a sleeping
futex costs tens of µs more than a spin, and most requests are answered within
this window."""
HINT_SLOT_POLL_S = 0.0002
"""``hint(wait=…)``: how often a hint waiting for a slot looks again."""
CONNECT_RETRY_FIRST_S = 0.001
CONNECT_RETRY_MAX_S = 0.05
"""A connect the server's queue had no room for is tried again after 1 ms,
then twice as long each time up to 50 ms, until the connect timeout."""


def server_socket(socket_path: str | None = None) -> str:
    """The control socket a client connects to: ``socket_path`` when given,
    else ``$PLE_SERVER_SOCKET``, else ``/run/ple-server/ple.sock`` (the
    systemd unit's)."""
    return socket_path or os.environ.get(p.SOCKET_ENV) or p.DEFAULT_SOCKET


def sockets_in(directory: str) -> list[str]:
    """The Unix sockets in ``directory``, by name: the ple-servers of a host
    that runs one per model (``/run/ple-server/NAME.sock``). An absent
    directory has none; one that cannot be listed raises ``OSError``."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                found.append(path)
        except OSError:
            continue  # removed meanwhile
    return found


@dataclass(frozen=True)
class TableInfo:
    """A table the server serves (one PLE layer)."""

    name: str
    layer: int
    rows: int
    cols: int
    dtype: str
    row_bytes: int
    scale: float | None
    fingerprint: str
    shard_size: int
    parts: int

    @classmethod
    def from_wire(cls, msg: dict) -> TableInfo:
        return cls(**{k: msg[k] for k in cls.__dataclass_fields__})


class Ticket:
    """One request in flight; ``wait`` returns the rows, ``release`` frees the
    slot. It holds its slot in its client's ``slots`` (as SlotOwner.TICKET)."""

    __slots__ = ("_client", "_slots", "_slot", "_table", "count", "_state")

    def __init__(self, client: PleClient, slot: SlotView, table: TableInfo, count: int):
        self._client = client
        self._slots = client.slots
        self._slot = slot
        self._table = table
        self.count = count
        self._state = "submitted"  # → done | released | abandoned

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The rows, as a zero-copy uint8 view ``[count, row_bytes]`` into shared
        memory, valid until ``release``. Raises RequestError for a rejected
        request (the slot is then already free), LookupTimeout, ServerGone."""
        if self._state == "done":
            return self._slot.rows_view(self.count, self._table.row_bytes)
        if self._state != "submitted":
            raise PleError(f"ticket already {self._state}")
        client = self._client
        if self._slots is not client._slots:  # submitted in a session since replaced
            self._state = "released"
            raise ServerGone(
                f"this request went to a ple-server session at {client.socket_path} "
                "that has ended since (the client reconnected): submit it again"
            )
        timeout = client.timeout if timeout is None else timeout
        # The state is read with acquire: it pairs with the server's release
        # of DONE and is what makes the rows visible on weakly ordered CPUs.
        state = self._slots.wait_answered(self._slot, timeout, SPIN_SECONDS)
        if state == p.SlotState.SUBMITTED:
            self.release()  # the slot comes back when the answer does
            raise LookupTimeout(
                f"ple-server at {client.socket_path} did not answer a request of "
                f"{self.count} rows within {timeout:.3g} s; the server may be "
                "overloaded (see `pleserver stats`)"
            )
        if state == p.SlotState.DONE:
            self._state = "done"
            return self._slot.rows_view(self.count, self._table.row_bytes)
        code, text = self._slot.words[p.SL_ERROR], self._slot.error_text()
        self._state = "released"
        self._slots.release(self._slot.index)
        if state == p.SlotState.ERROR:
            raise RequestError(code, f"ple-server rejected the request: {text}")
        raise ProtocolMismatch(f"slot {self._slot.index} in unexpected state {state}")

    def release(self) -> None:
        """Give the slot back. A ticket released before it completed is abandoned:
        its slot is reused only once the server has answered it."""
        if self._slots is not self._client._slots:  # its session ended: nothing to give back
            self._state = "released"
        elif self._state == "submitted":
            self._state = "abandoned"
            self._slots.abandon(self._slot.index)
        elif self._state == "done":
            self._state = "released"
            self._slots.release(self._slot.index)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PleClient:
    """A session with ple-server: control socket plus one shared-memory channel."""

    def __init__(
        self, sock: socket.socket, socket_path: str, welcome: dict, timeout: float
    ) -> None:
        self._sock = sock
        self.socket_path = socket_path
        self.timeout = timeout
        self._connect_timeout = timeout
        self.server_info = {k: v for k, v in welcome.items() if k != "tables"}
        self.tables = [TableInfo.from_wire(t) for t in welcome["tables"]]
        self._by_name = {t.name: t for t in self.tables}
        self._index = {t.name: i for i, t in enumerate(self.tables)}
        self._channel: ChannelMap | None = None
        self._slots: SlotPool | None = None  # with the channel
        self.gpu_driven = False  # set by _open_channel
        # A GPU-driven channel's segment, kept so that the next server can
        # adopt it (``reconnect``): captured graphs hold its addresses.
        self._segment_fd: int | None = None
        self._opened: tuple[str, int | None, int | None] = ("", None, None)  # name, capacity, depth
        self.sessions = 1
        """Sessions this client has had: 1, plus one per ``reconnect``."""
        self._sequence = 0
        self._lock = threading.Lock()
        self._gone: str | None = None
        # One reader for the session: a frame the server sends unasked
        # (SHUTDOWN, ERROR) may arrive over several liveness checks.
        self._reader = p.FrameReader()
        self._pid = os.getpid()
        self.hints_sent = 0
        """Row ids sent as prefetch hints (``hint``)."""
        self.hints_skipped = 0
        """Row ids of hints not sent: no free slot, or a server without hints."""
        self._hints_unsupported_logged = False

    # --------------------------------------------------------------- connect
    @classmethod
    def connect(
        cls,
        socket_path: str | None = None,
        timeout: float = 10.0,
        *,
        name: str | None = None,
        capacity: int | None = None,
        depth: int | None = None,
        gpu_driven: bool = False,
    ) -> PleClient:
        """Connect, say hello, open the channel. ``socket_path`` defaults to
        ``$PLE_SERVER_SOCKET`` or ``/run/ple-server/ple.sock``. A
        ``gpu_driven`` channel is rung by a CUDA stream (``pleclient.gpu``), not
        by ``submit``; ProtocolMismatch if the server does not offer it."""
        path = server_socket(socket_path)
        sock = _connect_socket(path, timeout)
        try:
            _send_hello(sock, name or f"pid{os.getpid()}")
            welcome = _expect(sock, p.MessageType.WELCOME, path)
            if welcome.get("version") != p.PROTOCOL_VERSION:
                raise ProtocolMismatch(
                    f"ple-server at {path} speaks protocol {welcome.get('version')!r}, this "
                    f"client speaks {p.PROTOCOL_VERSION}; install matching pleserver versions"
                )
            client = cls(sock, path, welcome, timeout)
            if gpu_driven and p.FEATURE_GPU_DRIVEN not in client.features:
                raise ProtocolMismatch(
                    f"ple-server {client.server_info.get('server', '?')} at {path} does "
                    "not serve GPU-driven channels; upgrade it, or use the host path"
                )
            client._opened = (name or f"pid{os.getpid()}", capacity, depth)
            client._open_channel(capacity, depth, gpu_driven)
            return client
        except BaseException:
            sock.close()
            raise

    @classmethod
    def query_stats(cls, socket_path: str | None = None, timeout: float = 5.0) -> dict:
        """Server statistics, without opening a channel (for ``pleserver stats``)."""
        path = server_socket(socket_path)
        with _connect_socket(path, timeout) as sock:
            _send_hello(sock, "stats")
            _expect(sock, p.MessageType.WELCOME, path)
            p.send_message(sock, {"type": p.MessageType.STATS.value})
            reply = _expect(sock, p.MessageType.STATS, path)
            p.send_message(sock, {"type": p.MessageType.BYE.value})
            return reply["stats"]

    @classmethod
    def query_tables(cls, socket_path: str | None = None, timeout: float = 5.0) -> list[TableInfo]:
        """The tables a server serves (its hello answer), without opening a
        channel: cheap enough to ask every server of a host."""
        path = server_socket(socket_path)
        with _connect_socket(path, timeout) as sock:
            _send_hello(sock, "tables")
            welcome = _expect(sock, p.MessageType.WELCOME, path)
            p.send_message(sock, {"type": p.MessageType.BYE.value})
        try:
            return [TableInfo.from_wire(t) for t in welcome["tables"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolMismatch(
                f"ple-server at {path} sent an unusable table list: {exc}"
            ) from None

    @property
    def features(self) -> tuple[str, ...]:
        """What the server offers beyond the base protocol (WELCOME ``features``)."""
        features = self.server_info.get("features")
        return (
            tuple(f for f in features if isinstance(f, str)) if isinstance(features, list) else ()
        )

    def _open_channel(self, capacity: int | None, depth: int | None, gpu_driven: bool) -> None:
        request: dict[str, str | int | bool] = {"type": p.MessageType.OPEN_CHANNEL.value}
        if gpu_driven:
            request["gpu_driven"] = True
            request["rung_word"] = True  # its stream writes the rung word (protocol.py)
        if capacity is not None:
            request["capacity"] = int(capacity)
        if depth is not None:
            request["depth"] = int(depth)
        p.send_message(self._sock, request)
        reply, fds = _expect_with_fds(self._sock, p.MessageType.CHANNEL, self.socket_path)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolMismatch(f"CHANNEL reply carried {len(fds)} fds, expected 1")
        try:
            layout = p.ChannelLayout.from_wire(reply["layout"])
            self._channel = ChannelMap(fds[0], layout)
        except (KeyError, TypeError, ValueError) as exc:
            os.close(fds[0])
            raise ProtocolMismatch(
                f"ple-server at {self.socket_path} sent an unusable channel: {exc}"
            ) from None
        if gpu_driven:
            self._segment_fd = fds[0]
        else:
            os.close(fds[0])
        if bool(reply.get("gpu_driven", False)) != gpu_driven:
            self.close()
            raise ProtocolMismatch(
                f"ple-server at {self.socket_path} opened a channel that is "
                f"{'not ' if gpu_driven else ''}GPU-driven, as this client did not ask"
            )
        self.gpu_driven = gpu_driven
        owner = SlotOwner.STREAM if gpu_driven else SlotOwner.FREE
        self._slots = SlotPool(self._channel, owner, self._check_alive)
        self._sequence = self._channel.submit_counter
        self._sock.setblocking(False)

    # ------------------------------------------------------------- reconnect
    def reconnect(self, window: float = DEFAULT_WINDOW_S, timeout: float | None = None) -> None:
        """Replace a session the server ended (``ServerGone``: it stopped,
        restarted or crashed) with a new one on the same socket, trying with
        backoff for up to ``window`` seconds (``ServerUnavailable`` past it);
        this object stays the one to use::

            try:
                rows = client.lookup(3, ids)
            except ServerGone:
                client.reconnect()
                rows = client.lookup(3, ids)

        A CPU channel is opened anew: requests in flight are void (their
        ``Ticket.wait`` raises ServerGone; submit them again) and
        ``segment_buffer`` is another buffer. A GPU-driven channel keeps its
        segment, which the new server adopts, so the addresses a captured CUDA
        graph holds stay valid and the lookups it has rung are answered by the
        new server (``pleclient.protocol``, "A server restart under a
        GPU-driven channel"); the new server must serve the same tables, in
        the same order (a server that does not is tried again within the
        window, as one still being replaced would be). ``timeout``: one try's
        connect and handshake (default: the connect timeout)."""
        reconnect_within(
            lambda: self._reconnect_once(self._connect_timeout if timeout is None else timeout),
            window_s=window,
            socket=self.socket_path,
        )

    def _reconnect_once(self, timeout: float) -> None:
        path = self.socket_path
        name, capacity, depth = self._opened
        sock = _connect_socket(path, timeout)
        try:
            _send_hello(sock, name)
            welcome = _expect(sock, p.MessageType.WELCOME, path)
            if welcome.get("version") != p.PROTOCOL_VERSION:
                raise ProtocolMismatch(
                    f"ple-server at {path} speaks protocol {welcome.get('version')!r}, this "
                    f"client speaks {p.PROTOCOL_VERSION}; install matching pleserver versions"
                )
            tables = [TableInfo.from_wire(t) for t in welcome["tables"]]
            features = welcome.get("features") or []
            if self.gpu_driven and p.FEATURE_ADOPT not in features:
                raise ProtocolMismatch(
                    f"ple-server {welcome.get('server', '?')} at {path} cannot adopt this "
                    "client's GPU-driven channel; install the same pleserver version on both "
                    "sides"
                )
            if self.gpu_driven and tables != self.tables:
                raise _NotSameTables(
                    f"ple-server at {path} now serves other tables ({_names(tables)}) than "
                    f"this client's GPU-driven channel was opened with ({_names(self.tables)}): "
                    "the lookups its CUDA graphs replay name tables by index; start the "
                    "server on the same checkpoint, or restart this client"
                )
        except BaseException:
            sock.close()
            raise
        with self._lock:
            old, self._sock = self._sock, sock
            old.close()
            self.server_info = {k: v for k, v in welcome.items() if k != "tables"}
            self.tables = tables
            self._by_name = {t.name: t for t in tables}
            self._index = {t.name: i for i, t in enumerate(tables)}
            self._reader = p.FrameReader()
            self._gone = None
            self.sessions += 1
            if self.gpu_driven:
                self._adopt_channel(capacity, depth)
            else:
                self._close_channel()
                self._open_channel(capacity, depth, False)

    def _adopt_channel(self, capacity: int | None, depth: int | None) -> None:
        """Hand the kept segment to the new server: its slots the dead server
        claimed and never answered are rung again, so the new one serves them."""
        channel = self._require_channel()
        assert self._segment_fd is not None  # (a GPU-driven channel keeps it)
        channel.offer_for_adoption()
        request = {
            "type": p.MessageType.OPEN_CHANNEL.value,
            "gpu_driven": True,
            "rung_word": True,
            "adopt": True,
            "capacity": channel.layout.capacity,
            "depth": channel.layout.depth,
        }
        p.send_message(self._sock, request, fds=[self._segment_fd])
        reply, fds = _expect_with_fds(self._sock, p.MessageType.CHANNEL, self.socket_path)
        for fd in fds:
            os.close(fd)
        try:
            layout = p.ChannelLayout.from_wire(reply["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolMismatch(
                f"ple-server at {self.socket_path} answered an adoption with an unusable "
                f"layout: {exc}"
            ) from None
        if reply.get("adopted") is not True or layout != channel.layout:
            raise ProtocolMismatch(
                f"ple-server at {self.socket_path} did not adopt this client's channel as it "
                f"is (adopted {reply.get('adopted')!r}, layout {layout} for {channel.layout})"
            )
        self._sock.setblocking(False)

    # ----------------------------------------------------------------- lookup
    @property
    def capacity(self) -> int:
        return self._require_channel().layout.capacity

    @property
    def depth(self) -> int:
        return self._require_channel().layout.depth

    @property
    def free_slots(self) -> int:
        """Slots no unreleased ticket holds: how many ``submit`` calls can
        follow before a ticket must be released (none on a GPU-driven channel)."""
        return self.slots.free

    @property
    def slots(self) -> SlotPool:
        """Who holds each slot of the channel (``pleclient.slots``)."""
        self._require_channel()
        assert self._slots is not None  # (opened with the channel)
        return self._slots

    @property
    def segment_buffer(self) -> memoryview:
        """The whole channel segment (page-aligned rows areas), e.g. for
        ``cudaHostRegister``; valid until ``close``."""
        return self._require_channel().buf

    def table(self, key: str | int) -> TableInfo:
        """A table by name or by layer index."""
        if isinstance(key, str):
            if key in self._by_name:
                return self._by_name[key]
        else:
            matches = [t for t in self.tables if t.layer == key]
            if len(matches) == 1:
                return matches[0]
        known = ", ".join(f"{t.name} (layer {t.layer})" for t in self.tables)
        raise KeyError(
            f"ple-server at {self.socket_path} serves no single table {key!r}; it serves: {known}"
        )

    def table_index(self, table: str | int | TableInfo) -> int:
        """The index a request names ``table`` by (its place in WELCOME's list)."""
        info = table if isinstance(table, TableInfo) else self.table(table)
        return self._index[info.name]

    def _request_of(
        self, table: str | int | TableInfo, ids, verb: str
    ) -> tuple[TableInfo, np.ndarray, ChannelMap]:
        """What ``submit`` and ``hint`` check first: the table, the ids as one
        flat array, and a CPU-driven channel to a server that is not gone."""
        info = table if isinstance(table, TableInfo) else self.table(table)
        flat = np.asarray(ids).reshape(-1)
        channel = self._require_channel()
        if self.gpu_driven:
            raise PleError(
                "this client's channel is GPU-driven: its slots are rung by a CUDA "
                f"stream (pleclient.gpu.GpuLookups), not by {verb}()"
            )
        if self._gone:
            raise ServerGone(self._gone)
        return info, flat, channel

    def _fill(self, slot: SlotView, info: TableInfo, ids: np.ndarray, kind: int) -> None:
        """Write a request into ``slot`` with the next sequence number (under
        ``_lock``; the caller publishes the submit counter)."""
        slot.submit(self._index[info.name], ids, self._sequence, time.monotonic_ns(), kind)
        self._sequence = (self._sequence + 1) & 0xFFFFFFFF

    def submit(self, table: str | int | TableInfo, ids) -> Ticket:
        """Queue a lookup of ``ids`` (≤ capacity) and return its ticket."""
        info, ids, channel = self._request_of(table, ids, "submit")
        n = ids.shape[0]
        if n > channel.layout.capacity:
            raise ValueError(
                f"{n} ids exceed the channel capacity of "
                f"{channel.layout.capacity}; use lookup(), which splits"
            )
        with self._lock:
            slot = self.slots.take(self.timeout)
            if slot is None:
                raise LookupTimeout(
                    f"ple-server at {self.socket_path} did not answer the released "
                    f"requests holding this channel's slots within {self.timeout:.3g} s"
                )
            self._fill(slot, info, ids, p.RequestKind.LOOKUP)
            channel.publish_submit(self._sequence)
        return Ticket(self, slot, info, n)

    @property
    def hints_supported(self) -> bool:
        """Whether the server reads prefetch hints (WELCOME ``features``)."""
        return p.FEATURE_HINTS in self.features

    def hint(self, table: str | int | TableInfo, ids, *, wait: float = 0.0) -> None:
        """Tell the server the rows of ``ids`` will be needed soon: it reads
        those it does not hold into its row cache, below every lookup, so a
        later ``lookup`` of them is a cache hit. Returns nothing and, with
        ``wait`` 0, never blocks: the ids go into free slots of the channel
        (``capacity`` a slot), and what finds no free slot is skipped, counted
        in ``hints_skipped`` (as are all hints to a server without them:
        ``hints_supported``). A hint's slot comes back once the server has
        admitted it (at once, before any read): a thread of its own that
        hints more ids than the slots hold may ``wait`` up to that many
        seconds for each slot to come back before it skips the rest. Whether
        the server read them, dropped them (disk saturated, queue or cache
        budget full) or refused them (bad ids) is in its stats, per table
        (``hints_*``)."""
        info, ids, channel = self._request_of(table, ids, "hint")
        n = ids.shape[0]
        if not self.hints_supported:
            self.skip_hints(n)
            return
        cap = channel.layout.capacity
        sent = 0
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                published = sent
                while sent < n:
                    slot = self.slots.take_for_hint()
                    if slot is None:
                        break
                    piece = ids[sent : sent + cap]
                    self._fill(slot, info, piece, p.RequestKind.HINT)
                    sent += piece.shape[0]
                if sent > published:
                    channel.publish_submit(self._sequence)  # E1: every hint slot before it
                    deadline = time.monotonic() + wait  # a slot came back: wait again
                self.hints_sent += sent - published
            if sent >= n or wait <= 0 or time.monotonic() >= deadline:
                break
            time.sleep(HINT_SLOT_POLL_S)  # the lock released: lookups go on meanwhile
        with self._lock:
            self.hints_skipped += n - sent

    def skip_hints(self, n: int) -> None:
        """Count ``n`` hinted ids not sent to a server that reads no hints
        (said once in the log)."""
        self.hints_skipped += n
        if not self._hints_unsupported_logged:
            self._hints_unsupported_logged = True
            log.info(
                "ple-server %s at %s reads no prefetch hints: hints are skipped "
                "(lookups work as before; upgrade the server to use them)",
                self.server_info.get("server", "?"),
                self.socket_path,
            )

    def lookup(
        self, table: str | int | TableInfo, ids, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Rows of ``ids`` in order, copied into ``out`` (or a new array). Any
        number of ids: larger requests are split and pipelined over the slots."""
        info = table if isinstance(table, TableInfo) else self.table(table)
        ids = np.asarray(ids).reshape(-1)
        n = ids.shape[0]
        if out is None:
            out = np.empty((n, info.row_bytes), dtype=np.uint8)
        elif out.shape != (n, info.row_bytes) or out.dtype != np.uint8:
            raise ValueError(
                f"out must be uint8 {(n, info.row_bytes)}, got {out.dtype} {out.shape}"
            )
        cap = self.capacity
        if n <= cap:
            ticket = self.submit(info, ids)
            try:
                out[:] = ticket.wait()
            finally:
                ticket.release()
            return out
        in_flight: list[tuple[int, Ticket]] = []
        window = max(1, self.depth - 1)
        try:
            for start in range(0, n, cap):
                if len(in_flight) >= window:
                    s, t = in_flight.pop(0)
                    out[s : s + t.count] = t.wait()
                    t.release()
                in_flight.append((start, self.submit(info, ids[start : start + cap])))
            while in_flight:
                s, t = in_flight.pop(0)
                out[s : s + t.count] = t.wait()
                t.release()
        finally:
            for _, t in in_flight:
                t.release()
        return out

    def stats(self) -> dict:
        """Server statistics over this session's control socket."""
        if self._gone:
            raise ServerGone(self._gone)
        with self._lock:
            self._sock.setblocking(True)
            self._sock.settimeout(self.timeout)
            try:
                p.send_message(self._sock, {"type": p.MessageType.STATS.value})
                return _expect(self._sock, p.MessageType.STATS, self.socket_path)["stats"]
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ServerGone(
                    f"ple-server at {self.socket_path} closed the connection "
                    f"({exc.strerror}: stopped, restarted or crashed); reconnect "
                    "with PleClient.connect()"
                ) from None
            finally:
                self._sock.setblocking(False)

    def _check_alive(self) -> None:
        if self._gone:
            raise ServerGone(self._gone)
        if self._pid != os.getpid():
            raise PleError("a PleClient cannot be used across fork(); connect again in the child")
        readable, _, _ = select.select([self._sock], [], [], 0)
        if not readable:
            return
        try:
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, why = b"", str(exc)
        else:
            why = "closed the connection"
        if not data:
            self._gone = (
                f"ple-server at {self.socket_path} {why} (stopped, restarted "
                "or crashed); reconnect with PleClient.reconnect()"
            )
        else:
            try:
                messages = self._reader.feed(data)
            except p.FrameError as exc:  # the session cannot be read any further
                raise ProtocolMismatch(
                    f"ple-server at {self.socket_path} sent a malformed frame: {exc}"
                ) from None
            for msg in messages:
                if msg["type"] == p.MessageType.SHUTDOWN.value:
                    self._gone = (
                        f"ple-server at {self.socket_path} is shutting down "
                        f"({msg.get('reason', 'no reason given')}); reconnect "
                        "once it is back"
                    )
                elif msg["type"] == p.MessageType.ERROR.value:  # then it closes the session
                    self._gone = (
                        f"ple-server at {self.socket_path} ended this session: "
                        f"{msg.get('message', 'no reason given')}"
                    )
        if self._gone:
            raise ServerGone(self._gone)

    def poll_gone(self) -> str | None:
        """Why the server is gone, or None while the session stands (reads
        what the server sent, never blocks; for a watchdog thread)."""
        with self._lock:
            try:
                self._check_alive()
            except ServerGone as exc:
                return str(exc)
            except PleError as exc:  # malformed frames: the session is unusable
                return str(exc)
        return None

    @property
    def channel(self) -> ChannelMap:
        """The mapped channel (GPU-driven lookups ring its slots directly)."""
        return self._require_channel()

    def _require_channel(self) -> ChannelMap:
        if self._channel is None:
            raise PleError("this client is closed")
        return self._channel

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """End the session; the server frees its channel. Idempotent."""
        if self._channel is None and self._sock.fileno() < 0:
            return
        try:
            if not self._gone and self._sock.fileno() >= 0 and self._pid == os.getpid():
                self._sock.setblocking(True)
                self._sock.settimeout(1.0)
                p.send_message(self._sock, {"type": p.MessageType.BYE.value})
        except OSError:
            pass
        self._close_channel()
        if self._segment_fd is not None:
            os.close(self._segment_fd)
            self._segment_fd = None
        self._sock.close()

    def _close_channel(self) -> None:
        if self._channel is not None:
            assert self._slots is not None
            self._slots.close()
            self._channel.close()
            self._channel = None

    def __enter__(self) -> PleClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._pid == os.getpid():
                self.close()
        except Exception:
            pass


def _connect_socket(path: str, timeout: float) -> socket.socket:
    """A socket connected to ``path`` within ``timeout``. A server whose queue of
    connections waiting for accept is full (EAGAIN: a burst of clients, or
    another process flooding it) is tried again, and so is one that refuses
    while it still listens; each with a backoff from ``CONNECT_RETRY_FIRST_S``
    to ``CONNECT_RETRY_MAX_S``, until ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = CONNECT_RETRY_FIRST_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except FileNotFoundError:
            sock.close()
            raise ServerUnavailable(
                f"socket {path} not found: is the ple-server service running? "
                "`systemctl status ple-server` (or set PLE_SERVER_SOCKET / pass socket_path)"
            ) from None
        except BlockingIOError:  # EAGAIN: the queue is full; room comes with each accept
            sock.close()
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"ple-server at {path} took no new connection within {timeout:.3g} s: "
                    "its queue of connections stayed full (overloaded, or flooded by "
                    "another process); see `systemctl status ple-server` and its journal"
                ) from None
        except ConnectionRefusedError:
            sock.close()
            wrong = _not_a_socket(path)
            if wrong:
                raise ServerUnavailable(wrong) from None
            if not _listening(path) or time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"nothing listens on {path} (a stale socket of a stopped server): "
                    "`systemctl start ple-server`"
                ) from None
        except PermissionError:
            sock.close()
            raise ServerUnavailable(
                f"permission denied on {path}: this user may not reach the socket; see "
                "allow_uids/allow_gids in the ple-server configuration"
            ) from None
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(
                _not_a_socket(path) or f"cannot connect to {path}: {exc}"
            ) from None
        time.sleep(delay * random.uniform(0.5, 1.0))  # spread the retries of many clients
        delay = min(2 * delay, CONNECT_RETRY_MAX_S)


def _not_a_socket(path: str) -> str | None:
    """What ``path`` is when it is not a socket (a directory, a regular file:
    a misread setting), said with the fix; None for a socket or no answer."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return (
            f"{path} is a directory, not ple-server's socket: pass the socket's own path "
            f"(e.g. {os.path.join(path, 'ple.sock')}) as PLE_SERVER_SOCKET or socket_path"
        )
    if not stat.S_ISSOCK(mode):
        return (
            f"{path} is a {'regular file' if stat.S_ISREG(mode) else 'file'}, not a socket: "
            "pass the path of ple-server's socket (its `socket` setting, "
            f"{p.DEFAULT_SOCKET} by default) as PLE_SERVER_SOCKET or socket_path"
        )
    return None


def _listening(path: str) -> bool:
    """Whether a socket bound to ``path`` listens now (``/proc/net/unix``, this
    network namespace's): a refusal from it is passing, one from a stale
    socket file is not."""
    names = {path, os.path.abspath(path)}
    try:
        with open("/proc/net/unix") as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split(None, 7)
                # Flags __SO_ACCEPTCON (0x10000): listen() was called on it.
                if (
                    len(fields) == 8
                    and int(fields[3], 16) & 0x10000
                    and fields[7].rstrip("\n") in names
                ):
                    return True
    except (OSError, ValueError):
        pass
    return False


def _send_hello(sock: socket.socket, name: str) -> None:
    try:
        p.send_message(
            sock,
            {
                "type": p.MessageType.HELLO.value,
                "version": p.PROTOCOL_VERSION,
                "pid": os.getpid(),
                "name": name[: p.MAX_NAME_CHARS],
            },
        )
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused on accept (not allowed, too many clients): the reason waits unread


def _expect(sock: socket.socket, kind: p.MessageType, path: str) -> dict:
    msg, fds = _expect_with_fds(sock, kind, path)
    for fd in fds:
        os.close(fd)
    return msg


def _expect_with_fds(sock: socket.socket, kind: p.MessageType, path: str) -> tuple[dict, list[int]]:
    try:
        msg, fds = p.recv_message(sock)
    except TimeoutError:
        raise LookupTimeout(f"ple-server at {path} did not answer {kind.value!r} in time") from None
    except p.FrameError as exc:
        raise ProtocolMismatch(f"ple-server at {path} sent a malformed frame: {exc}") from None
    except ConnectionResetError:
        msg, fds = None, []
    if msg is None:
        raise ServerGone(
            f"ple-server at {path} closed the connection while this client "
            f"waited for {kind.value!r}"
        )
    if msg["type"] == p.MessageType.SHUTDOWN.value:
        raise ServerGone(
            f"ple-server at {path} is shutting down "
            f"({msg.get('reason', 'no reason given')}); reconnect once it is back"
        )
    if msg["type"] == p.MessageType.ERROR.value:
        for fd in fds:
            os.close(fd)
        code, text = msg.get("code", p.ErrorCode.INTERNAL), msg.get("message", "")
        if code == p.ErrorCode.VERSION_MISMATCH:
            raise ProtocolMismatch(text)
        if code == p.ErrorCode.TOO_MANY_CLIENTS:
            raise TooManyClients(text)
        if code == p.ErrorCode.NOT_ALLOWED:
            raise AccessDenied(text)
        raise RequestError(code, text)
    if msg["type"] != kind.value:
        raise ProtocolMismatch(
            f"ple-server at {path} answered {msg['type']!r} where {kind.value!r} was expected"
        )
    return msg, fds


class _NotSameTables(ProtocolMismatch):
    """The server a GPU-driven client reconnected to serves other tables."""


def _names(tables: list[TableInfo]) -> str:
    return ", ".join(f"{t.name} ({t.fingerprint or 'no fingerprint'})" for t in tables) or "none"
