"""The vLLM plugin's side of DeepSeek-V4.1's Engram tables: served MXFP8 rows
decoded to BF16 bit for bit as vLLM's own Engram lookup decodes its table
(``_engram_lookup_kernel``, run by Triton's interpreter on CPU, in a scenario
process: ``tests/vllm_helpers/engram_scenarios.py``)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

from pleclient import PleClient, TableInfo
from pleclient.engram import EngramHasher
from pleclient.families import hasher_for
from pleclient.vllm_plugin import loader, mxfp8
from pleclient.vllm_plugin import prompt_ahead as pa
from pleclient.vllm_plugin.settings import ShmSettings
from tests.harness import server_launcher, wait_until
from tests.vllm_helpers import run_scenario

TRITON_ON_CPU = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def test_served_rows_decode_as_vllms_engram_lookup_through_torch_and_its_kernel():
    result = run_scenario(
        "decode_engram_rows",
        {"rows": 997, "cols": 256, "heads": 24, "tokens": 40, "seed": 3},
        module="tests.vllm_helpers.engram_scenarios",
        env=TRITON_ON_CPU,
        timeout=600,
    )
    assert result["equal"] == {"torch": True, "kernel": True, "kernel, buffers": True}, result
    assert result["values"] == 40 * 24 * 256 and result["zeros"] > 0  # (scale byte 0)


def test_a_wrong_output_is_refused_naming_the_shapes():
    raw = torch.zeros((3, mxfp8.row_bytes(64)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"decode into 3 x 64 contiguous BF16 elements"):
        mxfp8.decode_into(raw, torch.empty((3, 65), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"the output is torch\.float16"):
        mxfp8.decode_into(raw, torch.empty((3, 64), dtype=torch.float16))


# ------------------------------------------------------ the Engram layers
@pytest.fixture(scope="module")
def engram_model(tmp_path_factory):
    from pleserver.devkit.deepseek_v41 import write_tiny_deepseek_v41

    return write_tiny_deepseek_v41(str(tmp_path_factory.mktemp("dsv41")))


def run_layers(model, out, env=None, *, expect_error: bool = False, **parallel) -> dict:
    """The layers over three batches (1, 7 and 33 tokens); ``parallel``: the
    scenario's ``world``, ``rank``, ``init_file``, ``sequence_parallel``."""
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 2_000, n).tolist() for n in (1, 7, 33)]
    return run_scenario(
        "engram_layers",
        {
            "model": str(model),
            "out": str(out),
            "batches": batches,
            "expect_error": expect_error,
            **parallel,
        },
        module="tests.vllm_helpers.engram_scenarios",
        env={**TRITON_ON_CPU, **(env or {})},
        timeout=600,
    )


def test_engram_layers_read_their_rows_from_ple_server_as_stock_reads_its_table(
    start_server, engram_model, tmp_path
):
    """vLLM's real ``Engram`` layers, stock and patched (every head's rows from a
    real ple-server): the same rows, bit for bit, and the same outputs."""
    server = start_server(engram_model)
    stock = run_layers(engram_model, tmp_path / "stock.pt")
    shm = run_layers(
        engram_model,
        tmp_path / "shm.pt",
        {
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": server.socket,
            "VLLM_PLE_SHM_CHECKPOINT": str(engram_model),
        },
    )
    assert stock["storages"] == ["ParallelEngramEmbedding"]
    assert shm["storages"] == ["EngramShmStorage"]
    want, got = torch.load(tmp_path / "stock.pt"), torch.load(tmp_path / "shm.pt")
    assert sorted(want) == sorted(got) and len(want) == 3 * 2 * 2
    for key in want:
        assert torch.equal(got[key].view(torch.int16), want[key].view(torch.int16)), key
    with server.client() as client:
        tables = {t["name"]: t for t in client.stats()["tables"]}
    assert all(t["requests"] >= 3 for t in tables.values()), tables  # every batch, each layer


def test_the_loader_skips_the_engram_tables_and_keeps_the_rest():
    assert loader.is_ple_shard("layers.1.engram.embed.weight")
    assert loader.is_ple_shard("language_model.model.layers.14.engram.embed.scale")
    assert not loader.is_ple_shard("layers.1.engram.wkv.weight")
    assert not loader.is_ple_shard("layers.1.engram.q_weight")


def test_a_prompts_engram_rows_hinted_at_arrival_are_the_rows_its_layers_look_up(engram_model):
    """Prompt-ahead in the engine core picks the Engram hasher from the
    config; the rows it hints are then every lookup's cache hits."""
    prompt = np.random.default_rng(8).integers(0, 2_000, 150).tolist()
    hasher = EngramHasher.from_checkpoint(engram_model)
    assert isinstance(hasher_for(engram_model), EngramHasher)
    with server_launcher(engram_model, "--io", "buffered", "--cache-size", "4M").start() as server:
        ahead = pa.PromptAhead(ShmSettings(socket=server.socket), engram_model, ("arrival",))
        try:
            ahead.arrived("r0", prompt)
            assert ahead.idle(60)
            assert ahead.stats.ids_sent > 0 and ahead.stats.errors == 0
            with PleClient.connect(server.socket) as client:
                for layer in hasher.layers:  # (the session open: its hints stay queued)

                    def settled(name=layer.table):
                        t = next(t for t in client.stats()["tables"] if t["name"] == name)
                        return t["hints_read"] + t["hints_cached"] == t["hints_received"] > 0

                    assert wait_until(settled, timeout=30), client.stats()["tables"]
                    ids = layer.row_ids(prompt).reshape(-1)
                    before = next(t for t in client.stats()["tables"] if t["name"] == layer.table)
                    client.lookup(layer.table, ids)
                    after = next(t for t in client.stats()["tables"] if t["name"] == layer.table)
                    assert after["io"]["misses"] == before["io"]["misses"], layer.table
                    assert after["hints_hits"] - before["hints_hits"] == len(np.unique(ids))
        finally:
            ahead.close()


