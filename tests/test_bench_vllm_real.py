"""``bench.real_vllm``'s coordinator, cells, exactness rule and checkpoint
script on the CPU, before they get the GPU host's scarce
minutes: the exactness rule on constructed outcomes, the checkpoint (written
by the script, accepted by ``pleserver inspect``, transformers and vLLM's own
loader), the arguments vLLM's own parsers make of each cell, the OpenAI
streaming client against a stand-in of vLLM's completions stream, the
server's figures from a real ple-server, the coordinator's deadline and its
end of a cell's process group, and the summary.

A whole ``LLM`` does not run here: the CUDA wheel of vLLM 0.33 has no CPU
kernels (its CPU worker stops at ``torch.ops._C.init_cpu_memory_env``), and
Qwen4Exp's hyper-connection and PLE kernels are Triton-only."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from bench.real_vllm import cells as vc
from bench.real_vllm.exact import IncomparableOutcomes, Outcome, judge
from tests.harness import REPO

BENCH = REPO / "bench"


# ------------------------------------------------------------------ exactness
def outcome(tokens, lps=None, digest="p") -> Outcome:
    """Outcomes of two prompts; each position's logprobs: the token's own and
    a runner-up's."""
    lps = lps or [[-0.5] * len(seq) for seq in tokens]
    return Outcome(
        tuple(tuple(seq) for seq in tokens),
        tuple(
            tuple({t: lp, 999: lp - 1.0} for t, lp in zip(seq, lseq, strict=True))
            for seq, lseq in zip(tokens, lps, strict=True)
        ),
        digest,
    )


A = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
B = [[1, 2, 3, 4, 50, 60], [7, 8, 9, 10, 11, 12]]  # stock's other outcome: parts at 4


def test_an_outcome_equal_to_one_stock_run_passes_as_identical():
    stock = [outcome(A), outcome(B), outcome(A)]
    v = judge(stock, outcome(B))
    assert v.passed and v.how == "identical" and v.identical_to == [1]
    assert v.stock_outcomes == 2


def test_a_difference_within_stocks_own_spread_passes():
    # stock: one sequence differs, from position 4; logprobs before it differ by 0.01
    stock = [outcome(A), outcome(B, [[-0.51] * 6, [-0.5] * 6])]
    # candidate: A's tokens but its own small logprob drift, less than stock's
    v = judge(stock, outcome(A, [[-0.505] * 6, [-0.5] * 6]))
    assert v.passed and v.how == "within spread", v.detail
    assert v.stock_spread.sequences == 1 and v.stock_spread.first_position == 4


@pytest.mark.parametrize(
    "tokens, lps, measure",
    [
        ([[1, 2, 3, 4, 50, 60], [7, 8, 9, 10, 11, 99]], None, "more sequences"),
        ([[1, 2, 30, 4, 5, 6], [7, 8, 9, 10, 11, 12]], None, "earlier"),
        (A, [[-0.5] * 6, [-0.9] * 6], "larger logprob"),
    ],
)
def test_a_difference_outside_stocks_spread_fails(tokens, lps, measure):
    stock = [outcome(A), outcome(B, [[-0.51] * 6, [-0.5] * 6])]
    v = judge(stock, outcome(tokens, lps))
    assert not v.passed and v.how == "outside spread", measure


def test_stock_runs_that_agree_leave_room_for_nothing_but_identity():
    stock = [outcome(A), outcome(A)]
    assert judge(stock, outcome(A)).passed
    v = judge(stock, outcome(A, [[-0.5] * 5 + [-0.50001], [-0.5] * 6]))
    assert not v.passed and v.stock_spread.max_logprob == 0.0


def test_the_judge_needs_two_stock_runs_of_the_same_prompts():
    with pytest.raises(ValueError, match="at least two"):
        judge([outcome(A)], outcome(A))
    with pytest.raises(IncomparableOutcomes):
        judge([outcome(A), outcome(A)], outcome(A, digest="other"))


def test_outcomes_survive_their_json():
    o = outcome(B, [[-0.1, -0.2, -0.3, -0.4, -1e-9, -7.5], [-0.5] * 6])
    back = Outcome.from_json(json.loads(json.dumps(o.to_json())))
    assert back.key() == o.key()


