#!/usr/bin/env python3
"""Hints never slow a lookup: a bystander's cold lookups with and without a
client flooding the server with prefetch hints, in one run.

Writes one synthetic FP8 table (default 4 M rows × 160 cols = 160-byte rows,
≈ 0.6 GiB) into a temporary directory and serves it with ``--io direct`` and
a row cache of ``--cache-size`` (default 64M: the table is ≈ 10 × the cache,
so random rows miss and go to disk). A *bystander* — capacity 16, depth 1 —
looks up 16 random ids, one lookup every ``--gap-ms``, for ``--seconds``, in
four cases:

  alone    nobody else;
  flood    beside a *flooder*, a process that hints 8 × 16 384 random ids of
           the same table as fast as ``PleClient.hint`` takes them (every
           free slot, again and again): the disk is as busy as hints can make it;
  burn     beside as many processes as the flood has, each keeping a core
           busy and sending the server nothing (at the flooder's nice): the
           control. On a machine of few cores a flood's processes take CPU the
           server and the bystander would use; what the bystander loses here
           is what sharing the cores costs it alone, the floor under the
           flood's figures, and ``flood / burn`` what the server's handling
           of the flood adds to that;
  alone    again, after the flood (what the flood left behind in the cache
           and the disk, and the machine's drift).

``--flood tiny`` floods with many tiny hints instead: ``--sessions`` sessions
(default 30) of 64 slots each, every slot hinting 1 id, each slot hinted
again as soon as it is answered; and the bystander's 16 ids come from the
table's first ``--hot-rows`` rows (default 4 096), cached before the first
case: its lookups are cache hits, whose time is the serving loop's own, which
a flood of tiny hints competes for in the admission pass.

``--flood cached`` is the large flood's client hinting only those
``--hot-rows`` cached rows (8 × 16 384 ids at a time, as fast as it can),
beside the same bystander: hints that read nothing, whose cost is the hint
reader's own beside the serving loop.

``--flood lookups`` is the tiny flood's shape with lookups instead of hints:
``--sessions`` sessions of 64 slots, each slot a 1-id lookup submitted again
as soon as it is answered, beside the same cached bystander (lookups are not
best effort: what bounds this flood is the admission pass's share and the
channels' turns, not ``hint_rate``).

``--flood rings`` rings GPU-driven channels instead (``GpuLookups`` over the
CPU stand-in of a CUDA stream): ``--sessions`` channels (8 is what one uid
may hold at the default ``max_gpu_slots_per_uid``) of 64 hint slots, every
doorbell rung again and again with 1 id, beside the cached bystander.

For each case it reports the bystander's p50 / p99 / p99.9 / max (the whole
``lookup`` call), the server's misses per lookup, and, for the flood, the
hints received, read, cached and dropped by reason, the cores the flood's
or the burners' processes kept busy (``load cores``); then the ratio of the
flood's p50 and p99 to the first ``alone`` case's. Hints are read only while
no lookup is with a gather worker, so the ratio's distance from 1 is what a
flood costs a lookup (one batch of hint reads ahead of its own in the miss
engine, and the hint reader's Python beside the serving loop's). The CPU
share that processes other than the benchmark, its server and its flooder
used meanwhile is ``others_cpu``: repeat a run where it is high.

    python -m bench.floods.hint_flood                      # 15 s a case
    python -m bench.floods.hint_flood --seconds 30 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from bench.harness.load import CPU_BURNER, Helpers, bystander, cores_used, latency_ms
from bench.harness.provenance import OthersMeter, footer, loadavg, machine, proc_ticks, source
from bench.harness.scaffold import add_json, add_load, add_server_args, parser, save_json, work_dir
from bench.harness.servers import write_model
from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable

FLOODER = """
import json, os, sys
import numpy as np
from pleclient import PleClient
path, stop, hot = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = PleClient.connect(path, name="flooder", capacity=16384, depth=8)
rows = hot or client.tables[0].rows  # hot: the cached rows only
rng = np.random.default_rng(os.getpid())
print("ready", flush=True)
while not os.path.exists(stop):
    client.hint(0, rng.integers(0, rows, 8 * 16384))
client.close()
print(json.dumps({"sent": client.hints_sent, "skipped": client.hints_skipped}), flush=True)
"""

SESSIONS = """
import json, os, sys
import numpy as np
from pleclient import PleClient
path, stop, sessions, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
clients = [
    PleClient.connect(path, name=f"{kind}-flooder-{i}", capacity=1, depth=64)
    for i in range(sessions)
]
rows = clients[0].tables[0].rows
ids = np.random.default_rng(os.getpid()).integers(0, rows, 4096)
"""
"""The start of a flood of one-id requests: ``sessions`` sessions of 64
one-id slots, and 4 096 random ids of the table to send in turn."""

TINY_FLOODER = (
    SESSIONS
    + """
print("ready", flush=True)
k = 0
while not os.path.exists(stop):
    for client in clients:  # every free slot of every session, 1 id each (skipped when none)
        for _ in range(64):
            client.hint(0, ids[k % 4096 : k % 4096 + 1])
            k += 1
