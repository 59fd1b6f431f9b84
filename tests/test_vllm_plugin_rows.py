"""The plugin's row service and settings, in-process (torch on CPU, no vLLM),
against a real ple-server over the core tests' checkpoint."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pleclient import TableInfo  # noqa: E402
from pleclient.vllm_plugin import (  # noqa: E402
    IdentityMismatch,
    PleBackendError,
    SettingsError,
    UnsupportedCompilation,
    identity,
    loader,
    registration,
    settings,
)
from pleclient.vllm_plugin.identity import Expected  # noqa: E402
from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows  # noqa: E402
from pleclient.vllm_plugin.routes import Routes  # noqa: E402
from pleclient.vllm_plugin.rows import RowService  # noqa: E402
from pleserver.devkit.synthetic import read_reference  # noqa: E402
from tests.conftest import SMALL_TABLES  # noqa: E402

FP8, BF16 = SMALL_TABLES


def expected(table, **changes) -> Expected:
    fields = dict(
        prefix=f"{table.name.removesuffix('.ngram_embedding')}",
        rows=table.rows,
        cols=table.cols,
        dtypes=(table.dtype,),
        parts=table.parts,
    )
    fields.update(changes)
    return Expected(**fields)


@pytest.fixture
def routes(server, checkpoint):
    rows = Routes(
        RowService(
            settings.ShmSettings(
                socket=server.socket,
                checkpoint=str(checkpoint),
                capacity=100,
                depth=2,
                reconnect_window=0,
                fallback_after=None,  # the worker never reads rows itself here
            )
        )
    )
    yield rows
    rows.close()


def layer(routes: Routes, table, **changes) -> LayerLookups:
    """A PLE layer's lookups over ``table`` (bound now), as a storage holds them."""
    binding = routes.service.bind(expected(table, **changes))
    return LayerLookups(binding, routes, StoredRows(binding))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return {t.layer: read_reference(str(checkpoint), t.name) for t in SMALL_TABLES}


def typed(table, n: int) -> torch.Tensor:
    dtype = torch.float8_e4m3fn if table.dtype == "F8_E4M3" else torch.bfloat16
    return torch.empty((n, table.cols), dtype=dtype)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


# ------------------------------------------------------------------- settings
def test_settings_defaults_follow_the_service(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("VLLM_PLE_") or name == "PLE_SERVER_SOCKET":
            monkeypatch.delenv(name)
    s = settings.ShmSettings.from_env()
    assert (s.socket, s.depth, s.capacity, s.prefetch, s.allow_dummy) == (
        None,
        4,
        None,
        True,
        False,
    )
    assert s.socket_dir == "/run/ple-server"
    assert s.gpu_ops == "kernels"
    monkeypatch.setenv("VLLM_PLE_SHM_GPU_OPS", "Memops")
    assert settings.ShmSettings.from_env().gpu_ops == "memops"
    gpu = __import__("pleclient.gpu").gpu
    assert settings.GPU_OPS == gpu.GPU_OPS  # one list, two homes
    assert settings.DEFAULT_GPU_OPS == gpu.DEFAULT_GPU_OPS
    monkeypatch.setenv("PLE_SERVER_SOCKET", "/tmp/a.sock")
    assert settings.ShmSettings.from_env().socket == "/tmp/a.sock"
    monkeypatch.setenv("VLLM_PLE_SHM_SOCKET", "/tmp/b.sock")
    monkeypatch.setenv("VLLM_PLE_SHM_PREFETCH", "0")
    s = settings.ShmSettings.from_env()
    assert s.socket == "/tmp/b.sock" and s.prefetch is False


@pytest.mark.parametrize(
    "name,value",
    [
        ("VLLM_PLE_SHM_CAPACITY", "lots"),
        ("VLLM_PLE_SHM_LOOKUP_TIMEOUT", "-1"),
        ("VLLM_PLE_SHM_PREFETCH", "maybe"),
        ("VLLM_PLE_SHM_DEPTH", "99"),
        ("VLLM_PLE_SHM_GPU_OPS", "graphs"),
    ],
)
def test_bad_settings_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name):
        settings.ShmSettings.from_env()


