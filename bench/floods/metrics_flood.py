#!/usr/bin/env python3
"""Metrics-port benchmark: a bystander's lookup latency while the metrics port
is flooded.

Writes one synthetic BF16 table (default 500 000 rows × 160 cols, ≈ 150 MiB)
into a temporary directory, starts ``pleserver serve --prewarm full
--metrics-address 127.0.0.1:PORT``, and measures a *bystander* — one client of
capacity 16, depth 1, doing ``lookup`` of 16 random ids, one every
``--gap-ms`` — in each case:

- ``none``: nobody touches the metrics port (the baseline);
- ``prometheus``: one scrape of ``/metrics`` a second (what monitoring costs);
- ``scrape-flood``: ``--flooders`` processes, each scraping ``/metrics`` as
  fast as the server answers, a new connection each time;
- ``health-flood``: the same on ``/healthz`` (no render: the cheapest answer);
- ``connect-flood``: the same, connecting and closing without a request;
- ``idle-3000``: 3 000 connections holding half-sent requests for the whole case;
- ``slowloris``: one process holding 40 half-sent requests (more than the
  port's cap of 32), each reopened as soon as the server closes it;
- ``connect-storm``: one process keeping 512 connects in flight, never
  waiting for one (``connect-flood``'s processes wait for each, so they stay
  near the port's accept rate; this one overflows the kernel's backlog).

For each case it reports the bystander's p50 / p99 / p99.9 / max latency (the
whole ``lookup`` call) and their ratios to ``none`` measured in the same run,
the requests the flooders got answered (200) and refused (503 or closed) per
second (``slowloris``: its heads sent, and those closed under it;
``connect-storm``: its connects), the
server's CPU share, and the CPU share that processes other than the
benchmark, its server and its flooders used meanwhile (``others_cpu``): a run
with high ``others_cpu`` should be repeated. Throughout each case a prober
does what the kubelet and Prometheus would: a ``/healthz`` probe every 0.25 s
(a new connection, failed unless answered 200 within 1 s, the kubelet's
default timeout), a ``/metrics`` scrape every second (within 5 s), and, with
``--health-socket``, ``pleserver health`` on the server's health socket every
0.25 s (within 1 s); it reports the share of each that succeeded. Everything
is removed at the end.

    python -m bench.floods.metrics_flood                     # every case, 10 s each
    python -m bench.floods.metrics_flood --cases none,scrape-flood --seconds 30 --json out.json
    python -m bench.floods.metrics_flood --cases none,slowloris,connect-flood --health-socket
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from bench.harness.load import Helpers, bystander, latency_ms
from bench.harness.provenance import OthersMeter, footer, loadavg, machine, proc_ticks, source
from bench.harness.scaffold import add_json, add_load, parser, save_json, work_dir
from bench.harness.servers import Server, write_model
from pleclient import PleClient
from pleserver.devkit.synthetic import SyntheticTable

CASES = (
    "none",
    "prometheus",
    "scrape-flood",
    "health-flood",
    "connect-flood",
    "idle-3000",
    "slowloris",
    "connect-storm",
)

FLOODER = """
import http.client, json, resource, selectors, socket, sys, time
host, port, seconds, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
stop = time.monotonic() + seconds
counts = {"ok": 0, "busy": 0, "failed": 0}
if mode == "idle":
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    held, selector = [], selectors.DefaultSelector()
    for _ in range(3000):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        held.append(s)
        selector.register(s, selectors.EVENT_WRITE)
    while selector.get_map() and time.monotonic() < stop:
        for key, _ in selector.select(0.5):
            selector.unregister(key.fileobj)
            try:
                key.fileobj.send(b"GET /metrics HTTP/1.1\\r\\n")
                counts["ok"] += 1
            except OSError:
                counts["failed"] += 1
    print("ready", flush=True)
    time.sleep(max(0.0, stop - time.monotonic()))
