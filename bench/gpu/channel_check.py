#!/usr/bin/env python3
"""GPU-driven channels on a real GPU: correctness checks, printed as a report.

Needs torch with CUDA (no vLLM). Writes a small synthetic FP8 + BF16
checkpoint, starts ``pleserver serve`` on it, and checks with
``pleclient.gpu.GpuLookups`` on a CUDA stream:

  eager        ring + collect on the stream, rows bit-exact on the device
  graph        the same inside one captured CUDA graph of 4 lookups, replayed
               200 times with new ids each replay (copied into the graph's
               static input), every replay's rows bit-exact
  no-sync      the replays under ``torch.cuda.set_sync_debug_mode("error")``:
               the client makes no host synchronization per step
  error        (child process) a bad id inside a graph: the step fails with a
               device-side assertion, it never hands out rows
  watchdog     (child process) the server is killed while the graph waits:
               the watchdog's error mark ends the wait, the step fails
  hints        (io = direct) a captured graph that hints one slot's ids
               (``GpuLookups.hint``, never waited on) and looks up another's,
               replayed 50 times with host-sync checks on: rows bit-exact,
               every replay's hint received by the server, and lookups of
               rows hinted earlier counted as hits on hinted rows

    python3 -m bench.gpu.channel_check [--json out.json] [--gpu-ops memops]

``--gpu-ops`` chooses what rings and collects in every check:
``pleclient.gpu_kernels``' two kernels (the default, ``DEFAULT_GPU_OPS``) or
the driver's stream memory operations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from bench.harness.checkout import REPO
from bench.harness.scaffold import save_json
from pleclient.gpu import DEFAULT_GPU_OPS, GPU_OPS, GpuLookups, stream_memops_supported
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, read_reference, write_checkpoint

TABLES = [
    SyntheticTable(layer=1, rows=200_000, cols=160, dtype="F8_E4M3", parts=8),
    SyntheticTable(layer=3, rows=100_000, cols=160, dtype="BF16", parts=8),
]

CHILD = r"""
import os, signal, sys, time, numpy as np, torch
from pleclient.gpu import GpuLookups
from bench.harness.checkout import REPO
mode, socket, ops = sys.argv[1], sys.argv[2], sys.argv[3]
gl = GpuLookups.open(socket, device="cuda", capacity=1024, depth=2, timeout=60.0, ops=ops)
rows = gl.client.table(1).rows
ids = torch.arange(512, device="cuda")
out = torch.empty((512, 160), dtype=torch.uint8, device="cuda")
graph = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    gl.ring(0, 1, ids); gl.collect(0, out)     # warm-up outside the graph
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=s):
        gl.ring(0, 1, ids); gl.collect(0, out)
graph.replay(); torch.cuda.synchronize()
print("replayed", flush=True)
if mode == "error":
    ids.fill_(rows + 7)                        # out of range: the server answers ERROR
    out.fill_(0xAB)
else:
    print("pid", os.getpid(), flush=True)
    sys.stdin.readline()                       # the parent stops the server now
graph.replay()
try:
    torch.cuda.synchronize()
    print("RESULT no error raised", flush=True)
except Exception as exc:                       # the device-side assertion
    print("RESULT raised:", type(exc).__name__, str(exc).splitlines()[0], flush=True)
