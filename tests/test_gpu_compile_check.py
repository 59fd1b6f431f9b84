"""``bench/gpu/compile_check.py`` on the CPU: the forward compiled by inductor
(full, and split at the PLE ops as vLLM's piecewise backend splits it) over the
GPU-driven route's CPU stand-in, against a real server, with vLLM hidden from
the process as on the GPU host. No CUDA graphs here: those modes run on the
GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tests.harness import REPO, shm_entries

SCRIPT = ["-m", "bench.gpu.compile_check"]


def test_dry_run_imports_no_vllm(tmp_path):
    run = subprocess.run(
        [sys.executable, *SCRIPT, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["vllm_imported"] is False
    assert report["modes"] == ["full", "piecewise", "breakable"]
    assert report["inductor_options"]["enable_auto_functionalized_v2"] is False


def test_compiled_full_and_piecewise_on_the_cpu_stand_in_are_exact(tmp_path):
    out = tmp_path / "compile.json"
    before = shm_entries()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    run = subprocess.run(
        [sys.executable, *SCRIPT, "--device", "cpu", "--steps", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] == {"full": True, "piecewise": True}
    assert report["vllm_imported"] is False
    for mode in ("full", "piecewise"):
        result = report[mode]
        assert result["route"] == ["gpu-driven (CPU stand-in)"]
        assert result["replays_not_exact"] == 0 and result["compiled_warm_runs_exact"] == "2/2"
        assert result["requests_per_layer"] == [2, 2, 2]  # one request per PLE layer per step
    # Every PLE layer's start and finish ran eagerly between the compiled pieces.
    assert report["piecewise"]["eager_ple_ops"] == 6
    assert report["piecewise"]["ple_ops_in_graph_pieces"] == 0
    assert not shm_entries() - before, "the check left shared memory behind"
