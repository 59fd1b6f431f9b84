"""The hot set: the row cache's keys saved to the state directory, and the
refill of the cache from them after a restart.

A restarted server with an empty cache reads every hot row from disk again,
one miss at a time as requests ask for them; refilled from the saved keys, it
reads them at the miss engine's full queue depth before the requests do, so
the warm hit rate comes back in seconds.

File (``<state_dir>/hotset.bin``, little-endian)::

    +---------+---------+------------+------------------+----------------+----------+
    | magic 8 | version | header_len | header: JSON     | keys: u64 ×    | SHA-256  |
    | PLEHOTS | u32 = 1 | u32        | (tables, count)  | count          | 32 bytes |
    +---------+---------+------------+------------------+----------------+----------+

The header names each table's key (its number in the cache keys), name, rows
and checkpoint fingerprint; the checksum covers every byte before it. A file
that is short, corrupt, of another version or of another checkpoint (the
fingerprints differ) is ignored with a WARNING and never trusted: every key is
also checked against its table's rows before any read. Written atomically
(temp file, fsync, rename, fsync of the directory), so a crash mid-save leaves
the previous file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from pleserver.table import KEY_ROW_BITS, Table

log = logging.getLogger(__name__)

MAGIC = b"PLEHOTS\0"
VERSION = 1
FILE_NAME = "hotset.bin"
PREFIX = struct.Struct("<8sII")
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 1 << 20
STOP_JOIN_S = 10.0
"""How long ``stop`` waits for the refill thread (a read stuck in the kernel
must not hold up the server's exit)."""
REFILL_CHUNK = 8192
"""Rows per ``fill`` call: enough to keep the miss engine's queue full, few
enough that a stop request is seen quickly."""
ROW_MASK = (1 << KEY_ROW_BITS) - 1


class HotSetError(ValueError):
    """The file cannot be trusted; the message says why."""


def identity(tables: list[Table]) -> list[dict]:
    """What a hot-set file must name to be ours: each table's key, name, rows
    and fingerprint."""
    return [
        {"key": t.key, "name": t.spec.name, "rows": t.rows, "fingerprint": t.spec.fingerprint}
        for t in tables
    ]


def encode(tables: list[Table], keys: np.ndarray) -> bytes:
    keys = np.ascontiguousarray(keys, dtype="<u8")
    header = json.dumps(
        {"tables": identity(tables), "count": int(keys.size)}, separators=(",", ":")
    ).encode()
    body = PREFIX.pack(MAGIC, VERSION, len(header)) + header + keys.tobytes()
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, tables: list[Table]) -> np.ndarray:
    """The keys of a hot-set file, checked against ``tables``; raises
    ``HotSetError`` naming the first problem."""
    if len(data) < PREFIX.size + DIGEST_BYTES:
        raise HotSetError(f"{len(data)} bytes, shorter than any hot-set file (truncated)")
    magic, version, header_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise HotSetError("not a hot-set file (bad magic)")
    if version != VERSION:
        raise HotSetError(f"format version {version}, this server reads {VERSION}")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise HotSetError("checksum mismatch (truncated or corrupt)")
    if header_len > min(MAX_HEADER_BYTES, len(body) - PREFIX.size):
        raise HotSetError(f"header length {header_len} runs past the file")
    try:
        header = json.loads(body[PREFIX.size : PREFIX.size + header_len])
        named, count = header["tables"], int(header["count"])
    except (ValueError, KeyError, TypeError) as exc:
        raise HotSetError(f"malformed header ({exc})") from None
    if named != identity(tables):
        raise HotSetError("it was saved for another checkpoint (table fingerprints differ)")
    raw = body[PREFIX.size + header_len :]
    if count < 0 or len(raw) != count * 8:
        raise HotSetError(f"{len(raw)} bytes of keys for a count of {count}")
    keys = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    table_keys = keys >> np.uint64(KEY_ROW_BITS)
    rows = keys & np.uint64(ROW_MASK)
    limits = np.zeros(len(tables), dtype=np.uint64)
    for t in tables:
        limits[t.key] = t.rows
    if keys.size and (
        int(table_keys.max()) >= len(tables)
        or bool(np.any(rows >= limits[np.minimum(table_keys, len(tables) - 1).astype(np.int64)]))
    ):
        raise HotSetError("it holds keys outside the tables' rows")
    return keys


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


