# PYTHON_ARGCOMPLETE_OK (argcomplete's global completion completes this command)
"""The ``pleserver`` command: serve, config (check, show, default), inspect,
doctor, plan, stats, health, demo, files, completion.

The ``serve`` flags are generated from the settings' metadata
(``pleserver.ops.flags``); every other option is written out here, each with its
help and its default. Shell completion is argcomplete's: ``pleserver
completion SHELL`` prints its script, which runs this command to complete
(``main`` answers before parsing when argcomplete asks); the man page
(``man/pleserver.1``) is generated from ``build_parser``."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn, cast

from pleclient import protocol as p
from pleserver.observe import logs

if TYPE_CHECKING:
    from pleclient.checkpoint import CheckpointError
    from pleserver.config import ConfigError, ServerConfig

log = logging.getLogger("pleserver")


EX_CONFIG = 78  # sysexits.h: configuration error (the unit does not restart on it)
SHELLS = ("bash", "zsh", "fish")  # argcomplete's scripts for them (`pleserver completion`)
EXIT_SIGINT = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C


def cmd_serve(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import CheckpointError
    from pleserver.config import CONFIG_ENV, SETTINGS, ConfigError, env_settings, unknown_env
    from pleserver.control.reload import ConfigSource
    from pleserver.ops.flags import deprecations, given_settings
    from pleserver.server import Server

    flags = given_settings(args)
    env = env_settings(os.environ)
    # Kept for reloads (SIGHUP): they read the same file under the same
    # environment and flags.
    source = ConfigSource(args.config or os.environ.get(CONFIG_ENV) or None, flags, env)
    try:
        loaded = source.load()
    except ConfigError as exc:
        # In the format asked for, when that much of the configuration parsed:
        # a shipper expecting JSON gets the error as JSON too.
        logs.setup("INFO", exc.values.get("log_format", "text"))
        log.error("%s", exc)
        return EX_CONFIG
    logs.setup(loaded.config.log_level, loaded.config.log_format)
    for note in deprecations(args) + unknown_env(os.environ):
        log.warning("%s", note)
    # A watchdog kill is a SIGABRT: dump every thread's stack first (to stderr,
    # the journal), so a wedged server says where it was stuck.
    faulthandler.enable(all_threads=True)
    log.info(
        "configuration: %s%s%s",
        loaded.file or "defaults (no config file)",
        "; environment: " + " ".join(SETTINGS[n].env for n in env) if env else "",
        "; flags: " + " ".join(SETTINGS[n].flag for n in flags) if flags else "",
    )
    log.debug("effective configuration:\n%s", loaded.to_toml())
    try:
        return Server(loaded.config, source=source).run()
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
    from pleserver.config import (
        CONFIG_ENV,
        DEFAULT_CONFIG_PATH,
        SETTINGS,
        ConfigError,
        env_settings,
        load_config,
        unknown_env,
    )
    from pleserver.control.reload import diff, format_changes

    if args.socket is not None and not args.against_running:
        args.parser.error("--socket names the running server: it goes with --against-running")
    file = args.file or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH
    against: dict | None = None  # what the file is compared with, for the report
    old = None
    flags: dict = {}
    env = env_settings(os.environ)  # this shell's; the running server's with --against-running
    env_notes = unknown_env(os.environ)
    optional_file = False  # the running server's default file, read only if it exists
    if args.against_running:
        running = _running_config(args.socket)
        if isinstance(running, int):
            return running
        against, old, flags, env = running
        env_notes = []
        if args.file is None:  # the file a reload of that server reads
            file, optional_file = against["running"]["file"], not against["running"]["file_named"]
    elif args.against is not None:
        try:  # both files under this environment: only the files' differences show
            old = load_config(args.against, env=env).config
        except ConfigError as exc:
            return print_problems(args.json, {"file": file, "against": args.against}, exc)
        against = {"file": args.against}
    try:
        loaded = (
            load_config(None, flags, env=env, default_path=file)
            if optional_file
            else load_config(file, flags, env=env)
        )
    except ConfigError as exc:
        subject = {"file": file, **({"against": against} if against else {})}
        return print_problems(args.json, subject, exc)
    problems, warnings = setting_effects(loaded.config)
    warnings += env_notes
    report: dict = {
        "file": loaded.file,
        "ok": not problems,
        "config": loaded.to_dict(),
        "sources": loaded.sources,
        "warnings": warnings,
    }
    if problems:
        report["problems"] = problems
    if old is None:
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            for text in problems:
                print(f"error: {text}", file=sys.stderr)
            for text in warnings:
                print(f"warning: {text}", file=sys.stderr)
            print(loaded.to_toml(), end="")
        return 1 if problems else 0
    changes = diff(old, loaded.config)
    report.update(
        against=against,
        changes=[c.to_json() for c in changes],
        reload=[c.name for c in changes if c.reloadable],
        restart=[c.name for c in changes if not c.reloadable],
    )
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    assert against is not None  # (set with old)
    if "running" in against:
        server = against["running"]
        print(
            f"{file}: valid; against the running ple-server (pid {server['pid']}, "
            f"socket {server['socket']}):"
        )
        if server["file"] != file:
            print(f"note: that server reads {server['file']}: a reload reads that file, not {file}")
        if env:
            print(f"with its environment's {', '.join(SETTINGS[n].env for n in env)} over it")
        if flags:
            print(f"with its command line's {', '.join(SETTINGS[n].flag for n in flags)} over it")
    else:
        print(f"{file}: valid; against {against['file']}:")
    print(format_changes(changes), end="")
    return 0


def setting_effects(cfg: ServerConfig) -> tuple[list[str], list[str]]:
    """What a valid configuration still gets wrong on this host: problems (the
    model cannot be read: the server would not start) and warnings (settings
    that would have no effect, with the tables' sizes deciding ``io = auto``)."""
    from pleclient.checkpoint import CheckpointError, checkpoint_files, discover_tables
    from pleserver.box import this_box
    from pleserver.data import budget

    problems: list[str] = []
    warnings: list[str] = []
    io = cfg.io
    auto = ""  # what io = auto chose, and why
    if cfg.model:
        _, unreadable = checkpoint_files(cfg.model)
        problems += [f"model: {text}" for text in unreadable]
        if not unreadable and io == "auto":  # what auto would choose here, and why
            try:
                tables = discover_tables(cfg.model, fingerprint=False)
            except CheckpointError as exc:
                problems += [f"model: {text}" for text in exc.problems]
            else:
                box = this_box(cfg.gpu_memory)
                chosen = budget.plan(tables, "auto", cfg.cache_size, cfg.prewarm_reserve, box)
                io = chosen.io
                auto = f"io = auto chooses {io} on this host ({chosen.io_reason})"
    if cfg.prewarm == "full" and io in ("direct", "buffered"):
        why = auto if cfg.io == "auto" else f"io = {io}"
        warnings.append(
            f"prewarm = full has no effect: {why}; prewarm reads tables into the page cache "
            "for io = mmap, and a row cache is refilled from the saved hot set instead. "
            'Remove prewarm, or set io = "mmap" where the tables fit in memory'
        )
    # (With io = auto, cache_size is what the tables are weighed against.)
    if cfg.cache_size is not None and cfg.io == "mmap":
        warnings.append(
            "cache_size has no effect: io = mmap, and mapped tables have no row cache "
            "(the page cache serves them)"
        )
    return problems, warnings


def _running_config(socket_path: str | None) -> tuple[dict, ServerConfig, dict, dict] | int:
    """(what to call it, its configuration in effect, its command line's
    settings, its environment's) of the server on ``socket_path``, from its
    stats; else the exit status, the error printed."""
    from pleclient import PleClient, PleError
    from pleserver.config import SETTINGS
    from pleserver.control.reload import config_from_dict

    try:
        stats = PleClient.query_stats(socket_path)
    except PleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = stats.get("config")
    if not isinstance(report, dict) or not isinstance(report.get("settings"), dict):
        print(
            f"error: the ple-server at {stats.get('socket', socket_path)} (version "
            f"{stats.get('version', '?')}) does not report its configuration: it predates "
            "configuration reloads. Compare with its file instead (--against FILE), or "
            "restart it on this version",
            file=sys.stderr,
        )
        return 1
    # A setting of another version's command line that this one lacks cannot
    # be compared: left out (its key in the file would be reported unknown).
    flags = {k: v for k, v in (report.get("flags") or {}).items() if k in SETTINGS}
    env = {k: v for k, v in (report.get("env") or {}).items() if k in SETTINGS}
    against = {
        "running": {
            "pid": stats.get("pid"),
            "socket": stats.get("socket"),
            "file": report.get("file") or "",
            "file_named": bool(report.get("file_named", True)),
            "flags": flags,
            "env": {SETTINGS[k].env: v for k, v in env.items()},
        }
    }
    return against, config_from_dict(report["settings"]), flags, env


def cmd_config_show(args: argparse.Namespace) -> int:
    from pleserver.config import CONFIG_ENV, ConfigError, env_settings, load_config, unknown_env
    from pleserver.ops.flags import deprecations, given_settings

    for note in deprecations(args) + unknown_env(os.environ):
        print(f"warning: {note}", file=sys.stderr)
    path = args.config or os.environ.get(CONFIG_ENV) or None
    try:
        loaded = load_config(path, given_settings(args), env=env_settings(os.environ))
    except ConfigError as exc:
        return print_problems(args.json, {"file": path}, exc)
    if args.json:
        report = {"file": loaded.file, "ok": True, "config": loaded.to_dict()}
        print(json.dumps({**report, "sources": loaded.sources}, indent=1))
    else:
        print(loaded.to_toml(), end="")
    return 0


def cmd_config_default(args: argparse.Namespace) -> int:
    from pleserver.ops import deployfiles

    print(deployfiles.read("config.toml"), end="")
    return 0


def cmd_files(args: argparse.Namespace) -> int:
    from pleserver.ops import deployfiles

    folder = deployfiles.directory()
    if args.dir:
        print(folder)
    elif args.json:
        files = [
            {"path": str(folder / f.path), "installs_to": f.installs_to, "what": f.what}
            for f in deployfiles.FILES
        ]
        print(json.dumps({"dir": str(folder), "files": files}, indent=1))
    else:
        print(folder)
        path_width = max(len(f.path) for f in deployfiles.FILES)
        to_width = max(len(f.installs_to) for f in deployfiles.FILES)
        for f in deployfiles.FILES:
            print(f"  {f.path:<{path_width}}  → {f.installs_to:<{to_width}}  {f.what}")
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    import argcomplete

    # The script runs `pleserver` to complete (main answers it), so it stays
    # current through upgrades; "pleserver" as the command a user types.
    print(argcomplete.shellcode(["pleserver"], shell=args.shell).lstrip("\n"), end="")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import CheckpointError, discover_tables
    from pleclient.families.qwen4_exp import NVFP4

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
                                    "tensor": seg.tensor,
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
        if len(t.segments) > 1:  # NVFP4, Engram: say how a served row is made
            parts = " + ".join(
                f"{seg.row_bytes} B {seg.name.replace('_', ' ')} ({seg.dtype} {seg.tensor})"
                for seg in t.segments
            )
            scale = "" if t.scale is None else f"; global scale weight_scale_2 = {t.scale!r}"
            lines.append(
                f"layer {t.layer} {t.dtype}: {t.cols} columns served as {t.row_bytes}-byte rows = "
                f"{parts}{scale}"
            )
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    from pleserver.config import (
        CONFIG_ENV,
        DEFAULT_CONFIG_PATH,
        ConfigError,
        ServerConfig,
        env_settings,
        load_config,
    )
    from pleserver.ops import doctor

    # The host's config, when there is one: the advice starts from its settings
    # (the file's, under this environment's, as `serve` would read them).
    path = args.config or os.environ.get(CONFIG_ENV) or None
    try:
        config = load_config(
            path, {"model": args.model} if args.model else {}, env=env_settings(os.environ)
        ).config
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


def cmd_plan(args: argparse.Namespace) -> int:
    from pleclient.checkpoint import CheckpointError
    from pleserver.ops import sizing

    try:
        inputs = sizing.gather_inputs(
            model=args.model,
            tables=args.tables,
            weights=args.weights,
            memory=args.memory,
            unified=args.unified,
            row_bytes=args.row_bytes,
            utilization=args.gpu_memory_utilization,
            kv_cache=args.kv_cache,
            system=args.system,
            reserve=args.prewarm_reserve,
            io=args.io,
            clients=args.clients,
            hot_set=args.hot_set,
        )
    except sizing.PlanError as exc:
        args.parser.error(str(exc))
    except CheckpointError as exc:
        return print_problems(args.json, {"model": exc.model_dir}, exc)
    plan = sizing.make_plan(inputs)
    print(json.dumps(plan.to_json(), indent=1) if args.json else sizing.format_plan(plan))
    return 0 if plan.fits else 1


def stats_sockets(socket_path: str | None) -> list[str]:
    """The servers ``pleserver stats`` shows: the one named (``--socket``,
    else ``$PLE_SERVER_SOCKET``), or every socket in the directory named, else
    in the default socket directory (a host may run one server per model),
    else the default socket (so that its absence is what the error names)."""
    from pleclient.client import server_socket, sockets_in

    named = socket_path or os.environ.get(p.SOCKET_ENV)
    if named and not os.path.isdir(named):
        return [server_socket(named)]
    folder = named or os.path.dirname(p.DEFAULT_SOCKET)  # a directory: its every socket
    try:
        found = sockets_in(folder)
    except OSError:
        found = []
    return found or [named or p.DEFAULT_SOCKET]


def cmd_stats(args: argparse.Namespace) -> int:
    from pleclient import PleClient, PleError
    from pleserver.observe.snapshot import Snapshot
    from pleserver.observe.stats import format_human, format_interval, interval

    sockets = stats_sockets(args.socket)
    redraw = bool(args.watch) and not args.json and sys.stdout.isatty()
    last: dict[str, tuple[float, Snapshot]] = {}
    while True:
        blocks: list[tuple[dict, str]] = []
        failed = False
        for path in sockets:
            now = time.monotonic()
            try:
                # The STATS reply is the server's Snapshot, as JSON.
                stats = cast(Snapshot, PleClient.query_stats(path))
            except PleError as exc:
                if not args.watch:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                # Watching waits through a restart: say so, and look again.
                failed = True
                last.pop(path, None)
                blocks.append(({"socket": path, "error": str(exc)}, f"{path}: waiting: {exc}"))
                continue
            figures = None
            if path in last:
                then, before = last[path]
                figures = interval(before, stats, now - then)
            last[path] = (now, stats)
            text = format_human(stats)
            if figures is not None:
                text += "\n" + format_interval(figures)
            report: dict = {**stats, "interval": figures} if args.watch else dict(stats)
            blocks.append((report, text))
        if args.json:
            reports = [b[0] for b in blocks]
            print(json.dumps(reports[0] if len(sockets) == 1 else reports))
        else:
            if redraw:  # in place: home, then clear the screen
                sys.stdout.write("\x1b[H\x1b[2J")
            heading = len(sockets) > 1
            print("\n\n".join(f"== {b[0]['socket']}\n{b[1]}" if heading else b[1] for b in blocks))
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)  # Ctrl-C here: main() exits quietly with 130
        if not args.json and not redraw and not failed:
            print()