print("FAILURE", gl.failure, flush=True)
"""


def make_server(workdir: str):
    ckpt = os.path.join(workdir, "ckpt")
    if not os.path.isdir(ckpt):
        write_checkpoint(ckpt, TABLES, files=2)
    return ServerLauncher(ckpt, "--prewarm", "full", die_with_parent=True).start()


def check_eager_and_graph(
    socket: str, refs: dict[int, torch.Tensor], report: dict, ops: str
) -> None:
    device = torch.device("cuda")
    gl = GpuLookups.open(socket, device=device, capacity=4096, depth=4, timeout=30.0, ops=ops)
    report["gpu_ops_run"] = gl.ops  # what rang and collected in fact
    try:
        layers = (1, 3, 1, 3)
        sizes = (16, 512, 4096, 1000)
        gen = torch.Generator(device="cuda").manual_seed(0)
        ids = [torch.empty(n, dtype=torch.int64, device=device) for n in sizes]
        outs = [
            torch.empty((n, refs[layer].shape[1]), dtype=torch.uint8, device=device)
            for n, layer in zip(sizes, layers, strict=True)
        ]

        def new_ids() -> None:
            for layer, buf in zip(layers, ids, strict=True):
                buf.copy_(
                    torch.randint(0, refs[layer].shape[0], buf.shape, generator=gen, device=device)
                )

        def step() -> None:
            for slot, (layer, buf) in enumerate(zip(layers, ids, strict=True)):
                gl.ring(slot, layer, buf)
            for slot, out in enumerate(outs):
                gl.collect(slot, out)

        def exact() -> bool:
            return all(
                torch.equal(out, refs[layer][buf])
                for layer, buf, out in zip(layers, ids, outs, strict=True)
            )

        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            new_ids()
            step()
            torch.cuda.synchronize()
            report["eager_exact"] = exact()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                step()
            torch.cuda.synchronize()
            bad = 0
            times = []
            for _ in range(200):
                new_ids()
                start = time.perf_counter()
                torch.cuda.set_sync_debug_mode("error")
                graph.replay()
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                bad += not exact()
            report["graph_replays"] = 200
            report["graph_replays_not_exact"] = bad
            report["graph_step_ms_p50"] = round(float(np.median(times)) * 1e3, 3)
            report["no_host_sync"] = True  # set_sync_debug_mode("error") raised nothing
    finally:
        torch.cuda.synchronize()
        gl.close()


def check_hints(workdir: str, refs: dict[int, torch.Tensor], report: dict, ops: str) -> None:
    """Hints from a CUDA stream, inside a graph (``hints`` in the docstring)."""
    from pleclient import PleClient

    ckpt = os.path.join(workdir, "ckpt")
    device = torch.device("cuda")
    server = ServerLauncher(
        ckpt,
        "--io",
        "direct",
        "--cache-size",
        "64M",
        "--state-dir",
        workdir,
        die_with_parent=True,
    ).start()
    with server:
        gl = GpuLookups.open(
            server.socket, device=device, capacity=1024, depth=4, timeout=30.0, ops=ops
        )
        try:
            n = 512
            hint_ids = torch.empty(n, dtype=torch.int64, device=device)
            ids = torch.empty(n, dtype=torch.int64, device=device)
            out = torch.empty((n, refs[1].shape[1]), dtype=torch.uint8, device=device)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                hint_ids.copy_(torch.arange(n, device=device))
                ids.copy_(torch.arange(n, 2 * n, device=device))
                gl.hint(3, 1, hint_ids)  # warm-up outside the graph (writes the kind word)
                gl.ring(0, 1, ids)
                gl.collect(0, out)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    gl.hint(3, 1, hint_ids)
                    gl.ring(0, 1, ids)
                    gl.collect(0, out)
                torch.cuda.synchronize()
                bad = 0
                for step in range(50):
                    # Each step hints the rows the next step looks up.
                    hint_ids.copy_(torch.arange((step + 2) * n, (step + 3) * n, device=device))
                    ids.copy_(torch.arange((step + 1) * n, (step + 2) * n, device=device))
                    torch.cuda.set_sync_debug_mode("error")
                    graph.replay()
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()
                    bad += not torch.equal(out, refs[1][ids])
                    time.sleep(0.02)  # room for the hint to be read before the next step
            with PleClient.connect(server.socket) as watcher:
                t = next(t for t in watcher.stats()["tables"] if t["layer"] == 1)
            report["hints_graph_replays_not_exact"] = bad
            report["hints_received"] = t["hints_received"]
            report["hints_read"] = t["hints_read"]
            report["hints_hits"] = t["hints_hits"]
            report["hints_dropped_by"] = t["hints_dropped_by"]
        finally:
            torch.cuda.synchronize()
            gl.close()


def run_child(mode: str, server, ops: str) -> str:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, server.socket, ops],
        cwd=REPO,  # `-c`: the working directory first on the path, this checkout's packages
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if mode == "watchdog":
            while True:
                line = child.stdout.readline()
                if not line or line.startswith("pid"):
                    break
            server.kill()
            child.stdin.write("go\n")
            child.stdin.flush()
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        out += "\nRESULT hung (killed after 120 s)"
    lines = [line for line in out.splitlines() if line.startswith(("RESULT", "FAILURE"))]
    return " | ".join(lines) or f"exit {child.returncode}: {err[-500:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument(
        "--gpu-ops",
        choices=GPU_OPS,
        default=DEFAULT_GPU_OPS,
        help=f"how the stream rings and collects (default {DEFAULT_GPU_OPS})",
    )
    args = parser.parse_args()
    supported, why = stream_memops_supported("cuda")
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "memops": why,
        "gpu_ops": args.gpu_ops,
    }
    if not supported:
        print(json.dumps(report, indent=1))
        return 1
    with tempfile.TemporaryDirectory(prefix="ple-gpu-check-") as workdir:
        server = make_server(workdir)
        with server:
            ckpt = os.path.join(workdir, "ckpt")
            refs = {t.layer: torch.from_numpy(read_reference(ckpt, t.name)).cuda() for t in TABLES}
            check_eager_and_graph(server.socket, refs, report, args.gpu_ops)
            report["error_in_graph"] = run_child("error", server, args.gpu_ops)
        second = make_server(workdir)
        with second:
            report["watchdog_server_killed"] = run_child("watchdog", second, args.gpu_ops)
        check_hints(workdir, refs, report, args.gpu_ops)
    print(json.dumps(report, indent=1))
    save_json(report, args.json, indent=1)
    ok = (
        report.get("eager_exact")
        and report.get("graph_replays_not_exact") == 0
        and "raised" in report.get("error_in_graph", "")
        and "raised" in report.get("watchdog_server_killed", "")
        and report.get("hints_graph_replays_not_exact") == 0
        and report.get("hints_received", 0) >= 50 * 512
        and report.get("hints_hits", 0) > 0
        and report.get("gpu_ops_run") == args.gpu_ops  # not a fallback passed off as it
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