def test_backend_values(monkeypatch):
    monkeypatch.delenv("VLLM_PLE_BACKEND", raising=False)
    assert settings.backend() == "vllm"
    monkeypatch.setenv("VLLM_PLE_BACKEND", "SHM")
    assert settings.backend() == "shm"
    monkeypatch.setenv("VLLM_PLE_BACKEND", "mmap")
    with pytest.raises(SettingsError, match="VLLM_PLE_BACKEND=shm"):
        settings.backend()


def test_register_without_backend_installs_nothing(monkeypatch):
    monkeypatch.delenv("VLLM_PLE_BACKEND", raising=False)
    registration.register()
    assert not registration.is_registered()


def test_shard_names_and_nothing_else_count_as_unused():
    assert loader.is_ple_shard("model.layers.7.ple.ple_embedding.ngram_embedding.shard_511.weight")
    assert loader.is_ple_shard("ngram_embedding.shard_0.weight") is False  # not a full name
    assert not loader.is_ple_shard("model.layers.7.ple.ple_embedding.ngram_embedding.weight_scale")
    assert not loader.is_ple_shard("model.layers.7.ple.kv_proj.weight")


# ------------------------------------------------------------------- identity
def test_identity_reports_both_sides(checkpoint):
    spec = identity.select(
        identity.checkpoint_tables(str(checkpoint)),
        "layers.1.ple.ple_embedding.ngram_embedding",
        "ckpt",
    )
    server = TableInfo(**{**spec.info(), "fingerprint": "0" * 32, "rows": spec.rows + 1})
    with pytest.raises(IdentityMismatch) as err:
        identity.verify(server, "/run/x.sock", spec, str(checkpoint), expected(FP8))
    text = str(err.value)
    assert "/run/x.sock" in text and str(checkpoint) in text
    assert f"rows: server {spec.rows + 1} ≠ checkpoint {spec.rows}" in text
    assert f"fingerprint: server '{'0' * 32}' ≠ checkpoint '{spec.fingerprint}'" in text


def test_identity_against_the_model_geometry(routes):
    with pytest.raises(IdentityMismatch, match="cols: checkpoint 160, model expects 16"):
        routes.service.bind(expected(FP8, cols=16))
    with pytest.raises(IdentityMismatch, match="dtype: checkpoint 'BF16', model expects"):
        routes.service.bind(expected(BF16, dtypes=("F8_E4M3",)))


# ------------------------------------------------------------------- lookups
def test_lookup_larger_than_every_slot_together_is_exact(routes, reference):
    bf16 = layer(routes, BF16)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, BF16.rows, 1000))
    out = typed(BF16, 1000)  # 10 requests of 100 rows over 2 slots
    bf16.lookup(ids, out)
    assert np.array_equal(as_bytes(out), reference[3][ids.numpy()])


def test_two_prefetches_in_flight_collect_in_any_order(routes, reference):
    fp8, bf16 = layer(routes, FP8), layer(routes, BF16)
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.integers(0, FP8.rows, (25, 6)))  # 150 ids: 2 requests
    b = torch.from_numpy(rng.integers(0, BF16.rows, 70))
    fp8.start(a)
    bf16.start(b)
    out_b, out_a = typed(BF16, 70), typed(FP8, 150)
    bf16.finish(out_b)
    fp8.finish(out_a)
    assert np.array_equal(as_bytes(out_a), reference[1][a.reshape(-1).numpy()])
    assert np.array_equal(as_bytes(out_b), reference[3][b.numpy()])