elif mode == "slowloris":
    selector = selectors.DefaultSelector()
    def open_one():
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        selector.register(s, selectors.EVENT_WRITE)
    for _ in range(40):
        open_one()
    print("ready", flush=True)
    while time.monotonic() < stop:
        for key, events in selector.select(0.2):
            s = key.fileobj
            if events & selectors.EVENT_WRITE and not s.getsockopt(
                socket.SOL_SOCKET, socket.SO_ERROR
            ):
                try:
                    s.send(b"GET /metrics HTTP/1.1\\r\\n")  # and never the blank line
                    counts["ok"] += 1
                    selector.modify(s, selectors.EVENT_READ)
                    continue
                except OSError:
                    pass
            counts["busy"] += 1  # closed under it (or refused): another at once
            selector.unregister(s)
            s.close()
            open_one()
elif mode == "storm":
    print("ready", flush=True)
    in_flight = []
    while time.monotonic() < stop:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        counts["ok"] += 1
        in_flight.append(s)
        if len(in_flight) > 512:
            in_flight.pop(0).close()
else:
    print("ready", flush=True)
    path = "/metrics" if mode == "scrape" else "/healthz"
    interval = 1.0 if mode == "prometheus" else 0.0
    while time.monotonic() < stop:
        started = time.monotonic()
        try:
            if mode == "connect":
                socket.create_connection((host, port), timeout=5).close()
                counts["ok"] += 1
            else:
                conn = http.client.HTTPConnection(host, port, timeout=5)
                conn.request("GET", "/metrics" if mode == "prometheus" else path)
                response = conn.getresponse()
                response.read()
                conn.close()
                counts["ok" if response.status == 200 else "busy"] += 1
        except OSError:
            counts["failed"] += 1
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
print(json.dumps(counts), flush=True)
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    ap.add_argument("--flooders", type=int, default=4, help="flooding processes (default 4)")
    add_load(ap, seconds=10)
    ap.add_argument(
        "--health-socket",
        action="store_true",
        help="give the server a health socket and probe it too (servers that have one)",
    )
    add_json(ap)
    return ap.parse_args(argv)


class Prober:
    """The kubelet's and Prometheus' view of the port during a case, each kind
    of probe in a thread of its own (a slow one delays no other), each probe a
    new connection: counts of those that succeeded, and of all."""

    def __init__(self, port: int, health_socket: str | None) -> None:
        self.port = port
        self.counts = {k: [0, 0] for k in ("healthz", "scrape", "socket")}
        self._stop = threading.Event()
        kinds = [
            ("healthz", 0.25, lambda: self._http("/healthz", 1.0)),
            ("scrape", 1.0, lambda: self._http("/metrics", 5.0)),
        ]
        if health_socket is not None:
            from pleserver.observe.health import ask  # (a server from before it has none)

            kinds.append(("socket", 0.25, lambda: ask(health_socket, timeout=1.0)[0]))
        self._threads = [
            threading.Thread(target=self._run, args=kind, daemon=True) for kind in kinds
        ]

    def _http(self, path: str, timeout: float) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _run(self, what: str, every_s: float, one: Callable[[], bool]) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            ok = one()
            self.counts[what][0] += ok
            self.counts[what][1] += 1
            self._stop.wait(max(0.0, every_s - (time.monotonic() - started)))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> dict:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return {f"{what}_ok": f"{ok}/{total}" for what, (ok, total) in self.counts.items() if total}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_flooders(case: str, port: int, args) -> Helpers:
    mode, count = {
        "none": ("", 0),
        "prometheus": ("prometheus", 1),
        "scrape-flood": ("scrape", args.flooders),
        "health-flood": ("health", args.flooders),
        "connect-flood": ("connect", args.flooders),
        "idle-3000": ("idle", 1),
        "slowloris": ("slowloris", 1),
        "connect-storm": ("storm", 1),
    }[case]
    argv = ["127.0.0.1", str(port), str(args.seconds + 3), mode]
    flooders = Helpers("flooder", FLOODER, [argv] * count)
    try:
        flooders.wait_ready()
    except BaseException:
        flooders.close()
        raise
    return flooders


