#!/usr/bin/env python3
"""Fairness benchmark: a small client's latency beside maximal submitters.

Writes one synthetic BF16 table (default 2 M rows × 160 cols = 320-byte rows,
≈ 0.6 GiB) into a temporary directory, starts ``pleserver serve --prewarm
full``, and measures a *bystander* — one client of capacity 16, depth 1, doing
``lookup`` of 16 random ids, one every ``--gap-ms`` — with 0, 1 and 4 *maximal
submitters* beside it (``--submitters``). A maximal submitter is a process
with a channel of depth 64 × capacity 16 383 that keeps every slot submitted
with 16 383 random ids, taking each answer and resubmitting at once.

The bystander reads a table of its own (layer 1, 100 000 rows), so the
server's statistics for that table are the bystander's alone: its queue time
(client's submit → the loop admits it: the wait behind other clients' chunks)
and server time (admitted → answered), read off the server's histograms
(bucket upper bounds, ≈ 19 % resolution). For each case it reports those and
the bystander's p50 / p99 / p99.9 / max latency (the whole ``lookup`` call,
timed in the bystander, which adds its own wake-ups), the submitters' rows per
second, and the CPU share that processes other than the benchmark, its server
and its submitters used meanwhile (``others_cpu``): other load on the machine
lands in the bystander's tail, so a run with high ``others_cpu`` should be
repeated. Everything is removed at the end.

    python -m bench.floods.fairness                          # 0, 1 and 4 submitters, 15 s each
    python -m bench.floods.fairness --submitters 4 --seconds 30 --json out.json

Large cold requests (``--attack large-cold``): the server reads from disk
(``--io direct`` with a row cache of ``--cache-size``, 128 MiB by default,
which holds the bystander's table: its lookups are cache hits, warmed first),
and each submitter keeps ``--depth`` (12) slots of ``--request-rows`` (262 144,
the default ``max_capacity``) random ids of the 2 M-row table submitted: cold
reads, handed to the gather workers. ``--request-rows 16383`` and ``16384``
sit either side of ``parallel_min_rows``. With ``--cold-bystander`` the
bystander's table (1 M rows) is not warmed and does not fit the cache, and
the bystander never looks a row up twice in the whole run (``FirstTouches``):
its lookups are misses, handed to the gather workers beside the submitters'
(``misses``: the bystander's misses per lookup, from its table's counters).

    python -m bench.floods.fairness --attack large-cold --submitters 0,1,3

The control (``--disk-load QD,…``): after the submitters' cases, the
bystander beside a process that reads the checkpoint's file itself, 4 KiB
``O_DIRECT`` random reads at each queue depth given (``DISK_LOAD``: the disk
probe of ``pleserver doctor``), sending the server nothing. With
``--cold-bystander`` the bystander's reads then queue at the disk behind that
many reads of another process: the floor under what a submitter's cold reads
through the server (at most ``queue_depth``, 128, in flight) can cost it.

    python -m bench.floods.fairness --attack large-cold --cold-bystander --submitters 0,1 \
        --disk-load 32,128
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

from bench.harness.load import DISK_LOAD, FirstTouches, Helpers, bystander, latency_ms
from bench.harness.provenance import OthersMeter, footer, loadavg, machine, source
from bench.harness.scaffold import add_json, add_load, add_server_args, parser, save_json, work_dir
from bench.harness.servers import Server, hist_quantiles, write_model
from pleclient import PleClient
from pleserver.devkit.synthetic import SyntheticTable

SUBMITTER = """
import json, os, sys, time
import numpy as np
from pleclient import PleClient
path, seconds = sys.argv[1], float(sys.argv[2])
size, depth = int(sys.argv[3]), int(sys.argv[4])
client = PleClient.connect(path, name="submitter", capacity=size, depth=depth)
rows = client.tables[0].rows
rng = np.random.default_rng(os.getpid())
ids = [rng.integers(0, rows, size) for _ in range(8)]
tickets = [client.submit(0, ids[i % 8]) for i in range(depth)]
print("ready", flush=True)
stop, done, i = time.monotonic() + seconds, 0, 0
while time.monotonic() < stop:
    ticket = tickets.pop(0)
    ticket.wait()
    ticket.release()
    done += 1
    i += 1
    tickets.append(client.submit(0, ids[i % 8]))
for ticket in tickets:  # not waited for: a queue of large cold lookups takes minutes
    ticket.release()
client.close()
print(json.dumps({"requests": done, "rows": done * size}), flush=True)
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument(
        "--submitters",
        default="0,1,4",
        help="comma-separated numbers of maximal submitters (default 0,1,4)",
    )
    add_load(ap, seconds=15)
    add_server_args(ap)
    ap.add_argument(
        "--attack",
        choices=("mapped", "large-cold"),
        default="mapped",
        help="mapped: prewarmed tables, submitters of 16 383 rows at depth 64 (the default); "
        "large-cold: io direct, submitters of --request-rows cold rows at --depth",
    )
    ap.add_argument("--request-rows", type=int, help="a submitter's request (large-cold: 262144)")
    ap.add_argument("--depth", type=int, help="a submitter's slots (large-cold: 12)")
    ap.add_argument("--cache-size", default="128M", help="large-cold: the row cache (default 128M)")
    ap.add_argument(
        "--cold-bystander",
        action="store_true",
        help="large-cold: the bystander's table (1 M rows) is not warmed and does not fit the "
        "cache: its lookups are misses, handed to the gather workers beside the submitters'",
    )
    ap.add_argument(
        "--disk-load",
        default="",
        help="comma-separated queue depths: a case beside another process's random reads of "
        "the checkpoint at each depth, no submitter (the control of --cold-bystander)",
    )
    add_json(ap)
    return ap.parse_args(argv)


