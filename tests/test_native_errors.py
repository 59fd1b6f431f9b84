"""The native data plane under bad input and failing files: arguments checked
at the door (TypeError/ValueError, never a crash), read errors reported with
file, offset and errno, and the disk probe."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from pleclient.checkpoint import discover_tables
from pleserver import _native as nat
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint
from tests.host import require_o_direct
from tests.test_native_gather import Opened, file_rows, opened, specs  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def own_copy(tmp_path):
    """A checkpoint of its own (one file) that a test may truncate."""
    write_checkpoint(
        str(tmp_path),
        (SyntheticTable(layer=2, rows=5000, cols=160, dtype="BF16", parts=2),),
        files=1,
    )
    return discover_tables(str(tmp_path), fingerprint=False)[0]


@pytest.mark.parametrize("kind", ["auto", "threads"])
def test_truncated_file_gives_read_error_naming_file_and_offset(own_copy, kind):
    spec = own_copy
    expected = file_rows(spec)
    engine = nat.ReadEngine(queue_depth=8, kind=kind, threads=2)
    o = Opened(spec, "direct", engine=engine)
    try:
        path = spec.files[0]
        keep = spec.shards[1].offset + 100 * spec.row_bytes  # shard 1 keeps 100 rows
        os.truncate(path, keep)
        lost = np.array([spec.shard_size + 2000, 3, spec.shard_size + 2001], dtype=np.int64)
        with pytest.raises(nat.ReadError) as caught:
            o.gather(lost)
        exc = caught.value
        assert isinstance(exc, OSError) and exc.errno == errno.EIO
        assert path in str(exc) and "offset" in str(exc) and "short read" in str(exc)
        assert o.source.stats()["read_errors"] >= 1
        # Nothing wrong was cached; what is still on disk keeps being served.
        out = np.empty((lost.size, spec.row_bytes), np.uint8)
        assert o.source.gather_hits(lost, out) > 0
        ok = np.array([3, 4, spec.shard_size + 5, spec.shard_size + 99], dtype=np.int64)
        np.testing.assert_array_equal(o.gather(ok), expected[ok])
    finally:
        o.close()


@pytest.mark.parametrize("kind", ["auto", "threads"])
def test_read_error_from_the_kernel_carries_its_errno(tmp_path, kind):
    """An fd that every read refuses (a directory: EISDIR) gives ReadError
    with that errno, and the engine keeps working for other tables."""
    fd = os.open(tmp_path, os.O_RDONLY)
    cache = nat.RowCache(1 << 20, 160)
    engine = nat.ReadEngine(queue_depth=4, kind=kind, threads=2)
    try:
        assert os.fstat(fd).st_size >= 10 * 160
        src = nat.TableSource(5, 160, 10, [(fd, 0, 10, str(tmp_path), 0)], cache, engine, False)
        with pytest.raises(nat.ReadError) as caught:
            src.gather(np.array([4], dtype=np.int64), np.empty((1, 160), np.uint8))
        assert caught.value.errno == errno.EISDIR
        assert str(tmp_path) in str(caught.value) and "offset 0" in str(caught.value)
        assert src.stats()["read_errors"] == 1
        src.close()
        data = tmp_path / "rows"
        data.write_bytes(bytes(range(160)) * 10)
        with open(data, "rb") as f:
            src = nat.TableSource(
                6, 160, 10, [(f.fileno(), 0, 10, str(data), 0)], cache, engine, False
            )
        out = np.empty((2, 160), np.uint8)
        src.gather(np.array([9, 0], dtype=np.int64), out)
        assert (out == np.arange(160, dtype=np.uint8)).all()
        src.close()
    finally:
        os.close(fd)
        cache.close()
        engine.close()


@pytest.fixture
def fp8(specs, opened):
    return opened(specs["F8_E4M3"], "direct")


def test_ids_of_the_wrong_type_raise_type_error(fp8):
    out = np.empty((4, 160), np.uint8)
    for ids in (
        np.arange(4, dtype=np.int32),
        np.arange(4, dtype=np.float64),
        np.arange(8, dtype=np.int64)[::2],
        np.arange(4, dtype=np.int64).reshape(2, 2),
        [0, 1, 2, 3],
        "abcd",
    ):
        with pytest.raises(TypeError):
            fp8.source.gather(ids, out)


def test_out_of_the_wrong_shape_or_kind_raises(fp8):
    ids = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="need"):
        fp8.source.gather(ids, np.empty((3, 160), np.uint8))
    with pytest.raises(ValueError, match="need"):
        fp8.source.gather(ids, np.empty((4, 159), np.uint8))
    with pytest.raises(TypeError):
        fp8.source.gather(ids, np.empty((4, 80), np.uint16))
    with pytest.raises(TypeError):
        fp8.source.gather(ids, np.empty((4, 320), np.uint8)[:, ::2])
    readonly = np.empty((4, 160), np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fp8.source.gather(ids, readonly)
    with pytest.raises(ValueError, match="read-only"):
        fp8.source.gather_hits(ids, bytes(640))
    with pytest.raises(ValueError, match="threads"):
        fp8.source.gather(ids, np.empty((4, 160), np.uint8), 0)
    with pytest.raises(ValueError, match="need"):
        fp8.source.cached(ids, np.empty(3, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        fp8.source.cached(ids, bytes(4))
    with pytest.raises(TypeError):
        fp8.source.cached(ids.astype(np.int32), np.empty(4, np.uint8))


@pytest.mark.parametrize("bad", [-1, 20_011, 2**62, -(2**63)])
def test_ids_out_of_range_raise_value_error(fp8, bad):
    ids = np.array([0, 1, bad], dtype=np.int64)
    out = np.empty((3, 160), np.uint8)
    for call in (
        lambda: fp8.source.gather(ids, out),
        lambda: fp8.source.gather_hits(ids, out),
        lambda: fp8.source.fill(ids),
        lambda: fp8.source.cached(ids, np.empty(3, np.uint8)),
        lambda: fp8.source.gather(ids, out, 4),
    ):
        with pytest.raises(ValueError, match="not in the table"):
            call()
    big = np.full(10_000, bad, dtype=np.int64)
    with pytest.raises(ValueError, match="not in the table"):
        fp8.source.gather(big, np.empty((10_000, 160), np.uint8), 4)


def test_bad_constructor_arguments_raise(specs, tmp_path):
    spec = specs["F8_E4M3"]
    with pytest.raises(ValueError):
        nat.ReadEngine(kind="spdk")
    with pytest.raises(ValueError):
        nat.ReadEngine(queue_depth=0)
    with pytest.raises(ValueError, match="rows"):
        nat.RowCache(100, 160)
    with pytest.raises(ValueError):
        nat.RowCache(1 << 20, 0)
    cache = nat.RowCache(1 << 20, 160)
    engine = nat.ReadEngine(queue_depth=4)
    fd = os.open(spec.files[0], os.O_RDONLY)
    try:
        good = [(fd, s.offset, s.rows, s.path, 0) for s in spec.shards]
        with pytest.raises(ValueError, match="O_DIRECT"):
            nat.TableSource(1, 160, spec.shard_size, good, cache, engine, True)
        with pytest.raises(ValueError, match="slots"):
            nat.TableSource(1, 320, spec.shard_size, good, cache, engine, False)
        with pytest.raises(ValueError, match="mapping"):
            nat.TableSource(1, 160, spec.shard_size, good, None, None, False)
        with pytest.raises(ValueError, match="table_key"):
            nat.TableSource(1 << 24, 160, spec.shard_size, good, cache, engine, False)
        with pytest.raises(TypeError):
            nat.TableSource(1, 160, spec.shard_size, [(fd, 0, 1)], cache, engine, False)
        with pytest.raises(TypeError):
            nat.TableSource(1, 160, spec.shard_size, good, engine, cache, False)
        too_long = [(fd, s.offset, spec.shard_size + 1, s.path, 0) for s in spec.shards]
        with pytest.raises(ValueError):
            nat.TableSource(1, 160, spec.shard_size, too_long, cache, engine, False)
        past_end = [(fd, 1 << 40, 10, spec.files[0], 0)]
        with pytest.raises(ValueError, match="file has"):
            nat.TableSource(1, 160, 10, past_end, cache, engine, False)
    finally:
        os.close(fd)
        cache.close()
        engine.close()
    with pytest.raises(ValueError, match="closed"):
        cache.stats()


def fresh_path(base, shard: int) -> str:
    """A path string with no other reference, longer than CPython's small
    objects (512 bytes): when it dies the allocator frees it through malloc,
    where AddressSanitizer poisons it, so a read after that is caught."""
    return "".join([str(base), f"/{shard}-", "p" * 600])


def names_shard(message: str, shard: int, path: str) -> bool:
    """Whether an error names shard ``shard`` of ``path`` (as far as the
    native error record's 512 bytes hold it)."""
    return message.startswith(f"shard {shard} of {path}"[:500])


def test_shards_from_a_generator_keep_their_paths(specs, tmp_path):
    """A generator's shard tuples live only while the argument is parsed: the
    source keeps copies of their paths, for its error messages."""
    spec = specs["F8_E4M3"]
    expected = file_rows(spec)
    engine = nat.ReadEngine(queue_depth=4)
    fds = {path: os.open(path, os.O_RDONLY) for path in spec.files}
    fd = fds[spec.files[0]]
    size = os.fstat(fd).st_size
    try:
        shards = (
            (fds[s.path], s.offset, s.rows, fresh_path(tmp_path, s.index), 0) for s in spec.shards
        )
        source = nat.TableSource(1, 160, spec.shard_size, shards, None, engine, False)
        ids = np.array([0, spec.shard_size + 7, spec.rows - 1], dtype=np.int64)
        out = np.empty((ids.size, 160), np.uint8)
        source.gather(ids, out)
        np.testing.assert_array_equal(out, expected[ids])
        source.close()
        # Shard 1 runs past the end of the file: the error names its path.
        layout = [(0, 10), (size - 800, 10)]
        shards = ((fd, at, rows, fresh_path(tmp_path, i), 0) for i, (at, rows) in enumerate(layout))
        with pytest.raises(ValueError) as caught:
            nat.TableSource(1, 160, 10, shards, None, engine, False)
        assert names_shard(str(caught.value), 1, fresh_path(tmp_path, 1))
    finally:
        for fd in fds.values():
            os.close(fd)
        engine.close()


def test_shards_emptied_while_they_are_read_stay_valid(specs, tmp_path):
    """An fd whose ``__index__`` empties the list of shards it is read from:
    the shards read so far, and the one being read, stay valid."""
    spec = specs["F8_E4M3"]
    engine = nat.ReadEngine(queue_depth=4)
    fd = os.open(spec.files[0], os.O_RDONLY)
    size = os.fstat(fd).st_size
    shards: list[tuple] = []

    class EmptiesTheList:
        def __index__(self) -> int:
            shards.clear()  # drops every tuple of the list, and their paths
            return fd

    # Shard 1 runs past the end of the file: the error names its path.
    shards += [
        (fd, 0, 10, fresh_path(tmp_path, 0), 0),
        (EmptiesTheList(), size - 800, 10, fresh_path(tmp_path, 1), 0),
    ]
    try:
        with pytest.raises(ValueError) as caught:
            nat.TableSource(1, 160, 10, shards, None, engine, False)
        assert names_shard(str(caught.value), 1, fresh_path(tmp_path, 1))
    finally:
        os.close(fd)
        engine.close()


def test_a_cache_and_an_engine_closed_while_a_source_opens_stay_its_own(specs):
    """The source holds the cache and the engine from the moment it takes them:
    closed before, they are refused; closed while its shards are read (Python
    code runs there), the source still opens on them, serves, and releases
    them when it goes."""
    spec = specs["F8_E4M3"]
    expected = file_rows(spec)
    fds = {path: os.open(path, os.O_RDONLY) for path in spec.files}
    try:
        for closed in ("cache", "engine"):
            cache, engine = nat.RowCache(1 << 20, 160), nat.ReadEngine(queue_depth=4)
            (cache if closed == "cache" else engine).close()
            good = [(fds[s.path], s.offset, s.rows, s.path, 0) for s in spec.shards]
            name = "RowCache" if closed == "cache" else "ReadEngine"
            with pytest.raises(ValueError, match=f"{name} is closed"):
                nat.TableSource(1, 160, spec.shard_size, good, cache, engine, False)
            cache.close()
            engine.close()
        cache, engine = nat.RowCache(1 << 20, 160), nat.ReadEngine(queue_depth=4)

        class ClosesBoth:
            def __init__(self, fd: int) -> None:
                self.fd = fd

            def __index__(self) -> int:
                cache.close()
                engine.close()
                return self.fd

        shards = [(ClosesBoth(fds[s.path]), s.offset, s.rows, s.path, 0) for s in spec.shards]
        source = nat.TableSource(1, 160, spec.shard_size, shards, cache, engine, False)
        ids = np.array([0, spec.shard_size + 7, spec.rows - 1], dtype=np.int64)
        for _ in range(2):  # misses read by the engine, then hits from the cache
            out = np.empty((ids.size, 160), np.uint8)
            source.gather(ids, out)
            np.testing.assert_array_equal(out, expected[ids])
        assert source.stats()["hits"] == ids.size
        source.close()  # the last references: the engine's threads are joined
    finally:
        for fd in fds.values():
            os.close(fd)


def test_probe_reports_the_disk_rate(specs):
    paths = specs["F8_E4M3"].files
    require_o_direct(os.path.dirname(paths[0]))
    for kind in ("auto", "threads"):
        r = nat.probe_random_reads(paths, block=4096, queue_depth=4, seconds=0.2, kind=kind)
        assert r["reads"] > 0 and r["reads_per_s"] > 0
        assert 0.2 <= r["seconds"] < 10
        assert r["kind"] in ("io_uring", "threads") and r["queue_depth"] == 4
        assert r["block"] == 4096
    assert nat.probe_random_reads(paths, seconds=0.1, direct=False)["reads"] > 0


def test_probe_rejects_bad_arguments(specs, tmp_path):
    paths = specs["F8_E4M3"].files
    require_o_direct(os.path.dirname(paths[0]))
    with pytest.raises(ValueError):
        nat.probe_random_reads(paths, block=1000)
    with pytest.raises(ValueError):
        nat.probe_random_reads(paths, block=512, direct=True)
    with pytest.raises(ValueError):
        nat.probe_random_reads(paths, seconds=0)
    with pytest.raises(ValueError):
        nat.probe_random_reads([])
    with pytest.raises(FileNotFoundError):
        nat.probe_random_reads([str(tmp_path / "missing")], seconds=0.1)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="block"):
        nat.probe_random_reads([str(empty)], seconds=0.1)