def run_case(server: Server, port: int, case: str, args, health_socket: str | None) -> dict:
    prober = None
    with start_flooders(case, port, args) as flooders:
        try:
            time.sleep(1.0)  # the flood in its steady state
            prober = Prober(port, health_socket)
            prober.start()
            rng = np.random.default_rng(7)
            meter = OthersMeter([server.proc.pid, *flooders.pids])
            server_ticks = proc_ticks(server.proc.pid)
            with PleClient.connect(server.socket, name="bystander", capacity=16, depth=1) as client:
                meter.start()
                started = time.monotonic()
                ms = bystander(client, 0, args.seconds, args.gap_ms, rng)
                wall = time.monotonic() - started
                others = meter.stop()
                server_cpu = (proc_ticks(server.proc.pid) - server_ticks) / OthersMeter.HZ / wall
            probes = prober.stop()
            reports = flooders.reports()
        finally:
            if prober is not None:
                prober.stop()  # (again, when the case ended well: it returns at once)
    span = args.seconds + 3
    return {
        "case": case,
        **latency_ms(ms),
        "answered_per_s": round(sum(r["ok"] for r in reports) / span, 1),
        "refused_per_s": round(sum(r["busy"] for r in reports) / span, 1),
        "failed_per_s": round(sum(r["failed"] for r in reports) / span, 1),
        "server_cpu": round(server_cpu, 3),
        "others_cpu": others,
        "loadavg": loadavg(),
        **probes,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    with work_dir("ple-metrics-flood-", args.dir) as workdir:
        model = write_model(
            workdir,
            [SyntheticTable(layer=0, rows=args.rows, cols=args.cols, dtype="BF16", parts=8)],
        )
        port = free_port()
        health_socket = os.path.join(workdir, "health.sock") if args.health_socket else None
        extra = ["--metrics-address", f"127.0.0.1:{port}"]
        if health_socket is not None:
            extra += ["--health-socket", health_socket]
        with Server("metrics", model, 0, 16, extra) as server:
            server.wait_ready()
            result = {"machine": machine(), "source": source(), "args": vars(args), "cases": []}
            print(
                f"{'case':>13} {'lookups':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} "
                f"{'max ms':>8} {'p50 ×':>6} {'p99 ×':>6} {'200/s':>7} {'503/s':>7} "
                f"{'server cpu':>10} {'others cpu':>10} {'healthz ok':>10} {'scrapes ok':>10} "
                f"{'socket ok':>9}"
            )
            base = None
            for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
                row = run_case(server, port, case, args, health_socket)
                base = base or row
                row["p50_ratio"] = round(row["p50_ms"] / base["p50_ms"], 2)
                row["p99_ratio"] = round(row["p99_ms"] / base["p99_ms"], 2)
                result["cases"].append(row)
                print(
                    f"{case:>13} {row['bystander_lookups']:>8} {row['p50_ms']:>8.3f} "
                    f"{row['p99_ms']:>8.3f} {row['p999_ms']:>9.3f} {row['max_ms']:>8.3f} "
                    f"{row['p50_ratio']:>6.2f} {row['p99_ratio']:>6.2f} "
                    f"{row['answered_per_s']:>7.1f} {row['refused_per_s']:>7.1f} "
                    f"{100 * row['server_cpu']:>9.1f}% {100 * row['others_cpu']:>9.1f}% "
                    f"{row.get('healthz_ok', '-'):>10} {row.get('scrape_ok', '-'):>10} "
                    f"{row.get('socket_ok', '-'):>9}",
                    flush=True,
                )
            print(f"{footer(result)}; ratios against the first case of this run")
            save_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