# ---------------------------------------------------------------- checkpoint
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The script's tiny checkpoint, written by its command line on the CPU, and
    its FP8 twin and NVFP4 copy beside it."""
    root = tmp_path_factory.mktemp("qwen4-bench")
    for args in (
        ["--out", str(root / "bf16"), "--tiny", "--device", "cpu", "--ngram-vocab-base", "300"],
        ["--out", str(root / "fp8"), "--twin-of", str(root / "bf16")],
        [
            "--out",
            str(root / "nvfp4"),
            "--twin-of",
            str(root / "bf16"),
            "--dtype",
            "nvfp4",
            "--device",
            "cpu",
        ],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "bench.real_vllm.checkpoint", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def vllm_facts(tiny):
    """What vLLM (and transformers) make of the checkpoint and of the cells'
    arguments, found by a process of their own that starts with the first
    checkpoint test and runs beside the tests that follow (vLLM's import and
    loader take most of this file's time); ``vllm_facts()`` waits for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            VLLM_CHECKS,
            str(tiny / "bf16"),
            TOKENIZER_TEXT,
            str(tiny / "nvfp4"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    found: dict = {}

    def facts() -> dict:
        if not found:
            stdout, stderr = proc.communicate(timeout=300)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-6000:]
            found.update(json.loads(lines[-1][len("RESULT ") :]))
        return found

    yield facts
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def cpu_cell(tiny, tmp_path_factory):
    """``vllm_real.py run`` of a real shm cell on the tiny checkpoint, on the CPU,
    started beside the tests that follow: the coordinator, the cell process,
    its ple-server and vLLM's ``LLM`` with the cell's arguments, as far as
    vLLM's CPU build lets an engine start (mp0: the engine core in the cell's
    own process). ``cpu_cell()`` waits for it; (work, out, exit code, output)."""
    work, out = tmp_path_factory.mktemp("cell-work"), tmp_path_factory.mktemp("cell-out")
    (work / "ckpt").mkdir()
    (work / "ckpt" / "small-bf16").symlink_to(tiny / "bf16")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")
    argv = [sys.executable, "-m", "bench.real_vllm.coordinator", "run", "--cells", "shm-eager-mp0"]
    argv += ["--work", str(work), "--out", str(out), "--deadline-s", "600", "--no-probe"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )
    done: list = []

    def result():
        if not done:
            output, _ = proc.communicate(timeout=300)
            done.append((work, out, proc.returncode, output))
        return done[0]

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_checkpoint_is_one_pleserver_inspect_accepts(tiny, vllm_facts, cpu_cell):
    for dtype, expected in (("bf16", "BF16"), ("fp8", "F8_E4M3"), ("nvfp4", "NVFP4")):
        r = subprocess.run(
            [sys.executable, "-m", "pleserver.cli", "inspect", "--json", str(tiny / dtype)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        tables = json.loads(r.stdout)["tables"]
        assert [t["layer"] for t in tables] == [1, 2]  # ple_layer_ids [2, 3], one-indexed
        assert {t["dtype"] for t in tables} == {expected}
        assert {t["cols"] for t in tables} == {16}  # the tiny dims: 64 / 4 n-gram heads
    marker = json.loads((tiny / "fp8" / "bench-checkpoint.json").read_text())
    assert marker["dtype"] == "fp8" and marker["twin_of"] == str(tiny / "bf16")
    config = json.loads((tiny / "nvfp4" / "config.json").read_text())
    assert config["ple_embedding_dtype"] == "nvfp4"


def test_vllm_decodes_the_nvfp4_copy_close_to_the_bf16_rows(vllm_facts):
    """vLLM's own NVFP4 method loads the copy (every parameter) and decodes each
    row within NVFP4's rounding of the BF16 one: a real model, its own family."""
    nvfp4 = vllm_facts()["nvfp4"]
    assert nvfp4["unloaded"] == []
    assert [layer["method"] for layer in nvfp4["layers"]] == ["Qwen4ExpPLENvFp4EmbeddingMethod"] * 2
    for layer in nvfp4["layers"]:
        # E2M1's widest step (4 to 6) is a sixth of a block's largest value;
        # the block scale's E4M3 rounding adds a little
        assert 0 < layer["max_error_of_amax"] <= 0.2
        assert layer["correlation"] > 0.99


def test_fp8_twin_holds_the_bf16_numbers(tiny):
    import torch
    from safetensors.torch import load_file

    bf16 = load_file(str(tiny / "bf16" / "model.safetensors"))
    fp8 = load_file(str(tiny / "fp8" / "model.safetensors"))
    shards = [k for k in bf16 if ".ngram_embedding.shard_" in k]
    assert shards
    for key in shards:
        table = key.split(".shard_")[0]
        scale = fp8[f"{table}.weight_scale"].float()
        assert fp8[key].dtype == torch.float8_e4m3fn
        assert torch.equal((fp8[key].float() * scale).to(torch.bfloat16), bf16[key])


# ---------------------------------------------------------------- the cells
def test_cell_names_say_what_runs():
    c = vc.parse_cell("serve-shm-piecewise-host-nopa-direct-large-tp5-x2")
    assert (c.api, c.backend, c.mode, c.route, c.io, c.checkpoint) == (
        "serve",
        "shm",
        "piecewise",
        "host",
        "direct",
        "large-bf16",
    )
    assert (c.prompt_ahead, c.throughput_reps, c.exact_runs) == (False, 5, 2)
    assert (vc.parse_cell("shm-default-ttft").ttft_reps, c.ttft_reps) == (3, 0)
    assert vc.parse_cell("stock-default-noexact-ttft5").ttft_reps == 5
    assert c.env("/s") == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": "/s",
        "VLLM_PLE_SHM_GPU_PATH": "off",
        "VLLM_PLE_SHM_PROMPT_AHEAD": "off",
    }
    assert c.server_args()[:2] == ["--io", "direct"] and "--cache-size" in c.server_args()
    assert "--no-gather-in-order" not in c.server_args()
    unordered = vc.parse_cell("shm-default-direct-deep-unordered-tp")
    assert unordered.server_args()[-1] == "--no-gather-in-order"
    assert vc.parse_cell("shm-default-nospin-tp").server_args()[-2:] == ["--spin-us", "0"]
    assert "--spin-us" not in vc.parse_cell("shm-default-tp").server_args()
    stock = vc.parse_cell("stock-default-mp0-x10")
    assert stock.env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} and stock.exact_runs == 10
    # an FP8 twin is judged against the BF16 stock runs: the same numbers
    assert (
        vc.parse_cell("shm-default-fp8").reference_key()
        == vc.parse_cell("stock-default").reference_key()
    )
    # an NVFP4 copy is rounded: only NVFP4 stock runs are its references
    nvfp4 = vc.parse_cell("shm-default-nvfp4-mp0").reference_key()
    assert nvfp4 == vc.parse_cell("stock-default-nvfp4-mp0").reference_key()
    assert nvfp4 != vc.parse_cell("stock-default-mp0").reference_key()
    assert vc.parse_cell("stock-default#2").instance == 2
    prof = vc.parse_cell("shm-default-deepsmall-noexact-prof")
    assert prof.profile and prof.exact_runs == 0 and prof.checkpoint == "deepsmall-bf16"
    assert vc.parse_cell("shm-default-deepsmall-pin-tp").pin
    assert vc.parse_cell("stock-default-deepsmall-pin-tp").pin  # (the engine's CPUs alike)
    assert vc.pin_cpus(range(16)) == (list(range(14)), [14, 15])
    kernels = vc.parse_cell("shm-default-deepsmall-kernels-tp2")
    assert kernels.env()["VLLM_PLE_SHM_GPU_OPS"] == "kernels"
    memops = vc.parse_cell("shm-default-deepsmall-memops-tp2")
    assert memops.env()["VLLM_PLE_SHM_GPU_OPS"] == "memops"
    assert "VLLM_PLE_SHM_GPU_OPS" not in vc.parse_cell("shm-default-tp").env()  # the plugin's
    with pytest.raises(vc.CellError, match="none for the engine"):
        vc.pin_cpus([0, 1])


@pytest.mark.parametrize(
    "name, problem",
    [
        ("shm-default-host", "refused by the plugin"),
        ("stock-eager-direct", "need the shm backend"),
        ("stock-default-nospin", "need the shm backend"),
        ("stock-default-kernels", "needs shm on that route"),
        ("shm-eager-host-kernels", "needs shm on that route"),
        ("offload-default-memops", "needs shm on that route"),
        ("eager", "no backend"),
        ("shm-eager-fast", "unknown word"),
        ("stock-shm", "two backends"),
        ("stock-eager-noexact", "measure nothing"),
        ("shm-default-restart", "needs serve"),
        ("serve-offload-default-restart", "use stock or shm"),
        ("shm-default-mp0-verify", "needs shm, eager"),
        ("shm-eager-verify", "and mp0"),
        ("serve-shm-default-prof", "drop serve"),
        ("serve-stock-default-dsv41", "drop serve"),
        ("shm-eager-mp0-dsv41-verify", "drop dsv41"),
        ("shm-eager-mp0-gpus2-verify", "one GPU"),
        ("stock-eager-gpus0", "at least one GPU"),
    ],
)
def test_a_cell_that_cannot_run_is_refused_with_its_reason(name, problem):
    with pytest.raises(vc.CellError, match=problem):
        vc.parse_cell(name)


def _trace_event(cat: str, name: str, ts: float, dur: float, correlation: int | None = None):
    event = {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_the_gpu_trace_gives_each_decode_steps_span_busy_idle_and_copies(tmp_path):
    from bench.real_vllm import gpu_trace

    decode = "execute_context_0(0)_generation_2(2)"
    events = [
        # a prefill step, then two decode steps of 2 requests (host annotations)
        _trace_event("user_annotation", "execute_context_1(256)_generation_1(1)", 0, 50),
        _trace_event("user_annotation", decode, 100, 20),
        _trace_event("user_annotation", decode, 300, 20),
        _trace_event("cpu_op", "aten::mm", 100, 5),  # no GPU work of its own here
        # the steps' launches: a graph replay each, a driver call before it,
        # step 2's sampling after its annotation (before step 3's)
        _trace_event("cuda_runtime", "cudaLaunchKernel", 10, 1, correlation=1),
        _trace_event("cuda_driver", "cuMemcpyAsync", 105, 1, correlation=2),
        _trace_event("cuda_runtime", "cudaGraphLaunch", 110, 2, correlation=3),
        _trace_event("cuda_runtime", "cudaLaunchKernel", 200, 1, correlation=6),
        _trace_event("cuda_runtime", "cudaGraphLaunch", 310, 2, correlation=4),
        _trace_event("cuda_runtime", "cudaGraphLaunch", -50, 2, correlation=5),  # no step
        # GPU work of the prefill step
        _trace_event("kernel", "prefill", 20, 40, correlation=1),
        # step 2: an ids copy out, kernels, a wait (idle), the rows' copy in,
        # a kernel overlapping the next on another stream
        _trace_event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 120, 2, correlation=2),
        _trace_event("kernel", "layer0", 125, 10, correlation=3),
        _trace_event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 150, 3, correlation=3),
        _trace_event("kernel", "layer1", 153, 20, correlation=3),
        _trace_event("kernel", "side", 160, 20, correlation=3),
        _trace_event("gpu_memset", "Memset (Device)", 180, 1, correlation=3),
        _trace_event("kernel", "sample", 201, 4, correlation=6),
        # step 3: one kernel
        _trace_event("kernel", "layer0", 320, 30, correlation=4),
        _trace_event("kernel", "orphan", -40, 5, correlation=5),
    ]
    path = tmp_path / "w.pt.trace.json.gz"
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    steps = gpu_trace.steps(gpu_trace.load(path))
    assert [(s["context"], s["generation"]) for s in steps] == [(1, 1), (0, 2), (0, 2)]
    first, second, third = steps
    assert first["activities"] == 1 and first["period_us"] == 100 and first["host_us"] == 50
    # 120..205: busy 2 + 10 + 3 + 27 (153..180 over two streams) + 1 + 4 (the
    # sampling, launched after the annotation), idle the rest
    assert second["span_us"] == 85 and second["busy_us"] == 47 and second["idle_us"] == 38
    assert second["idle_before_htod_us"] == 15  # 135 → 150: the wait for the rows
    assert (second["kernel_n"], second["kernel_us"]) == (4, 54)
    assert (second["memcpy_HtoD_n"], second["memcpy_DtoH_n"], second["gpu_memset_n"]) == (1, 1, 1)
    assert third["period_us"] is None and third["span_us"] == 30 and third["idle_us"] == 0
    # the forward's graph alone (correlation 3): 125..181, its one wait 135 → 150;
    # the ids' copy before it and the sampling after it are the step's, not the graph's
    assert second["graph_activities"] == 5
    graph = (second["graph_span_us"], second["graph_busy_us"], second["graph_idle_us"])
    assert graph == (56, 41, 15)
    assert second["graph_idle_before_htod_us"] == 15 and second["graph_wait_max_us"] == 15
    assert (third["graph_span_us"], third["graph_idle_us"]) == (30, 0)
    figures = gpu_trace.decode_figures(steps, 2)
    assert figures["steps"] == 2 and figures["all_steps"] == 3
    assert figures["span_us"] == 57.5 and figures["period_us"] == 200
    assert figures["memcpy_HtoD_n"] == 0.5  # a step without one counts 0
    assert figures["graph_span_us"] == 43 and figures["mean_graph_idle_us"] == 7.5
    assert figures["mean_period_us"] == 200 and figures["mean_graph_wait_max_us"] == 7.5
    assert gpu_trace.decode_figures(steps, 32)["steps"] == 0
    # the compact trace keeps every figure, without the CPU side
    small = tmp_path / "small.json.gz"
    gpu_trace.compact(gpu_trace.load(path), small)
    kept = gpu_trace.load(small)
    assert not [e for e in kept if e["cat"] == "cpu_op"]
    assert gpu_trace.steps(kept) == steps


