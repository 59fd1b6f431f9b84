#!/usr/bin/env python3
"""The first lookups after a server start: latency by request index, and faults.

Writes one synthetic BF16 table (default 4 M rows × 320 B, 128 shards in 8
files, ≈ 1.2 GiB) into a temporary directory (``--dir``, else ``$TMPDIR``),
then, for each case of ``--cases`` (``--rounds`` times, the cases interleaved),
starts a real ``pleserver serve`` on it, connects as soon as the server sent
``READY=1`` and times ``--requests`` lookups of ``--size`` uniformly random
ids, one at a time. Cases:

- ``none``: ``--prewarm none`` (the default): the first touch of each part of
  the mapped table faults it into the server's page tables;
- ``full``: ``--prewarm full``, served while the prewarm, which runs after
  readiness, reads and maps the table;
- ``full-done``: ``--prewarm full``, the first request only once the prewarm
  has ended (``pleserver stats`` shows its state).

Per case: the p50 of each block of ``--block`` requests up to request 400,
the p50 of requests [0, 10), [10, 50), [50, 200) and from 200 on, and the
minor faults of the server process and of this client over those ranges
(``/proc/PID/stat``, ``getrusage``). Load average and the CPU that other
processes used are printed with every case. Everything is removed at the end.

    python -m bench.micro.first_requests                  # ≈ 1 minute
    python -m bench.micro.first_requests --cases full --rounds 5 --json first.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.provenance import OthersMeter, loadavg, source
from bench.harness.scaffold import add_json, add_server_args, parser
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

CASES = ("none", "full", "full-done")
RANGES = ((0, 10), (10, 50), (50, 200), (200, None))


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument("--parts", type=int, default=128, help="shards")
    ap.add_argument("--files", type=int, default=8, help="checkpoint files (default 8)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=2, help="server starts per case (default 2)")
    ap.add_argument("--requests", type=int, default=1000, help="timed lookups per start")
    ap.add_argument("--size", type=int, default=16, help="ids per lookup (default 16)")
    ap.add_argument("--block", type=int, default=25, help="requests per p50 block (default 25)")
    add_server_args(ap)
    ap.add_argument("--id-seed", type=int, default=20240601)
    add_json(ap)
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases: {sorted(unknown)}")
    if args.requests < 200:
        ap.error("--requests must be at least 200")
    return args


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def one_start(args, model: str, case: str, ids: np.ndarray) -> dict:
    prewarm = "none" if case == "none" else "full"
    server = ServerLauncher(
        model,
        "--prewarm",
        prewarm,
        *args.server_arg,
        log_level="WARNING",
        cwd=REPO,
        die_with_parent=True,
    ).start()
    try:
        prewarm_state = server.wait_prewarm() if case == "full-done" else None
        meter = OthersMeter([server.pid])
        with server.client() as client:
            info = client.table(0)
            out = np.empty((args.size, info.row_bytes), dtype=np.uint8)
            lat = np.empty(args.requests, dtype=np.int64)
            ends = {hi or args.requests for _, hi in RANGES}  # and 0: every range's bounds
            faults = {0: (minor_faults(server.pid), resource.getrusage(resource.RUSAGE_SELF))}
            meter.start()
            for i in range(args.requests):
                t0 = time.perf_counter_ns()
                client.lookup(info, ids[i], out=out)
                lat[i] = time.perf_counter_ns() - t0
                if i + 1 in ends:
                    faults[i + 1] = (
                        minor_faults(server.pid),
                        resource.getrusage(resource.RUSAGE_SELF),
                    )
            others = meter.stop()
            stats = client.stats()
    finally:
        server.close()
    us = lat / 1e3
    result: dict = {
        "case": case,
        "others_cpu": others,
        "loadavg": loadavg(),
        "prewarm_at_end": (stats.get("prewarm") or {}).get("state", "none"),
        "prewarm_waited": prewarm_state,
        "blocks_p50_us": [
            round(float(np.median(us[i : i + args.block])), 1)
            for i in range(0, min(400, args.requests), args.block)
        ],
        "ranges": [],
    }
    for lo, hi in RANGES:
        hi = hi or args.requests
        result["ranges"].append(
            {
                "requests": [lo, hi],
                "p50_us": round(float(np.median(us[lo:hi])), 1),
                "server_faults_per_request": round((faults[hi][0] - faults[lo][0]) / (hi - lo), 2),
                "client_faults_per_request": round(
                    (faults[hi][1].ru_minflt - faults[lo][1].ru_minflt) / (hi - lo), 2
                ),
            }
        )
    return result


def report(r: dict) -> None:
    parts = []
    for rng in r["ranges"]:
        lo, hi = rng["requests"]
        parts.append(
            f"[{lo},{hi}) {rng['p50_us']:7.1f} µs "
            f"(faults/req server {rng['server_faults_per_request']}, "
            f"client {rng['client_faults_per_request']})"
        )
    print(
        f"{r['case']:10s} others {r['others_cpu'] * 100:3.0f}% load {r['loadavg'][:1]} "
        f"prewarm at end: {r['prewarm_at_end']}"
    )
    print("    p50 by range: " + "; ".join(parts))
    print("    p50 per block: " + " ".join(f"{v:.0f}" for v in r["blocks_p50_us"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="ple-first-", dir=args.dir)
    try:
        model = os.path.join(workdir, "model")
        table = SyntheticTable(
            layer=0, rows=args.rows, cols=args.cols, dtype="BF16", parts=args.parts
        )
        write_checkpoint(model, [table], files=args.files)
        rng = np.random.default_rng(args.id_seed)
        ids = rng.integers(0, args.rows, size=(args.requests, args.size), dtype=np.int64)
        print(
            f"table: {args.rows:,} rows × {args.cols * 2} B in {args.files} files; "
            f"{args.requests} lookups of {args.size} ids per start; source {source()}"
        )
        results = []
        for _ in range(args.rounds):
            for case in args.cases:
                r = one_start(args, model, case, ids)
                report(r)
                results.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1)
                f.write("\n")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
