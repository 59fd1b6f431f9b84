#!/usr/bin/env python3
"""The server's CPU per row read from disk, by request size, against the disk probe's own.

What a missed row costs the server in CPU decides how many cores a fast NVMe
needs: at 2 µs a row, two cores keep up with a million reads a second. This
benchmark has a real ``pleserver serve --io direct`` with a row cache far
smaller than its table (``--rows`` BF16 rows of 320 bytes, ``--cache-size``
32M) answer one client's lookups of uniformly random ids, so that almost every
row is a miss read from disk, in requests of ``--sizes`` ids (16: a decode
step of one token; 512: of 32 tokens; 4 096; 65 536: a prefill chunk), one
request in flight, ``--seconds`` each. Per size: rows/s, misses, disk reads,
and the server's CPU over it, from ``/proc/<pid>/task``: the whole process,
and the gather workers' part (``ple-gather-N``: the probe of the cache, the
reads, the checks and copies, and their Python around each piece), each per
missed row.

The baseline, in the same run on the same files: the disk probe's own CPU
per 4 KiB ``O_DIRECT`` random read at queue depths 1 and 128
(``pleserver._native.probe_random_reads``: io_uring with nothing around it),
and its rate, the bound of the server's miss rate.

    python -m bench.evals.miss_cpu --rows 4000000 --seconds 8
"""

from __future__ import annotations

import os
import time

import numpy as np

from bench.evals.cold import ceiling
from bench.harness.provenance import OthersMeter, envelope, footer, thread_cpu_s
from bench.harness.scaffold import add_json, parser, save_json, work_dir
from bench.harness.servers import close_client
from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

SIZES = (16, 512, 4096, 65536)
COLS = 160  # BF16: 320-byte rows, as Qwen3.8-Flash-Next's


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server's threads: the gather workers'
    (``ple-gather-*``) and the ``total``."""
    threads = thread_cpu_s(pid)
    return {
        "gather": sum(cpu for name, cpu in threads.items() if name.startswith("ple-gather-")),
        "total": sum(threads.values()),
    }


def timed(client: PleClient, pid: int, rows: int, size: int, seconds: float) -> dict:
    """Lookups of ``size`` random ids for ``seconds``: rows/s, and the
    server's misses, reads and CPU over them."""
    rng = np.random.default_rng(size)
    before, cpu0 = client.stats()["tables"][0]["io"], thread_cpu(pid)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        client.lookup(0, rng.integers(0, rows, size))
        done += size
    elapsed = time.perf_counter() - start
    after, cpu1 = client.stats()["tables"][0]["io"], thread_cpu(pid)
    misses = after["misses"] - before["misses"]
    reads = after["reads"] - before["reads"]
    per_miss = {k: 1e6 * (cpu1[k] - cpu0[k]) / misses if misses else None for k in cpu0}
    return {
        "size": size,
        "rows_per_s": round(done / elapsed),
        "misses_per_s": round(misses / elapsed),
        "hit_ratio": round(1 - misses / max(1, done), 4),
        "reads_per_miss": round(reads / max(1, misses), 3),
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0},
        "cpu_us_per_miss": {k: None if v is None else round(v, 2) for k, v in per_miss.items()},
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000, help="rows of the table (default 4 M)")
    ap.add_argument("--seconds", type=float, default=8.0, help="per size (default 8)")
    ap.add_argument(
        "--sizes", default=",".join(map(str, SIZES)), help="ids a request, comma-separated"
    )
    ap.add_argument("--cache-size", default="32M", help="the server's row cache (default 32M)")
    ap.add_argument("--probe-seconds", type=float, default=4.0)
    add_json(ap)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = envelope("evals.miss_cpu")
    result.update({"rows": args.rows, "cache_size": args.cache_size, "cases": []})
    with work_dir("miss-cpu-", args.dir) as root:
        model = f"{root}/model"
        write_checkpoint(model, [SyntheticTable(layer=0, rows=args.rows, cols=COLS)], files=1)
        files = [os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors")]
        print(f"disk ceiling on a {args.rows:,}-row table:")
        result["ceiling"] = ceiling(files, args.probe_seconds, "auto", (1, 128))
        launched = ServerLauncher(
            model,
            "--io",
            "direct",
            "--cache-size",
            args.cache_size,
            "--prewarm",
            "none",
            "--max-capacity",
            str(max(sizes)),
            log_level="WARNING",
        ).start()
        client = None
        try:
            client = PleClient.connect(launched.socket, capacity=max(sizes), depth=1)
            meter = OthersMeter([launched.proc.pid, os.getpid()])
            meter.start()
            for size in sizes:
                r = timed(client, launched.proc.pid, args.rows, size, args.seconds)
                result["cases"].append(r)
                per = r["cpu_us_per_miss"]
                print(
                    f"{size:>6} ids: {r['rows_per_s']:>9,} rows/s, {r['misses_per_s']:>8,} "
                    f"misses/s (hits {r['hit_ratio']:.1%}), {r['reads_per_miss']:.2f} reads a "
                    f"miss; server CPU a miss {per['total']} µs, gather workers {per['gather']} µs"
                )
            result["others_cpu"] = meter.stop()
        finally:
            close_client(client)
            launched.close()
    for qd, c in (result["ceiling"] or {}).items():
        if isinstance(c, dict) and c.get("cpu_us_per_read") is not None:
            print(f"the probe at QD {qd}: {c['cpu_us_per_read']:.2f} µs of CPU a read")
    print(f"others' CPU {result['others_cpu']:.1%}; {footer(result)}")
    save_json(result, args.json)


if __name__ == "__main__":
    main()
