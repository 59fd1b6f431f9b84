"""``bench/evals/northstar.py`` at a small size on the CPU: a real cold server per
path, the GPU-driven channel's CPU stand-in, the report. The trace here is a
small one made for the test (Zipf-distributed ids, so that rows repeat as in
text), of one PLE layer or of two Engram layers (tokens, hashed by the
benchmark as it loads the trace); the benchmark itself runs on
``bench/sim/text_trace.py``'s and ``bench/sim/engram_trace.py``'s real text.

What must hold: every path that ran returned the table's rows; a server path's
misses are exactly the trace's first-touch ids (a row cache that starts empty
and never evicts misses those and nothing else), so the server was cold and
the warm-up touched none of the timed rows; the paths that cannot run here say
why; nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench.sim.text_trace import ENGRAM_FORMAT, HEADS, write_npz
from pleclient.engram import EngramConfig, bucket_primes
from tests.harness import REPO, shm_entries

TRACE_ROWS = 320_001_536  # the trace's geometry: ids are scaled from it onto the table


def small_trace(path, tokens: int = 20_000) -> None:
    rng = np.random.default_rng(7)
    # each token's 16 ids: a Zipf-ranked n-gram, hashed per head into the head's range
    rank = rng.zipf(1.3, size=(tokens, 1)) % 400_000
    heads = np.arange(HEADS, dtype=np.uint64)
    span = TRACE_ROWS // HEADS
    ids = (heads * span + (rank.astype(np.uint64) * 2_654_435_761 + heads) % span).astype(np.uint32)
    meta = {"format": "pleserver-trace/1", "geometry": {"rows": TRACE_ROWS}, "tokens": tokens}
    write_npz(
        str(path),
        {
            "ids": ids,
            "tokens": np.zeros(tokens, np.int32),
            "doc_starts": np.array([0, tokens], np.int64),
            "meta": np.array(json.dumps(meta)),
        },
    )


def small_engram_trace(path, tokens: int = 20_000) -> None:
    """An Engram trace (``bench.sim.engram_trace``'s format: tokens and a
    compressed map, hashed when loaded) of Zipf-ranked tokens, two layers."""
    rng = np.random.default_rng(7)
    vocab = 600
    config = EngramConfig(
        layer_ids=ENGRAM_LAYERS,
        max_ngram_size=3,
        n_heads=2,
        compressed_vocab_size=400,
        pad_token_id=0,
        vocab_size=50_000,
    )
    rows = [sum(p) for p in bucket_primes(config)]
    meta = {
        "format": ENGRAM_FORMAT,
        "tokens": tokens,
        "geometry": {
            "layer_ids": list(ENGRAM_LAYERS),
            "max_ngram_size": config.max_ngram_size,
            "n_heads": config.n_heads,
            "compressed_vocab_size": config.compressed_vocab_size,
            "pad_token_id": config.pad_token_id,
            "engram_vocab_size": config.vocab_size,
            "heads": config.hash_cols * len(ENGRAM_LAYERS),
            "ids_per_layer": config.hash_cols,
            "layer_rows": rows,
            "rows": sum(rows),
        },
    }
    write_npz(
        str(path),
        {
            "tokens": (rng.zipf(1.3, size=tokens) % vocab).astype(np.int32),
            "doc_starts": np.array([0, tokens // 2, tokens], np.int64),
            "token_map": (np.arange(vocab) % config.compressed_vocab_size).astype(np.int32),
            "meta": np.array(json.dumps(meta)),
        },
    )


ENGRAM_LAYERS = (1, 3)


@pytest.mark.parametrize("family", ["ple", "engram"])
def test_northstar_on_the_cpu_checks_rows_and_counts_every_cold_miss(tmp_path, family):
    trace, out = tmp_path / "trace.npz", tmp_path / "northstar.json"
    if family == "ple":
        small_trace(trace)
        layers = ["--ple-at", "2"]
    else:  # every case has the trace's two Engram layers
        small_engram_trace(trace)
        layers = ["--gpu-ops", "memops"]  # (the CPU stand-in runs the words from the host)
    argv = [
        sys.executable,
        "-m",
        "bench.evals.northstar",
        "--cpu",
        "--trace",
        str(trace),
        "--workdir",
        str(tmp_path),
        "--layers",
        "4",
        *layers,
        "--batches",
        "8",
        "--steps",
        "60",
        "--prompts",
        "2",
        "--chunk-tokens",
        "128",
        "--probe-seconds",
        "0.2",
        "--json",
        str(out),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=REPO)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    want = {"ple": [[2]], "engram": [list(ENGRAM_LAYERS)]}[family]
    assert [c["ple_at"] for c in report["cases"]] == want * 2, [c["key"] for c in report["cases"]]
    assert report["table"]["row_bytes"] == {"ple": 160, "engram": 256}[family]
    assert report["args"]["gpu_ops"] == {"ple": "kernels", "engram": "memops"}[family]
    assert report["disk"]["1"]["reads_per_s"] > 0 and report["disk"]["128"]["reads_per_s"] > 0
    runs = {(c["kind"], r["path"]): r for c in report["cases"] for r in c["runs"]}
    assert set(runs) == {("decode", p) for p in ("a", "b", "e", "d")} | {
        ("prefill", p) for p in ("a", "b", "prompt-ahead-arrival", "prompt-ahead", "e", "d")
    }
    assert "CUDA" in runs["decode", "b"]["unavailable"]
    for (kind, path), r in runs.items():
        if r["unavailable"]:
            assert path == "b", (kind, path, r)
            continue
        assert r["error"] is None, r["error"]
        assert r["exact"] is True and r["checked_steps"] > 0, (kind, path)
        if path in ("e", "d", "prompt-ahead-arrival", "prompt-ahead"):
            assert r["server"]["requests"] > 0
            if not path.startswith("prompt-ahead"):  # hints change what a lookup misses
                assert r["server"]["misses"] == r["trace"]["misses"] > 0, (kind, path)
            else:  # every prompt's hints sent by the thread, none skipped
                assert r["hints"]["ids"] > 0 and r["hints"]["skipped"] == 0, r["hints"]
                assert r["server"]["hints"]["hints_received"] == r["hints"]["ids"], r["server"]
    decode = {p: runs["decode", p] for p in ("a", "e", "d")}
    for r in decode.values():
        assert r["steps"] == 60 and len(r["step_ms"]) == 60
        assert [r["windows"][w]["steps"] for w in ("first 50", "warming", "steady")] == [15, 15, 30]
    assert set(decode["e"]["bound"]) == {"first 50", "warming", "steady", "whole"}
    assert set(report["disk"]) == {"1", "8", "32", "128"}  # the depths the bound reads
    assert runs["prefill", "e"]["prompts"]["prompt_ms"][0] > 0
    assert not list(tmp_path.glob("ple-northstar-*")), "the benchmark left its directory"
    assert not shm_entries()


def test_an_engram_layer_can_run_alone_but_only_one_the_trace_has(tmp_path, capsys):
    """``--ple-at`` with an Engram trace: a case for each named layer alone (a
    deeper layer's reads without layer 1's); a layer the trace has no ids
    of is refused by name."""
    from bench.evals import northstar

    trace = tmp_path / "trace.npz"
    small_engram_trace(trace)
    common = ["--cpu", "--trace", str(trace), "--layers", "4"]
    assert northstar.parse_args(common).ple_at == [ENGRAM_LAYERS]
    assert northstar.parse_args([*common, "--ple-at", "3,1"]).ple_at == [(3,), (1,)]
    with pytest.raises(SystemExit):
        northstar.parse_args([*common, "--ple-at", "2"])
    assert "has the ids of its layers [1, 3] only" in capsys.readouterr().err


def test_the_bound_of_a_steps_reads_is_the_disks_time_at_their_queue_depth():
    """``disk_time_s``: one read costs the QD-1 latency; ``n`` reads issued
    together cost ``n ÷ rate(n)``, the rate at that depth probed or
    interpolated on log depth; past the deepest probe, its rate."""
    from bench.evals.northstar import disk_time_s

    disk = {d: {"reads_per_s": r} for d, r in (("1", 40e3), ("8", 80e3), ("32", 100e3))}
    disk["128"] = {"error": "the probe did not return"}  # a failed depth is left out
    assert disk_time_s(1, disk) == pytest.approx(1 / 40e3)
    assert disk_time_s(8, disk) == pytest.approx(8 / 80e3)
    assert disk_time_s(16, disk) == pytest.approx(16 / 90e3)  # half way on log depth
    assert disk_time_s(1000, disk) == pytest.approx(1000 / 100e3)
    assert disk_time_s(0.5, disk) == pytest.approx(0.5 / 40e3)
    assert disk_time_s(0, disk) == 0.0
    assert disk_time_s(5, {"1": {"error": "no"}}) is None