def test_probe_paths_emptied_while_they_are_read_stay_valid(specs):
    """A path whose ``__fspath__`` empties the list it is read from: the
    paths after it are still read, none from a list that has gone."""
    files = specs["F8_E4M3"].files
    paths: list = []

    class EmptiesTheList:
        def __fspath__(self) -> str:
            paths.clear()
            return files[0]

    paths += [EmptiesTheList(), files[1]]
    assert nat.probe_random_reads(paths, seconds=0.1, direct=False)["reads"] > 0


def test_empty_requests_do_nothing(fp8):
    ids = np.empty(0, dtype=np.int64)
    out = np.empty((0, 160), np.uint8)
    fp8.source.gather(ids, out, 4)
    assert fp8.source.gather_hits(ids, out) == 0
    assert fp8.source.fill(ids) == 0
    assert fp8.source.stats()["reads"] == 0


# --------------------------------------------------- unreadable mapped pages
@pytest.fixture(params=["BF16", "NVFP4"])
def mapped_copy(tmp_path, request):
    """A checkpoint of its own (one file) that a test may truncate, mapped."""
    write_checkpoint(
        str(tmp_path),
        (SyntheticTable(layer=2, rows=6000, cols=160, dtype=request.param, parts=2),),
        files=1,
    )
    return discover_tables(str(tmp_path), fingerprint=False)[0]