sent = sum(c.hints_sent for c in clients)
skipped = sum(c.hints_skipped for c in clients)
for client in clients:
    client.close()
print(json.dumps({"sent": sent, "skipped": skipped}), flush=True)
"""
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument("--cache-size", default="64M")
    add_load(ap, seconds=15)
    add_server_args(ap)
    ap.add_argument(
        "--flood",
        choices=("large", "tiny", "cached", "rings", "lookups"),
        default="large",
        help="large: one client hinting 8 × 16 384 cold ids at a time (default); cached: "
        "the same, of the bystander's cached rows; tiny: "
        "--sessions sessions × 64 slots of 1-id hints, against cached bystander rows",
    )
    ap.add_argument(
        "--sessions", type=int, default=30, help="tiny flood: sessions (30); rings: channels"
    )
    ap.add_argument(
        "--flooder-nice",
        type=int,
        default=0,
        help="the flooder's nice value (default 0: the server's; 10 tells what the server "
        "itself costs the bystander from what sharing 2 cores with the flooder does)",
    )
    ap.add_argument(
        "--hot-rows", type=int, default=4096, help="tiny and cached floods: bystander rows"
    )
    add_json(ap)
    return ap.parse_args(argv)


def measure_bystander(
    socket: str, seconds: float, gap_ms: float, pids: list[int], seed: int, hot_rows: int = 0
) -> dict:
    """The shared bystander (bench/harness/load.py) on the table's first layer (its
    first ``hot_rows`` rows only, when given), with the server's misses and
    hint counters over its run."""
    rng = np.random.default_rng(seed)
    meter = OthersMeter(pids)
    with PleClient.connect(socket, name="bystander", capacity=16, depth=1) as client:
        table = client.tables[0]
        if hot_rows:
            table = dataclasses.replace(table, rows=min(hot_rows, table.rows))
        before = client.stats()["tables"][0]
        meter.start()
        ms = bystander(client, table, seconds, gap_ms, rng)
        others = meter.stop()
        after = client.stats()["tables"][0]
    lookups = after["requests"] - before["requests"]  # the flooder makes none
    return {
        **latency_ms(ms),
        "misses_per_lookup": round((after["io"]["misses"] - before["io"]["misses"]) / lookups, 2)
        if lookups
        else None,
        "hints": {
            key: (
                {r: after[key][r] - before[key][r] for r in after[key]}
                if isinstance(after[key], dict)
                else after[key] - before[key]
            )
            for key in (
                "hints_received",
                "hints_read",
                "hints_cached",
                "hints_dropped",
                "hints_dropped_by",
            )
        },
        "others_cpu": others,
        "loadavg": loadavg(),
    }


LOOKUP_FLOODER = (
    SESSIONS
    + """
tickets = [[c.submit(0, ids[k : k + 1]) for k in range(64)] for c in clients]
print("ready", flush=True)
k = sent = 0
while not os.path.exists(stop):
    for client, mine in zip(clients, tickets):  # each slot again as soon as it is answered
        for j in range(64):
            mine[j].wait()
            mine[j].release()
            mine[j] = client.submit(0, ids[k % 4096 : k % 4096 + 1])
            k += 1
            sent += 1
for mine in tickets:
    for ticket in mine:
        ticket.release()
for client in clients:
    client.close()
print(json.dumps({"sent": sent, "skipped": 0}), flush=True)
"""
)

RINGS_FLOODER = """
import json, os, sys
import numpy as np
from pleclient.gpu import GpuLookups
path, stop, channels = sys.argv[1], sys.argv[2], int(sys.argv[3])
rings = [
    GpuLookups.open(path, device="cpu", name=f"ring-flooder-{i}", capacity=1, depth=64)
    for i in range(channels)
]
rows = rings[0].tables[0].rows
ids = np.random.default_rng(os.getpid()).integers(0, rows, 4096)
print("ready", flush=True)
k = 0
while not os.path.exists(stop):
    for lookups in rings:  # every slot's doorbell, 1 id each, again and again
        for slot in range(64):
            lookups.hint(slot, 0, ids[k % 4096 : k % 4096 + 1])
            k += 1
sent = sum(lookups.client.hints_sent for lookups in rings)
for lookups in rings:
    lookups.close()
print(json.dumps({"sent": sent, "skipped": 0}), flush=True)
"""


def hot_rows(args: argparse.Namespace) -> int:
    """The bystander's cached rows (0: random rows of the whole table)."""
    return args.hot_rows if args.flood in ("tiny", "cached", "rings", "lookups") else 0


def warm_hot_rows(socket: str, rows: int) -> None:
    """The bystander's rows, read into the cache before the first case."""
    with PleClient.connect(socket, name="warm", capacity=4096, depth=2) as client:
        client.lookup(0, np.arange(rows))


