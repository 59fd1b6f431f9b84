#!/usr/bin/env python3
"""Engram rows from disk: two reads a cold row (values, then scales) or one.

An Engram table is served as 264-byte rows composed of two tensors: 256 bytes
of FP8 values and, about 98 GB away in the real checkpoint, 8 bytes of UE8M0
scales (``pleclient.families.deepseek_v41``). A missed row read from both
costs two random 4 KiB reads; with the 6.1 GB of scales kept in the server's
memory (``resident_scales``, the default) it costs one. This benchmark
measures both, on this machine's disk, through a real ``pleserver serve --io
direct`` with a row cache too small to hit:

- ``engram``: an Engram table (``--rows`` rows × 256 columns, MXFP8), its
  values in one file and its scales in another, served with
  ``--no-resident-scales``: two reads a missed row;
- ``resident``: the same table with its scales in memory (``--resident-scales``);
- ``one-read``: an FP8 table of as many 264-byte rows, one tensor: one read a
  missed row, the bound the resident scales should reach;
- the disk's own 4 KiB ``O_DIRECT`` random-read rate at queue depths 1 and
  128 (``pleserver._native.probe_random_reads``), on the same files.

Each table gets a fresh server and is timed with random ids in decode-sized
lookups (``--decode-tokens`` 32 tokens × 24 heads) and prefill-sized ones
(2 048 tokens × 24 heads), for ``--seconds`` each; reported: rows/s, the
server's disk reads per missed row, and the ratios of engram and resident to
one-read.

    python -m bench.evals.engram_reads --rows 4000000 --seconds 10
"""

from __future__ import annotations

import time

import numpy as np

from bench.evals.cold import ceiling
from bench.harness.provenance import OthersMeter, envelope, footer
from bench.harness.scaffold import add_json, parser, save_json, work_dir
from bench.harness.servers import close_client
from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

HEADS = 24  # DeepSeek-V4.1's rows a token a layer
COLS = 256
PREFILL_TOKENS = 2048


def tables(rows: int) -> dict[str, SyntheticTable]:
    return {
        "engram": SyntheticTable(layer=1, rows=rows, cols=COLS, dtype="MXFP8", parts=1),
        "one-read": SyntheticTable(
            layer=1, rows=rows, cols=COLS + COLS // 32, dtype="F8_E4M3", parts=1
        ),
    }


CONTENDERS = {  # name: (its table, the server's flags)
    "engram": ("engram", ("--no-resident-scales",)),
    "resident": ("engram", ("--resident-scales",)),
    "one-read": ("one-read", ()),
}


def timed(client: PleClient, table: int, rows: int, ids_per_lookup: int, seconds: float) -> dict:
    """Random lookups of ``ids_per_lookup`` ids for ``seconds``: rows/s and
    the server's misses and disk reads over them."""
    rng = np.random.default_rng(ids_per_lookup)
    before = client.stats()["tables"][0]["io"]
    done, start = 0, time.perf_counter()
    lookups = []
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        client.lookup(table, rng.integers(0, rows, ids_per_lookup))
        lookups.append(time.perf_counter() - t0)
        done += ids_per_lookup
    elapsed = time.perf_counter() - start
    after = client.stats()["tables"][0]["io"]
    misses = after["misses"] - before["misses"]
    reads = after["reads"] - before["reads"]
    return {
        "rows_per_s": round(done / elapsed),
        "lookup_p50_ms": round(float(np.median(lookups)) * 1e3, 3),
        "misses": misses,
        "reads_per_miss": round(reads / max(1, misses), 3),
        "hit_ratio": round(1 - misses / max(1, done), 4),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000, help="rows a table (default 4 M)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per case (default 10)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens a decode lookup")
    ap.add_argument("--probe-seconds", type=float, default=5.0)
    add_json(ap)
    args = ap.parse_args()
    result = envelope("evals.engram_reads")
    result.update({"rows": args.rows, "cases": {}})
    cases = {"decode": args.decode_tokens * HEADS, "prefill": PREFILL_TOKENS * HEADS}
    with work_dir("engram-reads-", args.dir) as root:
        paths = {}
        for name, table in tables(args.rows).items():
            paths[name] = f"{root}/{name}"
            write_checkpoint(paths[name], [table], files=2, extra_tensor=False)
        print(f"disk ceiling on {args.rows:,}-row tables:")
        files = [f"{p}/model-0000{i}-of-00002.safetensors" for p in paths.values() for i in (1, 2)]
        result["ceiling"] = ceiling(files, args.probe_seconds, "auto", (1, 128))
        others = []
        for name, (table, flags) in CONTENDERS.items():
            launched = ServerLauncher(
                paths[table],
                "--io",
                "direct",
                "--cache-size",
                "1M",
                "--max-capacity",
                "65536",
                *flags,
                log_level="WARNING",
            ).start()
            client = None
            try:
                client = PleClient.connect(launched.socket, capacity=65536, depth=1)
                meter = OthersMeter([launched.proc.pid])
                meter.start()
                for case, ids in cases.items():
                    r = timed(client, 1, args.rows, ids, args.seconds)
                    result["cases"][f"{name}/{case}"] = r
                    print(
                        f"{name:>8} {case:>7}: {r['rows_per_s']:>10,} rows/s, lookup p50 "
                        f"{r['lookup_p50_ms']:.2f} ms, {r['reads_per_miss']:.2f} reads a miss, "
                        f"hits {r['hit_ratio']:.1%}"
                    )
                others.append(meter.stop())
            finally:
                close_client(client)
                launched.close()
        result["others_cpu"] = max(others)
    for case in cases:
        one = result["cases"][f"one-read/{case}"]["rows_per_s"]
        for name in ("engram", "resident"):
            ratio = round(result["cases"][f"{name}/{case}"]["rows_per_s"] / one, 3)
            result[f"ratio_{name}_{case}"] = ratio
            print(f"{case}: {name} / one-read = {ratio:.3f}")
    print(f"others' CPU {result['others_cpu']:.1%}; {footer(result)}")
    save_json(result, args.json)


if __name__ == "__main__":
    main()