@pytest.mark.parametrize("cached", [False, True], ids=["mmap", "cache-over-mapping"])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_mapped_page_that_cannot_be_read_fails_the_gather_not_the_process(
    mapped_copy, opened, cached, threads
):
    """Touching a mapped page past the end of a truncated file raises SIGBUS,
    as a disk's I/O error under a mapping does: the gather fails with a read
    error naming the file and the offset, in the calling thread and in the
    native threads of a split gather, and the process serves on."""
    spec = mapped_copy
    expected = file_rows(spec)
    o = opened(spec, "mmap")
    if cached:  # the same mappings, through a row cache
        cache = nat.RowCache(16 << 20, spec.row_bytes)
        shards = [
            (-1, s.offset, s.rows, s.path, o.views[0].ctypes.data)
            for i in range(spec.parts)
            for s in (segment.shards[i] for segment in spec.segments)
        ]
        source = nat.TableSource(
            9, spec.row_bytes, spec.shard_size, shards, cache, None, False,
            segments=[segment.row_bytes for segment in spec.segments],
        )  # fmt: skip
    else:
        cache, source = None, o.source
    try:
        path = spec.files[0]
        last = spec.segments[-1].shards[-1]  # the file's last shard: its rows end the file
        keep = last.offset + 100 * spec.segments[-1].row_bytes
        os.truncate(path, keep - keep % mmap.PAGESIZE)
        lost = np.concatenate([np.arange(0, 2000), np.arange(spec.rows - 3000, spec.rows)])
        out = np.empty((lost.size, spec.row_bytes), np.uint8)
        for _ in range(3):  # every time, not once
            with pytest.raises(nat.ReadError) as caught:
                source.gather(lost, out, threads)
            exc = caught.value
            assert exc.errno == errno.EIO, exc
            assert f"of {path} through its mapping" in str(exc) and "offset" in str(exc), exc
        ok = np.arange(0, 2000)
        got = np.empty((ok.size, spec.row_bytes), np.uint8)
        source.gather(ok, got, threads)
        np.testing.assert_array_equal(got, expected[ok])
        if cache is not None:  # what failed was not cached; what was read was
            assert source.gather_hits(lost, out) > 0 and source.gather_hits(ok, got) == 0
    finally:
        if cache is not None:
            source.close()
            cache.close()