def test_a_host_break_called_while_vllm_captures_asks_the_server_nothing(server, routes, reference):
    """The host route's calls are eager breaks; vLLM makes each break's first
    call during the capture, before the GPU ran the segment ahead of it, so
    the ids it hands over are not computed yet (here: what an unwritten
    buffer may hold, ids the server refuses). That call sends nothing and
    zeroes the output; the replays' calls, after the capture, read rows."""
    capturing = [True]
    binding = routes.service.bind(expected(BF16))
    bf16 = LayerLookups(binding, routes, StoredRows(binding), capturing=lambda: capturing[0])

    def requests() -> int:
        with server.client() as client:
            return sum(t["requests"] for t in client.stats()["tables"])

    before = requests()
    garbage = torch.tensor([-7, BF16.rows + 11, 3], dtype=torch.int64)
    out = typed(BF16, 3).fill_(1)
    bf16.lookup(garbage, out)
    assert not out.any()
    bf16.start(garbage)
    out.fill_(1)
    bf16.finish(out)
    assert not out.any() and not bf16.in_flight
    assert bf16.route is not None and not bf16.route.capturable  # (the host route)
    assert requests() == before
    capturing[0] = False  # a replay
    ids = torch.tensor([0, BF16.rows - 1, 3], dtype=torch.int64)
    bf16.start(ids)
    bf16.finish(out)
    assert np.array_equal(as_bytes(out), reference[3][ids.numpy()])
    assert requests() > before


def test_a_third_uncollected_prefetch_asks_for_more_depth(routes):
    held = [layer(routes, BF16), layer(routes, BF16)]
    ids = torch.arange(10)
    for lookups in held:
        lookups.start(ids)
    with pytest.raises(PleBackendError, match="VLLM_PLE_SHM_DEPTH"):
        layer(routes, BF16).start(ids)
    for lookups in held:
        lookups.discard()
    out = typed(BF16, 10)
    held[0].lookup(ids, out)  # the slots came back


def test_rows_convert_to_the_model_dtype(routes, reference):
    bf16 = layer(routes, BF16)
    ids = torch.arange(0, BF16.rows, 97)
    out = torch.empty((ids.numel(), BF16.cols), dtype=torch.float32)
    bf16.lookup(ids, out)
    want = torch.from_numpy(reference[3][ids.numpy()].copy()).view(torch.bfloat16).float()
    assert torch.equal(out, want)


def test_server_gone_with_no_reconnect_window_fails_at_once(server, routes):
    bf16 = layer(routes, BF16)
    server.stop()
    with pytest.raises(PleBackendError, match="systemctl start ple-server"):
        bf16.lookup(torch.arange(5), typed(BF16, 5))


def test_a_server_back_within_the_window_answers_the_lookup_that_waited(
    start_server, checkpoint, reference, caplog
):
    first = start_server(checkpoint)
    rows = Routes(
        RowService(
            settings.ShmSettings(
                socket=first.socket,
                checkpoint=str(checkpoint),
                capacity=100,
                depth=2,
                reconnect_window=60,
                fallback_after=None,  # what is tested is the wait for the server
            )
        )
    )
    try:
        bf16 = layer(rows, BF16)
        first.stop()
        ids = torch.arange(0, BF16.rows, 61)
        out = typed(BF16, ids.numel())
        with (
            caplog.at_level("WARNING", logger="pleclient.vllm_plugin"),
            ThreadPoolExecutor(1) as pool,
        ):  # the next server starts while the lookup waits
            second = pool.submit(start_server, checkpoint, socket_path=first.socket)
            bf16.lookup(ids, out)
            second.result()
        assert np.array_equal(as_bytes(out), reference[3][ids.numpy()])
        assert f"reconnected to ple-server at {first.socket}" in caplog.text
    finally:
        rows.close()


def test_missing_server_names_the_socket(tmp_path, checkpoint):
    rows = RowService(
        settings.ShmSettings(socket=str(tmp_path / "no.sock"), checkpoint=str(checkpoint))
    )
    with pytest.raises(PleBackendError, match=r"no\.sock.*systemctl start ple-server"):
        rows.bind(expected(FP8))


