"""The hot set: saved at stop, refilled first after a restart (stats show it),
and never trusted when corrupt, truncated or saved for another checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from pleserver.data import hotset
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint
from tests.conftest import SMALL_TABLES
from tests.harness import wait_until

HOT_IDS = np.arange(0, 5000, 7)


@pytest.fixture
def model(tmp_path):
    return write_checkpoint(str(tmp_path / "model"), SMALL_TABLES, files=2)


@pytest.fixture
def state_dir(tmp_path):
    path = tmp_path / "state"
    path.mkdir()
    return path


def direct(start_server, model, state_dir, *extra):
    return start_server(model, "--io", "direct", "--state-dir", str(state_dir), *extra)


def refill_over(client) -> dict:
    assert wait_until(
        lambda: client.stats()["hotset"]["state"] not in ("pending", "refilling"), timeout=30
    )
    return client.stats()


def warm_and_stop(start_server, model, state_dir) -> None:
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        for t in client.tables:
            client.lookup(t.layer, HOT_IDS)
    assert server.stop() == 0
    assert "hot set: saved" in server.log() or (state_dir / "hotset.bin").exists()


def test_the_hot_set_is_saved_at_stop_and_refilled_after_a_restart(start_server, model, state_dir):
    warm_and_stop(start_server, model, state_dir)
    assert (state_dir / "hotset.bin").exists()
    assert not [n for n in os.listdir(state_dir) if n != "hotset.bin"]  # no temp file left
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        stats = refill_over(client)
        hs = stats["hotset"]
        rows = HOT_IDS.size * len(SMALL_TABLES)
        assert hs["state"] == "done" and hs["target_rows"] == hs["done_rows"] == rows, hs
        assert stats["dataplane"]["cache"]["used_rows"] == rows
        before = {t["layer"]: t["io"] for t in stats["tables"]}
        for t in client.tables:  # every hot row is a hit now, and exact
            assert np.array_equal(
                client.lookup(t.layer, HOT_IDS), read_reference(model, t.name)[HOT_IDS]
            )
        after = {t["layer"]: t["io"] for t in client.stats()["tables"]}
    for layer in before:
        assert after[layer]["misses"] == before[layer]["misses"], (before, after)
        assert after[layer]["hits"] >= before[layer]["hits"] + HOT_IDS.size
    assert "hot set: refilling the row cache" in server.log()


def test_a_hot_set_larger_than_the_cache_refills_only_what_fits(start_server, model, state_dir):
    warm_and_stop(start_server, model, state_dir)
    server = direct(start_server, model, state_dir, "--cache-size", "64K")
    with server.client() as client:
        stats = refill_over(client)
    hs, cache = stats["hotset"], stats["dataplane"]["cache"]
    assert hs["state"] == "budget" and hs["target_rows"] == cache["capacity_rows"], (hs, cache)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage", "empty"])
def test_a_corrupt_hot_set_file_is_ignored_with_a_warning(start_server, model, state_dir, damage):
    warm_and_stop(start_server, model, state_dir)
    path = state_dir / "hotset.bin"
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        stats = refill_over(client)
        assert stats["hotset"]["state"] == "ignored" and stats["hotset"]["done_rows"] == 0
        assert stats["dataplane"]["cache"]["used_rows"] == 0
        t = client.tables[0]
        assert np.array_equal(
            client.lookup(t.layer, HOT_IDS), read_reference(model, t.name)[HOT_IDS]
        )
    log = server.log()
    assert f"WARNING pleserver.hotset: hot set: ignoring {path}" in log, log[-3000:]


def with_header(saved: bytes, header: bytes) -> bytes:
    """``saved`` (a file the server wrote) with ``header`` in place of its
    own, the keys kept and the checksum made anew: as valid as a file gets
    but for what its header says."""
    _, _, header_len = hotset.PREFIX.unpack_from(saved)
    keys = saved[hotset.PREFIX.size + header_len : -hotset.DIGEST_BYTES]
    body = hotset.PREFIX.pack(hotset.MAGIC, hotset.VERSION, len(header)) + header + keys
    return body + hashlib.sha256(body).digest()


def header_of(saved: bytes) -> str:
    _, _, header_len = hotset.PREFIX.unpack_from(saved)
    return saved[hotset.PREFIX.size : hotset.PREFIX.size + header_len].decode()


CRAFTED_HEADERS = {
    # name: (what becomes of the saved header, what the log names)
    "nested 100 000 deep": (
        lambda h: "[" * 100_000 + "]" * 100_000,
        "nested deeper than the 8 levels a hot-set header has",
    ),
    "count Infinity": (
        lambda h: re.sub(r'"count":\d+', '"count":Infinity', h),
        "a non-finite number, Infinity",
    ),
    "count NaN": (lambda h: re.sub(r'"count":\d+', '"count":NaN', h), "a non-finite number, NaN"),
    "count a float": (
        lambda h: re.sub(r'"count":(\d+)', r'"count":\1.0', h),
        "'count' is a JSON number, not an integer",
    ),
    "count a string": (
        lambda h: re.sub(r'"count":(\d+)', r'"count":"\1"', h),
        "'count' is a JSON string, not an integer",
    ),
    "rows 1e999": (
        lambda h: re.sub(r'"rows":\d+', '"rows":1e999', h, count=1),
        "table 0's 'rows' is a JSON number, not an integer",
    ),
    "a list": (lambda h: "[" + h + "]", "the header is a JSON list, not an object"),
}


@pytest.mark.parametrize("craft", list(CRAFTED_HEADERS))
def test_a_hot_set_file_with_a_crafted_header_is_ignored_naming_the_field(
    start_server, model, state_dir, craft
):
    """The checksum says only that the writer hashed the file. A header
    nested 100 000 deep ran the JSON parser past the recursion limit, and a
    count of Infinity overflowed its conversion to an integer: both ended the
    refill in state `failed` with a traceback; a count of 1430.0 or "1430"
    was converted and trusted. Every field is now checked for its type first,
    and each of these files is ignored with a line naming what is wrong."""
    warm_and_stop(start_server, model, state_dir)
    path = state_dir / "hotset.bin"
    saved = path.read_bytes()
    change, why = CRAFTED_HEADERS[craft]
    crafted = change(header_of(saved))
    assert crafted != header_of(saved)
    path.write_bytes(with_header(saved, crafted.encode()))
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        stats = refill_over(client)
        assert stats["hotset"]["state"] == "ignored", (stats["hotset"], server.log_tail())
        assert stats["dataplane"]["cache"]["used_rows"] == 0
        for t in client.tables:
            assert np.array_equal(
                client.lookup(t.layer, HOT_IDS), read_reference(model, t.name)[HOT_IDS]
            )
    log = server.log()
    assert f"hot set: ignoring {path}: malformed header ({why})" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    stops_in_budget(server)
    assert header_of(path.read_bytes()) != crafted  # the save at stop replaced it


def test_a_hot_set_of_another_checkpoint_is_ignored_with_a_warning(
    start_server, model, state_dir, tmp_path
):
    other = write_checkpoint(str(tmp_path / "other"), SMALL_TABLES, files=2, seed=1)
    warm_and_stop(start_server, other, state_dir)
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        stats = refill_over(client)
    assert stats["hotset"]["state"] == "ignored"
    assert stats["dataplane"]["cache"]["used_rows"] == 0
    assert "saved for another checkpoint" in server.log()


def test_the_refill_progress_reaches_systemd_status(start_server, model, state_dir):
    warm_and_stop(start_server, model, state_dir)
    server = direct(start_server, model, state_dir)
    # The status line keeps what is served in front of the refill's progress.
    serving = f"STATUS=serving {len(SMALL_TABLES)} tables on {server.socket}; "
    final = server.wait_for(serving + "hot set refill done")
    rows = HOT_IDS.size * len(SMALL_TABLES)
    assert f"{serving}hot set refill done: 100.0% ({rows} of {rows} rows)" in final, final


# ------------------------------------------------ files planted in the state dir
STOP_BUDGET_S = 10.0
"""SIGTERM to exit, well inside the unit's TimeoutStopSec=30."""


