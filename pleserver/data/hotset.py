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

What the state directory may hold is not trusted either, since whoever may
write the directory chooses it:

- the directory must be writable by this server's uid alone, and owned by it
  (or root); otherwise the hot set is neither restored nor saved, with an
  ERROR that says how to fix it (``check_state_dir``);
- the file is opened ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link is refused,
  and a FIFO can never block the open) and must be a regular file whose size
  fits these tables: the header's bytes and one key per row at most. Its
  magic, version, header (every field's type, no number that is not finite,
  no nesting deeper than a saved header's) and size are checked before its
  keys are read, and the keys are read and hashed as a stream, keeping only
  those the cache can hold: loading takes memory for the cache's keys, not
  for the file;
- a save opens the directory again by its path, with the same checks (so a
  directory removed and made again under the server is saved into, and one
  that another uid may now write is refused), and writes a temp file
  created ``O_EXCL | O_NOFOLLOW`` under a random name in it, so no link
  planted there is ever followed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from pleserver.data.tables import KEY_ROW_BITS, Table
from pleserver.observe.snapshot import HotsetSnapshot

log = logging.getLogger("pleserver.hotset")

MAGIC = b"PLEHOTS\0"
VERSION = 1
FILE_NAME = "hotset.bin"
TEMP_PREFIX = FILE_NAME + ".tmp."
PREFIX = struct.Struct("<8sII")
KEY_BYTES = 8
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 1 << 20
MAX_HEADER_NESTING = 8
"""Bracket levels a header may nest: a saved one has 3 (the object, its list
of tables, a table)."""
STREAM_KEYS = 1 << 17
"""Keys read, checked and hashed at a time (1 MiB) when loading or saving."""
STOP_JOIN_S = 10.0
"""How long ``stop`` waits for the refill thread (a read stuck in the kernel
must not hold up the server's exit)."""
STOP_SAVE_S = 10.0
"""How long ``stop`` waits for its save (a state directory on a disk that no
longer answers must not hold up the server's exit either; the previous file
stays). With ``STOP_JOIN_S`` and the serving loop's drain, within the unit's
TimeoutStopSec=."""
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


class StateDirError(RuntimeError):
    """The state directory is not safe to use; the message says why and the fix."""


def open_state_dir(path: str) -> int:
    """A descriptor of the state directory, checked by ``check_state_dir``;
    FileNotFoundError when it does not exist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_state_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_state_dir(fd: int, path: str) -> None:
    """Raise StateDirError unless the directory is owned by this server's uid
    (or root) and writable by nobody else: whoever else may write it could
    plant a link there that the server would write through, or a FIFO it
    would block on."""
    st = os.fstat(fd)
    uid = os.geteuid()
    problems = []
    if st.st_uid not in (uid, 0):
        problems.append(f"owned by uid {st.st_uid}, not by this server's uid {uid}")
    writable = [
        who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit
    ]
    if writable:
        problems.append(
            f"writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):04o})"
        )
    if problems:
        raise StateDirError(
            f"state_dir {path} is {' and '.join(problems)}: whoever else may write it "
            "could make the server overwrite other files through links planted there; "
            "the hot set is neither restored nor saved. Give it to the server's user "
            f"alone: `chown {uid} {path} && chmod 0750 {path}` (the unit's "
            "StateDirectory= does)"
        )


def _header(tables: list[Table], count: int) -> bytes:
    return json.dumps(
        {"tables": identity(tables), "count": int(count)}, separators=(",", ":")
    ).encode()


def write_file(fd: int, tables: list[Table], keys: np.ndarray) -> None:
    """Write a hot-set file of ``keys`` to ``fd``, hashing as it goes (no copy
    of the keys is made)."""
    keys = np.ascontiguousarray(keys, dtype="<u8")
    header = _header(tables, keys.size)
    digest = hashlib.sha256()
    raw = keys.data.cast("B")
    parts = [PREFIX.pack(MAGIC, VERSION, len(header)) + header] + [
        raw[i : i + STREAM_KEYS * KEY_BYTES] for i in range(0, len(raw), STREAM_KEYS * KEY_BYTES)
    ]
    for part in parts:
        digest.update(part)
        _write_all(fd, part)
    _write_all(fd, digest.digest())


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def size_bounds(tables: list[Table]) -> tuple[int, int]:
    """The smallest and the largest size a hot-set file of ``tables`` can have:
    a key per row at most (the keys of a cache are distinct)."""
    smallest = PREFIX.size + DIGEST_BYTES
    return smallest, smallest + MAX_HEADER_BYTES + KEY_BYTES * sum(t.rows for t in tables)


def read_file(
    fd: int, tables: list[Table], keep: int, stop: threading.Event | None = None
) -> tuple[np.ndarray, int] | None:
    """The first ``keep`` keys of the hot-set file open at ``fd``, and how many
    it holds; None if ``stop`` was set meanwhile. Raises HotSetError naming
    the first problem. Every check that needs no key comes first (type, size,
    magic, version, header, count); then the keys are read, checked against
    their tables and hashed a slice at a time, and the checksum is compared
    at the end: memory for ``keep`` keys, whatever the file's size."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HotSetError(f"not a regular file ({_kind(st.st_mode)})")
    smallest, largest = size_bounds(tables)
    if st.st_size < smallest:
        raise HotSetError(f"{st.st_size} bytes, shorter than any hot-set file (truncated)")
    if st.st_size > largest:
        raise HotSetError(
            f"{st.st_size} bytes, more than a hot set of these tables can hold ({largest})"
        )
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        prefix = _read_exact(f, PREFIX.size)
        magic, version, header_len = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise HotSetError("not a hot-set file (bad magic)")
        if version != VERSION:
            raise HotSetError(f"format version {version}, this server reads {VERSION}")
        if header_len > min(MAX_HEADER_BYTES, st.st_size - smallest):
            raise HotSetError(f"header length {header_len} runs past the file")
        header = _read_exact(f, header_len)
        named, count = parse_header(header)
        key_bytes = st.st_size - smallest - header_len
        if count < 0 or key_bytes != count * KEY_BYTES:
            raise HotSetError(f"{key_bytes} bytes of keys for a count of {count}")
        if named != identity(tables):
            raise HotSetError("it was saved for another checkpoint (table fingerprints differ)")
        limits = np.zeros(len(tables), dtype=np.uint64)
        for t in tables:
            limits[t.key] = t.rows
        digest = hashlib.sha256(prefix)
        digest.update(header)
        kept = np.empty(min(keep, count), dtype=np.uint64)
        buf = bytearray(STREAM_KEYS * KEY_BYTES)
        done = 0
        while done < count:
            if stop is not None and stop.is_set():
                return None
            n = min(STREAM_KEYS, count - done)
            view = memoryview(buf)[: n * KEY_BYTES]
            _read_into(f, view)
            digest.update(view)
            keys = np.frombuffer(view, dtype="<u8")
            table_keys = keys >> np.uint64(KEY_ROW_BITS)
            if int(table_keys.max()) >= len(tables) or bool(
                np.any((keys & np.uint64(ROW_MASK)) >= limits[table_keys.astype(np.intp)])
            ):
                raise HotSetError("it holds keys outside the tables' rows")
            if done < kept.size:
                take = min(n, kept.size - done)
                kept[done : done + take] = keys[:take]
            done += n
        if _read_exact(f, DIGEST_BYTES) != digest.digest():
            raise HotSetError("checksum mismatch (truncated or corrupt)")
    return kept, count


HEADER_FIELDS: dict[str, type] = {"tables": list, "count": int}
TABLE_FIELDS: dict[str, type] = {"key": int, "name": str, "rows": int, "fingerprint": str}
"""What a header says, and of each table (``identity``), with their JSON types."""
_JSON_KINDS: dict[type, str] = {  # (bool before int: a bool is an int to Python)
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
}
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


def parse_header(header: bytes) -> tuple[list[dict], int]:
    """The tables and the key count a header names; raises HotSetError naming
    what is wrong. The checksum proves only that whoever wrote the file
    hashed it, not that a server did: every field is checked for its type
    (and a number for being finite) before anything compares or converts it,
    so a crafted header is refused as any damaged one is."""
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HotSetError(
            f"malformed header (not UTF-8: {exc.reason} at byte {exc.start})"
        ) from None
    if _nesting(text) > MAX_HEADER_NESTING:
        raise HotSetError(
            f"malformed header (nested deeper than the {MAX_HEADER_NESTING} levels "
            "a hot-set header has)"
        )
    try:
        parsed = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise HotSetError(f"malformed header ({exc})") from None
    _expect(parsed, dict, "the header")
    for name, kind in HEADER_FIELDS.items():
        if name not in parsed:
            raise HotSetError(f"malformed header (no {name!r})")
        _expect(parsed[name], kind, repr(name))
    for i, table in enumerate(parsed["tables"]):
        _expect(table, dict, f"table {i}")
        if set(table) != set(TABLE_FIELDS):
            raise HotSetError(
                f"malformed header (table {i} names {', '.join(sorted(table)) or 'nothing'}, "
                f"not {', '.join(TABLE_FIELDS)})"
            )
        for field, of in TABLE_FIELDS.items():
            _expect(table[field], of, f"table {i}'s {field!r}")
    return parsed["tables"], parsed["count"]


def _expect(value: object, kind: type, what: str) -> None:
    """Raise HotSetError unless ``value`` is of ``kind`` (``true`` is no
    integer here, though a bool is an int to Python)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HotSetError(
            f"malformed header ({what} is a JSON {_json_kind(value)}, not {_JSON_KINDS[kind]})"
        )


def _refuse_constant(name: str) -> float:
    """``NaN``, ``Infinity`` and ``-Infinity``, which Python's JSON reader
    takes though JSON has no such numbers; no field of ours can hold one."""
    raise ValueError(f"a non-finite number, {name}")


def _nesting(text: str) -> int:
    """How deep the brackets of a JSON text nest, strings left out, found
    before parsing: the parser recurses once a level, and a header of a
    million '[' would take it past Python's recursion limit."""
    outside = np.frombuffer(_JSON_STRING.sub("", text).encode(), dtype=np.uint8)
    steps = np.isin(outside, _OPENERS).astype(np.int64) - np.isin(outside, _CLOSERS)
    return int(np.cumsum(steps).max(initial=0))


def _json_kind(value: object) -> str:
    """What JSON calls the type of ``value``, as it was parsed."""
    for kind, name in _JSON_KINDS.items():
        if isinstance(value, kind):
            return name.split(" ", 1)[1]
    return "null"


def _read_exact(f, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(f, memoryview(buf))
    return bytes(buf)


def _read_into(f, view: memoryview) -> None:
    while view:
        got = f.readinto(view)
        if not got:
            raise HotSetError("the file ended early (truncated while read)")
        view = view[got:]


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

    Opens the state directory at once: FileNotFoundError when it does not
    exist, StateDirError when others may write it (``check_state_dir``).

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
        self.save_error: str | None = None  # why the last save failed (None: it did not)
        self.save_failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._save_lock = threading.Lock()
        self._stopped = False  # (under _save_lock) no save from now on
        # Names in the directory are looked up through a descriptor of it,
        # opened and then checked: the directory written to is the one
        # checked. Each save opens the path again (``_current_dir``), so a
        # directory removed and made anew under the server is saved into.
        self._dir_fd: int = open_state_dir(state_dir)
        self._remove_temp_files()

    # ---------------------------------------------------------------- thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hotset", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the refill and the periodic saves; save once more, unless the
        refill did not finish (the file on disk then still holds more). Takes
        at most ``STOP_JOIN_S`` + ``STOP_SAVE_S``, and never raises: a save
        that fails or hangs is logged, and the server stops all the same."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)
            if self._thread.is_alive():
                log.warning(
                    "hot set: its thread (the refill or a save) did not stop within "
                    "%.0f s (a read or write stuck in the kernel?); not saved at stop, "
                    "%s keeps the previous set",
                    STOP_JOIN_S,
                    self.path,
                )
                self._close(wait=False)
                return
        if self.state in ("refilling", "stopped", "pending"):
            log.info(
                "hot set: not saved at stop (the refill did not finish; %s keeps the previous set)",
                self.path,
            )
        else:
            # On a thread of its own, so that the stop can go on without it.
            saver = threading.Thread(target=self.save, name="hotset-save", daemon=True)
            saver.start()
            saver.join(STOP_SAVE_S)
            if saver.is_alive():
                log.warning(
                    "hot set: the save at stop did not finish within %.0f s (is the disk "
                    "of %s answering?); stopping without it, the previous file stays",
                    STOP_SAVE_S,
                    self.state_dir,
                )
                self._close(wait=False)
                return
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        """No save from now on; the directory closed, unless a save still
        holds it (``wait`` False: the process is about to exit anyway)."""
        if not self._save_lock.acquire(blocking=wait):
            self._stopped = True  # (that save holds the directory: left open)
            return
        try:
            self._stopped = True
            os.close(self._dir_fd)
        finally:
            self._save_lock.release()

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

    def snapshot(self) -> HotsetSnapshot:
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
            "save_failures": self.save_failures,
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
    def load(self) -> tuple[np.ndarray, int] | None:
        """The saved keys the cache can hold and how many the file holds, or
        None (no file, a file not to trust — logged —, or a stop meanwhile)."""
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer.
            fd = os.open(
                FILE_NAME,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                dir_fd=self._dir_fd,
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
            return read_file(fd, self.tables, int(self.cache.capacity_rows), self._stop)
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
        loaded = self.load()
        if loaded is None:
            if self._stop.is_set():
                self.state = "stopped"
            elif self.state != "ignored":
                self.state = "none"
                log.info(
                    "hot set: no saved hot set at %s; the cache fills from requests", self.path
                )
            return
        keys, in_file = loaded
        self.target_rows = int(keys.size)
        self.state = "refilling"
        log.info(
            "hot set: refilling the row cache with %d rows from %s", self.target_rows, self.path
        )
        last_report = 0.0
        keys.sort()  # in place: by table, then by row (ascending: neighbouring blocks)
        for table in self.tables:
            bounds = np.array([table.key, table.key + 1], dtype=np.uint64) << np.uint64(
                KEY_ROW_BITS
            )
            first, end = np.searchsorted(keys, bounds)
            for start in range(int(first), int(end), REFILL_CHUNK):
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                if table.problem:  # its file changed: nothing of it is read any more
                    break
                chunk = keys[start : min(start + REFILL_CHUNK, int(end))]
                table.fill((chunk & np.uint64(ROW_MASK)).astype(np.int64))
                self.done_rows += chunk.size
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
        """Write the cache's keys atomically; False (logged) when it cannot.
        Never raises: the periodic saver and the stop must outlive a save."""
        with self._save_lock:
            if self._stopped:
                return False
            try:
                return self._save()
            except Exception as exc:  # a bug, not the disk (_save handles OSError)
                log.exception("hot set: saving %s failed", self.path)
                self._save_failed(f"internal error: {exc}", logging.ERROR)
                return False

    def _save(self) -> bool:
        dir_fd = self._current_dir()
        if dir_fd is None:
            return False
        keys = self.cache.keys()
        # A name no one can have planted a link under, created only if new.
        tmp = TEMP_PREFIX + secrets.token_hex(8)
        created = False
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o640,
                dir_fd=dir_fd,
            )
            created = True
            try:
                write_file(fd, self.tables, keys)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, FILE_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            created = False
            os.fsync(dir_fd)
        except OSError as exc:
            if created:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
            self._save_failed(
                f"cannot save {self.path} ({exc.strerror or exc}): "
                + save_hint(exc, self.state_dir),
                logging.WARNING,
            )
            return False
        if self.save_error is not None:
            log.info("hot set: saved %d keys to %s again", keys.size, self.path)
        else:
            log.debug("hot set: saved %d keys to %s", keys.size, self.path)
        self.save_error = None
        self.saved_rows, self.saved_at = int(keys.size), time.time()
        return True

    def _current_dir(self) -> int | None:
        """The directory ``state_dir`` names now, opened and checked as at
        start (``open_state_dir``): the one held since, if it still is, else
        the one made in its place, which is held from now on. None (logged)
        when there is none to save into."""
        try:
            fd = open_state_dir(self.state_dir)
        except FileNotFoundError:
            self._save_failed(
                f"state_dir {self.state_dir} does not exist any more (removed or moved "
                "since the server opened it): the hot set is not saved until it is back; "
                "make it again, owned by the server's user (the unit's StateDirectory= "
                "does at the next start)",
                logging.WARNING,
            )
            return None
        except StateDirError as exc:
            self._save_failed(str(exc), logging.ERROR)
            return None
        except OSError as exc:
            self._save_failed(
                f"cannot open state_dir {self.state_dir} ({exc.strerror or exc}): "
                "the hot set is not saved",
                logging.ERROR,
            )
            return None
        held, now = os.fstat(self._dir_fd), os.fstat(fd)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            os.close(fd)
            return self._dir_fd
        log.info(
            "hot set: state_dir %s is another directory than the one opened before "
            "(removed or moved, and made again): saving into the new one",
            self.state_dir,
        )
        os.close(self._dir_fd)
        self._dir_fd = fd
        return fd

    def _save_failed(self, why: str, level: int) -> None:
        """Log why a save failed, once while the reason stays the same (a save
        is tried every interval); counted (stats, ``ple_hotset_save_failures_total``)."""
        if why != self.save_error:
            log.log(level, "hot set: not saved: %s", why)
        self.save_error = why
        self.save_failures += 1

    def _remove_temp_files(self) -> None:
        """Remove temp files of saves a crash interrupted (each has a name of
        its own, so they would pile up). Unlinking never follows a link."""
        removed = 0
        for name in os.listdir(self._dir_fd):
            if name.startswith(TEMP_PREFIX):
                try:
                    os.unlink(name, dir_fd=self._dir_fd)
                    removed += 1
                except OSError:
                    pass
        if removed:
            log.info(
                "hot set: removed %d temp files of interrupted saves from %s",
                removed,
                self.state_dir,
            )


def save_hint(exc: OSError, state_dir: str) -> str:
    """What to do about a save that failed with ``exc``, by its errno."""
    uid = os.geteuid()
    hints = {
        errno.ENOSPC: (
            f"the file system of {state_dir} is full: free space there (`df -h {state_dir}`)"
        ),
        errno.EDQUOT: f"uid {uid} is over its disk quota on {state_dir}'s file system",
        errno.EROFS: (
            f"the file system of {state_dir} is read-only (remounted so after a disk error? "
            "`dmesg`, `findmnt`); give state_dir a writable file system"
        ),
        errno.EACCES: (
            f"uid {uid} (the server's user) may not write {state_dir}: make it the server's "
            "(the unit's StateDirectory= does)"
        ),
        errno.EPERM: f"uid {uid} may not write in {state_dir} (a file attribute or mount option?)",
        errno.EIO: f"the disk of {state_dir} failed a write: check it (`dmesg`, SMART)",
    }
    return hints.get(
        exc.errno or 0, "check that state_dir is on a healthy file system, writable by the server"
    )
