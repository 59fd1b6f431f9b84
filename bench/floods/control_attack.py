#!/usr/bin/env python3
"""Control-plane attacks: a bystander's latency while hostile peers talk to the server.

Writes a small synthetic checkpoint into a temporary directory, starts
``pleserver serve --prewarm full`` and measures a *bystander* — one client of
capacity 16, depth 1, doing ``lookup`` of 16 random ids, one every
``--gap-ms`` — for ``--seconds`` per case, beside ``--attackers`` processes
that play one attack each:

- ``none``: no attacker (the baseline of the run);
- ``stats``: after ``hello``, ``stats`` frames of 4 194 263 bytes whose body is
  ``{"type": "stats", "x": [[]] * 4_000_000}``, one after another (a valid
  message: a server without decoding limits answers it, after building four
  million lists with the GIL held); the attacker reconnects whenever the
  server closes its session;
- ``prehello``: 64 KiB frames before ``hello`` (``{"type": "hello", "x": [[]] * N}``),
  a new connection for each;
- ``stats-flood``: honest ``stats`` requests, 8 pipelined at a time, each
  reply read (the control thread builds a snapshot for each);
- ``connect``: connections from a uid the server refuses (``nobody``; needs
  root, skipped otherwise), opened and closed as fast as the attacker can,
  while a *newcomer* process connects a new legitimate client (connect, one
  lookup, close) every ``--newcomer-gap-s``; their failures are counted.

Each case reports the bystander's lookups per 10 s, p50 / p99 / max latency,
the server's CPU share, the newcomers' failures, and the CPU share that
processes other than the benchmark and its server used meanwhile
(``others_cpu``: other load lands in the bystander's tail; repeat a run where
it is high). Everything is removed at the end.

    python -m bench.floods.control_attack                         # every case, 10 s each
    python -m bench.floods.control_attack --cases none,stats --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from bench.harness.checkout import REPO
from bench.harness.load import Helpers, bystander, latency_ms
from bench.harness.provenance import OthersMeter, loadavg, machine, proc_ticks, source
from bench.harness.scaffold import add_json, add_load, parser, save_json, work_dir
from bench.harness.servers import write_model
from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable

CASES = ("none", "stats", "prehello", "stats-flood", "connect")
NOBODY = 65534

ATTACKER = """
import os, socket, struct, sys, time
import msgpack
from pleclient import protocol as p
path, kind, stop = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])

def frame(msg):
    body = msgpack.packb(msg, use_bin_type=True)
    return struct.pack("<I", len(body)) + body

hello = frame({"type": "hello", "version": 2, "pid": os.getpid(), "name": "attacker"})
huge_stats = frame({"type": "stats", "x": [[]] * 4_000_000})
base = len(msgpack.packb({"type": "hello", "version": 2, "x": []}))
prehello = frame({"type": "hello", "version": 2, "x": [[]] * ((64 << 10) - base - 4)})
if kind == "connect" and os.geteuid() == 0:
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
print("ready", flush=True)
sent = 0
while time.monotonic() < stop:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if kind == "connect":
            s.setblocking(False)
            try:
                s.connect(path)
                sent += 1
            except OSError:
                pass
            continue
        s.settimeout(5)
        s.connect(path)
        if kind == "stats-flood":
            s.sendall(hello)
            p.recv_message(s)
            while time.monotonic() < stop:
                s.sendall(frame({"type": "stats"}) * 8)
                for _ in range(8):
                    p.recv_message(s)
                sent += 8
            continue
        if kind == "prehello":
            s.sendall(prehello)
            s.recv(65536)
            sent += 1
            continue
        s.sendall(hello)
        s.recv(65536)
        while time.monotonic() < stop:
            s.sendall(huge_stats)
            if not s.recv(65536):
                break
            sent += 1
    except OSError:
        time.sleep(0.001)
    finally:
        s.close()
