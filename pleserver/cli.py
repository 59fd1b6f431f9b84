"""The ``pleserver`` command: serve, config check, inspect, doctor, stats, demo."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, ClassVar

from pleclient import protocol as p

if TYPE_CHECKING:
    from pleclient.checkpoint import CheckpointError
    from pleserver.config import ConfigError

log = logging.getLogger("pleserver")


EX_CONFIG = 78  # sysexits.h: configuration error (the unit does not restart on it)


class _JournalFormatter(logging.Formatter):
    """No timestamp (journald adds its own) and a ``<N>`` syslog priority prefix
    on every line, which journald turns into the entry's priority."""

    PRIORITY: ClassVar[dict[int, int]] = {
        logging.DEBUG: 7,
        logging.INFO: 6,
        logging.WARNING: 4,
        logging.ERROR: 3,
        logging.CRITICAL: 2,
    }

    def format(self, record: logging.LogRecord) -> str:
        prio = self.PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def _stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd connected us to
    ($JOURNAL_STREAM names its device and inode)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError):
        return False


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if _stderr_is_journal():
        handler.setFormatter(_JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])


def cmd_serve(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import CheckpointError
    from pleserver.config import CONFIG_ENV, SETTINGS, ConfigError, load_config
    from pleserver.server import Server

    flags = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    try:
        loaded = load_config(args.config or os.environ.get(CONFIG_ENV) or None, flags)
    except ConfigError as exc:
        setup_logging("INFO")
        log.error("%s", exc)
        return EX_CONFIG
    setup_logging(loaded.config.log_level)
    # A watchdog kill is a SIGABRT: dump every thread's stack first (to stderr,
    # the journal), so a wedged server says where it was stuck.
    faulthandler.enable(all_threads=True)
    log.info(
        "configuration: %s%s",
        loaded.file or "defaults (no config file)",
        "; flags: " + " ".join(SETTINGS[n].flag for n in flags) if flags else "",
    )
    log.debug("effective configuration:\n%s", loaded.to_toml())
    try:
        return Server(loaded.config).run()
    except CheckpointError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("ple-server failed: %s", exc)
        return 2


def print_problems(as_json: bool, subject: dict, exc: ConfigError | CheckpointError) -> int:
    """Report a validation failure (an exception with ``problems``); exit code 1."""
    if as_json:
        print(json.dumps({**subject, "ok": False, "problems": exc.problems}, indent=1))
    else:
        print(exc, file=sys.stderr)
    return 1


def cmd_config_check(args: argparse.Namespace) -> int:
    from pleserver.config import ConfigError, load_config

    try:
        loaded = load_config(args.file)
    except ConfigError as exc:
        return print_problems(args.json, {"file": args.file}, exc)
    if args.json:
        print(
            json.dumps(
                {
                    "file": loaded.file,
                    "ok": True,
                    "config": loaded.to_dict(),
                    "sources": loaded.sources,
                },
                indent=1,
            )
        )
    else:
        print(loaded.to_toml(), end="")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import NVFP4, CheckpointError, discover_tables

    try:
        tables = discover_tables(args.model)
    except CheckpointError as exc:
        return print_problems(args.json, {"model": exc.model_dir}, exc)
    if args.json:
        print(
            json.dumps(
                {
                    "model": os.path.abspath(args.model),
                    "ok": True,
                    "tables": [
                        dict(
                            t.info(),
                            shards=len(t.shards),
                            bytes=t.nbytes,
                            files=t.files,
                            segments=[
                                {
                                    "name": seg.name,
                                    "tensor": f"shard_<i>.{seg.tensor}",
                                    "dtype": seg.dtype,
                                    "row_bytes": seg.row_bytes,
                                }
                                for seg in t.segments
                            ],
                            **({"global_scale": t.scale} if t.dtype == NVFP4 else {}),
                        )
                        for t in tables
                    ],
                },
                indent=1,
            )
        )
        return 0
    print(tables_text(tables))
    return 0


def tables_text(tables) -> str:
    """The ``pleserver inspect`` table of a checkpoint's PLE tables."""
    lines = [
        f"{'layer':>5} {'rows':>12} {'cols':>5} {'dtype':>8} {'row B':>6} {'shards':>6} "
        f"{'GiB':>8}  fingerprint  name"
    ]
    for t in tables:
        lines.append(
            f"{t.layer:>5} {t.rows:>12} {t.cols:>5} {t.dtype:>8} {t.row_bytes:>6} "
            f"{t.parts:>6} {t.nbytes / 2**30:>8.3f}  {t.fingerprint[:11]}  {t.name}"
        )
    for t in tables:
        if len(t.segments) > 1:  # NVFP4: say how a served row is made
            parts = " + ".join(
                f"{seg.row_bytes} B {seg.name.replace('_', ' ')} "
                f"({seg.dtype} shard_<i>.{seg.tensor})"
                for seg in t.segments
            )
            lines.append(
                f"layer {t.layer} {t.dtype}: {t.cols} columns served as {t.row_bytes}-byte rows = "
                f"{parts}; global scale weight_scale_2 = {t.scale!r}"
            )
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    from pleserver import doctor
    from pleserver.config import (
        CONFIG_ENV,
        DEFAULT_CONFIG_PATH,
        ConfigError,
        ServerConfig,
        load_config,
    )

    # The host's config, when there is one: the advice starts from its settings.
    path = args.config or os.environ.get(CONFIG_ENV) or None
    try:
        config = load_config(path, {"model": args.model} if args.model else {}).config
    except ConfigError as exc:
        if [p for p in exc.problems if not p.startswith("model: required")]:
            return print_problems(args.json, {"file": path or DEFAULT_CONFIG_PATH}, exc)
        config = ServerConfig()  # no model anywhere: the host checks only
    report = doctor.run(config.model or None, config, args.probe_seconds)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(doctor.format_report(report, tables_text(report.tables)))
    return 0 if report.ok else 1


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
    code, report = run_demo(cache_dir=args.cache_dir, seconds=args.seconds, clients=args.clients)
    if args.json:
        print(json.dumps(report))
        return code
    print(f"demo checkpoint: {report['model']}")
    print(
        f"{report['clients']} client processes, {report['seconds']:.0f} s: "
        f"{report['requests']} requests, {report['rows']} rows, "
        f"{report['mismatches']} mismatching, {report['errors']} errors"
    )
    print(format_human(report["stats"]))
    print(
        "server stopped cleanly"
        if report["server_exit_code"] == 0
        else f"server exited with code {report['server_exit_code']}"
    )
    print("demo OK" if code == 0 else "demo FAILED")
    return code


def build_parser() -> argparse.ArgumentParser:
    from pleserver import __version__
    from pleserver.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, SETTINGS

    parser = argparse.ArgumentParser(
        prog="pleserver",
        description=(
            "Serve PLE (n-gram embedding) tables from NVMe to vLLM workers over shared memory."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pleserver {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the ple-server daemon in the foreground",
        description="Run the daemon. Settings come from the defaults, "
        "then the config file, then these flags.",
    )
    serve.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML config file (default: "
        f"${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} when it exists)",
    )
    for s in SETTINGS.values():
        serve.add_argument(
            s.flag,
            dest=s.name,
            default=argparse.SUPPRESS,
            action="append" if s.repeatable else "store",
            metavar=s.metavar or s.name.split("_")[-1].upper(),
            help=s.help + (" Repeatable." if s.repeatable else ""),
        )
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser("config", help="work with the config file")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser(
        "check",
        help="validate a config file and print the effective configuration (exit 1 when invalid)",
    )
    check.add_argument(
        "file",
        nargs="?",
        default=os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH,
        help=f"default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH}",
    )
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_config_check)

    inspect = sub.add_parser("inspect", help="list and validate a checkpoint's PLE tables")
    inspect.add_argument("model")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=cmd_inspect)

    doctor = sub.add_parser(
        "doctor",
        help="check this host for ple-server and recommend settings",
        description="Check io_uring, O_DIRECT on the model's file system, memlock, "
        "transparent huge pages, memory against the planned row cache, the disk's "
        "random-read rate (a probe at queue depths 1, 64 and 128) and the checkpoint's "
        "tables; then recommend io, cache_size, read_engine and queue_depth, each with "
        "its reason. Exit status 1 when the checkpoint cannot be served.",
    )
    doctor.add_argument(
        "--model", metavar="DIR", help="the checkpoint (default: the config's model)"
    )
    doctor.add_argument(
        "--config",
        metavar="PATH",
        help=f"the config the advice starts "
        f"from (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} when it "
        "exists, else the defaults)",
    )
    doctor.add_argument(
        "--probe-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="how long the disk probe reads at each queue depth (default 2)",
    )
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(func=cmd_doctor)

    stats = sub.add_parser("stats", help="show a running server's statistics")
    stats.add_argument(
        "--socket", default=None, help=f"default: ${p.SOCKET_ENV} or {p.DEFAULT_SOCKET}"
    )
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