def test_the_summary_gives_each_profiled_cells_gpu_step_and_its_difference_from_stock():
    def cell(name: str, span: float, htod: float) -> dict:
        f = dict.fromkeys(("kernel_n", "memcpy_HtoD_n", "memcpy_DtoH_n"), 1.0)
        f.update(steps=120, all_steps=130, period_us=3000.0, span_us=span, busy_us=2500.0)
        f.update(idle_us=span - 2500.0, idle_before_htod_us=htod)
        f.update(host_us=200.0, mean_host_us=210.0)
        f.update(mean_period_us=3100.0, graph_span_us=span - 100, mean_graph_span_us=span - 90)
        f.update(graph_idle_us=htod + 20, mean_graph_idle_us=htod + 30)
        f.update(graph_idle_before_htod_us=htod, graph_wait_max_us=htod / 4)
        f.update(mean_graph_wait_max_us=htod / 2)
        return {
            "format": vc.CELL_FORMAT,
            "run_id": "r",
            "name": name,
            "cell": vc.parse_cell(name).to_json(),
            "status": "done",
            "profile": {"1": f, "32": {"error": "no trace under /w"}},
        }

    text = vc.summary(
        [
            cell("stock-default-deepsmall-noexact-prof", 2600.0, 0.0),
            cell("shm-default-deepsmall-noexact-prof", 2950.0, 250.0),
        ]
    )
    table, graph = text.split("== GPU per decode step")[1].split("== The forward's CUDA graph")
    rows = [line.split() for line in table.splitlines()[2:] if line]
    stock = ["stock-default-deepsmall-noexact-prof", "1", "120", "3000", "2600", "2500"]
    assert rows[0][:6] == stock
    assert rows[1][:2] == ["shm-default-deepsmall-noexact-prof", "1"]
    # shm minus stock: 350 µs longer, all of it idle, 250 of it before the rows' copies
    assert rows[2][:9] == ["Δ", "against", "stock", "1", "0", "350", "0", "350", "250"]
    assert len(rows) == 3  # concurrency 32 had no trace: no row
    rows = [line.split() for line in graph.splitlines()[2:] if line]
    assert rows[0] == [*stock[:3], "3100", "200/210", "2500/2510", "20/30", "0", "0/0"]
    # inside the graph: 350 µs longer, 250 of it idle (all before the rows' copies)
    delta = ["0", "0/0", "350/350", "250/250", "250", "62/125"]
    assert rows[2] == ["Δ", "against", "stock", "1", *delta]
    assert len(rows) == 3


def test_the_gpu_trace_reads_vllms_step_annotations_from_a_real_torch_profiler_trace(tmp_path):
    """The host side of the format as torch's profiler writes it (on CPU: no
    GPU activity, so each step has none)."""
    import torch

    from bench.real_vllm import gpu_trace

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(tmp_path), worker_name="c1_dp0_pp0_tp0", use_gzip=True
        ),
    ):
        for n in (4, 1, 1):
            ctx = 1 if n == 4 else 0
            name = f"execute_context_{ctx}({ctx * 4})_generation_{1 - ctx}({1 - ctx})"
            with torch.profiler.record_function(name):
                torch.ones(8) @ torch.ones(8)
    (trace,) = tmp_path.glob("*.pt.trace.json.gz")
    steps = gpu_trace.steps(gpu_trace.load(trace))
    assert [(s["context"], s["generation"]) for s in steps] == [(1, 0), (0, 1), (0, 1)]
    assert all(s["activities"] == 0 for s in steps) and steps[0]["period_us"] > 0
    assert gpu_trace.decode_figures(steps, 1)["steps"] == 0  # no GPU work on CPU


def test_plans_expand_to_cells_and_their_checkpoints():
    for plan in vc.PLANS:
        assert vc.expand(plan)
    needed = [c.name for c in vc.checkpoints_needed(vc.expand("shm-default-fp8,stock-eager"))]
    assert needed == ["small-bf16", "small-fp8"]  # the twin after its source
    nvfp4 = vc.checkpoints_needed(vc.expand("stock-default-nvfp4"))
    assert [c.name for c in nvfp4] == ["small-bf16", "small-nvfp4"]
    assert nvfp4[1].args(Path("/w"))[-2:] == ["--dtype", "nvfp4"]
    with pytest.raises(vc.CellError, match="named twice"):
        vc.expand("stock-eager,stock-eager")
    tp = vc.expand("gpus2")
    assert {c.gpus for c in tp} == {2} and {c.checkpoint for c in tp} == {"large-bf16"}
    assert tp[0].reference_key() == tp[1].reference_key() == "generate/default/4L-1100000/mp0/tp2"
    assert vc.parse_cell("stock-default-mp0").reference_key() == "generate/default/4L-100000/mp0"
    dsv41 = vc.expand("dsv41")
    assert {c.checkpoint for c in dsv41} == {"dsv41-fp8"}
    assert {c.reference_key() for c in dsv41 if c.mode == "eager"} == {
        "generate/eager/deepseek-v41/mp0"
    }
    (ckpt,) = vc.checkpoints_needed(dsv41)
    assert ckpt.dummy_weights and ckpt.args(Path("/w")) == ["--model", "deepseek-v41"]
    # stock and shm alike compile DeepGEMM's kernels as used, not all at the start
    assert {c.env().get("VLLM_DEEP_GEMM_WARMUP") for c in dsv41} == {"skip"}
    assert "VLLM_DEEP_GEMM_WARMUP" not in vc.parse_cell("shm-eager-mp0").env()