print(sent, flush=True)
""".replace("NOBODY", str(NOBODY))

NEWCOMER = """
import json, sys, time
from pleclient import PleClient, PleError
path, stop, gap = sys.argv[1], time.monotonic() + float(sys.argv[2]), float(sys.argv[3])
ok, failures = 0, []
while time.monotonic() < stop:
    try:
        with PleClient.connect(path, name="newcomer", capacity=16, depth=1) as c:
            c.lookup(1, [1, 2, 3])
        ok += 1
    except PleError as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
    time.sleep(gap)
print(json.dumps({"ok": ok, "failures": failures}), flush=True)
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES)
    )
    add_load(ap, seconds=10, gap_ms=5)
    ap.add_argument("--attackers", type=int, default=2, help="attacking processes (default 2)")
    ap.add_argument("--newcomer-gap-s", type=float, default=0.5)
    add_json(ap)
    return ap.parse_args(argv)


def run_case(server, kind: str, args) -> dict:
    """One case: the bystander connects first, then the attack starts."""
    window = args.seconds + 1.0
    attack = [[server.socket, kind, str(window)]] * (args.attackers if kind != "none" else 0)
    newcomer = [server.socket, str(args.seconds), str(args.newcomer_gap_s)]
    with (
        PleClient.connect(server.socket, name="bystander", capacity=16, depth=1) as client,
        Helpers("attacker", ATTACKER, attack) as attackers,
    ):
        table = client.table(1)
        attackers.wait_ready()
        with Helpers("newcomer", NEWCOMER, [newcomer] if kind == "connect" else []) as newcomers:
            time.sleep(0.5)  # the attack in its steady state
            rng = np.random.default_rng(7)
            meter = OthersMeter([server.pid, *attackers.pids, *newcomers.pids])
            server_ticks = proc_ticks(server.pid)
            meter.start()
            started = time.monotonic()
            ms = bystander(client, table, args.seconds, args.gap_ms, rng)
            elapsed = time.monotonic() - started
            others = meter.stop()
            server_cpu = (proc_ticks(server.pid) - server_ticks) / OthersMeter.HZ / elapsed
            attacks = [int(out.split()[-1]) for out in attackers.outputs()]
            joined = [json.loads(out) for out in newcomers.outputs()]
    return {
        "case": kind,
        "lookups_per_10s": round(len(ms) * 10 / elapsed),
        **latency_ms(ms),
        "server_cpu": round(server_cpu, 3),
        "attacks": sum(attacks),
        "newcomers": joined[0] if joined else None,
        "others_cpu": others,
        "loadavg": loadavg(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; cases: {', '.join(CASES)}")
    if "connect" in cases and os.geteuid() != 0:
        print("skipping case 'connect': it needs root (to connect as a refused uid)")
        cases.remove("connect")
    with work_dir("ple-control-", args.dir) as workdir:
        model = write_model(workdir, [SyntheticTable(layer=1, rows=100_000, dtype="BF16", parts=4)])
        launcher = ServerLauncher(
            model, "--prewarm", "full", log_level="WARNING", cwd=REPO, die_with_parent=True
        )
        result = {"machine": machine(), "source": source(), "args": vars(args), "cases": []}
        with launcher.start() as server:
            server.wait_prewarm()
            print(
                f"{'case':>9} {'lookups/10s':>11} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>9} "
                f"{'server cpu':>10} {'attacks':>8} {'newcomers ok/failed':>19} {'others cpu':>10}"
            )
            for kind in cases:
                case = run_case(server, kind, args)
                result["cases"].append(case)
                nc = case["newcomers"]
                newcomers = f"{nc['ok']}/{len(nc['failures'])}" if nc else "-"
                print(
                    f"{kind:>9} {case['lookups_per_10s']:>11} {case['p50_ms']:>8.3f} "
                    f"{case['p99_ms']:>8.3f} {case['max_ms']:>9.3f} "
                    f"{100 * case['server_cpu']:>9.0f}% {case['attacks']:>8} "
                    f"{newcomers:>19} "
                    f"{100 * case['others_cpu']:>9.1f}%",
                    flush=True,
                )
                if nc and nc["failures"]:
                    print(f"          first failure: {nc['failures'][0]}")
            if not server.running:
                raise RuntimeError(f"the server died:\n{server.log_tail()}")
        result["loadavg_end"] = loadavg()
        save_json(result, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