class HotSet:
    """Refills the cache from the saved file (first, in a thread), then saves
    the cache's keys every ``interval_s`` and at ``stop``.

    States: pending → refilling → done | budget (the cache filled first) |
    none (no file) | ignored (untrusted file) | stopped | failed."""

    def __init__(
        self,
        state_dir: str,
        tables: list[Table],
        cache,
        interval_s: float,
        on_progress: Callable[[HotSet], None] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, FILE_NAME)
        self.tables = tables
        self.cache = cache
        self.interval_s = interval_s
        self.on_progress = on_progress
        self.state = "pending"
        self.target_rows = 0  # keys the refill means to read
        self.done_rows = 0  # keys read so far (inserted or already cached)
        self.refill_seconds: float | None = None
        self.saved_rows: int | None = None
        self.saved_at: float | None = None  # time.time() of the last save
        self.save_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._save_lock = threading.Lock()

    # ---------------------------------------------------------------- thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hotset", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the refill and the periodic saves; save once more, unless the
        refill did not finish (the file on disk then still holds more)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)
            if self._thread.is_alive():
                log.warning(
                    "hot set: the refill thread did not stop within %.0f s (a read "
                    "stuck in the kernel?); not saved at stop",
                    STOP_JOIN_S,
                )
                return
        if self.state in ("refilling", "stopped", "pending"):
            log.info(
                "hot set: not saved at stop (the refill did not finish; %s keeps the previous set)",
                self.path,
            )
            return
        self.save()

    def wait(self, timeout: float | None = None) -> None:
        """Until the refill is over (a test and benchmark helper)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state in ("pending", "refilling"):
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.01)

    @property
    def fraction(self) -> float:
        return self.done_rows / self.target_rows if self.target_rows else 1.0

    def snapshot(self) -> dict:
        return {
            "state": self.state,
            "file": self.path,
            "target_rows": self.target_rows,
            "done_rows": self.done_rows,
            "fraction": round(self.fraction, 4),
            "refill_seconds": self.refill_seconds,
            "saved_rows": self.saved_rows,
            "saved_unix": self.saved_at,
            "save_error": self.save_error,
            "save_interval_s": self.interval_s,
        }

    def _run(self) -> None:
        try:
            self._refill()
        except Exception:
            self.state = "failed"
            log.exception(
                "hot set: refill failed; serving continues with the cache filling from requests"
            )
        finally:
            if self.on_progress:
                self.on_progress(self)
        while self.interval_s > 0 and not self._stop.wait(self.interval_s):
            self.save()

    # ---------------------------------------------------------------- refill
    def load(self) -> np.ndarray | None:
        """The saved keys, or None (no file, or a file not to trust: logged)."""
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            fd = os.open(
                self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            )
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._ignore(
                "a symbolic link (never followed)"
                if exc.errno == errno.ELOOP
                else f"cannot open it ({exc.strerror or exc})"
            )
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise HotSetError(f"not a regular file ({_kind(st.st_mode)})")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            return decode(data, self.tables)
        except HotSetError as exc:
            self._ignore(str(exc))
        except OSError as exc:
            self._ignore(f"cannot read it ({exc.strerror or exc})")
        finally:
            os.close(fd)
        return None

    def _ignore(self, why: str) -> None:
        log.warning(
            "hot set: ignoring %s: %s; starting with an empty cache (the next save replaces it)",
            self.path,
            why,
        )
        self.state = "ignored"

    def _refill(self) -> None:
        started = time.monotonic()
        keys = self.load()
        if keys is None:
            if self.state != "ignored":
                self.state = "none"
                log.info(
                    "hot set: no saved hot set at %s; the cache fills from requests", self.path
                )
            return
        in_file = int(keys.size)
        self.target_rows = min(in_file, int(self.cache.capacity_rows))
        keys = keys[: self.target_rows]
        self.state = "refilling"
        log.info(
            "hot set: refilling the row cache with %d rows from %s", self.target_rows, self.path
        )
        last_report = 0.0
        table_keys = keys >> np.uint64(KEY_ROW_BITS)
        for table in self.tables:
            rows = np.sort(
                (keys[table_keys == table.key] & np.uint64(ROW_MASK)).astype(np.int64)
            )  # ascending: neighbouring blocks
            for start in range(0, rows.size, REFILL_CHUNK):
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                if table.problem:  # its file changed: nothing of it is read any more
                    break
                table.fill(rows[start : start + REFILL_CHUNK])
                self.done_rows += min(REFILL_CHUNK, rows.size - start)
                now = time.monotonic()
                if now - last_report >= 1.0:
                    last_report = now
                    if self.on_progress:
                        self.on_progress(self)
        self.refill_seconds = time.monotonic() - started
        self.state = "budget" if in_file > self.target_rows else "done"
        log.info(
            "hot set: refilled %d of the %d saved rows in %.1f s%s",
            self.done_rows,
            in_file,
            self.refill_seconds,
            " (the cache holds no more)" if self.state == "budget" else "",
        )

    # ------------------------------------------------------------------ save
    def save(self) -> bool:
        """Write the cache's keys atomically; False (logged) when it cannot."""
        with self._save_lock:
            keys = self.cache.keys()
            data = encode(self.tables, keys)
            tmp = f"{self.path}.tmp.{os.getpid()}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.path)
                dir_fd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            except OSError as exc:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if self.save_error is None:
                    log.warning(
                        "hot set: cannot save %s (%s); check that state_dir is "
                        "writable by the server's user",
                        self.path,
                        exc.strerror or exc,
                    )
                self.save_error = str(exc.strerror or exc)
                return False
            self.save_error = None
            self.saved_rows, self.saved_at = int(keys.size), time.time()
            log.debug("hot set: saved %d keys to %s", keys.size, self.path)
            return True