def stops_in_budget(server) -> None:
    started = time.monotonic()
    code = server.stop(timeout=STOP_BUDGET_S + 5)
    took = time.monotonic() - started
    assert code == 0 and took < STOP_BUDGET_S, (code, took, server.log_tail())


@pytest.mark.parametrize("plant", ["FIFO", "symlink to a FIFO"])
def test_a_hot_set_file_that_is_a_fifo_is_refused_and_sigterm_completes(
    start_server, model, state_dir, tmp_path, plant
):
    """Opening a FIFO for reading waits for a writer: the refill thread blocked
    there, the state stayed `pending` with no log line, and SIGTERM never
    completed. The file is now opened O_NONBLOCK | O_NOFOLLOW and must be a
    regular file."""
    path = state_dir / "hotset.bin"
    if plant == "FIFO":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "fifo")
        os.symlink(tmp_path / "fifo", path)
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        stats = refill_over(client)
        assert stats["hotset"]["state"] == "ignored", stats["hotset"]
        t = client.tables[0]
        assert np.array_equal(
            client.lookup(t.layer, HOT_IDS), read_reference(model, t.name)[HOT_IDS]
        )
    why = "not a regular file (a FIFO)" if plant == "FIFO" else "a symbolic link (never followed)"
    assert f"hot set: ignoring {path}: {why}" in server.log(), server.log_tail()
    stops_in_budget(server)
    assert stat.S_ISREG(os.lstat(path).st_mode)  # the save at stop replaced it
    if plant != "FIFO":
        assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)  # the link's target untouched