def test_the_deepseek_checkpoint_holds_its_engram_tables_for_a_stock_engine(tmp_path):
    """``--model deepseek-v41``: the devkit's whole model, its marker, its two
    Engram tables where ``engram_tables`` finds them for a stock engine, a
    second run reusing it; Qwen-only arguments refused."""
    from bench.real_vllm.engram_tables import engram_tensor_files

    out = tmp_path / "dsv41"
    argv = [sys.executable, "-m", "bench.real_vllm.checkpoint", "--out", str(out)]
    argv += ["--model", "deepseek-v41", "--device", "cpu", "--reuse"]
    for _ in range(2):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "already holds this checkpoint" in r.stderr
    marker = json.loads((out / "bench-checkpoint.json").read_text())
    assert (marker["model"], marker["layers"], marker["dtype"]) == ("deepseek-v41", 16, "fp8")
    assert sorted(marker["tables"]) == ["layers.1.engram.embed", "layers.14.engram.embed"]
    assert abs(marker["table_bytes"] / 2**30 - vc.table_gib_estimate("dsv41-fp8")) < 0.01
    files = engram_tensor_files(out)
    assert sorted(files) == [
        f"layers.{layer}.engram.embed.{kind}" for layer in (1, 14) for kind in ("scale", "weight")
    ]
    assert all(p.parent == out and p.exists() for p in files.values())
    with pytest.raises(FileNotFoundError, match="--whole-model"):
        engram_tensor_files(tmp_path)
    # the copy's check: a rank's rows (from its engram_vocab_start) byte for byte
    import torch
    from safetensors import safe_open

    from bench.real_vllm.engram_tables import check_rows

    name = "layers.14.engram.embed.scale"
    with safe_open(str(files[name]), framework="pt") as f:
        table = f.get_tensor(name)
    param = torch.nn.Parameter(table[100:200].view(torch.uint8).clone(), requires_grad=False)
    param.engram_vocab_start = 100  # type: ignore[attr-defined]
    check_rows(param, table, name)
    param.data[-1, 0] ^= 1
    with pytest.raises(RuntimeError, match="row 99 differs"):
        check_rows(param, table, name)
    bad = subprocess.run(
        [*argv[:-1], "--dtype", "nvfp4"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert bad.returncode == 2 and "writes its own FP8 model" in bad.stderr


def test_the_deadline_skips_a_cell_that_would_not_end_in_time():
    costs = vc.Costs()
    cold, warm = vc.History(), vc.History()
    warm.record("generate", "eager", 300.0)  # the host's first start: compiles, not counted
    warm.record("generate", "eager", 60.0)
    cell = vc.parse_cell("stock-eager")
    fresh = vc.expected_seconds(cell, costs, cold)
    assert vc.decide(cell, fresh + costs.margin_s + 1, costs, cold).run
    late = vc.decide(cell, fresh + costs.margin_s - 1, costs, cold)
    assert not late.run and late.reason.startswith("skipped: expected")
    # a warm start measured on the host replaces the guess and the first start's cost
    assert warm.measured("generate", "eager") == 60.0
    assert vc.expected_seconds(cell, costs, warm) < fresh - costs.first_start_extra_s["qwen4exp"]
    assert warm.measured("generate", "default") is None
    first_compile = vc.expected_seconds(vc.parse_cell("stock-default"), costs, warm)
    warm.record("generate", "default", 95.0)  # the first compiled start: cold too
    assert vc.expected_seconds(vc.parse_cell("stock-default"), costs, warm) < first_compile
    # tables loaded resident add to a stock start; throughput from disk is slower
    assert vc.expected_seconds(cell, costs, warm, table_gib=10.5) > vc.expected_seconds(
        cell, costs, warm
    )
    assert vc.expected_seconds(
        vc.parse_cell("shm-default-direct-large-tp"), costs, warm
    ) > vc.expected_seconds(vc.parse_cell("shm-default-large-tp"), costs, warm)
    # another model's first start compiles its own kernels: Qwen's warm starts say nothing
    dsv41 = vc.parse_cell("stock-eager-dsv41-mp0")
    assert vc.expected_seconds(dsv41, costs, warm) >= costs.first_start_extra_s["deepseek-v41"]
    assert costs.first_start_extra_s["deepseek-v41"] > costs.first_start_extra_s["qwen4exp"]
    warm.record("generate", "eager", 400.0, "deepseek-v41")  # its first: cold
    assert warm.measured("generate", "eager", "deepseek-v41") is None
    warm.record("generate", "eager", 90.0, "deepseek-v41")
    assert warm.measured("generate", "eager", "deepseek-v41") == 90.0
    assert warm.measured("generate", "eager") == 60.0  # Qwen's own, unchanged


def test_prompts_are_real_text_and_new_for_every_measurement():
    p = vc.prose()
    exact = vc.exact_prompts(p)
    assert len(exact) == vc.EXACT_PROMPTS and len(exact[0]) == vc.LONG_PROMPT_TOKENS
    assert b" the " in bytes(exact[0])  # English
    assert vc.prompts_digest(exact) == vc.prompts_digest(vc.exact_prompts(vc.prose()))
    windows = [
        tuple(w)
        for rep in range(3)
        for c in vc.CONCURRENCY
        for w in vc.throughput_prompts(p, rep, c)
    ]
    assert len(windows) == 3 * sum(vc.CONCURRENCY) == len(set(windows))
    assert {len(w) for w in windows} == {vc.TP_PROMPT_TOKENS}
    # the 8 000-token prompts: new text for each repetition, none of the others'
    long = [vc.ttft_prompt(p, rep) for rep in range(3)]
    assert {len(x) for x in long} == {vc.TTFT_PROMPT_TOKENS} and b" the " in bytes(long[0])
    read = {bytes(x) for x in long}
    assert len(read) == 3
    assert not any(bytes(w) in r for w in windows + [tuple(e) for e in exact] for r in read)


# ------------------------------------------------- the OpenAI client (serve cells)
class VllmStreamStandIn(BaseHTTPRequestHandler):
    """``/v1/completions`` streamed as vLLM 0.33 streams it with
    ``return_token_ids`` and ``return_tokens_as_token_ids``: each chunk a
    choice with ``token_ids`` and, when asked, logprobs keyed
    ``token_id:N``; tokens 2 at a time. The token at position i is prompt[i]."""

    requests: ClassVar[list[dict]] = []
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()
    all_in: threading.Barrier | None = None  # every request of a batch waits for the others

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.requests.append(body)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            if cls.all_in is not None:
                cls.all_in.wait()
            prompt, n = body["prompt"], body["max_tokens"]
            for start in range(0, n, 2):
                ids = [prompt[i % len(prompt)] for i in range(start, min(n, start + 2))]
                choice = {"index": 0, "text": "", "finish_reason": None, "token_ids": ids}
                if body.get("logprobs"):
                    choice["logprobs"] = {
                        "text_offset": [0] * len(ids),
                        "tokens": [f"token_id:{t}" for t in ids],
                        "token_logprobs": [-0.25] * len(ids),
                        "top_logprobs": [{f"token_id:{t}": -0.25, "token_id:3": -2.5} for t in ids],
                    }
                chunk = {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.002)
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with cls.lock:
                cls.in_flight -= 1


@contextlib.contextmanager
def stream_standin() -> Iterator[int]:
    """``VllmStreamStandIn`` on a port of its own (yielded), its counts reset;
    shut down after."""
    VllmStreamStandIn.most_in_flight = 0
    VllmStreamStandIn.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), VllmStreamStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_serve_cells_client_reads_tokens_logprobs_and_times_from_the_stream():
    import asyncio

    from bench.real_vllm import coordinator as vllm_real

    with stream_standin() as port:
        prompts = [[65 + i, 66, 67] for i in range(8)]
        VllmStreamStandIn.all_in = threading.Barrier(len(prompts), timeout=30)
        try:
            results = asyncio.run(
                vllm_real.stream_all(f"http://127.0.0.1:{port}/v1", prompts, 5, vllm_real.LOGPROBS)
            )
        finally:
            VllmStreamStandIn.all_in = None
    assert VllmStreamStandIn.most_in_flight == len(prompts)  # concurrent streams
    sent = VllmStreamStandIn.requests[0]
    assert sent["ignore_eos"] and sent["return_token_ids"] and sent["return_tokens_as_token_ids"]
    assert sent["temperature"] == 0.0 and sent["logprobs"] == vllm_real.LOGPROBS
    for p, r in zip(prompts, results, strict=True):
        assert r["tokens"] == [p[i % 3] for i in range(5)]
        assert r["logprobs"][0] == {str(p[0]): -0.25, "3": -2.5}
        assert len(r["logprobs"]) == 5 and r["ttft_s"] > 0 and r["tpot_s"] >= 0
        assert len(r["arrivals"]) == 5 and r["arrivals"] == sorted(r["arrivals"])


def test_the_serve_cells_exact_runs_stream_one_prompt_at_a_time():
    import asyncio

    from bench.real_vllm import coordinator as vllm_real

    with stream_standin() as port:
        prompts = [[70 + i, 66, 67] for i in range(4)]
        results = asyncio.run(
            vllm_real.stream_in_turn(f"http://127.0.0.1:{port}/v1", prompts, 5, vllm_real.LOGPROBS)
        )
    assert VllmStreamStandIn.most_in_flight == 1  # each alone
    assert [r["prompt"] for r in VllmStreamStandIn.requests] == prompts  # in order
    for p, r in zip(prompts, results, strict=True):
        assert r["tokens"] == [p[i % 3] for i in range(5)] and len(r["logprobs"]) == 5
    # each prompt began after the last one's final token
    for before, after in itertools.pairwise(results):
        assert before["arrivals"][-1] <= after["arrivals"][0]


def test_the_decode_window_holds_only_steps_where_every_request_decodes():
    # three requests: their first tokens at 1.0, 1.5 and 2.0 (prefills beside
    # the others' decode), one token every 0.1 s after; the first ends at 4.0
    def request(first: float, last: float) -> list[float]:
        return [first + 0.1 * i for i in range(round((last - first) / 0.1) + 1)]

    times = [request(1.0, 4.0), request(1.5, 4.5), request(2.0, 5.0)]
    window = vc.steady_window(times)
    # from 2.0 (the last first token) to 4.0 (the first last one): 20 steps
    # of the three requests, the tokens made after 2.0 up to 4.0
    assert window["requests"] == 3 and math.isclose(window["window_s"], 2.0)
    assert window["tokens"] == 60
    assert math.isclose(vc.decode_tok_s({"steady": window}), 30.0)
    # one request: its tokens after the first over their span, 1 / TPOT
    one = vc.steady_window([request(0.0, 5.0)])
    assert one["tokens"] == 50 and math.isclose(50 / one["window_s"], 10.0)
    # no window: a request ended before another's first token, or made one token
    assert vc.steady_window([request(0.0, 1.0), request(2.0, 3.0)]) is None
    assert vc.steady_window([[1.0], request(0.0, 3.0)]) is None
    assert vc.steady_window([]) is None
    assert vc.decode_tok_s({"tpot_s": [0.01]}) is None


def test_the_engine_cores_token_times_come_from_its_outputs_timestamps():
    """The wrap of the engine-core client's ``get_output`` (vLLM's own output
    classes), and the client left as it was after."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from bench.real_vllm import coordinator as vllm_real

    def step(at: float, *made: tuple[str, int]) -> EngineCoreOutputs:
        return EngineCoreOutputs(
            outputs=[EngineCoreOutput(request_id=r, new_token_ids=list(range(n))) for r, n in made],
            timestamp=at,
        )

    class CoreClient:  # vLLM's clients' one method the engine's step calls
        def __init__(self, steps: list[EngineCoreOutputs]) -> None:
            self.steps = steps

        def get_output(self) -> EngineCoreOutputs:
            return self.steps.pop(0)

    steps = [
        step(10.0, ("a", 1)),  # a's prefill ends
        step(10.5, ("a", 1), ("b", 1)),  # b's prefill ends beside a's decode
        step(11.0, ("a", 1), ("b", 1)),
        step(11.5, ("a", 1), ("b", 0)),  # b made nothing this step
        step(12.0, ("b", 2)),  # a ended; b took two tokens (a draft accepted)
        EngineCoreOutputs(outputs=[], timestamp=12.5),  # no outputs at all
    ]
    client = CoreClient(list(steps))
    with vllm_real.EngineTokenTimes(client) as times:
        for _ in steps:
            client.get_output()
    assert "get_output" not in vars(client)  # the class's method again
    assert times.times == {"a": [10.0, 10.5, 11.0, 11.5], "b": [10.5, 11.0, 12.0, 12.0]}
    # from b's first token (10.5) to a's last (11.5): a's at 11.0 and 11.5, b's at 11.0
    window = vc.steady_window(times.of_requests())
    assert window == {"requests": 2, "tokens": 3, "window_s": 1.0}


def test_a_serve_cell_waits_for_health_and_says_when_vllm_serve_died():
    from bench.real_vllm import coordinator as vllm_real

    with stream_standin() as port:
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        try:
            vllm_real.wait_healthy(f"http://127.0.0.1:{port}/health", alive, time.time() + 10)
            dead.wait()
            with pytest.raises(RuntimeError, match="exited with status 3"):
                vllm_real.wait_healthy(f"http://127.0.0.1:{port}/nothing", dead, time.time() + 10)
            with pytest.raises(TimeoutError, match="not up"):
                vllm_real.wait_healthy(f"http://127.0.0.1:{port}/nothing", alive, time.time() + 1)
        finally:
            alive.kill()
            alive.wait()


# ------------------------------------------------------- the server's figures
def test_a_pinned_server_runs_every_thread_on_its_cpus_also_after_a_restart(tiny):
    import signal

    from bench.real_vllm import coordinator as vllm_real

    cpu = max(os.sched_getaffinity(0))
    served = vllm_real.Served(
        tiny / "bf16", vc.parse_cell("shm-default-pin"), tiny / "server-pin.log", cpus=[cpu]
    )

    def allowed() -> set[str]:
        tasks = Path(f"/proc/{served.pid}/task")
        return {
            next(
                line.split()[1]
                for line in (task / "status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:")
            )
            for task in tasks.iterdir()
        }

    try:
        assert allowed() == {str(cpu)}
        served.kill(signal.SIGTERM)
        served.start()
        assert allowed() == {str(cpu)}
    finally:
        served.close()


def test_server_figures_come_from_a_real_ple_server(tiny):
    """A real ple-server as a ``direct`` cell starts it: cold, its row cache
    filled by the first lookups; hits, misses, lookup time and CPU per row
    come from its own counters."""
    from bench.real_vllm import coordinator as vllm_real

    cell = vc.parse_cell("shm-default-direct")
    served = vllm_real.Served(tiny / "bf16", cell, tiny / "server.log")
    try:
        with served.server.client() as client:
            table = client.tables[0]
            ids = np.arange(0, table.rows, 7)

            def lookups() -> dict:
                client.lookup(table.layer, ids)
                return {}

            cold = vllm_real.measured(served, lookups)["server"]
            warm = vllm_real.measured(served, lookups)["server"]
            # The gather workers' CPU is found by their thread names.
            names = [
                Path(f"/proc/{served.pid}/task/{tid}/comm").read_text().strip()
                for tid in os.listdir(f"/proc/{served.pid}/task")
            ]
            assert any(n.startswith("ple-gather-") for n in names), names
    finally:
        served.close()
    assert not Path(served._state).exists()
    fc, fw = vc.server_figures(cold), vc.server_figures(warm)
    assert cold["rows"] == warm["rows"] == len(ids)
    assert cold["misses"] > 0 and fc["hit_rate"] < 1.0  # a cold server reads from disk
    assert warm["misses"] == 0 and fw["hit_rate"] == 1.0
    assert fc["lookup_p50_s"] > 0 and fc["lookup_p99_s"] >= fc["lookup_p50_s"]
    assert cold["cpu_s"] >= 0 and fc["cpu_us_per_row"] is not None
    assert 0 <= cold["gather_cpu_s"] <= cold["cpu_s"] + 0.05  # (clock ticks apart)
    assert fc["gather_cpu_us_per_miss"] is not None and fw["gather_cpu_us_per_miss"] is None
    total = vc.server_figures(vc.add_deltas([cold, warm]))
    assert total["rows"] == 2 * len(ids) and 0 < total["hit_rate"] < 1


def test_the_step_timeline_comes_from_the_servers_own_trace(tiny):
    """A client stepping as the GPU-driven route does (every table's lookup
    at once, then the next step a few ms later): the server's trace cuts into
    those steps, the first one read from disk (a cold direct server), the
    others from its row cache; the summary shows them beside stock's TPOT."""
    from bench.real_vllm import coordinator as vllm_real
    from bench.real_vllm import steps as vllm_steps

    cell = vc.parse_cell("shm-default-direct")
    served = vllm_real.Served(tiny / "bf16", cell, tiny / "server-steps.log")
    steps, pause_s = 12, 0.004
    try:
        with served.server.client() as client:
            tables = list(client.tables)
            ids = [np.arange(0, t.rows, 11) for t in tables]

            def stepping() -> dict:
                for _ in range(steps):
                    tickets = [client.submit(t.layer, i) for t, i in zip(tables, ids, strict=True)]
                    for ticket in tickets:
                        ticket.wait()
                        ticket.release()
                    time.sleep(pause_s)
                return {}

            window = vllm_real.measured(served, stepping)["window_ns"]
        records = served.stop_for_trace()
    finally:
        served.close()
    assert records is not None and len(records) >= steps * len(tables)
    t = vllm_steps.timeline(records, tuple(window))
    assert t["steps"] == steps and t["requests"] == steps * len(tables), t
    assert t["period"]["n"] == steps - 1 and t["period"]["p50_us"] >= pause_s * 1e6
    assert t["period"]["mean_us"] >= pause_s * 1e6
    assert set(t["ready"]) == {str(i) for i in range(len(tables))}
    assert t["ready"]["0"]["n"] == steps and t["step_ready"]["max_us"] > 0
    # Cold: the first step's rows came from disk, through a gather worker.
    assert t["worker"]["n"] >= 1 and t["from_disk_share"] < 1
    assert 0 < t["slowest_from_disk_share"] < 1
    rep = {"rep": 0, "concurrency": 1, "steps": t}
    cells = [
        {
            "name": "shm-default-direct",
            "cell": {"reference_key": "k"},
            "throughput": {"reps": [rep]},
        }
    ]
    lines = vllm_steps.summary_lines(cells, {("k", 1): 5.0})
    assert lines[-1].split()[:5] == ["shm-default-direct", "0", "1", str(steps), "5.00"]


def test_a_layer_admitted_late_stays_in_its_step():
    """A loop busy with one layer's rows admits the next layer's request after
    the gap that cuts steps: it is still that step. Once a step has every
    layer, a gap starts the next."""
    from bench.real_vllm import steps as vllm_steps
    from pleserver.observe.trace import RECORD

    ms = 1_000_000
    starts = [(0, 0), (1, 0.5 * ms), (0, 5 * ms), (1, 5.01 * ms), (0, 10 * ms), (1, 10.9 * ms)]
    records = np.zeros(len(starts), dtype=RECORD)
    records["table"] = [t for t, _ in starts]
    records["started_ns"] = [int(ns) for _, ns in starts]
    steps = vllm_steps.steps_of(records)
    assert [list(s["table"]) for s in steps] == [[0, 1], [0, 1], [0, 1]]


# ------------------------------------------------------- the coordinator
MARK = "vllm-real-test-standin"
STANDIN_CELL = r"""
import json, os, subprocess, sys, time
name, out, run_id, order, end_at, mark, sleep = sys.argv[1:8]
# an engine core that ignores SIGTERM: only SIGKILL ends it
subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)", mark])
# a process that leaves the group (setsid) and is orphaned: the subreaper finds it
subprocess.Popen([sys.executable, "-c",
    "import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
    "'import os, time; os.setsid(); time.sleep(300)', sys.argv[1]])", mark])
stem = name.replace("#", "_")
record = {"format": "vllm-real-cell/1", "run_id": run_id, "order": int(order), "name": name,
          "cell": {"backend": "stock", "reference_key": "k", "api": "generate"},
          "status": "running", "times": {"engine_start_s": 1.5}, "cwd": os.getcwd()}
path = os.path.join(out, "cells", stem + ".json")
def save():
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
save()
time.sleep(float(sleep))
record["status"] = "done"
save()
os._exit(0)
"""

COORDINATOR = r"""
import json, sys, time
from pathlib import Path
from bench.real_vllm import cells as vllm_cells, coordinator as vllm_real
work, out = Path(sys.argv[1]), Path(sys.argv[2])
sleeps, deadline = json.loads(sys.argv[3]), float(sys.argv[4])
standin = sys.argv[5]
vllm_real.GROUP_GRACE_S = 1.0  # the SIGTERM-proof stand-in: SIGKILL soon

def argv_of(cell, work, out, run_id, order, end_at):
    return [sys.executable, "-c", standin, cell.name, str(out), run_id, str(order),
            str(end_at), "MARK", str(sleeps[cell.name])]

costs = vllm_cells.Costs(engine_start_s={"eager": 2.0, "piecewise": 2.0, "default": 2.0},
                         first_start_extra_s={"qwen4exp": 0.0}, first_compile_extra_s=0.0,
                         exact_run_s=0.0, teardown_s=0.0, margin_s=1.0)
cells = vllm_cells.expand(list(sleeps))
results = vllm_real.run(cells, work, out, t0=time.time(), deadline_s=deadline, costs=costs,
                        run_id="test", probe=False, argv_of=argv_of)
print("RESULT " + json.dumps([{k: r.get(k) for k in ("name", "status", "reason", "coordinator")}
                               for r in results]))
""".replace("MARK", MARK)


def standin_processes() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if MARK.encode() in cmdline:
                pids.append(int(entry))
    return pids


@pytest.fixture
def no_standins_left():
    yield
    left = standin_processes()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"stand-in processes outlived the coordinator: {left}"


def run_coordinator(
    tmp_path, sleeps: dict, deadline_s: float, env: dict | None = None
) -> list[dict]:
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            COORDINATOR,
            str(tmp_path / "work"),
            str(tmp_path / "out"),
            json.dumps(sleeps),
            str(deadline_s),
            textwrap.dedent(STANDIN_CELL),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_coordinator_ends_each_cells_whole_process_group(tmp_path, no_standins_left):
    results = run_coordinator(tmp_path, {"stock-eager": 1.5, "stock-eager#2": 1.5}, 60)
    assert [r["status"] for r in results] == ["done", "done"]
    for r in results:
        ended = r["coordinator"]["ended"]
        assert ended["sigkilled"] >= 1  # the SIGTERM-proof engine stand-in
        assert ended["orphans_killed"] >= 1  # the one that left the group
    assert not standin_processes()
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "cells").glob("*.json")) == [
        "stock-eager.json",
        "stock-eager_2.json",
    ]
    assert (out / "summary.txt").read_text().startswith("== cells")
    history = json.loads((tmp_path / "work" / "history.json").read_text())
    starts = history["starts"]
    assert [s["cold"] for s in starts] == [True, False] and starts[1]["seconds"] < 1.5
    # Cells start outside the checkout, whose unbuilt pleclient a `python -m`
    # subprocess of vLLM would import ahead of the installed one.
    cwd = Path(json.loads((out / "cells" / "stock-eager.json").read_text())["cwd"]).resolve()
    assert cwd != REPO.resolve() and REPO.resolve() not in cwd.parents


