#!/usr/bin/env python3
"""Soak: clients join and leave a real ple-server under mixed request sizes and
random faults; every row is checked and the server's footprint must stay flat.

Starts ``pleserver serve`` on a synthetic checkpoint (written to a temporary
directory, or ``--model DIR`` written by ``pleserver.devkit.synthetic``) and keeps
``--clients`` worker processes busy for ``--seconds``. A worker, in a loop,
connects with a random capacity and depth, makes a random number of requests —
1 row to 2.5 × its capacity, both tables, pipelined tickets — checks every row
against the checkpoint files (``read_reference``), and leaves. Faults:

- ``kill``: the soak SIGKILLs a random worker, mid-request as often as not;
- ``exit``: a worker exits with tickets in flight (``os._exit``);
- ``drop``: a worker closes its socket without saying bye;
- ``abandon``: a worker releases a ticket before its answer came;
- ``reject``: a worker asks for an id out of range and expects the error.

Workers that end are replaced. Every ``--sample`` seconds the server's RSS,
descriptors, threads, mapped channel segments and the ``/dev/shm`` entries are
sampled. At the end the workers stop, the server settles and gets SIGTERM.

Flat means: after the run, descriptors, threads and segments are back at their
baseline (taken after a warm-up that starts the gather threads), no ``/dev/shm``
entry ever appeared, and the server's anonymous memory (RssAnon: its heap, not
the table pages it maps) grew less than ``--rss-slack`` MiB over the second half
of the run. Exit status 0 when nothing failed and the server stayed flat.

    python -m bench.evals.soak                              # 10 minutes, 4 clients
    python -m bench.evals.soak --seconds 3600 --clients 8 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.harness.checkout import REPO
from bench.harness.scaffold import add_json, add_server_args, parser

FAULTS = ("kill", "exit", "drop", "abandon", "reject")


# ------------------------------------------------------------------- worker
def worker(socket_path: str, model: str, seed: int, until: float) -> int:
    """One client process: sessions until ``until`` (CLOCK_MONOTONIC); reports
    one line per event on stdout: ``ok ROWS``, ``fault KIND``, ``session``,
    ``bad TEXT`` (wrong rows or an unexpected error)."""
    import numpy as np

    from pleclient import PleClient, RequestError
    from pleserver.devkit.synthetic import read_reference

    rng = np.random.default_rng(seed)
    refs: dict[int, np.ndarray] = {}

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def check(layer: int, ids, rows) -> None:
        if not np.array_equal(rows, refs[layer][ids]):
            bad = int(np.flatnonzero((rows != refs[layer][ids]).any(axis=1))[0])
            say(
                f"bad layer {layer}: row of id {int(ids[bad])} (position {bad} of "
                f"{len(ids)}) differs"
            )
        else:
            say(f"ok {len(ids)}")

    while time.monotonic() < until:
        capacity = int(rng.choice([256, 1024, 4096, 16384]))
        try:
            client = PleClient.connect(
                socket_path, capacity=capacity, depth=int(rng.integers(1, 7)), name=f"soak{seed}"
            )
        except Exception as exc:
            say(f"bad connect: {type(exc).__name__}: {exc}")
            return 1
        if not refs:
            refs.update({t.layer: read_reference(model, t.name) for t in client.tables})
        layers = sorted(refs)
        say("session")
        try:
            for _ in range(int(rng.integers(1, 40))):
                layer = int(rng.choice(layers))
                rows_total = refs[layer].shape[0]
                roll = rng.random()
                if roll < 0.04:  # fault: ids out of range get an error status
                    ids = rng.integers(0, rows_total, 10)
                    ids[int(rng.integers(10))] = rows_total + int(rng.integers(0, 1 << 30))
                    try:
                        client.lookup(layer, ids)
                        say("bad an out-of-range id was answered with rows")
                    except RequestError:
                        say("fault reject")
                elif roll < 0.08:  # fault: a ticket released before its answer
                    client.submit(
                        layer,
                        rng.integers(0, rows_total, int(rng.integers(1, client.capacity + 1))),
                    ).release()
                    say("fault abandon")
                elif roll < 0.25 and client.depth > 1:  # pipelined tickets, zero-copy views
                    batch = [
                        rng.integers(0, rows_total, int(rng.integers(1, capacity + 1)))
                        for _ in range(int(rng.integers(1, client.depth + 1)))
                    ]
                    tickets = [client.submit(layer, ids) for ids in batch]
                    for ids, ticket in zip(batch, tickets, strict=True):
                        check(layer, ids, ticket.wait())
                        ticket.release()
                else:
                    n = int(rng.choice([1, 16, 300, 5000, capacity, int(2.5 * capacity)]))
                    ids = rng.integers(0, rows_total, n)
                    if rng.random() < 0.3:  # heavy duplicates, every shard boundary
                        ids = np.resize(rng.integers(0, rows_total, max(1, n // 50)), n)
                    check(layer, ids, client.lookup(layer, ids))
            roll = rng.random()
            if roll < 0.04:  # fault: exit with requests in flight
                for _ in range(client.depth):
                    client.submit(
                        layers[0], rng.integers(0, refs[layers[0]].shape[0], client.capacity)
                    )
                say("fault exit")
                os._exit(0)
            if roll < 0.15:  # fault: the socket just closes
                client._sock.close()
                say("fault drop")
            client.close()
        except Exception as exc:
            say(f"bad {type(exc).__name__}: {exc}")
            client.close()
    return 0


# ------------------------------------------------------------------- server
def footprint(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        status = {k: v.split()[0] for k, v in (line.split(":", 1) for line in f) if v.split()}
    with open(f"/proc/{pid}/maps") as f:
        segments = {line.split()[5] for line in f if "/memfd:ple." in line}
    # RssAnon is the server's own heap; RssFile grows as table pages are touched
    # (the page cache, mapped), RssShmem with the channels of the moment.
    return {
        "rss_kib": int(status["VmRSS"]),
        "rss_anon_kib": int(status["RssAnon"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "segments": len(segments),
        "shm": len([n for n in os.listdir("/dev/shm") if "ple" in n]),
    }


def quiet_footprint(pid: int, timeout: float = 15.0) -> dict:
    last = footprint(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = footprint(pid)
        if all(now[k] == last[k] for k in ("fds", "threads", "segments")):
            return now
        last = now
    return last


class Soak:
    def __init__(self, args: argparse.Namespace, model: str, workdir: str) -> None:
        self.args = args
        self.model = model
        self.socket = os.path.join(workdir, "soak.sock")
        self.log_path = os.path.join(workdir, "server.log")
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "rows": 0, "sessions": 0, "workers": 0}
        self.faults = dict.fromkeys(FAULTS, 0)
        self.failures: list[str] = []
        self.samples: list[dict] = []
        self.workers: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []  # one per worker: its stdout, to its end
        self.server = None  # a pleserver.devkit.launcher.LaunchedServer once started

    def start_server(self) -> None:
        from pleclient import PleClient
        from pleserver.devkit.launcher import ServerLauncher

        # The log is the report's (in the work directory, kept with --keep).
        self.server = ServerLauncher(
            self.model,
            *self.args.server_arg,
            socket_path=self.socket,
            log_level="INFO",
            log_path=self.log_path,
            cwd=REPO,
            die_with_parent=True,
        ).start()
        with PleClient.connect(self.socket) as client:  # warm-up: gather threads start
            for t in client.tables:
                client.lookup(t.layer, [i % t.rows for i in range(4 * client.capacity)])

    def spawn(self, until: float) -> None:
        seed = self.rng.randrange(1 << 30)
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.evals.soak",
                "--worker",
                self.socket,
                self.model,
                str(seed),
                repr(until),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        self.workers.append(child)
        with self.lock:
            self.counts["workers"] += 1
        reader = threading.Thread(target=self._read, args=(child,), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _read(self, child: subprocess.Popen) -> None:
        for line in child.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            with self.lock:
                if kind == "ok":
                    self.counts["requests"] += 1
                    self.counts["rows"] += int(rest)
                elif kind == "session":
                    self.counts["sessions"] += 1
                elif kind == "fault":
                    self.faults[rest] += 1
                else:
                    self.failures.append(f"worker {child.pid}: {line.strip()}")

    def run(self) -> dict:
        args = self.args
        self.start_server()
        pid = self.server.pid
        baseline = quiet_footprint(pid)
        started = time.monotonic()
        until = started + args.seconds
        next_sample = next_kill = started
        for _ in range(args.clients):
            self.spawn(until)
        while time.monotonic() < until:
            now = time.monotonic()
            if not self.server.running:
                self.failures.append(f"ple-server exited with {self.server.proc.returncode}")
                break
            for child in list(self.workers):
                if child.poll() is not None:
                    self.workers.remove(child)
                    if child.returncode not in (0, -signal.SIGKILL):
                        with self.lock:
                            self.failures.append(
                                f"worker {child.pid} exited with {child.returncode}"
                            )
                    if until - now > 1.0:
                        self.spawn(until)
            if now >= next_kill and self.workers:
                next_kill = now + self.rng.expovariate(args.kill_rate)
                if next_kill < until - 0.5:
                    victim = self.rng.choice(self.workers)
                    victim.send_signal(signal.SIGKILL)
                    with self.lock:
                        self.faults["kill"] += 1
            if now >= next_sample:
                next_sample = now + args.sample
                self.samples.append({"t": round(now - started, 2), **footprint(pid)})
            time.sleep(0.02)
        for child in self.workers:
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                self.failures.append(f"worker {child.pid} did not stop")
        for reader in self.readers:  # every worker's last lines counted
            reader.join(10)
        if self.server.running:
            final = quiet_footprint(pid)
            settle_deadline = time.monotonic() + 15
            while time.monotonic() < settle_deadline and any(
                final[k] > baseline[k] for k in ("fds", "threads", "segments")
            ):
                time.sleep(0.2)
                final = footprint(pid)
            from pleclient import PleClient

            stats = PleClient.query_stats(self.socket)
            server_exit = self.server.stop(timeout=60)
        else:
            final, stats, server_exit = (
                footprint(os.getpid()),
                {"tables": []},
                self.server.proc.returncode,
            )
        return self.report(baseline, final, stats, server_exit, time.monotonic() - started)

    def report(self, baseline, final, stats, server_exit, elapsed) -> dict:
        half = [s for s in self.samples if s["t"] >= self.args.seconds / 2] or self.samples
        rss_growth = (
            (max(s["rss_anon_kib"] for s in half) - half[0]["rss_anon_kib"]) / 1024 if half else 0.0
        )
        shm_max = max([s["shm"] for s in self.samples] + [final["shm"]])
        flat = (
            all(final[k] <= baseline[k] for k in ("fds", "threads", "segments"))
            and shm_max == 0
            and rss_growth < self.args.rss_slack
        )
        server_requests = sum(t["requests"] for t in stats["tables"])
        server_errors = {}
        for t in stats["tables"]:
            for kind, n in t["errors"].items():
                server_errors[kind] = server_errors.get(kind, 0) + n
        failures = list(self.failures)
        if server_exit != 0:
            failures.append(f"ple-server exit status {server_exit}")
        if server_errors.get("internal"):
            failures.append(f"{server_errors['internal']} internal errors in the server")
        series = (
            {
                k: [min(s[k] for s in self.samples), max(s[k] for s in self.samples)]
                for k in ("rss_kib", "rss_anon_kib", "fds", "threads", "segments")
            }
            if self.samples
            else {}
        )
        return {
            "seconds": round(elapsed, 1),
            "clients": self.args.clients,
            "requests_verified": self.counts["requests"],
            "rows_verified": self.counts["rows"],
            "sessions": self.counts["sessions"],
            "worker_processes": self.counts["workers"],
            "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()),
            "failures": len(failures),
            "failure_samples": failures[:20],
            "server": {
                "requests": server_requests,
                "errors": server_errors,
                "baseline": baseline,
                "final": final,
                "ranges": series,
                "rss_anon_growth_second_half_mib": round(rss_growth, 1),
                "shm_entries_max": shm_max,
                "exit_status": server_exit,
                "log": self.log_path,
            },
            "flat": flat,
            "ok": flat and not failures,
        }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        socket_path, model, seed, until = argv[1:5]
        return worker(socket_path, model, int(seed), float(until))
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=4, help="worker processes at once")
    ap.add_argument(
        "--kill-rate", type=float, default=0.5, help="worker SIGKILLs per second (mean)"
    )
    ap.add_argument("--sample", type=float, default=1.0, help="seconds between samples")
    ap.add_argument(
        "--rss-slack",
        type=float,
        default=16.0,
        help="MiB the server's anonymous RSS may grow over the second half",
    )
    ap.add_argument(
        "--rows", type=int, default=200_003, help="rows of the FP8 table (the BF16 one has half)"
    )
    ap.add_argument("--model", help="a checkpoint written by pleserver.devkit.synthetic")
    ap.add_argument("--seed", type=int, default=0)
    add_server_args(ap)
    add_json(ap)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

    workdir = tempfile.mkdtemp(prefix="ple-soak-")
    try:
        model = args.model
        if not model:
            model = write_checkpoint(
                os.path.join(workdir, "model"),
                (
                    SyntheticTable(layer=1, rows=args.rows, cols=160, dtype="F8_E4M3", parts=16),
                    SyntheticTable(layer=3, rows=args.rows // 2, cols=160, dtype="BF16", parts=8),
                ),
                files=3,
            )
        soak = Soak(args, model, workdir)
        try:
            report = soak.run()
        finally:
            for child in soak.workers:
                if child.poll() is None:
                    child.kill()
            if soak.server is not None:
                soak.server.close()
        text = json.dumps(report, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        return 0 if report["ok"] else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