def test_an_engram_layer_against_a_server_of_another_checkpoint_is_refused(
    start_server, engram_model, tmp_path
):
    from pleserver.devkit.deepseek_v41 import write_tiny_deepseek_v41

    other = write_tiny_deepseek_v41(str(tmp_path / "other"), seed=1)
    server = start_server(other)
    result = run_layers(
        engram_model,
        tmp_path / "shm.pt",
        {
            "VLLM_PLE_BACKEND": "shm",
            "VLLM_PLE_SHM_SOCKET": server.socket,
            "VLLM_PLE_SHM_CHECKPOINT": str(engram_model),
        },
        expect_error=True,
    )
    assert result["error"] == "IdentityMismatch", result
    assert "from another checkpoint than the one vLLM loads" in result["message"]
    assert "fingerprint" in result["message"]


def test_under_sequence_parallelism_each_rank_gets_its_own_tokens_rows(
    start_server, engram_model, tmp_path
):
    """Tensor parallel 2 with sequence parallelism: stock splits the heads over
    the ranks, gathers and picks each rank's chunk of tokens; the plugin reads
    every head and slices. Rank 1 (and 0) get the same rows and outputs."""
    server = start_server(engram_model)
    shm = {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": server.socket,
        "VLLM_PLE_SHM_CHECKPOINT": str(engram_model),
    }

    def both_ranks(name: str, env: dict | None) -> None:
        init_file = str(tmp_path / f"{name}-init")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(
                pool.map(
                    lambda rank: run_layers(
                        engram_model,
                        tmp_path / f"{name}-{rank}.pt",
                        env,
                        world=2,
                        rank=rank,
                        init_file=init_file,
                        sequence_parallel=True,
                    ),
                    range(2),
                )
            )

    both_ranks("stock", None)
    both_ranks("shm", shm)
    for rank in range(2):
        want = torch.load(tmp_path / f"stock-{rank}.pt")
        got = torch.load(tmp_path / f"shm-{rank}.pt")
        assert sorted(want) == sorted(got)
        for key in want:
            assert torch.equal(got[key].view(torch.int16), want[key].view(torch.int16)), (rank, key)
    rows = torch.load(tmp_path / "shm-1.pt")["2/0/rows"]
    assert rows.shape[0] == -(-33 // 2)  # rank 1's chunk of the 33 tokens


def test_rocm_with_an_engram_data_parallel_group_is_refused_naming_the_ways_out():
    from pleclient.vllm_plugin.deepseek_v41 import refuse_amd_data_parallel
    from pleclient.vllm_plugin.errors import PleBackendError

    refuse_amd_data_parallel("nvidia", 4)  # NVIDIA's model asks the storage: no gather
    refuse_amd_data_parallel("amd", 1)
    with pytest.raises(PleBackendError, match=r"group of 2 replicas.*--data-parallel-size 1"):
        refuse_amd_data_parallel("amd", 2)


def test_a_checkpoint_table_longer_than_the_hash_addresses_is_accepted_as_stock_does(
    engram_model,
):
    """vLLM's Engram loader reads the first rows (the primes' sum) of a table
    that may hold more; fewer is refused."""
    from pleclient.checkpoint import discover_tables
    from pleclient.vllm_plugin import identity
    from pleclient.vllm_plugin.errors import IdentityMismatch

    spec = discover_tables(engram_model)[0]  # layers.1: 1 067 rows
    info = TableInfo(**spec.info())

    def expected(rows: int) -> identity.Expected:
        return identity.Expected(
            "…layers.1.engram.embed_tokens",
            rows,
            64,
            ("MXFP8",),
            1,
            table="layers.1.engram.embed",
            rows_at_least=True,
        )

    identity.verify(info, "sock", spec, engram_model, expected(1067))
    identity.verify(info, "sock", spec, engram_model, expected(1000))
    with pytest.raises(IdentityMismatch, match="rows: checkpoint 1067, model expects 1100"):
        identity.verify(info, "sock", spec, engram_model, expected(1100))


def test_served_rows_of_another_width_are_refused_naming_the_table():
    raw = torch.zeros((3, 64), dtype=torch.uint8)  # no 32-column block fits 64 bytes
    with pytest.raises(ValueError, match="is the table an Engram one"):
        mxfp8.decode_into(raw, torch.empty((3, 62), dtype=torch.bfloat16))