def test_the_coordinator_skips_what_does_not_fit_and_kills_what_overruns(
    tmp_path, no_standins_left
):
    # 10 s to the deadline: the first cell (expected 4 s) starts but sleeps past
    # its kill time (deadline − 5 s); the second no longer fits, and says why.
    results = run_coordinator(tmp_path, {"stock-eager": 60, "shm-eager": 0.1}, 10)
    first, second = results
    assert first["status"] == "killed" and first["coordinator"]["wall_s"] < 12
    assert second["status"] == "skipped" and "deadline" in second["reason"]
    kept = json.loads((tmp_path / "out" / "cells" / "stock-eager.json").read_text())
    assert kept["times"]["engine_start_s"] == 1.5  # what it wrote before is kept
    assert "log_tail" in kept


def test_a_cell_wanting_more_gpus_than_the_host_has_is_skipped_with_why(tmp_path, no_standins_left):
    """A host of one GPU (``nvidia-smi`` answering as one does): a gpus2 cell
    is not started, and says so; a one-GPU cell runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 0\n")  # index 0 (and 0 MiB used)
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    results = run_coordinator(tmp_path, {"stock-eager-gpus2": 0.1, "stock-eager": 0.1}, 60, env=env)
    assert [r["status"] for r in results] == ["skipped", "done"]
    assert results[0]["reason"] == "skipped: 2 GPUs, 1 here"


# ------------------------------------------------------------------ the summary
def stats_snapshot(rows: int, hits: int, misses: int, at_bucket: int) -> dict:
    """A ``PleClient.query_stats`` snapshot's shape (one table), as the server
    counts: rows served, row-cache hits and misses, request times in a bucket."""
    buckets = [0] * 98
    buckets[at_bucket] = rows // 100
    io = {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses), "reads": misses}
    return {
        "tables": [
            {"requests": rows // 100, "rows": rows, "server_time": {"buckets": buckets}, "io": io}
        ]
    }


def cell_json(name: str, order: int, outcomes: list[Outcome], tok_s: dict | None = None) -> dict:
    cell = vc.parse_cell(name)
    record = {
        "format": vc.CELL_FORMAT,
        "run_id": "r1",
        "order": order,
        "name": name,
        "cell": cell.to_json(),
        "status": "done",
        "times": {"engine_start_s": 80.0, "total_s": 100.0},
        "exact": {"runs": [o.to_json() for o in outcomes]},
    }
    zero = vc.server_counters(stats_snapshot(0, 0, 0, 60))
    if cell.shm:
        record["server"] = {
            "at_ready": vc.server_counters(stats_snapshot(4000, 0, 0, 60)),
            "cell": vc.server_delta(
                zero, vc.server_counters(stats_snapshot(8000, 7000, 1000, 61)), 0.5, 30.0
            ),
        }
    if tok_s:
        reps = []
        for rep in range(3):
            for c, base in tok_s.items():
                # 1000 rows a repetition, 90 % of them hits, in 2 s
                after = vc.server_counters(stats_snapshot(1000, 900, 100, 60))
                reps.append(
                    {
                        "rep": rep,
                        "concurrency": c,
                        "tok_s": base * (0.9 + 0.1 * rep),
                        "ttft_s": [0.05] * c,
                        "tpot_s": [c / (base * (0.9 + 0.1 * rep))] * c,
                        # decoding at the repetition's tok/s in its steady window
                        "steady": {
                            "requests": c,
                            "tokens": 1000,
                            "window_s": 1000 / (base * (0.9 + 0.1 * rep)),
                        },
                        "server": vc.server_delta(zero, after, 0.002, 2.0) if cell.shm else None,
                    }
                )
        record["throughput"] = {"reps": reps}
    if cell.ttft_reps:
        scale = 1.0 if cell.stock else 1.5  # unread: 1.5 × stock's; read: 1.1 ×
        record["ttft"] = {
            "reps": [
                {
                    "rep": rep,
                    "kind": kind,
                    "ttft_s": 0.2 * (1.0 + 0.1 * rep) * (scale if kind == "unread" else 1.1),
                    "server": None,
                }
                for rep in range(3)
                for kind in ("unread", "read")
            ]
        }
        if cell.stock:
            for r in record["ttft"]["reps"]:
                r["ttft_s"] = 0.2 * (1.0 + 0.1 * r["rep"])
    return record


def test_the_summary_judges_every_shm_cell_and_gives_each_figure_its_spread(tmp_path):
    cells = [
        cell_json("stock-default-tp", 0, [outcome(A), outcome(B)], {1: 250.0, 32: 5000.0}),
        cell_json("stock-default#2", 1, [outcome(A)]),
        cell_json("shm-default-tp", 2, [outcome(B), outcome(A)], {1: 240.0, 32: 4500.0}),
        cell_json("shm-default-fp8", 3, [outcome(A, [[-0.5] * 6, [-3.0] * 6])]),
        cell_json("shm-eager", 4, [outcome(A)]),  # no stock eager run: no verdict
        {
            "format": vc.CELL_FORMAT,
            "run_id": "r1",
            "order": 5,
            "name": "stock-piecewise",
            "cell": vc.parse_cell("stock-piecewise").to_json(),
            "status": "skipped",
            "reason": "skipped: expected 124 s, 60 s left before the deadline",
        },
        cell_json("stock-default-noexact-ttft", 6, []),
        cell_json("shm-default-noexact-ttft", 7, []),
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for c in cells:
        (tmp_path / "a" / f"{c['name'].replace('#', '_')}.json").write_text(json.dumps(c))
    # the same cell copied to the host's directory counts once
    (tmp_path / "b" / "r1-stock-default-tp.json").write_text(json.dumps(cells[0]))
    disk = {"results": [{"queue_depth": 128, "reads_per_s": 512000.0, "mean_latency_s": 250e-6}]}
    run = {"format": vc.RUN_FORMAT, "run_id": "r1", "disk": {**disk, "summary": "-"}}
    (tmp_path / "a" / "run.json").write_text(json.dumps(run))
    loaded = vc.load_cells([tmp_path / "a", tmp_path / "b"])
    assert [c["name"] for c in loaded] == [c["name"] for c in cells]
    text = vc.summary(loaded, vc.load_runs([tmp_path / "a"]))
    assert "QD 128: 512,000 reads/s" in text and "250 µs" in text
    assert "generate/default/4L-100000/mp" in text.split("== stock references")[1]
    assert "2 engine(s), 3 runs, 2 distinct outcome(s)" in text
    exact = text.split("== exactness")[1].split("\n==")[0]
    lines = {line.split()[0]: line for line in exact.splitlines()[1:] if line}
    assert "PASS 2/2 (2 identical" in lines["shm-default-tp"]
    assert "FAIL 0/1" in lines["shm-default-fp8"] and "logprob" in lines["shm-default-fp8"]
    assert "no verdict" in text and "skipped: expected 124 s" in text
    assert "stock: 2 runs, 2 distinct" in text
    tp = [line for line in text.splitlines() if line.startswith("shm-default-tp ")]
    c32 = next(line for line in tp if line.split()[1] == "32")
    # median of 4050, 4500, 4950 [min-max], × the stock median (5000), hit rate 90 %
    assert "4500" in c32 and "[4050-4950]" in c32 and "0.90" in c32 and "90.0" in c32
    brief = vc.cell_brief(cells[2])
    assert brief.startswith(
        "2 exact runs, 2 distinct; tok/s c1 240, c32 4500; decode/s c1 240, c32 4500; "
        "server hit 87.5 %"
    )
    # the decode rate: the steady window's, its spread and the first (cold) repetition
    decode = text.split("== decode")[1].split("\n==")[0]
    c32 = next(x for x in decode.splitlines() if x.startswith("shm-default-tp ") and " 32 " in x)
    assert c32.split()[2:] == ["4500", "[4050-4950]", "0.90", "4050", "0.90"]
    # the 8 000-token prompt: unread 1.5 × stock's TTFT, read 1.1 ×
    ttft = text.split("== TTFT")[1]
    rows = {tuple(x.split()[:2]): x.split() for x in ttft.splitlines()[2:] if x}
    assert rows[("shm-default-noexact-ttft", "unread")][2:5] == ["330.0", "[300.0-360.0]", "1.50"]
    assert rows[("shm-default-noexact-ttft", "read")][4] == "1.10"
    assert rows[("stock-default-noexact-ttft", "read")][2] == "220.0"
    assert "8k TTFT ms unread 330.0, read 242.0" in vc.cell_brief(cells[-1])
    fig = vc.throughput_figures(cells[2]["throughput"]["reps"])[32]
    assert fig["tok_s"]["n"] == 3 and math.isclose(fig["ttft_p99_s"], 0.05)
    assert fig["server"]["misses_per_s"] == 300 / 6.0
    # the whole cell, from readiness: 8000 rows, 7000 hits, 0.5 s of CPU for 1000 misses
    srv = text.split("== ple-server")[1].split("\n==")[0]
    line = next(x for x in srv.splitlines() if x.startswith("shm-default-fp8 "))
    assert line.split()[1:5] == ["mmap", "4000", "8000", "87.5"] and "500.0" in line


def streams_cell(name: str, order: int, runs: dict[str, list[list[int]]]) -> dict:
    """A restart cell's JSON as ``vllm_real.restart_run`` writes it."""
    record = cell_json(name, order, [])
    del record["exact"]
    record["restart"] = {
        "runs": {
            run: {
                "wall_s": 20.0,
                "failed": [],
                "gap_max_ms": 30.0,
                "outcome": {
                    "prompts_digest": "p",
                    "tokens": tokens,
                    "logprobs": [[] for _ in tokens],
                },
            }
            for run, tokens in runs.items()
        },
        "events": [
            {"kind": kind, "at": at, "server_start_s": 0.4, "stall_s": 0.5}
            for at, kind in vc.RESTART_EVENTS
        ]
        if vc.parse_cell(name).shm
        else [],
    }
    return record


