#!/usr/bin/env python3
"""Row-integrity soak: attackers rewrite their slots at full speed beside
honest clients that check every row they get against the checkpoint.

For each io mode — mmap, and direct and buffered each with the io_uring and
with the thread read engine — a ``pleserver serve`` runs on a synthetic
checkpoint (an FP8, a BF16 and an NVFP4 table, its rows read from two
tensors) with a row cache much smaller than the tables, for ``--seconds``:

- **attackers** (``--attackers``): each a client process and a forked twin
  that maps the same segment and rewrites every slot's rows area (memset)
  at full speed, while the client sweeps through every table: each request a
  miss, of 2048 rows (gathered over native threads: ``parallel_min_rows`` is
  1024) or 61 rows at a time. Each publishes how far it got;
- **honest clients** (``--honest``): each asks, three times in four, for rows
  just behind an attacker's position (in the row cache by then: where a row
  the attacker managed to put its bytes into would be served), else for rows
  anywhere in a table, in requests of 1 to 2048 rows, and compares every row
  with the checkpoint (``read_reference``: plain file reads).

Per mode it reports the rows verified and the **wrong rows, which must be 0**,
the honest requests that failed (must be 0), the attackers' requests and
rewrites, the server's cache hits and misses, whether the server stayed up
and stopped cleanly, and the CPU share other processes of the machine used
meanwhile (``others_cpu``: this is not a timing benchmark, a busy machine
only slows it). Exit status 0 when every mode held.

    python -m bench.evals.integrity_soak                                 # 3 minutes a mode
    python -m bench.evals.integrity_soak --seconds 120 --json soak.json
    python -m bench.evals.integrity_soak --seconds 3 --rows 30000        # a smoke run
    python -m bench.evals.integrity_soak --modes direct:io_uring,mmap
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench.harness.checkout import REPO
from bench.harness.scaffold import add_json, parser

MODES = ("mmap", "direct:io_uring", "direct:threads", "buffered:io_uring", "buffered:threads")
CAPACITY = 2048
SMALL = 61  # rows per small request: gathered by one thread
WINDOW = 3000  # honest clients read this many rows behind an attacker


# ------------------------------------------------------------------ clients
def wait_for_start() -> float:
    """Say ready, then read when to stop (CLOCK_MONOTONIC) from the soak."""
    print(json.dumps({"ready": True}), flush=True)
    return float(sys.stdin.readline())


def attacker(socket_path: str, positions_path: str, index: int) -> int:
    """A client sweeping every table in misses while its twin rewrites its slots;
    prints one JSON line at the end."""
    import ctypes
    import mmap

    import numpy as np

    from pleclient import PleClient

    client = PleClient.connect(socket_path, capacity=CAPACITY, depth=4, name=f"attacker{index}")
    layout = client.channel.layout
    base = ctypes.addressof(ctypes.c_char.from_buffer(client.channel.mm))
    areas = [base + layout.slot_offset(i) + layout.rows_offset for i in range(layout.depth)]
    whole = layout.capacity * layout.max_row_bytes
    rewrites = np.frombuffer(mmap.mmap(-1, 8), dtype=np.uint64)  # shared with the twin
    parent = os.getpid()
    twin = os.fork()
    if twin == 0:  # the same segment in a second process: rewrite it at full speed
        memset = ctypes.CDLL(None).memset
        while os.getppid() == parent:
            for _ in range(64):  # mostly where small answers land, now and then all of it
                for area in areas:
                    memset(ctypes.c_void_p(area), 0xEE, SMALL * layout.max_row_bytes)
            for area in areas:
                memset(ctypes.c_void_p(area), 0xEE, whole)
            rewrites[0] += 1
        os._exit(0)
    print(json.dumps({"twin": twin}), flush=True)
    tables = client.tables
    until = wait_for_start()
    positions = np.memmap(positions_path, dtype=np.int64, mode="r+")
    requests = rows = 0
    step = index  # attackers start apart
    try:
        while time.monotonic() < until:
            lo = step * CAPACITY
            for k, t in enumerate(tables):
                start = lo % t.rows
                ids = np.arange(start, min(start + CAPACITY, t.rows))
                if step % 2:
                    for a in range(0, ids.size, SMALL):
                        client.lookup(t.layer, ids[a : a + SMALL])
                        requests += 1
                else:
                    client.lookup(t.layer, ids)
                    requests += 1
                rows += int(ids.size)
                positions[index * len(tables) + k] = int(ids[-1]) + 1
            step += 1
    finally:
        os.kill(twin, 9)
        os.waitpid(twin, 0)
    client.close()
    print(json.dumps({"requests": requests, "rows": rows, "rewrites": int(rewrites[0])}))
    return 0


def honest(socket_path: str, model: str, positions_path: str, seed: int) -> int:
    """A client checking every row it gets; prints one JSON line at the end."""
    import numpy as np

    from pleclient import PleClient, PleError
    from pleserver.devkit.synthetic import read_reference

    rng = np.random.default_rng(seed)
    client = PleClient.connect(socket_path, capacity=CAPACITY, depth=4, name=f"honest{seed}")
    tables = client.tables
    refs = [read_reference(model, t.name) for t in tables]
    positions = np.memmap(positions_path, dtype=np.int64, mode="r")
    attackers = positions.size // len(tables)
    report = {"requests": 0, "rows": 0, "wrong": 0, "failed": 0, "samples": []}
    until = wait_for_start()
    while time.monotonic() < until:
        k = int(rng.integers(len(tables)))
        t, ref = tables[k], refs[k]
        n = int(rng.choice([1, 16, 200, CAPACITY]))
        upto = int(positions[int(rng.integers(attackers)) * len(tables) + k])
        if upto and rng.random() < 0.75:  # just behind an attacker: in the cache
            ids = rng.integers(max(0, upto - WINDOW), upto, n)
        else:
            ids = rng.integers(0, t.rows, n)
        try:
            rows = client.lookup(t.layer, ids)
        except PleError as exc:
            report["failed"] += 1
            if len(report["samples"]) < 5:
                report["samples"].append(f"{type(exc).__name__}: {exc}")
            continue
        bad = np.flatnonzero((rows != ref[ids]).any(axis=1))
        report["requests"] += 1
        report["rows"] += int(ids.size)
        report["wrong"] += int(bad.size)
        if bad.size and len(report["samples"]) < 5:
            report["samples"].append(f"layer {t.layer} id {int(ids[bad[0]])}: not the checkpoint's")
    client.close()
    print(json.dumps(report))
    return 0


# --------------------------------------------------------------------- runs
class Child:
    """A client process of this script; its JSON lines, read in a thread."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.evals.integrity_soak", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        self.lines: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any("ready" in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def start(self, until: float) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{until!r}\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # it died: finish() says how
            pass

    def pids(self) -> list[int]:
        return [self.proc.pid] + [line["twin"] for line in self.lines if "twin" in line]

    def finish(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        self.proc.stderr.close()
        result = next(
            (line for line in reversed(self.lines) if "twin" not in line and "ready" not in line),
            None,
        )
        if self.proc.returncode != 0 or result is None:
            return {"crashed": f"exit {self.proc.returncode}: {err[-1500:]}"}
        return result


def run_mode(mode: str, args: argparse.Namespace, model: str, workdir: str) -> dict:
    from bench.harness.provenance import OthersMeter
    from pleclient import PleClient
    from pleserver.devkit.launcher import ServerLauncher

    io, _, engine = mode.partition(":")
    state = os.path.join(workdir, f"state-{io}-{engine or 'none'}")
    os.makedirs(state, exist_ok=True)
    flags = ["--io", io, "--cache-size", args.cache_size, "--state-dir", state]
    flags += ["--parallel-min-rows", "1024", "--max-capacity", str(CAPACITY)]
    if engine:
        flags += ["--read-engine", engine]
    positions = os.path.join(workdir, f"positions-{io}-{engine or 'none'}")
    with ServerLauncher(model, *flags, log_level="INFO", cwd=REPO).start() as server:
        tables = PleClient.query_tables(server.socket)
        with open(positions, "wb") as f:
            f.write(bytes(8 * len(tables) * args.attackers))
        attackers = [
            Child("--attacker", server.socket, positions, str(i)) for i in range(args.attackers)
        ]
        honest_ones = [
            Child("--honest", server.socket, model, positions, str(100 + i))
            for i in range(args.honest)
        ]
        children = attackers + honest_ones
        for child in children:  # connected, references read, twins forked
            child.ready(timeout=120)
        until = time.monotonic() + args.seconds
        for child in children:
            child.start(until)
        meter = OthersMeter([server.pid, *(p for c in children for p in c.pids())])
        meter.start()
        time.sleep(max(0.0, until - time.monotonic()))
        others = meter.stop()
        timeout = 120 + args.seconds
        honest_reports = [c.finish(timeout) for c in honest_ones]
        attacker_reports = [c.finish(timeout) for c in attackers]
        alive = server.running
        stats = PleClient.query_stats(server.socket) if alive else {"tables": [], "dataplane": {}}
        exit_status = server.stop(timeout=60)
        log = server.log()
    cache = (stats.get("dataplane") or {}).get("cache") or {}
    crashed = [r["crashed"] for r in honest_reports + attacker_reports if "crashed" in r]
    ok_honest = [r for r in honest_reports if "crashed" not in r]
    ok_attackers = [r for r in attacker_reports if "crashed" not in r]
    result = {
        "mode": mode,
        "seconds": args.seconds,
        "rows_verified": sum(r["rows"] for r in ok_honest),
        "requests_verified": sum(r["requests"] for r in ok_honest),
        "wrong_rows": sum(r["wrong"] for r in ok_honest),
        "failed_requests": sum(r["failed"] for r in ok_honest),
        "samples": [s for r in ok_honest for s in r["samples"]][:10],
        "attacker_requests": sum(r["requests"] for r in ok_attackers),
        "attacker_rows": sum(r["rows"] for r in ok_attackers),
        "rewrites": sum(r["rewrites"] for r in ok_attackers),
        "cache_hits": cache.get("hits"),
        "cache_misses": cache.get("misses"),
        "crashed_clients": crashed,
        "server_alive": alive,
        "server_exit": exit_status,
        "tracebacks_in_log": log.count("Traceback"),
        "others_cpu": others,
    }
    result["ok"] = (
        result["wrong_rows"] == 0
        and result["failed_requests"] == 0
        and result["rows_verified"] > 0
        and result["attacker_requests"] > 0
        and not crashed
        and alive
        and exit_status == 0
        and result["tracebacks_in_log"] == 0
    )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--attacker"]:
        socket_path, positions, index = argv[1:4]
        return attacker(socket_path, positions, int(index))
    if argv[:1] == ["--honest"]:
        socket_path, model, positions, seed = argv[1:5]
        return honest(socket_path, model, positions, int(seed))
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--seconds", type=float, default=180.0, help="per mode")
    ap.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}"
    )
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--honest", type=int, default=2)
    ap.add_argument(
        "--rows", type=int, default=200_003, help="rows of the FP8 table (BF16: half, NVFP4: 3/4)"
    )
    ap.add_argument("--cache-size", default="8M", help="the row cache (direct, buffered)")
    ap.add_argument("--model", help="a checkpoint written by pleserver.devkit.synthetic")
    add_json(ap)
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")

    from bench.harness.provenance import loadavg, machine, source
    from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

    workdir = tempfile.mkdtemp(prefix="ple-integrity-")
    try:
        model = args.model or write_checkpoint(
            os.path.join(workdir, "model"),
            (
                SyntheticTable(layer=1, rows=args.rows, cols=160, dtype="F8_E4M3", parts=8),
                SyntheticTable(layer=3, rows=args.rows // 2, cols=160, dtype="BF16", parts=4),
                SyntheticTable(layer=5, rows=args.rows * 3 // 4, cols=160, dtype="NVFP4", parts=6),
            ),
            files=3,
        )
        report = {
            "machine": machine(),
            "source": source(),
            "loadavg_before": loadavg(),
            "attackers": args.attackers,
            "honest": args.honest,
            "cache_size": args.cache_size,
            "modes": [],
        }
        print(
            f"{'mode':<18} {'rows verified':>14} {'wrong':>6} {'failed':>6} "
            f"{'attacker rows':>14} {'rewrites':>9} {'cache hits':>11} {'others cpu':>10}  ok"
        )
        for mode in modes:
            r = run_mode(mode, args, model, workdir)
            report["modes"].append(r)
            print(
                f"{mode:<18} {r['rows_verified']:>14,} {r['wrong_rows']:>6} "
                f"{r['failed_requests']:>6} {r['attacker_rows']:>14,} {r['rewrites']:>9,} "
                f"{r['cache_hits'] if r['cache_hits'] is not None else '-':>11} "
                f"{r['others_cpu']:>10.0%}  {'yes' if r['ok'] else 'NO'}",
                flush=True,
            )
            for line in r["samples"] + r["crashed_clients"]:
                print(f"    {line}")
        report["loadavg_after"] = loadavg()
        report["rows_verified"] = sum(r["rows_verified"] for r in report["modes"])
        report["wrong_rows"] = sum(r["wrong_rows"] for r in report["modes"])
        report["ok"] = all(r["ok"] for r in report["modes"])
        print(
            f"all modes: {report['rows_verified']:,} rows verified, "
            f"{report['wrong_rows']} wrong; commit {report['source']['commit']}"
            + (" (modified)" if report["source"]["modified"] else "")
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
        return 0 if report["ok"] else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
