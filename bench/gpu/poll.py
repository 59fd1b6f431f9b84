#!/usr/bin/env python3
"""The serving loop beside a decoding GPU: its wake-ups, CPU and answers by
``gpu_poll_us``.

A GPU-driven channel cannot wake the serving loop, which looks at its rung
word every ``gpu_poll_us`` while it rings (inside its native sleep:
``futex_waitv``'s polled words), also through the milliseconds between two
decode steps, whose PLE layers all ring at the step's start. Each look is a
timer wake-up. This runs, for each interval of ``--polls`` (µs), a
ple-server on a small synthetic FP8 table and one GPU-driven channel driven
by the CPU stand-in of a stream (``GpuLookups.open(device="cpu")``):
``--layers`` rings at the start of a step every ``--step-ms``, then their
collects, every row checked, for ``--seconds``. For each: the serving
thread's CPU share and its voluntary context switches a second (each a sleep
ended), and each step's time from its rings to its last answer (p50 / p99 /
max). ``others_cpu`` is what the rest of the machine used meanwhile (repeat a
run with a high one).

    python -m bench.gpu.poll                                   # 4.5 ms steps
    python -m bench.gpu.poll --polls 50,25 --step-ms 2.5 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.provenance import OthersMeter, footer, loadavg, machine, source
from bench.harness.scaffold import add_json, parser, save_json, work_dir
from bench.harness.servers import write_model
from pleclient.gpu import GpuLookups
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, read_reference

IDS = 128  # a layer's ids at a small decode batch (8 tokens × 16 heads)


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--polls", default="50,200", help="gpu_poll_us values (default 50,200)")
    ap.add_argument("--step-ms", type=float, default=4.5, help="a step every (default 4.5)")
    ap.add_argument("--layers", type=int, default=4, help="PLE layers a step (default 4)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per interval (default 5)")
    add_json(ap)
    return ap.parse_args(argv)


def serving_thread(pid: int) -> tuple[float, int]:
    """The serving loop's CPU seconds and voluntary context switches."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() != "ple-serving":
                continue
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            switches = next(
                int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:")
            )
        return (int(fields[11]) + int(fields[12])) / OthersMeter.HZ, switches
    raise RuntimeError(f"server {pid} has no thread named ple-serving")


def decode(lookups: GpuLookups, reference: np.ndarray, args, seconds: float, rng) -> list[float]:
    """Steps of ``args.layers`` rings, then their collects, one every
    ``args.step_ms``; each step's time from its rings to its last answer (ms)."""
    out = np.empty((IDS, reference.shape[1]), dtype=np.uint8)
    times: list[float] = []
    step_s = args.step_ms / 1e3
    start = next_step = time.monotonic()
    while next_step - start < seconds:
        time.sleep(max(0.0, next_step - time.monotonic()))
        next_step += step_s
        ids = [rng.integers(0, reference.shape[0], IDS) for _ in range(args.layers)]
        began = time.perf_counter()
        for slot in range(args.layers):
            lookups.ring(slot, 1, ids[slot])
        for slot in range(args.layers):
            lookups.collect(slot, out)
            if not np.array_equal(out, reference[ids[slot]]):
                raise AssertionError("a rung lookup's rows differ from the checkpoint")
        times.append((time.perf_counter() - began) * 1e3)
    return times


def measure(model: str, reference: np.ndarray, poll_us: str, args) -> dict:
    launcher = ServerLauncher(
        model,
        "--gpu-poll-us",
        poll_us,
        log_level="WARNING",
        cwd=REPO,
        die_with_parent=True,
    )
    rng = np.random.default_rng(5)
    with (
        launcher.start() as server,
        GpuLookups.open(
            server.socket, device="cpu", capacity=IDS, depth=args.layers, timeout=10.0
        ) as lookups,
    ):
        decode(lookups, reference, args, 1.0, rng)  # the rhythm is learnt
        meter = OthersMeter([server.proc.pid])
        meter.start()
        cpu0, switches0 = serving_thread(server.pid)
        t0 = time.monotonic()
        ms = np.array(decode(lookups, reference, args, args.seconds, rng))
        wall = time.monotonic() - t0
        cpu1, switches1 = serving_thread(server.pid)
        others = meter.stop()
    return {
        "gpu_poll_us": int(poll_us),
        "steps": len(ms),
        "serving_cpu": round((cpu1 - cpu0) / wall, 3),
        "switches_per_s": round((switches1 - switches0) / wall),
        "step_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "step_p99_ms": round(float(np.percentile(ms, 99)), 3),
        "step_max_ms": round(float(ms.max()), 3),
        "others_cpu": others,
        "loadavg": loadavg(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-gpu-poll-", args.dir) as workdir:
        table = SyntheticTable(layer=1, rows=100_000, cols=160, dtype="F8_E4M3", parts=2)
        model = write_model(workdir, [table])
        reference = read_reference(model, table.name)
        result: dict = {"machine": machine(), "source": source(), "args": vars(args)}
        result["cases"] = [
            measure(model, reference, us.strip(), args) for us in args.polls.split(",")
        ]
    report(result, args)
    save_json(result, args.json)
    return 0


def report(result: dict, args) -> None:
    base = result["cases"][0]
    print(
        f"{'poll µs':>8} {'steps':>6} {'serving cpu':>12} {'switches/s':>11} {'× first':>8} "
        f"{'step p50 ms':>12} {'p99 ms':>8} {'max ms':>8} {'others cpu':>10}"
    )
    for r in result["cases"]:
        ratio = r["switches_per_s"] / base["switches_per_s"] if base["switches_per_s"] else 0.0
        print(
            f"{r['gpu_poll_us']:>8} {r['steps']:>6} {100 * r['serving_cpu']:>11.1f}% "
            f"{r['switches_per_s']:>11} {ratio:>8.2f} {r['step_p50_ms']:>12.3f} "
            f"{r['step_p99_ms']:>8.3f} {r['step_max_ms']:>8.3f} {100 * r['others_cpu']:>9.1f}%"
        )
    print(
        f"{args.layers} layers of {IDS} ids a step every {args.step_ms} ms, "
        f"{args.seconds} s each; " + footer(result)
    )


if __name__ == "__main__":
    sys.exit(main())