def test_the_summary_judges_restart_streams_against_stocks_own_streams():
    a, b, c, d = [1, 2, 3, 4], [1, 2, 9, 9], [1, 5, 5, 5], [1, 2, 3, 7]
    cells = [
        streams_cell("serve-stock-default-restart-noexact", 0, {"before": [a, a], "after": [a, b]}),
        streams_cell(
            "serve-shm-default-restart-noexact",
            1,
            {"before": [a, a], "disturbed": [a, d], "after": [a, c]},
        ),
    ]
    text = vc.summary(cells)
    part = text.split("== streams under restarts")[1].split("\n==")[0]
    rows = {tuple(line.split()[:2]): line for line in part.splitlines() if line.startswith("serve")}
    assert "reference" in rows[("serve-stock-default-restart-noexact", "after")]
    assert "PASS identical" in rows[("serve-shm-default-restart-noexact", "before")]
    # one stream parting from each stock run at token 3: no more than stock from itself
    assert "PASS within spread" in rows[("serve-shm-default-restart-noexact", "disturbed")]
    # a stream parting at token 1, earlier than stock ever did
    assert "FAIL outside spread" in rows[("serve-shm-default-restart-noexact", "after")]
    assert "kill9-away" in part and "stall 0.50 s" in part
    assert "2 runs, 2 distinct" in part