SIGBUS_HANDLERS = REPO / "tests" / "native" / "sigbus_handlers.c"

# The child: installs SIGBUS handlers in the order its arguments give ("guard"
# opens a table, which installs the guard, again when another handler has been
# installed over it), checks that a guarded copy of a truncated page still
# fails as a read error, then touches that page outside any copy.
SIGBUS_ELSEWHERE = """
import ctypes, faulthandler, mmap, os, sys
import numpy as np
from pleserver import _native as nat
path = os.path.abspath("rows")  # in the test's temporary directory
with open(path, "wb") as f:
    f.write(bytes(2 * mmap.PAGESIZE))
fd = os.open(path, os.O_RDONLY)
mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
view = np.frombuffer(mm, np.uint8)
shards = [(fd, 0, 64, path, view.ctypes.data)]
handlers = ctypes.CDLL(os.path.abspath("handlers.so"))
source = None
for step in sys.argv[1:]:
    if step == "guard":
        source = nat.TableSource(1, 16, 64, shards, None, None, False)
    elif step == "faulthandler":
        faulthandler.enable()
    elif step == "faulthandler-off":
        faulthandler.disable()
    else:
        assert getattr(handlers, "install_" + step)() == 0, step
os.truncate(path, 0)
try:
    source.gather(np.arange(4, dtype=np.int64), np.empty((4, 16), np.uint8))
except nat.ReadError:
    print("guarded", flush=True)
print("touching", flush=True)
print(view[mmap.PAGESIZE])  # not a guarded copy: SIGBUS, as without the guard
print("survived", flush=True)
"""