def run_case(server: Server, n: int, args, ids) -> dict:
    argv = [server.socket, str(args.seconds + 2), str(args.request_rows), str(args.depth)]
    with Helpers("submitter", SUBMITTER, [argv] * n) as submitters:
        case = measure(server, submitters, args, ids)
        reports = submitters.reports()
    submitted_rows = sum(r["rows"] for r in reports)
    return {
        "case": f"{n} submitter{'s' if n != 1 else ''}",
        "submitters": n,
        **case,
        "submitter_rows_per_s": round(submitted_rows / (args.seconds + 2)),
    }


def disk_load_case(server: Server, model: str, queue_depth: int, args, ids) -> dict:
    """The bystander beside another process's random reads of the checkpoint's
    files at ``queue_depth`` (``DISK_LOAD``), no submitter."""
    paths = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    argv = [json.dumps([paths, queue_depth, args.seconds + 2, "io_uring"])]
    with Helpers("disk load", DISK_LOAD, [argv]) as load:
        case = measure(server, load, args, ids)
        report = load.reports(timeout=args.seconds + 60)[0]
    return {
        "case": f"disk QD {queue_depth}",
        "submitters": 0,
        "disk_load_queue_depth": queue_depth,
        **case,
        "disk_load_reads_per_s": round(report["reads_per_s"]),
    }


def measure(server: Server, load: Helpers, args, ids) -> dict:
    """The bystander's lookups (of ``ids``: a generator, or ``FirstTouches``)
    beside ``load`` (ready, then a second to settle), with the server's queue
    and server time of its table over them."""
    load.wait_ready(server.log_tail)
    time.sleep(1.0)  # every helper in its steady state
    meter = OthersMeter([server.proc.pid, *load.pids])
    with PleClient.connect(server.socket, name="bystander", capacity=16, depth=1) as client:
        before = PleClient.query_stats(server.socket)["tables"][1]
        meter.start()
        ms = bystander(client, 1, args.seconds, args.gap_ms, ids)
        others = meter.stop()
        after = PleClient.query_stats(server.socket)["tables"][1]
    lookups = after["requests"] - before["requests"]
    misses = (after.get("io") or {}).get("misses", 0) - (before.get("io") or {}).get("misses", 0)
    return {
        **latency_ms(ms),
        "misses_per_lookup": round(misses / lookups, 2) if lookups else None,
        "server_queue": hist_quantiles(before["queue_time"], after["queue_time"]),
        "server_time": hist_quantiles(before["server_time"], after["server_time"]),
        "others_cpu": others,
        "loadavg": loadavg(),
    }


def numbers(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def _pair(q: dict) -> str:
    return "/".join("-" if q[k] is None else f"{q[k]:.0f}" for k in ("p50_us", "p99_us"))


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-fairness-", args.dir) as workdir:
        bystanders = 1_000_000 if args.cold_bystander else 100_000
        model = write_model(
            workdir,
            [
                SyntheticTable(layer=0, rows=args.rows, cols=args.cols, dtype="BF16", parts=16),
                SyntheticTable(layer=1, rows=bystanders, cols=args.cols, dtype="BF16", parts=2),
            ],
        )
        large = args.attack == "large-cold"
        # A cold bystander never looks a row up twice, in any case: its every
        # lookup misses, whatever the earlier cases left in the cache.
        ids = FirstTouches(bystanders, 7) if args.cold_bystander else np.random.default_rng(7)
        args.request_rows = args.request_rows or (262_144 if large else 16_383)
        args.depth = args.depth or (12 if large else 64)
        extra = ["--io", "direct", "--cache-size", args.cache_size] if large else []
        with Server(
            "fairness", model, 0, max(args.request_rows, 16), [*extra, *args.server_arg]
        ) as server:
            server.wait_ready()
            if large and not args.cold_bystander:  # its table in the row cache: hits
                with PleClient.connect(server.socket, name="warm", capacity=16384) as client:
                    client.lookup(1, np.arange(100_000))
            result = {"machine": machine(), "source": source(), "args": vars(args), "cases": []}
            print(
                f"{'case':>13} {'lookups':>8} {'p50 ms':>8} {'p99 ms':>8} "
                f"{'p99.9 ms':>9} {'max ms':>8} {'queue p50/p99 µs':>17} "
                f"{'server p50/p99 µs':>18} {'misses':>6} {'rows|reads/s':>12} {'others cpu':>10}"
            )
            plan = [("submitters", n) for n in numbers(args.submitters)]
            plan += [("disk load", depth) for depth in numbers(args.disk_load)]
            for kind, n in plan:
                if kind == "submitters":
                    case = run_case(server, n, args, ids)
                else:
                    case = disk_load_case(server, model, n, args, ids)
                result["cases"].append(case)
                load = case.get("submitter_rows_per_s", case.get("disk_load_reads_per_s"))
                print(
                    f"{case['case']:>13} {case['bystander_lookups']:>8} "
                    f"{case['p50_ms']:>8.3f} {case['p99_ms']:>8.3f} {case['p999_ms']:>9.3f} "
                    f"{case['max_ms']:>8.3f} {_pair(case['server_queue']):>17} "
                    f"{_pair(case['server_time']):>18} {case['misses_per_lookup']!s:>6} "
                    f"{load or 0:>12,} "
                    f"{100 * case['others_cpu']:>9.1f}%",
                    flush=True,
                )
            print(footer(result))
            save_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