def cmd_health(args: argparse.Namespace) -> int:
    from pleserver.observe.health import ask

    healthy, said = ask(args.path, ready=args.ready, timeout=args.timeout)
    if healthy:
        print(said)
        return 0
    print(f"{'not ready' if args.ready else 'unhealthy'}: {said}", file=sys.stderr)
    return 1


def cmd_demo(args: argparse.Namespace) -> int:
    from pleserver.devkit.demo import headline, run_demo
    from pleserver.observe.stats import format_human

    logs.setup(args.log_level)
    code, report = run_demo(
        cache_dir=args.cache_dir,
        seconds=args.seconds,
        clients=args.clients,
        io=args.io,
        cache_size=args.cache_size,
    )
    if args.json:
        print(json.dumps(report))
        return code
    print(f"demo checkpoint: {report['model']}")
    print(
        f"{report['clients']} client processes, {report['seconds']:.0f} s: "
        f"{report['requests']} requests, {report['rows']} rows, "
        f"{report['mismatches']} mismatching, {report['errors']} errors"
    )
    print(headline(report["stats"]))
    print(format_human(report["stats"]))
    print(
        "server stopped cleanly"
        if report["server_exit_code"] == 0
        else f"server exited with code {report['server_exit_code']}"
    )
    print("demo OK" if code == 0 else "demo FAILED")
    return code


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors exit with ``usage_error_status``: ``serve``
    says 78 (EX_CONFIG), so that a unit with a bad flag is not restarted in a
    loop."""

    usage_error_status = 2

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(self.usage_error_status, f"{self.prog}: error: {message}\n")


SETTINGS_USAGE = "%(prog)s [-h] [--config PATH] [--model DIR] [--SETTING VALUE | --[no-]SWITCH ...]"
SETTINGS_EPILOG = """\
Every setting is also a key of the config file, with "_" for "-" (--max-clients: \
max_clients; --allow-uid and --allow-gid: allow_uids and allow_gids), in the same groups \
as `pleserver config default` prints, and a variable of the environment, PLE_SERVER_ and \
the key in capitals (PLE_SERVER_MAX_CLIENTS=8, PLE_SERVER_ALLOW_UIDS=alice,bob), written \
as on the command line; an empty one counts as unset. Flags override the environment, \
the environment the file, the file the defaults; "none" drops an optional value the \
file sets.