def test_the_summary_gives_each_verify_cells_row_check():
    ok, bad = (vc.parse_cell(n) for n in ("shm-eager-mp0-verify", "shm-eager-mp0-host-verify"))
    cells = [
        {"name": ok.name, "cell": ok.to_json(), "status": "done", "order": 0,
         "verify": {"layers": 2, "lookups": 80, "rows": 9000, "mismatched_rows": 0}},
        {"name": bad.name, "cell": bad.to_json(), "status": "done", "order": 1,
         "verify": {"layers": 2, "lookups": 80, "rows": 9000, "mismatched_rows": 3,
                    "mismatches": ["t1: 3 of 40 rows differ from the checkpoint"]}},
    ]  # fmt: skip
    part = vc.summary(cells).split("== every PLE row")[1]
    assert "2 layers, 80 lookups, 9000 rows: PASS: bit-equal" in part
    assert "FAIL: 3 rows differ" in part and "t1: 3 of 40 rows" in part


def test_the_summary_says_whether_stocks_engram_tables_changed_its_output():
    moved, lps, still = (
        vc.parse_cell(n)
        for n in ("stock-eager-dsv41-mp0", "stock-piecewise-dsv41-mp0", "stock-default-dsv41-mp0")
    )
    loaded = {"language_model.model.layers.1.engram.embed_tokens.weight": [1, 256]}
    cells = [
        {"name": moved.name, "cell": moved.to_json(), "status": "done", "order": 0,
         "engram_tables": {"loaded": loaded, "output_changed": True,
                           "prompts_with_other_tokens": [0, 3]}},
        {"name": lps.name, "cell": lps.to_json(), "status": "done", "order": 1,
         "engram_tables": {"loaded": loaded, "output_changed": True,
                           "prompts_with_other_tokens": []}},
        {"name": still.name, "cell": still.to_json(), "status": "done", "order": 2,
         "engram_tables": {"loaded": loaded, "output_changed": False,
                           "prompts_with_other_tokens": []}},
    ]  # fmt: skip
    part = vc.summary(cells).split("== stock's Engram tables")[1]
    assert f"{moved.name:<40} 1 tensors: yes, 2 prompts' tokens differ" in part
    assert f"{lps.name:<40} 1 tensors: yes, in the logprobs only" in part
    assert f"{still.name:<40} 1 tensors: NO: the output ignores the rows" in part


def test_a_shm_cell_whose_workers_ran_another_way_is_flagged_in_the_summary():
    """The route and ops each worker logged (``routes_run``; the plugin's own
    line, tests/test_vllm_plugin_rows.py) against what the cell's name asks."""
    from bench.real_vllm.coordinator import routes_run

    line = "pleclient.vllm_plugin: PLE backend shm: GPU-driven lookups on cuda:0 ({}): 4 PLE"
    assert routes_run("\n".join([line.format("kernels"), "other", line.format("kernels")])) == [
        "gpu:kernels",
        "gpu:kernels",
    ]
    kernels, host = (vc.parse_cell(n) for n in ("shm-default-kernels-tp", "shm-eager-host"))
    cells = [
        {"name": kernels.name, "cell": kernels.to_json(), "status": "done", "order": 0,
         "routes_run": routes_run(line.format("memops"))},
        {"name": host.name, "cell": host.to_json(), "status": "done", "order": 1,
         "routes_run": ["host"]},
    ]  # fmt: skip
    plain = vc.parse_cell("shm-default-tp")  # the plugin's default: kernels
    cells.append({"name": plain.name, "cell": plain.to_json(), "status": "done", "order": 2,
                  "routes_run": routes_run(line.format("kernels"))})  # fmt: skip
    table = vc.summary(cells).split("== cells")[1]
    assert "NOT AS NAMED: its workers ran gpu:memops, not gpu:kernels" in table
    assert table.count("NOT AS NAMED") == 1  # the host and the plain cell ran as named
    cells[0]["routes_run"] = []
    assert "no worker said which route it ran" in vc.summary(cells)


