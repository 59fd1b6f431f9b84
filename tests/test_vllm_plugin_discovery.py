"""The plugin's choice of server on a host with one ple-server per model: real
servers on sockets in one directory, the plugin's discovery and row service
(torch on CPU, no vLLM)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pleclient.vllm_plugin import IdentityMismatch, PleBackendError, settings  # noqa: E402
from pleclient.vllm_plugin.discovery import find_socket, sockets_in  # noqa: E402
from pleclient.vllm_plugin.identity import Expected  # noqa: E402
from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows  # noqa: E402
from pleclient.vllm_plugin.routes import Routes  # noqa: E402
from pleclient.vllm_plugin.rows import RowService  # noqa: E402
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint  # noqa: E402
from tests.conftest import SMALL_TABLES  # noqa: E402

OTHER_TABLE = SyntheticTable(layer=2, rows=5_003, cols=128, dtype="BF16", parts=2)


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("other")
    write_checkpoint(str(path), (OTHER_TABLE,), files=1, seed=7)
    return path


@pytest.fixture
def socket_dir(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    return path


def serve_on(start_server, model, path):
    """A server listening on ``path`` (the unit's --socket), ready."""
    return start_server(model, socket_path=str(path))


@pytest.fixture
def two_servers(start_server, checkpoint, other_checkpoint, socket_dir):
    """Two models, as ple-server@flash-next and ple-server@other would serve them."""
    return (
        serve_on(start_server, checkpoint, socket_dir / "flash-next.sock"),
        serve_on(start_server, other_checkpoint, socket_dir / "other.sock"),
    )


def expected(table: SyntheticTable) -> Expected:
    return Expected(
        prefix=table.name.removesuffix(".ngram_embedding"),
        rows=table.rows,
        cols=table.cols,
        dtypes=(table.dtype,),
        parts=table.parts,
    )


def test_each_checkpoint_finds_the_server_that_serves_it(
    two_servers, checkpoint, other_checkpoint, socket_dir
):
    first, second = two_servers
    assert find_socket(str(checkpoint), str(socket_dir)) == first.socket
    assert find_socket(str(other_checkpoint), str(socket_dir)) == second.socket


def test_stale_sockets_and_other_files_are_passed_over(two_servers, other_checkpoint, socket_dir):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_dir / "a-stale.sock"))  # sorts first; nothing listens
    stale.close()
    (socket_dir / "b-notes.txt").write_text("not a socket")
    assert [p.rsplit("/", 1)[1] for p in sockets_in(str(socket_dir))] == [
        "a-stale.sock",
        "flash-next.sock",
        "other.sock",
    ]
    assert find_socket(str(other_checkpoint), str(socket_dir)) == two_servers[1].socket


def test_a_checkpoint_no_server_serves_is_an_error_naming_each_socket(
    two_servers, tmp_path, socket_dir
):
    third = tmp_path / "third"
    write_checkpoint(str(third), (OTHER_TABLE,), files=1, seed=8)
    with pytest.raises(PleBackendError) as err:
        find_socket(str(third), str(socket_dir))
    message = str(err.value)
    assert "no ple-server in" in message and str(third) in message
    assert all(server.socket in message for server in two_servers)
    assert settings.ENV_SOCKET in message


def test_no_socket_at_all_says_how_to_start_or_point_at_one(checkpoint, socket_dir):
    with pytest.raises(PleBackendError) as err:
        find_socket(str(checkpoint), str(socket_dir))
    assert "no ple-server socket in" in str(err.value)
    assert settings.ENV_SOCKET in str(err.value) and "ple-server@NAME" in str(err.value)


def test_a_single_server_of_another_checkpoint_gets_the_identity_check(
    start_server, other_checkpoint, checkpoint, socket_dir
):
    only = serve_on(start_server, other_checkpoint, socket_dir / "ple.sock")
    assert find_socket(str(checkpoint), str(socket_dir)) == only.socket
    service = RowService(
        settings.ShmSettings(socket=None, socket_dir=str(socket_dir), checkpoint=str(checkpoint))
    )
    try:
        with pytest.raises(IdentityMismatch):
            service.bind(expected(SMALL_TABLES[1]))
    finally:
        service.close()


def test_the_row_service_binds_and_reads_from_the_discovered_server(
    two_servers, other_checkpoint, socket_dir, monkeypatch
):
    for name in ("VLLM_PLE_SHM_SOCKET", "PLE_SERVER_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_PLE_SHM_SOCKET_DIR", str(socket_dir))
    monkeypatch.setenv("VLLM_PLE_SHM_CHECKPOINT", str(other_checkpoint))
    service = RowService(settings.ShmSettings.from_env())
    routes = Routes(service)
    try:
        assert service.settings.socket is None
        binding = service.bind(expected(OTHER_TABLE))
        assert service.settings.socket == two_servers[1].socket
        ids = torch.tensor([0, 1, OTHER_TABLE.rows - 1, 77], dtype=torch.int64)
        out = torch.empty((4, OTHER_TABLE.cols), dtype=torch.bfloat16)
        LayerLookups(binding, routes, StoredRows(binding)).lookup(ids, out)
        reference = read_reference(str(other_checkpoint), OTHER_TABLE.name)
        assert np.array_equal(out.view(torch.uint8).numpy(), reference[ids.numpy()])
    finally:
        routes.close()


def test_an_explicit_socket_is_used_as_given(two_servers, monkeypatch, socket_dir):
    monkeypatch.setenv("VLLM_PLE_SHM_SOCKET", two_servers[0].socket)
    monkeypatch.setenv("VLLM_PLE_SHM_SOCKET_DIR", str(socket_dir))
    assert settings.ShmSettings.from_env().socket == two_servers[0].socket