# A table of 4 M rows of 16 bytes (64 MB): room for a valid hot set of 32 MB.
BIG_TABLE = SyntheticTable(layer=1, rows=4_000_000, cols=16, dtype="F8_E4M3", parts=4)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("big-model")
    write_checkpoint(str(path), [BIG_TABLE], files=1)
    yield path
    shutil.rmtree(path)


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def write_hotset(path: Path, like: bytes, keys: np.ndarray) -> None:
    """A valid hot-set file of ``keys``, with the table header of ``like`` (a
    file the server saved)."""
    _, _, header_len = hotset.PREFIX.unpack_from(like)
    header = json.loads(like[hotset.PREFIX.size : hotset.PREFIX.size + header_len])
    header["count"] = int(keys.size)
    raw = json.dumps(header, separators=(",", ":")).encode()
    body = hotset.PREFIX.pack(hotset.MAGIC, hotset.VERSION, len(raw)) + raw + keys.tobytes()
    path.write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize(
    "plant", ["symlink to /dev/zero", "sparse file of 3 GiB", "valid, 4 M keys"]
)
def test_loading_a_hot_set_takes_memory_for_the_cache_not_for_the_file(
    start_server, big_model, state_dir, plant
):
    """The refill read the whole file into memory and decoded it in copies: a
    link to /dev/zero got the server OOM-killed, a sparse 3 GiB file took
    2.9 GiB before "bad magic", and a valid 229 MiB file 8 × its size. Now the
    size is checked against what the tables can hold before anything is read,
    and the keys are read as a stream, keeping what the cache can hold (4096
    keys here). The server runs with a 1 GiB data limit (as a MemoryMax= would
    put it), so the old way failed rather than swallow the machine."""
    flags = ("--io", "direct", "--cache-size", "64K", "--state-dir", str(state_dir))
    limit = ("prlimit", f"--data={1 << 30}", "--")
    ids = np.arange(0, 4_000_000, 1000)
    baseline = start_server(big_model, *flags, prefix=limit)
    with baseline.client() as client:
        assert refill_over(client)["hotset"]["state"] == "none"
        client.lookup(1, ids)
    baseline_peak = peak_rss_kib(baseline.pid)
    stops_in_budget(baseline)
    path = state_dir / "hotset.bin"
    saved = path.read_bytes()
    path.unlink()
    if plant == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
        expected, why = "ignored", "a symbolic link (never followed)"
    elif plant == "sparse file of 3 GiB":
        with open(path, "wb") as f:
            f.truncate(3 << 30)
        expected, why = "ignored", f"{3 << 30} bytes, more than a hot set of these tables can hold"
    else:
        write_hotset(path, saved, np.arange(BIG_TABLE.rows, dtype="<u8"))
        expected, why = "budget", None
    try:
        server = start_server(big_model, *flags, prefix=limit)
        with server.client() as client:
            hs = refill_over(client)["hotset"]
            client.lookup(1, ids)
        peak = peak_rss_kib(server.pid)
        log = server.log()
        stops_in_budget(server)
    finally:
        path.unlink()
    print(
        f"{plant}: hot set {hs['state']}, {hs['done_rows']} rows refilled; peak RSS "
        f"{peak / 1024:.0f} MiB, {(peak - baseline_peak) / 1024:+.1f} MiB against no hot set"
    )
    assert hs["state"] == expected, (hs, log[-3000:])
    if why:
        assert f"hot set: ignoring {path}: {why}" in log, log[-3000:]
    else:
        assert hs["target_rows"] == hs["done_rows"] > 0
        assert f"refilled {hs['done_rows']} of the {BIG_TABLE.rows} saved rows" in log
    # The valid file alone is 32 MiB: it is never held whole.
    assert peak - baseline_peak < 16 << 10, (baseline_peak, peak)


