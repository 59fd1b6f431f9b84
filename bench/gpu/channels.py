#!/usr/bin/env python3
"""GPU-driven channels by number: what open, idle ones cost the serving loop.

Starts ``pleserver serve`` on a small synthetic FP8 table and measures, in one
run, three cases:

* ``none``: no GPU-driven channel, the baseline;
* ``idle``: ``--channels`` GPU-driven channels of ``--slots`` slots each, open
  and never rung;
* ``rare``: the same channels, one ring every ``--ring-every`` seconds (the
  CPU stand-in of the stream, ``pleclient.gpu.HostStream``; another channel
  and slot each time, every row checked).

For each case: a *bystander* (capacity 16, depth 1) doing ``lookup`` of 16
random ids every ``--gap-ms``, its p50 / p99 / max over ``--seconds``; then,
without the bystander, the CPU share of the server's serving thread (the
kernel thread ``ple-serving``, from ``/proc/PID/task/TID/stat``) over
``--seconds``. The ratios to ``none`` are the result; ``others_cpu`` is the
CPU share the rest of the machine used meanwhile (a run with a high one
should be repeated). Everything is removed at the end.

    python -m bench.gpu.channels                        # 60 channels × 64 slots
    python -m bench.gpu.channels --channels 120 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.load import bystander, latency_ms
from bench.harness.provenance import OthersMeter, footer, loadavg, machine, source
from bench.harness.scaffold import add_json, add_load, parser, save_json, work_dir
from bench.harness.servers import write_model
from pleclient import PleClient
from pleclient.gpu import HostStream
from pleserver.devkit.launcher import LaunchedServer, ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, read_reference


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--channels", type=int, default=60, help="GPU-driven channels (default 60)")
    ap.add_argument("--slots", type=int, default=64, help="slots of each (default 64)")
    add_load(ap, seconds=10)
    ap.add_argument("--ring-every", type=float, default=0.9, help="seconds (default 0.9)")
    add_json(ap)
    return ap.parse_args(argv)


def serving_thread_ticks(pid: int) -> int:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "ple-serving":
                    continue
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        return int(fields[11]) + int(fields[12])
    raise RuntimeError(f"server {pid} has no thread named ple-serving")


class Ringer:
    """Rings one slot of one channel every ``every`` seconds, checking its rows."""

    def __init__(self, channels: list[PleClient], every: float, reference: np.ndarray) -> None:
        self.channels, self.every, self.reference = channels, every, reference
        self.rings = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stream, rng = HostStream(wait_timeout=30.0), np.random.default_rng(7)
        out = np.empty((16, self.reference.shape[1]), dtype=np.uint8)
        try:
            while not self._stop.wait(self.every):
                channel = self.channels[int(rng.integers(len(self.channels)))].channel
                slot = channel.slots[int(rng.integers(channel.layout.depth))]
                ids = rng.integers(0, self.reference.shape[0], 16)
                stream.ring(slot, 0, ids, 16)
                stream.collect(slot, out, 16, out.shape[1])
                if not np.array_equal(out, self.reference[ids]):
                    raise AssertionError("a rung lookup's rows differ from the checkpoint")
                self.rings += 1
        except BaseException as exc:
            self.failure = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        if self.failure is not None:
            raise RuntimeError(f"the ringer failed: {self.failure!r}")


def measure(server: LaunchedServer, args) -> dict:
    """The bystander's latencies, then the serving thread's CPU alone."""
    rng = np.random.default_rng(8)
    meter = OthersMeter([server.proc.pid])
    meter.start()
    with PleClient.connect(server.socket, name="bystander", capacity=16, depth=1) as client:
        ms = bystander(client, 1, args.seconds, args.gap_ms, rng)
    time.sleep(0.5)  # past the loop's spin after the bystander's last lookup
    ticks, started = serving_thread_ticks(server.pid), time.monotonic()
    time.sleep(args.seconds)
    cpu = (serving_thread_ticks(server.pid) - ticks) / OthersMeter.HZ / (time.monotonic() - started)
    return {
        **latency_ms(ms),
        "serving_cpu": round(cpu, 3),
        "others_cpu": meter.stop(),
        "loadavg": loadavg(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-gpu-channels-", args.dir) as workdir:
        table = SyntheticTable(layer=1, rows=100_000, cols=160, dtype="F8_E4M3", parts=2)
        model = write_model(workdir, [table])
        reference = read_reference(model, table.name)
        launcher = ServerLauncher(
            model,
            "--max-clients",
            str(args.channels + 2),
            "--max-gpu-slots-per-uid",
            str(args.channels * args.slots),
            log_level="WARNING",
            cwd=REPO,
            die_with_parent=True,
        )
        channels: list[PleClient] = []
        result: dict = {"machine": machine(), "source": source(), "args": vars(args)}
        with launcher.start() as server:
            result["none"] = measure(server, args)
            try:
                for i in range(args.channels):
                    channels.append(
                        server.client(
                            name=f"gpu-{i}", capacity=16, depth=args.slots, gpu_driven=True
                        )
                    )
                time.sleep(1.0)
                result["idle"] = measure(server, args)
                ringer = Ringer(channels, args.ring_every, reference)
                try:
                    result["rare"] = measure(server, args)
                finally:
                    ringer.stop()
                result["rare"]["rings"] = ringer.rings
            finally:
                for client in channels:
                    client.close()
        report(result, args)
        save_json(result, args.json)
    return 0


def report(result: dict, args) -> None:
    base = result["none"]
    print(
        f"{'case':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'serving cpu':>12} "
        f"{'p50 ×':>7} {'others cpu':>10} {'load':>6}"
    )
    for case in ("none", "idle", "rare"):
        r = result[case]
        r["p50_ratio"] = round(r["p50_ms"] / base["p50_ms"], 2)
        print(
            f"{case:>6} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} "
            f"{100 * r['serving_cpu']:>11.1f}% {r['p50_ratio']:>7.2f} "
            f"{100 * r['others_cpu']:>9.1f}% {r['loadavg'][0] if r['loadavg'] else '?':>6}"
        )
    print(
        f"{args.channels} channels × {args.slots} slots, a ring every {args.ring_every} s; "
        + footer(result)
    )


if __name__ == "__main__":
    sys.exit(main())
