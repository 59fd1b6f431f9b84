"""Prompt-ahead (``pleclient.vllm_plugin.prompt_ahead``) through vLLM's own
``Scheduler`` on CPU and the whole tiny Qwen4Exp model, against a real
ple-server with a row cache (``--io buffered``), started cold for each case.

A 200-token prompt is scheduled in 64-token chunks (4 chunks); each chunk runs
through the whole model, stock and with the plugin, after the hints sent so
far have been read. The server's counters show what each stage did: with
prompt-ahead off every chunk reads rows from disk; with hints at arrival no
chunk does, and its lookups hit hinted rows; with hints at scheduling the first
chunk reads from disk and chunks 2..4 do not."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from pleclient import PleClient
from pleclient.ngram import NgramHasher
from pleclient.vllm_plugin import prompt_ahead as pa
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.settings import SettingsError, ShmSettings
from tests.harness import server_launcher, shm_env, wait_until
from tests.vllm_helpers import qwen4_model as qm
from tests.vllm_helpers import run_scenario

PROMPT_TOKENS = 200
CHUNK = 64
CHUNKS = 4  # 64, 64, 64, 8


def serve(model):
    return server_launcher(model, "--io", "buffered", "--cache-size", "4M").start()


@pytest.fixture(scope="module", params=["off", "arrival", "scheduled", "arrival,scheduled"])
def run(request, qwen4_checkpoints) -> dict:
    model = qwen4_checkpoints.fp8
    with serve(model) as server:
        result = run_scenario(
            "prompt_ahead",
            {"model": model, "tokens": PROMPT_TOKENS, "chunk": CHUNK},
            env=shm_env(server, model, VLLM_PLE_SHM_PROMPT_AHEAD=request.param),
            timeout=400,
        )
    result["stages"] = request.param
    return result


def misses(chunk: dict) -> int:
    return sum(t["misses"] for t in chunk["tables"].values())


def hinted_hits(chunk: dict) -> int:
    return sum(t["hints_hits"] for t in chunk["tables"].values())


def test_the_scheduler_is_patched_and_chunks_the_prompt(run):
    assert run["patched"]
    chunks = run["chunks"]
    assert [c["tokens"] for c in chunks] == [64, 64, 64, 8]
    assert [c["new_request"] for c in chunks] == [["prompt-0"], [], [], []]


def test_rows_are_bit_identical_to_the_stock_build_in_every_chunk(run):
    for chunk in run["chunks"]:
        assert chunk["layers_compared"] == list(qm.PLE_DECODER_LAYERS)
        assert chunk["outputs_equal"], chunk["start"]


def test_what_each_stage_hints_and_what_the_chunks_read_from_disk(run):
    chunks, stages = run["chunks"], run["stages"]
    final = run["final"]
    received = sum(t["hints_received"] for t in final.values())
    if stages == "off":
        assert run["prompt_ahead"] is None
        assert received == 0
        assert all(misses(c) > 0 for c in chunks), [misses(c) for c in chunks]
        return
    stats = run["prompt_ahead"]
    assert stats["errors"] == 0 and stats["prompts_dropped"] == 0
    assert stats["ids_skipped"] == 0 and stats["ids_sent"] > 0
    # Nothing dropped by the server: the cache holds the tiny tables.
    assert sum(t["hints_dropped"] for t in final.values()) == 0
    assert sum(t["hints_read"] for t in final.values()) > 0
    if "arrival" in stages:
        assert stats["prompts"]["arrival"] == 1
        # Every row of every chunk was read by a hint before the chunk ran.
        assert [misses(c) for c in chunks] == [0] * CHUNKS
        assert all(hinted_hits(c) > 0 for c in chunks)
        assert sum(t["hints_received"] for t in run["after_arrival"].values()) > 0
    else:
        assert stats["prompts"]["arrival"] == 0
        assert sum(t["hints_received"] for t in run["after_arrival"].values()) == 0
        assert misses(chunks[0]) > 0  # chunk 1 is looked up as it runs
        assert [misses(c) for c in chunks[1:]] == [0] * (CHUNKS - 1)
        assert all(hinted_hits(c) > 0 for c in chunks[1:])
    assert stats["prompts"]["scheduled"] == (1 if "scheduled" in stages else 0)


def test_hinted_rows_are_the_rows_the_layers_look_up(qwen4_checkpoints):
    """The hasher's ids for a prompt, hinted, then looked up: every lookup is a
    hit on a hinted row (the same rows, so the same hashing)."""
    model = qwen4_checkpoints.fp8
    hasher = NgramHasher.from_checkpoint(model)
    prompt = np.random.default_rng(5).integers(8, 500, 120)
    with serve(model) as server, PleClient.connect(server.socket) as client:
        pa.check_tables(client, hasher, model)
        for layer in hasher.layers:
            ids = layer.row_ids(prompt).reshape(-1)
            client.hint(layer.table, ids)
        for layer in hasher.layers:
            ids = layer.row_ids(prompt).reshape(-1)

            def settled(name=layer.table):
                t = next(t for t in client.stats()["tables"] if t["name"] == name)
                return t["hints_read"] + t["hints_cached"] == t["hints_received"] > 0

            assert wait_until(settled, timeout=30)
            before = next(t for t in client.stats()["tables"] if t["name"] == layer.table)
            client.lookup(layer.table, ids)
            after = next(t for t in client.stats()["tables"] if t["name"] == layer.table)
            assert after["io"]["misses"] == before["io"]["misses"]
            assert after["hints_hits"] - before["hints_hits"] == len(np.unique(ids))


def test_a_server_of_another_checkpoint_turns_prompt_ahead_off(qwen4_checkpoints):
    hasher = NgramHasher.from_checkpoint(qwen4_checkpoints.fp8)
    with serve(qwen4_checkpoints.bf16) as server:
        with (
            PleClient.connect(server.socket) as client,
            pytest.raises(PleBackendError, match="another checkpoint"),
        ):
            pa.check_tables(client, hasher, qwen4_checkpoints.fp8)
        settings = ShmSettings(socket=server.socket)
        ahead = pa.PromptAhead(settings, str(qwen4_checkpoints.fp8), ("arrival",))
        try:
            ahead.arrived("r0", list(range(8, 300)))
            ahead.arrived("r1", list(range(8, 300)))
            assert ahead.idle(30)
            assert ahead.stats.prompts_not_hinted == 2 and ahead.stats.ids_sent == 0
        finally:
            ahead.close()
        stats = PleClient.query_stats(server.socket)
        assert all(not t.get("hints_received") for t in stats["tables"])


def test_without_a_server_prompts_are_counted_and_the_caller_never_waits(
    qwen4_checkpoints, tmp_path
):
    settings = ShmSettings(socket=str(tmp_path / "none.sock"), connect_timeout=0.2)
    ahead = pa.PromptAhead(settings, str(qwen4_checkpoints.fp8), ("arrival", "scheduled"))
    try:
        ahead.arrived("r0", list(range(8, 300)))
        ahead.scheduled("r0", list(range(8, 300)), 64)
        ahead.scheduled("r0", list(range(8, 300)), 300)  # nothing after the chunk: no prompt
        assert ahead.idle(30)
        assert ahead.stats.prompts_not_hinted == 2
        assert ahead.stats.ids_sent == 0 and ahead.stats.errors == 0
    finally:
        ahead.close()


def test_a_restarted_server_gets_the_next_prompts_hints(qwen4_checkpoints, tmp_path):
    model = qwen4_checkpoints.fp8
    socket = str(tmp_path / "ple.sock")
    launcher = server_launcher(model, "--io", "buffered", "--cache-size", "4M", socket_path=socket)
    ahead = pa.PromptAhead(ShmSettings(socket=socket), str(model), ("arrival",))

    def received() -> int:
        return sum(t.get("hints_received") or 0 for t in PleClient.query_stats(socket)["tables"])

    try:
        # The server counts a hint once it has answered its slot, and the
        # client does not wait for that answer: the count comes a little after.
        with launcher.start():
            ahead.arrived("r0", list(range(8, 200)))
            assert ahead.idle(30)
            assert wait_until(lambda: received() > 0, 10)
        with launcher.start():  # stopped, and started again on the same socket
            assert received() == 0
            ahead.arrived("r1", list(range(8, 200)))
            assert ahead.idle(30)
            assert wait_until(lambda: received() > 0, 10)
        assert ahead.stats.prompts["arrival"] == 2 and ahead.stats.errors == 0
    finally:
        ahead.close()


def test_prompts_past_the_queue_are_dropped_counted_and_logged(qwen4_checkpoints, tmp_path, caplog):
    settings = ShmSettings(socket=str(tmp_path / "none.sock"), connect_timeout=0.2)
    ahead = pa.PromptAhead(settings, str(qwen4_checkpoints.fp8), ("arrival",), queue_prompts=1)
    try:
        with caplog.at_level("WARNING", logger="pleclient.vllm_plugin"), ahead._wake:
            # Holding the queue's lock, the thread cannot take a prompt meanwhile.
            for i in range(4):
                ahead.arrived(f"r{i}", list(range(8, 100)))
        assert ahead.stats.prompts_dropped == 3
        drops = [r.getMessage() for r in caplog.records if "not hinted so far" in r.message]
        assert len(drops) == 2, drops  # the 1st and the 2nd, not the 3rd
        assert ahead.idle(30)
        assert ahead.stats.prompts_not_hinted == 1  # the one queued (no server)
    finally:
        ahead.close()


@pytest.mark.parametrize(
    "value, stages",
    [
        ("", ("arrival", "scheduled")),
        ("off", ()),
        ("arrival", ("arrival",)),
        ("scheduled", ("scheduled",)),
        ("scheduled,arrival", ("arrival", "scheduled")),
    ],
)
def test_the_stages_setting(monkeypatch, value, stages):
    monkeypatch.setenv("VLLM_PLE_SHM_PROMPT_AHEAD", value)
    assert ShmSettings.from_env().prompt_ahead == stages


def test_a_bad_stage_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("VLLM_PLE_SHM_PROMPT_AHEAD", "arrival,later")
    with pytest.raises(SettingsError, match="arrival, scheduled"):
        ShmSettings.from_env()