SIGBUS_ORDERS = {
    "none": ["guard"],
    "faulthandler": ["faulthandler", "guard"],
    "faulthandler-after": ["guard", "faulthandler", "guard"],
    "faulthandler-toggled": [
        *("guard", "faulthandler", "guard"),
        *("faulthandler-off", "faulthandler", "guard"),
    ],
    "guard-thrice": ["guard", "guard", "guard"],
    "two-others-after": ["guard", "restorer", "guard", "caller", "guard"],
    "two-others-before": ["restorer", "caller", "guard"],
    "all-three-after": ["guard", "caller", "guard", "faulthandler", "guard", "restorer", "guard"],
    "around": ["restorer", "guard", "faulthandler", "guard", "caller", "guard"],
}


@pytest.fixture(scope="module")
def sigbus_handlers(tmp_path_factory):
    """tests/native/sigbus_handlers.c, built as a shared library."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler to build tests/native/sigbus_handlers.c: apt-get install gcc")
    out = tmp_path_factory.mktemp("sigbus") / "handlers.so"
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror"]
    subprocess.run([cc, *flags, "-o", str(out), str(SIGBUS_HANDLERS)], check=True)
    return out


@pytest.mark.parametrize("order", list(SIGBUS_ORDERS))
def test_a_sigbus_outside_a_guarded_copy_still_ends_the_process(tmp_path, sigbus_handlers, order):
    """The guard takes only faults of its own copies: any other SIGBUS goes on
    to every other handler once (CPython's faulthandler, which prints the
    tracebacks; a crash reporter that restores its predecessor and lets the
    access run again; one that calls its predecessor), then the default
    action, as if the guard were not there, whatever the order they were
    installed in. A handler installed over the guard chains back to it; the
    guard, installed again over that one, never passes the signal to it twice
    (the cycle once spun for ever, printing tracebacks). Guarded copies stay
    the guard's in every order."""
    import shutil
    import subprocess
    import sys

    steps = SIGBUS_ORDERS[order]
    shutil.copy(sigbus_handlers, tmp_path / "handlers.so")
    run = subprocess.run(
        [sys.executable, "-c", SIGBUS_ELSEWHERE, *steps],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    said = run.stdout + run.stderr
    assert "guarded" in run.stdout and "touching" in run.stdout, said
    assert "survived" not in run.stdout and run.returncode != 0, said
    tracebacks = run.stderr.count("Fatal Python error: Bus error")
    assert tracebacks == (1 if "faulthandler" in steps else 0), said
    for other in ("restorer", "caller"):
        assert run.stderr.count(f"handler ran: {other}") == steps.count(other), said
    # The default action ends it (or, under the sanitizers, ASan's report).
    assert run.returncode == -7 or "AddressSanitizer" in run.stderr, said