def test_a_lookup_larger_than_its_layer_slots_takes_them_in_turns(
    server, checkpoint, reference, caplog
):
    """The GPU-driven route (its CPU stand-in) sizes each layer's slots for its
    largest lookup; a larger one rings its later requests as slots come back.
    The route chosen is logged as the real-vLLM harness reads it."""
    from bench.real_vllm.coordinator import routes_run

    caplog.set_level("INFO", logger="pleclient.vllm_plugin")
    rows = Routes(
        RowService(
            settings.ShmSettings(
                socket=server.socket, checkpoint=str(checkpoint), capacity=100, gpu_path="standin"
            )
        )
    )
    try:
        binding = rows.service.bind(expected(BF16), max_ids=200)  # 2 slots of 100 ids
        bf16 = LayerLookups(binding, rows, StoredRows(binding))
        ids = torch.from_numpy(np.random.default_rng(2).integers(0, BF16.rows, 450))
        out = typed(BF16, 450)
        bf16.lookup(ids, out)  # 5 requests over the layer's 2 slots
        assert bf16.route is not None and bf16.route.name == "gpu-driven (CPU stand-in)"
        assert routes_run(caplog.text) == ["gpu:host"]
        assert np.array_equal(as_bytes(out), reference[3][ids.numpy()])
        bf16.start(ids[:150])
        out = typed(BF16, 150)
        bf16.finish(out)
        assert np.array_equal(as_bytes(out), reference[3][ids[:150].numpy()])
    finally:
        rows.close()


def test_step_layers_outnumbering_the_slots_take_them_in_layer_order(routes, reference):
    """Four PLE layers started together with the step on a 2-slot channel (the
    host route): the first layers' requests go out at once, the others as the
    earlier layers finish; every layer's rows are exact, none waits forever."""
    layers = [layer(routes, BF16) for _ in range(4)]
    for lookups in layers:
        lookups.binding.with_step = True  # what the step start marks (step.adopt)
    rng = np.random.default_rng(3)
    ids = [torch.from_numpy(rng.integers(0, BF16.rows, n)) for n in (150, 30, 250, 70)]
    for lookups, layer_ids in zip(layers, ids, strict=True):
        lookups.start(layer_ids)  # 2 + 1 + 3 + 1 requests of at most 100 ids
    client = routes.service.client
    assert client is not None and client.free_slots == 0  # the first layer holds both
    for lookups, layer_ids in zip(layers, ids, strict=True):
        out = typed(BF16, layer_ids.numel())
        lookups.finish(out)
        assert np.array_equal(as_bytes(out), reference[3][layer_ids.numpy()])
    assert client.free_slots == 2


def test_the_host_route_under_full_cuda_graphs_stops_at_the_route_choice(
    server, checkpoint, caplog
):
    """A worker whose vLLM captures full CUDA graphs and whose lookups take the
    host path (off here; with auto, where GPU-driven lookups are unavailable)
    fails when its first lookup chooses the route, before any graph is
    captured, naming the mode and the ways out. The same worker on CPU, or
    without full graphs, takes the host route."""

    def routes_with(full_graphs) -> Routes:
        return Routes(
            RowService(
                settings.ShmSettings(
                    socket=server.socket, checkpoint=str(checkpoint), gpu_path="off"
                )
            ),
            full_graphs=full_graphs,
        )

    refusing = routes_with("FULL_AND_PIECEWISE")
    try:
        binding = refusing.service.bind(expected(FP8))
        assert refusing.for_layer(binding, torch.device("cpu")) is refusing.host
        with pytest.raises(UnsupportedCompilation) as failure:
            refusing.for_layer(binding, torch.device("cuda"))
        message = str(failure.value)
        assert "-cc.cudagraph_mode=FULL_AND_PIECEWISE captures whole steps" in message
        assert "-cc.cudagraph_mode=PIECEWISE" in message and "VLLM_PLE_SHM_GPU_PATH=auto" in message
    finally:
        refusing.close()
    plain = routes_with(None)
    try:
        caplog.set_level("INFO", logger="pleclient.vllm_plugin")
        binding = plain.service.bind(expected(FP8))
        assert plain.for_layer(binding, torch.device("cuda")) is plain.host
        from bench.real_vllm.coordinator import routes_run

        assert routes_run(caplog.text)[-1] == "host"  # as the real-vLLM harness reads it
    finally:
        plain.close()
    # The mode is read when the route is chosen: vLLM's model runner may settle
    # another one after the routes were built (here: full graphs given up).
    mode: list[str | None] = ["FULL_AND_PIECEWISE"]
    settled = routes_with(lambda: mode[0])
    try:
        binding = settled.service.bind(expected(FP8))
        mode[0] = None
        assert settled.for_layer(binding, torch.device("cuda")) is settled.host
    finally:
        settled.close()