Values: sizes in bytes or with a binary unit (512M, 16G, 1.5T); durations as a number in \
the unit the name says (--spin-us 2000, --hello-timeout-s 5) or with a unit (500ms, 2s, \
50us, 10m, 1m30s); switches as --NAME or --no-NAME; users and groups as names or numbers."""


def build_parser() -> argparse.ArgumentParser:
    from pleserver import __version__
    from pleserver.box import SYSTEM_RESERVE, VLLM_GPU_MEMORY_UTILIZATION
    from pleserver.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, LOG_LEVELS, SETTINGS, format_size
    from pleserver.ops.flags import (
        HelpFormatter,
        add_setting_flags,
        complete,
        duration_type,
        size_type,
    )

    def command(parent, name: str, help: str, description: str | None = None, **kwargs):
        sub = parent.add_parser(
            name,
            help=help,
            description=description or help[:1].upper() + help[1:] + ".",
            formatter_class=HelpFormatter,
            **kwargs,
        )
        sub.set_defaults(parser=sub)  # the innermost command's: main() reports with it
        return sub

    def json_flag(parser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")

    config_default = f"${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH} when it exists"
    parser = _Parser(
        prog="pleserver",
        description=(
            "Serve PLE (n-gram embedding) tables from NVMe to vLLM workers over shared memory."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"pleserver {__version__}",
        help="print the version and exit",
    )
    parser.set_defaults(parser=parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = command(
        sub,
        "serve",
        "run the ple-server daemon in the foreground",
        "Run the daemon. Settings come from the defaults, then the config file, then "
        "the environment (PLE_SERVER_<KEY>), then these flags.\nA command-line error exits "
        "with status 78, as a bad config file does (systemd does not restart the unit for "
        "it).",
        usage=SETTINGS_USAGE,
        epilog=SETTINGS_EPILOG,
    )
    serve.usage_error_status = EX_CONFIG
    complete(
        serve.add_argument(
            "--config", metavar="PATH", help=f"TOML config file (default: {config_default})"
        ),
        "file",
    )
    add_setting_flags(serve)
    serve.set_defaults(func=cmd_serve)

    config = command(sub, "config", "check, show and print config files")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    check = command(
        config_sub,
        "check",
        "validate a config file and print the effective configuration (exit 1 when invalid)",
        "Validate a config file and print the effective configuration, each value with "
        "its source; exit status 1, and every problem, when it is invalid.\n"
        "With --against-running (or --against OLD): instead of the configuration, what "
        "a reload (systemctl reload ple-server, SIGHUP) would apply and what needs a "
        "restart, with the reason for each, as the server itself would log it.",
    )
    complete(
        check.add_argument(
            "file",
            nargs="?",
            default=None,
            help=f"the file to check (default: the running server's file with "
            f"--against-running, else ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
        ),
        "file",
    )
    against = check.add_mutually_exclusive_group()
    against.add_argument(
        "--against-running",
        action="store_true",
        help="compare with the configuration the running server is in, under the "
        "command-line flags it was started with (its stats say both)",
    )
    complete(
        against.add_argument(
            "--against",
            metavar="OLD",
            help="compare with the config file OLD (the one in effect), without flags",
        ),
        "file",
    )
    complete(
        check.add_argument(
            "--socket",
            metavar="PATH",
            default=None,
            help=f"the running server's control socket, with --against-running (default: "
            f"${p.SOCKET_ENV}, else {p.DEFAULT_SOCKET})",
        ),
        "file",
    )
    json_flag(check)
    check.set_defaults(func=cmd_config_check)
    show = command(
        config_sub,
        "show",
        "print the configuration `serve` would run with, given the same flags",
        "Print the effective configuration, each value with its source, that `pleserver "
        "serve` would run with given the same flags: paste a unit's ExecStart arguments "
        "after `config show`. Exit status 1 when it is invalid.",
        usage=SETTINGS_USAGE,
        epilog=SETTINGS_EPILOG,
    )
    complete(
        show.add_argument(
            "--config", metavar="PATH", help=f"TOML config file (default: {config_default})"
        ),
        "file",
    )
    json_flag(show)
    add_setting_flags(show)
    show.set_defaults(func=cmd_config_show)
    default = command(
        config_sub,
        "default",
        "print the default config file, every key documented",
        "Print the documented default config file (deploy/config.toml in the source "
        "tree): `pleserver config default > /etc/ple-server/config.toml`, then edit it.",
    )
    default.set_defaults(func=cmd_config_default)

    inspect = command(sub, "inspect", "list and validate a checkpoint's PLE tables")
    complete(
        inspect.add_argument(
            "model", metavar="DIR", help="the checkpoint directory (safetensors files)"
        ),
        "dir",
    )
    json_flag(inspect)
    inspect.set_defaults(func=cmd_inspect)

    doctor = command(
        sub,
        "doctor",
        "check this host for ple-server and recommend settings",
        "Check io_uring, O_DIRECT on the model's file system, memlock, transparent huge "
        "pages, memory against the planned row cache, the disk's random-read rate (a "
        "probe at queue depths 1, 64 and 128) and the checkpoint's tables; then "
        "recommend io, cache_size, read_engine and queue_depth, each with its reason.\n"
        "Exit status 1 when the checkpoint cannot be served.",
    )
    complete(
        doctor.add_argument(
            "--model", metavar="DIR", help="the checkpoint (default: the config's model)"
        ),
        "dir",
    )
    complete(
        doctor.add_argument(
            "--config",
            metavar="PATH",
            help=f"the config the advice starts from (default: {config_default}, "
            "else the defaults)",
        ),
        "file",
    )
    doctor.add_argument(
        "--probe-seconds",
        type=duration_type("s", minimum=0.001),
        default=2.0,
        metavar="DURATION",
        help="how long the disk probe reads at each queue depth, in seconds or with a "
        "unit (default: 2s)",
    )
    json_flag(doctor)
    doctor.set_defaults(func=cmd_doctor)

    plan = command(
        sub,
        "plan",
        "size ple-server for a box beside vLLM: io, cache_size, prewarm_budget",
        "Size ple-server for a box beside vLLM, with the arithmetic, each term on its "
        "line: what vLLM takes (on unified memory, --gpu-memory-utilization of the box: "
        "weights, KV cache and activations), what the system holds, what that leaves; "
        "then io, cache_size and prewarm_budget as the server would choose them there, "
        "and what ple-server needs beside its row cache. Nothing is measured or started: "
        "the box is this one (MemTotal, its GPU detected) unless --memory and --unified or "
        "--discrete describe another.\nExit status 1 when the numbers do not fit (each "
        "warning says what and the fix) or the checkpoint cannot be read.",
    )
    complete(
        plan.add_argument(
            "--model",
            metavar="DIR",
            help="the checkpoint: its PLE tables' size and rows, and its weights (the "
            "safetensors that are not PLE tables)",
        ),
        "dir",
    )
    plan.add_argument(
        "--tables", type=size_type, metavar="SIZE", help="the PLE tables' size, without --model"
    )
    plan.add_argument(
        "--weights",
        type=size_type,
        metavar="SIZE",
        help="the weights vLLM loads (default: from --model)",
    )
    plan.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=VLLM_GPU_MEMORY_UTILIZATION,
        metavar="U",
        help=f"vLLM's --gpu-memory-utilization (default: {VLLM_GPU_MEMORY_UTILIZATION}, "
        "vLLM's own)",
    )
    plan.add_argument(
        "--kv-cache",
        type=size_type,
        metavar="SIZE",
        help="the KV cache vLLM needs, checked against its share (on unified memory the "
        "share holds the weights and the KV cache both)",
    )
    plan.add_argument(
        "--memory",
        type=size_type,
        metavar="SIZE",
        help="the box's memory, for a box other than this one (with --unified or "
        "--discrete; default: this box's MemTotal)",
    )
    gpu = plan.add_mutually_exclusive_group()
    gpu.add_argument(
        "--unified",
        dest="unified",
        action="store_const",
        const=True,
        help="the GPU allocates from the box's memory (DGX Spark, GX10, Jetson) (default: "
        "detected on this box)",
    )
    gpu.add_argument(
        "--discrete",
        dest="unified",
        action="store_const",
        const=False,
        help="the GPU has memory of its own (default: detected on this box)",
    )
    plan.add_argument(
        "--system",
        type=size_type,
        default=SYSTEM_RESERVE,
        metavar="SIZE",
        help=f"what the OS and its services hold (default: {format_size(SYSTEM_RESERVE)})",
    )
    plan.add_argument(
        "--prewarm-reserve",
        type=size_type,
        default=SETTINGS["prewarm_reserve"].default,
        metavar="SIZE",
        help="the config's prewarm_reserve (default: "
        f"{format_size(SETTINGS['prewarm_reserve'].default)}, its default)",
    )
    plan.add_argument(
        "--io",
        choices=("auto", "direct", "buffered", "mmap"),
        default="auto",
        help="the config's io (default: auto: what the server would choose)",
    )
    plan.add_argument(
        "--clients",
        type=int,
        default=1,
        metavar="N",
        help="vLLM workers on the box, one channel each (default: 1)",
    )
    plan.add_argument(
        "--row-bytes",
        type=int,
        metavar="N",
        help="the tables' widest row, without --model (default: 320, BF16)",
    )
    plan.add_argument(
        "--hot-set",
        type=size_type,
        metavar="SIZE",
        help="the rows lookups keep coming back to: a warning when the row cache is smaller",
    )
    json_flag(plan)
    plan.set_defaults(func=cmd_plan)

    stats = command(sub, "stats", "show a running server's statistics")
    complete(
        stats.add_argument(
            "--socket",
            metavar="PATH",
            default=None,
            help=f"the server's control socket, or a directory: each socket in it (default: "
            f"${p.SOCKET_ENV}, else every socket in {os.path.dirname(p.DEFAULT_SOCKET)}/)",
        ),
        "file",
    )
    json_flag(stats)
    stats.add_argument(
        "--watch",
        type=duration_type("s", minimum=0.01),
        metavar="DURATION",
        help="show them again every DURATION (seconds, or 500ms, 2s) until Ctrl-C, with the "
        "rates of each interval; on a terminal in place. Waits through a server restart",
    )
    stats.set_defaults(func=cmd_stats)

    health = command(
        sub,
        "health",
        "ask a running server's health socket: an exec probe (exit 1 when unhealthy)",
        "Ask the server's health socket (health_socket) whether it is alive (/healthz: "
        "its serving and control loops run) or, with --ready, ready (/readyz: it "
        "serves). Exit status 0 and `ok` when it is; 1 and the reason otherwise, a "
        "server that does not answer included.\nFor Kubernetes exec probes: unlike the "
        "metrics port, only root and the server's own user can reach the socket, so no "
        "other local user can make the probe fail.",
    )
    complete(health.add_argument("path", metavar="PATH", help="the server's health_socket"), "file")
    health.add_argument(
        "--ready", action="store_true", help="ask /readyz (startup and readiness probes)"
    )
    health.add_argument(
        "--timeout",
        type=duration_type("s", minimum=0.01),
        default=5.0,
        metavar="DURATION",
        help="give up, unhealthy, after this long (default: 5s)",
    )
    health.set_defaults(func=cmd_health)

    demo = command(sub, "demo", "generate a demo checkpoint, serve it, drive it")
    complete(
        demo.add_argument(
            "--cache-dir",
            metavar="DIR",
            default=None,
            help="where the demo checkpoint is generated and kept "
            "(default: $XDG_CACHE_HOME/pleserver, else ~/.cache/pleserver)",
        ),
        "dir",
    )
    demo.add_argument(
        "--seconds",
        type=duration_type("s", minimum=0.0),
        default=3.0,
        metavar="DURATION",
        help="how long the clients drive the server, in seconds or with a unit (default: 3s)",
    )
    demo.add_argument(
        "--clients",
        type=int,
        default=2,
        metavar="N",
        help="client processes, each checking every row it gets",
    )
    demo.add_argument(
        "--io",
        choices=("direct", "buffered", "mmap"),
        default="direct",
        help="how the server reads rows (default: direct, with a row cache smaller than "
        "the tables: hits, misses and disk reads; mmap: the tables mapped and prewarmed)",
    )
    demo.add_argument(
        "--cache-size",
        default=None,
        metavar="SIZE",
        help="the row cache of direct and buffered (default: about a fifth of the demo tables)",
    )
    json_flag(demo)
    demo.add_argument(
        "--log-level",
        default="WARNING",
        choices=LOG_LEVELS,
        type=str.upper,
        help="the demo's own log level (the server logs warnings and errors)",
    )
    demo.set_defaults(func=cmd_demo)

    files = command(
        sub,
        "files",
        "list the unit files, snippets and default config this version ships",
        "List the files an operator installs, as this installation carries them: the "
        "systemd units, the sysusers.d and tmpfiles.d snippets and the default config, "
        "each with where it goes (deploy/README.md installs them).",
    )
    files.add_argument("--dir", action="store_true", help="print only their folder (for scripts)")
    json_flag(files)
    files.set_defaults(func=cmd_files)

    completion = command(
        sub,
        "completion",
        "print a shell completion script",
        "Print the completion script for SHELL (argcomplete's: it asks pleserver "
        "itself, so it stays current through upgrades).\n"
        "  bash: pleserver completion bash > /etc/bash_completion.d/pleserver\n"
        '  zsh:  pleserver completion zsh > "${fpath[1]}/_pleserver"\n'
        "  fish: pleserver completion fish > ~/.config/fish/completions/pleserver.fish",
    )
    completion.add_argument("shell", choices=SHELLS, help="the shell")
    completion.set_defaults(func=cmd_completion)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if argv is None and "_ARGCOMPLETE" in os.environ:
        # A shell asks for completions (`pleserver completion`'s script):
        # argcomplete answers and exits. Imported only then, as each command
        # imports what it needs.
        import argcomplete

        argcomplete.autocomplete(
            parser,
            always_complete_options=False,  # options once a "-" is typed, as git's
            # Nothing for a value that does not say what it is (a number, a
            # duration): files and folders are offered where complete() says so.
            default_completer=argcomplete.completers.ChoicesCompleter({}),
        )
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's own parser reports it, with its exit status
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C ends a long-running command (stats --watch, demo, doctor's
        # probe): quietly, with the shell's status for SIGINT.
        return EXIT_SIGINT
    except BrokenPipeError:
        # stdout closed early (`pleserver stats --watch 1 | head`): no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
