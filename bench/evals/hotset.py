#!/usr/bin/env python3
"""Time to the warm hit rate after a restart, with and without the saved hot set.

Writes one synthetic BF16 table (default 4 M rows × 160 cols, 1.2 GiB) into a
temporary directory (``--dir``, else ``$TMPDIR``) and serves it with
``--io direct`` and a row cache much smaller than the table (``--cache-size``).
The workload is decode steps of 32 sequences × 16 ids drawn from a Zipf
distribution over a fixed random permutation of the rows (hot rows scattered
over the files, as hashed n-grams are).

1. warm-up: a server runs ``--warm-steps`` steps; its hit rate over the last
   window is the *warm hit rate*; it stops with SIGTERM and saves the hot set;
2. for each variant, ``with`` (the saved file) and ``without`` (no file): the
   checkpoint's pages are dropped from the page cache (``POSIX_FADV_DONTNEED``),
   a server starts, and the same step sequence runs; reported: the time from
   readiness until a window of ``--window`` steps reaches ``--target`` × the
   warm hit rate, the hit rate of the first window, and the refill's time.

Everything is removed at the end, also on error or Ctrl-C.

    python -m bench.evals.hotset                    # a minute or two
    python -m bench.evals.hotset --rows 20000000 --cache-size 1G --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from bench.harness.scaffold import parser
from pleclient import PleClient
from pleserver.config import parse_size
from pleserver.devkit.launcher import LaunchedServer, ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

STEP_IDS = 32 * 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--cache-size", default="64M")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids")
    ap.add_argument("--warm-steps", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=1500, help="steps per restarted variant")
    ap.add_argument("--window", type=int, default=50, help="steps per hit-rate window")
    ap.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="fraction of the warm hit rate that counts as warm",
    )
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    return ap.parse_args(argv)


def start_server(model: str, state: str, socket_path: str, cache_size: str) -> LaunchedServer:
    """A ``--io direct`` server with a small row cache, ready; it saves its hot
    set only at stop."""
    return ServerLauncher(
        model,
        "--io",
        "direct",
        "--cache-size",
        cache_size,
        "--state-dir",
        state,
        "--hotset-save-interval",
        "0",
        socket_path=socket_path,
        log_level="WARNING",
        die_with_parent=True,
    ).start()


def steps(rows: int, count: int, exponent: float, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(rows)
    out = []
    for _ in range(count):
        rank = rng.zipf(exponent, STEP_IDS) - 1
        out.append(permutation[rank % rows].astype(np.int64))
    return out


def drive(server: LaunchedServer, work: list[np.ndarray], window: int) -> list[tuple[float, float]]:
    """(seconds since readiness, hit rate of the window) per window of steps."""
    curve = []
    with PleClient.connect(server.socket) as client:
        last = client.stats()["tables"][0]["io"]
        for i, ids in enumerate(work, 1):
            client.lookup(1, ids)
            if i % window == 0:
                io = client.stats()["tables"][0]["io"]
                hits, misses = io["hits"] - last["hits"], io["misses"] - last["misses"]
                curve.append(
                    (
                        time.monotonic() - server.ready_at,
                        hits / (hits + misses) if hits + misses else 0.0,
                    )
                )
                last = io
    return curve


def drop_page_cache(model: str) -> None:
    for name in os.listdir(model):
        fd = os.open(os.path.join(model, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    args = parse_args(argv)
    parse_size(args.cache_size)  # a bad size fails here, not in the server
    root = tempfile.mkdtemp(prefix="ple-hotset-", dir=args.dir)
    servers: list[LaunchedServer] = []
    try:
        model, state = os.path.join(root, "model"), os.path.join(root, "state")
        os.makedirs(state)
        write_checkpoint(
            model, (SyntheticTable(layer=1, rows=args.rows, dtype="BF16", parts=16),), files=4
        )
        sock = os.path.join(root, "ple.sock")
        work = steps(args.rows, args.warm_steps + args.steps, args.zipf)
        drop_page_cache(model)
        servers.append(start_server(model, state, sock, args.cache_size))
        warm_curve = drive(servers[-1], work[: args.warm_steps], args.window)
        servers[-1].stop()
        warm_rate = warm_curve[-1][1]
        saved = os.path.join(root, "hotset.saved")
        shutil.copy(os.path.join(state, "hotset.bin"), saved)
        results = {}
        for variant in ("with", "without"):
            target = os.path.join(state, "hotset.bin")
            if variant == "with":
                shutil.copy(saved, target)
            elif os.path.exists(target):
                os.unlink(target)
            drop_page_cache(model)
            servers.append(start_server(model, state, sock, args.cache_size))
            curve = drive(servers[-1], work[args.warm_steps :], args.window)
            with PleClient.connect(sock) as client:
                hotset = client.stats()["hotset"]
            servers[-1].stop()
            reached = next((t for t, rate in curve if rate >= args.target * warm_rate), None)
            results[variant] = {
                "seconds_to_warm": reached,
                "first_window_hit_rate": curve[0][1],
                "last_window_hit_rate": curve[-1][1],
                "refill_seconds": hotset["refill_seconds"],
                "refilled_rows": hotset["done_rows"],
                "curve": curve,
            }
        report = {
            "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "rows": args.rows,
            "cache_size": args.cache_size,
            "zipf": args.zipf,
            "window_steps": args.window,
            "warm_hit_rate": warm_rate,
            "target": args.target,
            "variants": results,
        }
        print(
            f"warm hit rate {100 * warm_rate:.1f} % (last {args.window} of "
            f"{args.warm_steps} steps); warm = {100 * args.target:.0f} % of it"
        )
        for variant, r in results.items():
            reached = (
                "not reached" if r["seconds_to_warm"] is None else f"{r['seconds_to_warm']:.2f} s"
            )
            refill = (
                ""
                if r["refill_seconds"] is None
                else f", refill {r['refilled_rows']} rows in {r['refill_seconds']:.2f} s"
            )
            print(
                f"{variant:>8} hot set: warm after {reached}; first window "
                f"{100 * r['first_window_hit_rate']:.1f} %{refill}"
            )
        if args.json:
            text = json.dumps(report, indent=1)
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
        return 0
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
