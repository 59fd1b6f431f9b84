"""``pleserver demo``: the whole path on a generated checkpoint, in a few seconds.

Generates a small checkpoint (an FP8 table with its scale, a BF16 table and an
NVFP4 table with its block scales and global scale, partial last shards) in
the cache directory, starts a real ple-server process, drives it from several
client processes that check every row against the files, prints the server's
statistics and stops it with SIGTERM. The server is started by
``pleserver.devkit.launcher``: ready when it says so, always reaped.

By default it runs the headline path: ``io = direct`` with a row cache of a
fifth of the tables, so the lookups show hits, misses and the disk reads the
misses cost. The clients ask for rows the way n-gram traffic does, a few hot
rows often and a long tail rarely (Zipf ranks, scattered over the table).
``--io mmap`` maps the tables instead (prewarmed).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import numpy as np

from pleclient import PleClient, PleError
from pleclient.checkpoint import CheckpointError, discover_tables
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import DEMO_TABLES, read_reference, write_checkpoint
from pleserver.observe.snapshot import Snapshot

log = logging.getLogger("pleserver.demo")

DEMO_VERSION = 2  # bump when DEMO_TABLES change, so a stale cache is regenerated
REQUEST_SIZES = (1, 16, 256, 4096, 20000)
DEFAULT_CACHE = "16M"  # about a fifth of the demo tables (78 MiB)
ZIPF_A = 1.2  # the skew of the rows asked for
_SCATTER = 2654435761  # a rank's row: ranks spread over the table


def demo_checkpoint(cache_dir: str | None = None) -> str:
    """The demo checkpoint's directory, generated on first use."""
    base = cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pleserver"
    )
    path = os.path.join(base, f"demo-checkpoint-v{DEMO_VERSION}")
    try:
        discover_tables(path, fingerprint=False)
    except CheckpointError:
        log.info("writing the demo checkpoint to %s", path)
        write_checkpoint(path, DEMO_TABLES, files=2)
    return path


def ignore_sigint() -> None:
    """A client process's start: Ctrl-C reaches the whole foreground process
    group, and only the demo itself answers it (it ends the clients and stops
    the server), so that the clients print no tracebacks of their own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def drive(socket_path: str, model: str, seconds: float, seed: int) -> dict:
    """One client process: random lookups of mixed sizes, every row verified."""
    rng = np.random.default_rng(seed)
    counts = {"requests": 0, "rows": 0, "mismatches": 0, "errors": 0}
    with PleClient.connect(socket_path, name=f"demo-{seed}") as client:
        references = {t.name: read_reference(model, t.name) for t in client.tables}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            table = client.tables[int(rng.integers(len(client.tables)))]
            ranks = rng.zipf(ZIPF_A, int(rng.choice(REQUEST_SIZES))) - 1
            ids = (ranks % table.rows) * _SCATTER % table.rows
            try:
                rows = client.lookup(table.layer, ids)
            except PleError:
                counts["errors"] += 1
                continue
            counts["requests"] += 1
            counts["rows"] += ids.size
            counts["mismatches"] += int(not np.array_equal(rows, references[table.name][ids]))
    return counts


def run_demo(
    cache_dir: str | None = None,
    seconds: float = 3.0,
    clients: int = 2,
    io: str = "direct",
    cache_size: str | None = None,
) -> tuple[int, dict]:
    """Run the demo; returns (exit code, report)."""
    model = demo_checkpoint(cache_dir)
    cache_size = cache_size or DEFAULT_CACHE
    serving = (
        ["--io", "mmap", "--prewarm", "full"]
        if io == "mmap"
        else ["--io", io, "--cache-size", cache_size]
    )
    with ServerLauncher(model, *serving, log_level="WARNING").start() as server:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(clients, initializer=ignore_sigint) as pool:
            results = pool.starmap(
                drive, [(server.socket, model, seconds, seed) for seed in range(clients)]
            )
        stats = PleClient.query_stats(server.socket)
        server_code = server.stop(timeout=30)
        if server_code != 0:
            log.error(
                "ple-server exited with %d; its log ends:\n%s", server_code, server.log_tail()
            )
    totals = {k: sum(r[k] for r in results) for k in results[0]}
    ok = server_code == 0 and totals["mismatches"] == 0 and totals["errors"] == 0
    return (0 if ok else 1), {
        "model": model,
        "clients": clients,
        "seconds": seconds,
        "io": io,
        "server_exit_code": server_code,
        "ok": ok,
        **totals,
        "stats": stats,
    }


def headline(stats: Snapshot) -> str:
    """The row cache and the disk over the demo, in one line."""
    plane = stats["dataplane"]
    io = [t["io"] for t in stats["tables"]]
    hits, misses = sum(x["hits"] for x in io), sum(x["misses"] for x in io)
    reads, read_bytes = sum(x["reads"] for x in io), sum(x["read_bytes"] for x in io)
    cache = plane["cache"] if plane else None
    if not plane or not cache:
        io_mode = plane["io"] if plane else "?"
        return f"io {io_mode}: the tables are mapped, so every row is read in place"
    rate = f"{100 * hits / (hits + misses):.1f} %" if hits + misses else "-"
    return (
        f"io {plane['io']}: a row cache of {cache['budget_bytes'] / 2**20:.0f} MiB: "
        f"{hits} hits, {misses} misses (hit rate {rate}); the misses cost {reads} disk "
        f"reads ({read_bytes / 2**20:.1f} MiB)"
    )
