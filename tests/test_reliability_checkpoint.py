"""Bad checkpoints: refused at start with the reason; changed under a running
server: replaced files keep being served as mapped, files changed in place
make their tables answer errors, and a read racing a truncation fails that
request (the page past the new end raises SIGBUS, which the native gather
takes as a read error), never the daemon."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from pleclient import PleClient, RequestError
from pleserver.devkit.synthetic import read_reference, write_checkpoint
from tests.conftest import SMALL_TABLES
from tests.harness import wait_until


@pytest.fixture
def model(tmp_path):
    return write_checkpoint(str(tmp_path / "model"), SMALL_TABLES, files=2)


def second_file(model: str) -> str:
    return sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))[
        1
    ]


def test_a_truncated_shard_file_is_refused_at_start(start_server, model):
    path = second_file(model)
    os.truncate(path, os.path.getsize(path) - 1000)
    server = start_server(model, wait=False)
    assert server.exit_code() == 2
    log = server.log()
    assert path in log and "truncated" in log
    assert not os.path.exists(server.socket)


def test_a_garbage_header_is_refused_at_start(start_server, model):
    path = second_file(model)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{{")
    server = start_server(model, wait=False)
    assert server.exit_code() == 2
    assert "malformed safetensors header" in server.log()
    assert not os.path.exists(server.socket)


def test_a_shard_truncated_under_an_idle_server_fails_its_requests_clearly(start_server, model):
    server = start_server(model)
    with server.client() as client:
        client.lookup(3, [1, 10_000])
        path = second_file(model)
        os.truncate(path, os.path.getsize(path) // 2)
        assert wait_until(lambda: "changed on disk" in server.log()), server.log()[-2000:]
        for layer in (1, 3):  # both tables have shards in that file
            with pytest.raises(
                RequestError,
                match="changed on disk while ple-server had it "
                r"mapped \(size .* bytes\).*restart ple-server",
            ):
                client.lookup(layer, [1, 10_000])
        assert client.stats()["tables"][0]["errors"]["internal"] == 1
    assert server.proc.poll() is None
    assert server.stop() == 0
    # What a restart (systemd's Restart=on-failure) then says:
    again = start_server(model, wait=False)
    assert again.exit_code() == 2 and "truncated" in again.log()


def test_a_request_racing_a_truncation_fails_and_the_server_serves_on(start_server, model):
    server = start_server(model)
    path = second_file(model)
    ids = np.arange(10_007)  # every row: some live past the new end of the file
    with server.client(timeout=10.0) as client:
        client.lookup(3, [1])
        os.truncate(path, os.path.getsize(path) // 2)
        # Either the periodic check saw it first, or the read touched a page
        # past the end (SIGBUS), which fails that request only.
        with pytest.raises(RequestError, match=r"changed on disk|through its mapping"):
            client.lookup(3, ids)
        assert client.stats()["tables"][0]["io_mode"] == "mmap"
    assert server.proc.poll() is None, server.log_tail()
    assert server.stop() == 0
    assert "Bus error" not in server.log()


def test_a_shard_replaced_while_serving_keeps_serving_the_mapped_rows(start_server, model):
    reference = read_reference(model, SMALL_TABLES[1].name)
    server = start_server(model)
    path = second_file(model)
    other = write_checkpoint(
        str(os.path.join(os.path.dirname(model), "other")), SMALL_TABLES, files=2, seed=1
    )
    shutil.copy(second_file(other), path + ".new")
    os.replace(path + ".new", path)  # as downloads and rsync do
    assert wait_until(lambda: "was replaced on disk" in server.log())
    ids = np.arange(10_007)
    with server.client() as client:
        assert np.array_equal(client.lookup(3, ids), reference)  # the rows it mapped


def test_a_shard_rewritten_in_place_fails_its_requests_clearly(start_server, model):
    server = start_server(model)
    path = second_file(model)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # same size, other bytes: as `cp other file` would
        f.seek(size - 4096)
        f.write(bytes(4096))
    assert wait_until(lambda: "changed on disk" in server.log())
    with (
        server.client() as client,
        pytest.raises(RequestError, match="rewritten in place, same size"),
    ):
        client.lookup(3, [1])
    assert PleClient.query_stats(server.socket)["pid"] == server.pid  # still up


@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_a_shard_rewritten_in_place_with_its_mtime_put_back_is_detected(
    start_server, model, tmp_path, io
):
    """Same size, other bytes, and the modification time put back (as
    `rsync --inplace --times` or a careless script leaves it): the change time
    moved, which nobody can set back, and the server sees that."""
    server = start_server(model, "--io", io, "--state-dir", str(tmp_path))
    path = second_file(model)
    with server.client() as client:
        client.lookup(3, [1, 10_000])  # some rows in the cache (direct mode)
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(before.st_size - 4096)
        f.write(bytes(4096))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert wait_until(lambda: "changed on disk" in server.log()), server.log_tail()
    with (
        server.client() as client,
        pytest.raises(RequestError, match="same size and modification time"),
    ):
        client.lookup(3, [1])
    assert server.stop() == 0


def test_a_chmod_of_a_shard_moves_its_ctime_and_is_only_logged(start_server, model):
    reference = read_reference(model, SMALL_TABLES[1].name)
    server = start_server(model)
    path = second_file(model)
    os.chmod(path, 0o600)
    assert wait_until(lambda: "its mode changed" in server.log()), server.log_tail()
    with server.client() as client:
        ids = np.arange(10_007)
        assert np.array_equal(client.lookup(3, ids), reference)
    assert "changed on disk" not in server.log()