# ------------------------------------------- a state dir replaced under the server
def saved_rows_after_restart(start_server, model, state_dir) -> int:
    """How many rows a fresh server refills from ``state_dir``'s hot set."""
    server = direct(start_server, model, state_dir)
    with server.client() as client:
        hs = refill_over(client)["hotset"]
    stops_in_budget(server)
    assert hs["state"] == "done", (hs, server.log_tail())
    return hs["done_rows"]


@pytest.mark.parametrize("save", ["periodic", "at stop"])
@pytest.mark.parametrize("how", ["removed", "moved aside"])
def test_a_state_dir_made_again_under_the_server_is_the_one_saved_into(
    start_server, model, state_dir, tmp_path, save, how
):
    """The server held the directory it opened at start and saved into it for
    good: once that directory was removed (or moved aside) and made again,
    every periodic save and the save at SIGTERM went to the old one (gone,
    or no longer the state_dir), and the next start found no hot set. Each
    save now opens the path again, with the start's checks."""
    interval = "0.2" if save == "periodic" else "0"
    server = direct(start_server, model, state_dir, "--hotset-save-interval", interval)
    with server.client() as client:
        assert refill_over(client)["hotset"]["state"] == "none"
        for t in client.tables:
            client.lookup(t.layer, HOT_IDS)
        rows = HOT_IDS.size * len(client.tables)
        if save == "periodic":
            assert wait_until(lambda: (state_dir / "hotset.bin").exists())
        aside = tmp_path / "state.old"
        if how == "removed":
            shutil.rmtree(state_dir)
        else:
            state_dir.rename(aside)
        if save == "periodic":  # a save meanwhile finds no directory, and says so
            assert wait_until(lambda: "does not exist any more" in server.log()), server.log_tail()
            assert client.stats()["hotset"]["save_error"]
        state_dir.mkdir(mode=0o750)
        if save == "periodic":
            assert wait_until(lambda: (state_dir / "hotset.bin").exists()), server.log_tail()
            hs = client.stats()["hotset"]
            assert hs["save_error"] is None and hs["saved_rows"] == rows, hs
            assert "saving into the new one" in server.log()
    stops_in_budget(server)
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
    if how == "moved aside" and save == "at stop":
        assert not (aside / "hotset.bin").exists()  # the old directory is not the state_dir
    assert saved_rows_after_restart(start_server, model, state_dir) == rows


@pytest.mark.parametrize("state", ["removed", "made again writable by others"])
def test_a_save_at_stop_that_cannot_be_made_is_logged_and_the_stop_completes(
    start_server, model, state_dir, state
):
    """With the state_dir gone, or made again with a mode others may write,
    SIGTERM logs why nothing is saved and the server exits 0 in its budget;
    nothing is written to a directory others may write."""
    server = direct(start_server, model, state_dir, "--hotset-save-interval", "0")
    with server.client() as client:
        assert refill_over(client)["hotset"]["state"] == "none"
        client.lookup(client.tables[0].layer, HOT_IDS)
    shutil.rmtree(state_dir)
    if state != "removed":
        state_dir.mkdir()
        state_dir.chmod(0o777)
    stops_in_budget(server)
    log = server.log()
    why = (
        f"WARNING pleserver.hotset: hot set: not saved: state_dir {state_dir} does not exist"
        if state == "removed"
        else f"ERROR pleserver.hotset: hot set: not saved: state_dir {state_dir} is writable "
        "by group and others (mode 0777)"
    )
    assert why in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "stopped" in log.splitlines()[-1], log[-3000:]
    if state != "removed":
        assert not os.listdir(state_dir)