# ------------------------------------------------------------------ the scripts
@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_every_bench_script_parses(script):
    run = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_the_device_script_parses_and_lists_the_checkpoints_its_cells_need(tmp_path):
    assert subprocess.run(["bash", "-n", str(BENCH / "device_vllm.sh")]).returncode == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.real_vllm.coordinator",
            "checkpoints",
            "--cells",
            "exact-3,bench-1",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines()]
    assert names == ["small-bf16", "small-fp8", "large-bf16"]
    assert f"--twin-of {tmp_path}/ckpt/small-bf16" in r.stdout
    plan = subprocess.run(
        [sys.executable, "-m", "bench.real_vllm.coordinator", "plan", "--cells", "exact-1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert plan.returncode == 0 and "stock-eager" in plan.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.real_vllm.coordinator",
            "plan",
            "--cells",
            "shm-default-host",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "eager or piecewise" in bad.stderr


# ------------------------------------------------------------- vLLM's view
TOKENIZER_TEXT = "Real English text, with a \u2018quote\u2019.\n"

VLLM_CHECKS = r"""
import json, os, sys
from pathlib import Path
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
from tests.vllm_helpers.cpu_kernels import install_sgl_gemm_standins
install_sgl_gemm_standins()
from vllm.distributed import init_distributed_environment
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.config import CompilationConfig
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from bench.real_vllm import cells as vllm_cells, coordinator as vllm_real
from transformers import AutoConfig
from vllm.tokenizers import get_tokenizer
model, text = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(model)
tokenizer = get_tokenizer(model)
ids = tokenizer.encode(text, add_special_tokens=False)
checked = {}
for name in ("stock-eager", "offload-piecewise", "shm-default", "serve-shm-default-gpus2"):
    cell = vllm_cells.parse_cell(name)
    kwargs = dict(vllm_real.engine_kwargs(cell))
    cc = kwargs.pop("compilation_config", None)  # LLM() makes the dict a CompilationConfig
    generate = EngineArgs(model=model, **kwargs,
                          **({"compilation_config": CompilationConfig(**cc)} if cc else {}))
    argv = vllm_real.serve_argv(cell, Path(model), 8000)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[argv.index("serve") + 1:])
    validate_parsed_serve_args(args)
    serve = AsyncEngineArgs.from_cli_args(args)
    checked[name] = [
        {
            "offload": e.engram_config.cpu_offload,
            "eager": bool(e.enforce_eager),
            "cudagraph_mode": str(getattr(e.compilation_config, "cudagraph_mode", None)),
            "prefix_caching": e.enable_prefix_caching,
            "max_num_seqs": e.max_num_seqs,
            "chunk": e.max_num_batched_tokens,
            "tp": e.tensor_parallel_size,
        }
        for e in (generate, serve)
    ]
from bench.real_vllm import checkpoint as qwen4_checkpoint
import torch
from transformers import Qwen4ExpForCausalLM
real = {}
for layers, base in ((4, 100_000), (4, 1_100_000), (16, 550_000)):
    with torch.device("meta"):  # the real dims' shapes, nothing allocated
        m = Qwen4ExpForCausalLM(qwen4_checkpoint.text_config(layers, base))
    qwen4_checkpoint.drop_indexer(m)
    shapes = [list(m.model.layers[i - 1].ple.ple_embedding.ngram_embedding.weight.shape)
              for i in m.config.ple_layer_ids]
    real[f"{layers}-{base}"] = {
        "tables": shapes,
        "indexers": sum(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "indexer")
                        for layer in m.model.layers),
        "estimate_gib": vllm_cells.table_gib_estimate(
            {(4, 100_000): "small-bf16", (4, 1_100_000): "large-bf16",
             (16, 550_000): "deep-bf16"}[(layers, base)]),
    }
import tempfile
init_distributed_environment(1, 0, f"file://{tempfile.mkdtemp()}/init", 0, backend="gloo")
from tests.vllm_helpers.qwen4_model import load_vllm_model
loaded = load_vllm_model(model)
layers = loaded.model.model.layers
rounded = load_vllm_model(sys.argv[3])
nvfp4 = {"unloaded": rounded.unloaded_parameters, "layers": []}
for i, layer in enumerate(layers):
    if getattr(layer, "ple", None) is None:
        continue
    a = layer.ple.ple_embedding.ngram_embedding
    b = rounded.model.model.layers[i].ple.ple_embedding.ngram_embedding
    every_row = torch.arange(a.weight.shape[0])
    exact = a.dequantize(a(every_row), torch.float32)
    decoded = b.dequantize(b(every_row), torch.float32)
    nvfp4["layers"].append({
        "method": type(b.quant_method).__name__,
        "max_error_of_amax": ((decoded - exact).abs().max() / exact.abs().max()).item(),
        "correlation": torch.corrcoef(torch.stack([exact.flatten(), decoded.flatten()]))[0, 1]
                       .item(),
    })
print("RESULT " + json.dumps({
    "config": {
        "layer_types": config.layer_types,
        "ple_layer_ids": config.ple_layer_ids,
        "eos_token_id": config.eos_token_id,
        "indexer_n_heads": getattr(config, "indexer_n_heads", None),
        "partial_rotary_factor": config.rope_parameters["partial_rotary_factor"],
    },
    "tokenizer": {"ids": ids, "decoded": tokenizer.decode(ids), "size": len(tokenizer),
                  "eos": tokenizer.eos_token_id},
    "args": checked,
    "real": real,
    "attention": type(layers[3].self_attn).__name__,
    "ple_layers": [i for i, layer in enumerate(layers) if getattr(layer, "ple", None) is not None],
    "unloaded": loaded.unloaded_parameters,
    "nvfp4": nvfp4,
}))
"""


def test_the_checkpoint_has_no_indexer_and_a_byte_tokenizer(tiny, vllm_facts):
    from safetensors import safe_open

    config = vllm_facts()["config"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["indexed_attention"]
    assert config["ple_layer_ids"] == [2, 3] and config["eos_token_id"] == 256
    assert config["indexer_n_heads"] is None  # vLLM builds plain full attention
    assert config["partial_rotary_factor"] == 0.25
    with safe_open(str(tiny / "bf16" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if ".indexer." in n]
    tokenizer = vllm_facts()["tokenizer"]  # as vLLM loads it
    assert tokenizer["ids"] == vc.tokens_of(TOKENIZER_TEXT) == list(TOKENIZER_TEXT.encode())
    assert tokenizer["decoded"] == TOKENIZER_TEXT
    assert (tokenizer["size"], tokenizer["eos"]) == (512, 256)


def test_vllm_takes_the_checkpoint_and_every_cells_arguments(vllm_facts):
    """vLLM's own loader builds the whole model from the checkpoint (the
    indexed layer as plain attention), and vLLM's own argument handling takes
    what the cells give ``LLM`` and ``vllm serve``."""
    result = vllm_facts()
    assert result["attention"] == "Qwen3NextAttention" and result["unloaded"] == []
    assert result["ple_layers"] == [1, 2]
    for name, runs in result["args"].items():
        for e in runs:  # LLM(...) and vllm serve alike
            assert e["offload"] is name.startswith("offload"), (name, e)
            assert e["eager"] is name.endswith("eager"), (name, e)
            assert e["prefix_caching"] is False
            assert (e["max_num_seqs"], e["chunk"]) == (32, 512)
            assert e["tp"] == (2 if name.endswith("gpus2") else 1), (name, e)
    assert all("PIECEWISE" in e["cudagraph_mode"] for e in result["args"]["offload-piecewise"])


def test_the_real_dims_make_160_column_tables_of_the_planned_sizes(vllm_facts):
    """The GPU checkpoints' configs, built on the meta device: transformers takes
    them, every table has Qwen3.8-Flash-Next's 160 columns, the indexer goes,
    and the disk cells' tables are at least 10 GiB (their row cache of 1 GiB is
    under a tenth of them)."""
    real = vllm_facts()["real"]
    assert [len(r["tables"]) for r in real.values()] == [2, 2, 4]
    for name, r in real.items():
        assert {cols for _, cols in r["tables"]} == {160}, name
        assert r["indexers"] == 0, name
        gib = sum(rows * cols * 2 for rows, cols in r["tables"]) / 2**30
        assert abs(gib - r["estimate_gib"]) < 0.02 * gib, (name, gib, r["estimate_gib"])
    for name in ("4-1100000", "16-550000"):
        gib = sum(rows * cols * 2 for rows, cols in real[name]["tables"]) / 2**30
        assert gib >= 10 * vc.parse_cell("shm-default-direct").cache_size_gib()


def test_a_cell_runs_on_the_cpu_as_far_as_vllms_cpu_build_lets_an_engine_start(cpu_cell):
    """Everything of a shm cell but the GPU: the coordinator starts the cell in
    its own process group, the cell its cold ple-server and vLLM's ``LLM`` with
    the cell's environment; the engine cannot start on this CPU build of vLLM
    (no CPU kernels), which the cell records as its error; then nothing of it
    is left: no process, no server, no state directory."""
    work, out, code, output = cpu_cell()
    record = json.loads((out / "cells" / "shm-eager-mp0.json").read_text())
    assert record["status"] in ("failed", "done"), output[-3000:]
    if record["status"] == "failed":
        assert code == 1 and record["error"] and record["log_tail"]
    assert record["env"]["VLLM_PLE_BACKEND"] == "shm"
    assert record["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert record["env"]["VLLM_PLE_SHM_SOCKET"].endswith("ple.sock")
    assert record["server"]["args"][:2] == ["--io", "mmap"] and record["times"]["server_start_s"]
    assert record["prompts"]["source"].startswith("pydoc_data.topics")
    assert record["coordinator"]["ended"]["sigkilled"] == 0  # it ended on its own
    state = Path(record["server"]["args"][record["server"]["args"].index("--state-dir") + 1])
    assert not state.parent.exists()  # the server's cold state directory is gone
    assert not Path(record["env"]["VLLM_PLE_SHM_SOCKET"]).parent.exists()
    server_log = (out / "logs" / "shm-eager-mp0.server.log").read_text()  # its tail, in $OUT
    assert server_log and "Traceback" not in server_log
    assert (out / "logs" / "shm-eager-mp0.log").read_text()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            assert str(work).encode() not in cmdline, cmdline
    assert "== cells" in (out / "summary.txt").read_text()


def test_serve_runs_sent_in_turn_are_judged_only_against_stock_runs_sent_alike():
    """Stock sent its prompts concurrently over HTTP gave several outcomes;
    in turn it gives one. An in-turn shm run that matches only a concurrent
    stock outcome is not identical to stock sent alike: it fails, where the
    pooled references would have passed it."""
    concurrent = cell_json("serve-stock-default", 0, [outcome(A), outcome(B)])
    in_turn = cell_json("serve-stock-default#2", 1, [outcome(A), outcome(A)])
    shm = cell_json("serve-shm-default", 2, [outcome(B)])
    for c in (in_turn, shm):
        c["exact"]["submission"] = "in_turn"
    verdicts = vc.judgments([concurrent, in_turn, shm])
    assert verdicts["r1/serve-shm-default"]["line"].startswith("FAIL 0/1")
    assert "2 stock runs, 1 distinct" in verdicts["r1/serve-shm-default"]["line"]
    refs = vc.references([concurrent, in_turn, shm])
    assert any("in_turn" in r and "2 runs, 1 distinct" in r for r in refs)
    assert any("in_turn" not in r and "2 runs, 2 distinct" in r for r in refs)
