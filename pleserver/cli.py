"""The ``pleserver`` command: serve, inspect, stats, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from pleclient import protocol as p

log = logging.getLogger("pleserver")


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``1.5T``, ``4096`` → bytes (binary units)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        return int(float(s[: len(s) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8G, 512M)") from None


def setup_logging(level: str) -> None:
    # journald stamps every line itself; elsewhere print our own timestamps.
    under_journal = bool(os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"))
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journal else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt,
                        stream=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> int:
    from pleserver.config import ServerConfig
    from pleserver.server import Server
    from pleclient.checkpoint import CheckpointError

    cfg = ServerConfig(model=args.model, socket=args.socket)
    for key in ("allow_uids", "allow_gids", "max_clients", "max_capacity", "prewarm",
                "prewarm_budget", "gather_workers", "spin_us", "metrics_address",
                "client_group"):
        value = getattr(args, key, None)
        if value is not None:
            setattr(cfg, key, value)
    setup_logging(args.log_level)
    try:
        return Server(cfg).run()
    except CheckpointError as exc:
        log.error("%s", exc)
        return 2


def cmd_inspect(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import CheckpointError, discover_tables

    try:
        tables = discover_tables(args.model)
    except CheckpointError as exc:
        if args.json:
            print(json.dumps({"model": exc.model_dir, "ok": False, "problems": exc.problems},
                             indent=1))
        else:
            print(exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"model": os.path.abspath(args.model), "ok": True,
                          "tables": [dict(t.info(), shards=len(t.shards), bytes=t.nbytes,
                                          files=t.files) for t in tables]}, indent=1))
        return 0
    print(f"{'layer':>5} {'rows':>12} {'cols':>5} {'dtype':>8} {'row B':>6} {'shards':>6} "
          f"{'GiB':>8}  fingerprint  name")
    for t in tables:
        print(f"{t.layer:>5} {t.rows:>12} {t.cols:>5} {t.dtype:>8} {t.row_bytes:>6} "
              f"{t.parts:>6} {t.nbytes / 2**30:>8.3f}  {t.fingerprint[:11]}  {t.name}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from pleclient import PleClient, PleError
    from pleserver.stats import format_human

    while True:
        try:
            stats = PleClient.query_stats(args.socket)
        except PleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(stats))
        else:
            print(format_human(stats))
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)
        if not args.json:
            print()


def cmd_demo(args: argparse.Namespace) -> int:
    from pleserver.demo import run_demo
    from pleserver.stats import format_human

    setup_logging(args.log_level)
    code, report = run_demo(cache_dir=args.cache_dir, seconds=args.seconds,
                            clients=args.clients)
    if args.json:
        print(json.dumps(report))
        return code
    print(f"demo checkpoint: {report['model']}")
    print(f"{report['clients']} client processes, {report['seconds']:.0f} s: "
          f"{report['requests']} requests, {report['rows']} rows, "
          f"{report['mismatches']} mismatching, {report['errors']} errors")
    print(format_human(report["stats"]))
    print("server stopped cleanly" if report["server_exit_code"] == 0 else
          f"server exited with code {report['server_exit_code']}")
    print("demo OK" if code == 0 else "demo FAILED")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pleserver", description=(
        "Serve PLE (n-gram embedding) tables from NVMe to vLLM workers over shared memory."))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ple-server daemon in the foreground")
    serve.add_argument("--model", required=True, help="model directory (safetensors)")
    serve.add_argument("--socket", default=p.DEFAULT_SOCKET, help="control socket path")
    serve.add_argument("--allow-uid", dest="allow_uids", type=int, action="append",
                       help="uid allowed to connect (repeatable)")
    serve.add_argument("--allow-gid", dest="allow_gids", type=int, action="append",
                       help="gid whose members may connect (repeatable)")
    serve.add_argument("--client-group", type=int, help="gid to share semaphores through")
    serve.add_argument("--max-clients", type=int)
    serve.add_argument("--max-capacity", type=int, help="largest rows per request")
    serve.add_argument("--prewarm", choices=["none", "full"])
    serve.add_argument("--prewarm-budget", type=parse_size, help="e.g. 16G")
    serve.add_argument("--gather-workers", type=int)
    serve.add_argument("--spin-us", type=int, help="spin before blocking when idle")
    serve.add_argument("--metrics-address", help="host:port for Prometheus metrics")
    serve.add_argument("--log-level", default="INFO")
    serve.set_defaults(func=cmd_serve)

    inspect = sub.add_parser("inspect", help="list and validate a checkpoint's PLE tables")
    inspect.add_argument("model")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_inspect)

    stats = sub.add_parser("stats", help="show a running server's statistics")
    stats.add_argument("--socket", default=None, help=f"default: ${p.SOCKET_ENV} or "
                       f"{p.DEFAULT_SOCKET}")
    stats.add_argument("--json", action="store_true")
    stats.add_argument("--watch", type=float, metavar="SECONDS")
    stats.set_defaults(func=cmd_stats)

    demo = sub.add_parser("demo", help="generate a demo checkpoint, serve it, drive it")
    demo.add_argument("--cache-dir", default=None)
    demo.add_argument("--seconds", type=float, default=3.0)
    demo.add_argument("--clients", type=int, default=2)
    demo.add_argument("--json", action="store_true")
    demo.add_argument("--log-level", default="WARNING")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