def flood_case(server, args, workdir: str) -> dict:
    hot = hot_rows(args)
    stop = os.path.join(workdir, "stop")
    flooder = {
        "tiny": [TINY_FLOODER, server.socket, stop, str(args.sessions), "tiny"],
        "lookups": [LOOKUP_FLOODER, server.socket, stop, str(args.sessions), "lookup"],
        "rings": [RINGS_FLOODER, server.socket, stop, str(args.sessions)],
    }.get(args.flood, [FLOODER, server.socket, stop, str(hot)])
    case, reports = loaded_case(server, args, "flooder", flooder[0], [flooder[1:]], stop, 2)
    case["flooder"] = reports[0]
    return case


def burn_case(server, args, workdir: str, processes: int) -> dict:
    """The bystander beside ``processes`` processes that keep a core busy each
    and send the server nothing (``CPU_BURNER``), at the flooder's nice: what
    the flood's processes cost the bystander by sharing the cores alone."""
    stop = os.path.join(workdir, "stop-burn")
    case, _ = loaded_case(server, args, "burner", CPU_BURNER, [[stop]] * processes, stop, 4)
    return case


def loaded_case(
    server, args, what: str, script: str, argvs: list, stop: str, seed: int
) -> tuple[dict, list[dict]]:
    """The bystander beside helper processes running ``script`` (one per
    argument list, at the flooder's nice, ended by the file ``stop``), with
    the cores they kept busy meanwhile (``load_cores``) and their processes;
    and their reports."""
    with Helpers(what, script, argvs, nice=args.flooder_nice) as helpers:
        helpers.wait_ready(server.log_tail)
        time.sleep(1.0)  # the load in its steady state
        ticks, t0 = [proc_ticks(p) for p in helpers.pids], time.monotonic()
        case = measure_bystander(
            server.socket,
            args.seconds,
            args.gap_ms,
            [server.pid, *helpers.pids],
            seed,
            hot_rows(args),
        )
        case["load_cores"] = cores_used(helpers.pids, ticks, time.monotonic() - t0)
        case["processes"] = len(helpers.pids)
        open(stop, "w").close()
        return case, helpers.reports()


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-hint-flood-", args.dir) as workdir:
        model = write_model(
            workdir,
            [SyntheticTable(layer=0, rows=args.rows, cols=args.cols, dtype="F8_E4M3", parts=16)],
        )
        launcher = ServerLauncher(
            model,
            "--io",
            "direct",
            "--cache-size",
            args.cache_size,
            "--state-dir",
            workdir,
            *args.server_arg,
            die_with_parent=True,
        )
        with launcher.start() as server:
            result: dict = {"machine": machine(), "source": source(), "args": vars(args)}
            pids = [server.pid]
            hot = hot_rows(args)
            if hot:
                warm_hot_rows(server.socket, hot)
            result["alone"] = measure_bystander(
                server.socket, args.seconds, args.gap_ms, pids, 1, hot
            )
            result["flood"] = flood_case(server, args, workdir)
            # as many burners as the flood had processes
            result["burn"] = burn_case(server, args, workdir, result["flood"]["processes"])
            result["alone_after"] = measure_bystander(
                server.socket, args.seconds, args.gap_ms, pids, 3, hot
            )
        report(result)
        save_json(result, args.json)
    return 0


def report(result: dict) -> None:
    base, flood, burn = result["alone"], result["flood"], result["burn"]
    result["flood_over_alone"] = {
        "p50": round(flood["p50_ms"] / base["p50_ms"], 3),
        "p99": round(flood["p99_ms"] / base["p99_ms"], 3),
    }
    result["flood_over_burn"] = {
        "p50": round(flood["p50_ms"] / burn["p50_ms"], 3),
        "p99": round(flood["p99_ms"] / burn["p99_ms"], 3),
    }
    print(
        f"{'case':>12} {'lookups':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} "
        f"{'max ms':>8} {'misses/lookup':>14} {'load cores':>10} {'others cpu':>10}"
    )
    for name in ("alone", "flood", "burn", "alone_after"):
        c = result[name]
        load = f"{c['load_cores']:.2f}" if "load_cores" in c else "-"
        print(
            f"{name:>12} {c['bystander_lookups']:>8} {c['p50_ms']:>8.3f} {c['p99_ms']:>8.3f} "
            f"{c['p999_ms']:>9.3f} {c['max_ms']:>8.3f} {c['misses_per_lookup']!s:>14} "
            f"{load:>10} {100 * c['others_cpu']:>9.1f}%"
        )
    h = flood["hints"]
    print(
        f"flood: hinted rows received {h['hints_received']:,}, read {h['hints_read']:,}, "
        f"cached {h['hints_cached']:,}, dropped {h['hints_dropped']:,} "
        f"({', '.join(f'{r} {n:,}' for r, n in h['hints_dropped_by'].items() if n) or '-'})"
    )
    ratio = result["flood_over_alone"]
    print(f"flood / alone: p50 {ratio['p50']:.3f}, p99 {ratio['p99']:.3f}")
    ratio = result["flood_over_burn"]
    print(
        f"flood / burn (the flood against its processes' CPU alone): "
        f"p50 {ratio['p50']:.3f}, p99 {ratio['p99']:.3f}"
    )
    print(footer(result))


if __name__ == "__main__":
    sys.exit(main())
