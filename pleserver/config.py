"""ple-server settings: the ``ServerConfig`` dataclass, and loading it.

Four layers, each overriding the one before it:

1. the defaults below;
2. the TOML file: ``--config PATH``, else ``$PLE_SERVER_CONFIG``, else
   ``/etc/ple-server/config.toml``. A missing default file is fine (defaults
   and flags only); a missing file named by the flag or the variable is an
   error;
3. the environment: ``PLE_SERVER_<KEY>`` (``PLE_SERVER_CACHE_SIZE=4G``), one
   variable per setting, written as on the command line (``env_settings``); an
   empty variable counts as unset, as a shell's ``VAR=`` means;
4. the ``pleserver serve`` flags.

Every setting has the same name everywhere: a top-level key in the file, a
field here, a flag with ``-`` for ``_`` (``max_clients`` → ``--max-clients``),
a variable in capitals (``PLE_SERVER_MAX_CLIENTS``). Two variables of the prefix
are not settings: ``PLE_SERVER_CONFIG`` names the file (``config`` can be no
setting's name), and ``PLE_SERVER_SOCKET`` is where clients and ``pleserver
stats`` look for the server, which is the ``socket`` setting's variable too: one
path, read by both ends.
The two lists are repeatable flags in the singular, ``--allow-uid`` and
``--allow-gid``; a list given on the command line replaces the file's list.
Each field's metadata (``_setting``) holds all the command line needs: the
kind of value, the help, the ``group`` it is listed in, a duration's unit;
``pleserver.cli`` generates the flags from it. ``deploy/config.toml``
documents every key, in sections that are the groups.

Values:
- sizes: an integer number of bytes, or a string with a binary unit
  (``"8G"``, ``"512M"``, ``"1.5T"``, ``"64KiB"``);
- users and groups: names or numbers; names are resolved with the host's
  user database when the config is loaded;
- durations: a number in the unit the key's name ends with (``spin_us`` in
  microseconds, ``hello_timeout_s`` in seconds; ``hotset_save_interval`` in
  seconds), or a string with units, ``"500ms"``, ``"2s"``, ``"50us"``,
  ``"10m"``, ``"1m30s"`` (``parse_duration``);
- ``socket_mode``: an integer (TOML ``0o666``) or an octal string (``"0666"``);
- switches (``cache_hugepages``, ``cache_mlock``): TOML ``true``/``false``, or
  ``true``/``false``/``yes``/``no``/``on``/``off``/``1``/``0`` as strings; on
  the command line ``--cache-mlock`` and ``--no-cache-mlock``;
- optional settings (``max_channel_memory``, ``prewarm_budget``, ``cache_size``,
  ``read_buffer_memory``, ``watchdog_s``, ``metrics_address``, ``health_socket``,
  ``lookup_trace``):
  leave the key out for none; ``"none"`` also means none (on the command line,
  to drop a value the file sets).

A bad configuration raises ``ConfigError`` listing every problem, each naming
the key and where its value came from (the file, the variable, or the flag).
"""

from __future__ import annotations

import difflib
import grp
import math
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pleclient import protocol as p

IDLE_WAITS = ("auto", "futex_waitv", "poll")

DEFAULT_CONFIG_PATH = "/etc/ple-server/config.toml"
CONFIG_ENV = "PLE_SERVER_CONFIG"  # names the file when --config does not
ENV_PREFIX = "PLE_SERVER_"  # PLE_SERVER_<KEY> sets a setting (env_settings)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
PREWARM_MODES = ("none", "full")
IO_MODES = ("auto", "direct", "buffered", "mmap")
GPU_MEMORY_MODES = ("auto", "unified", "discrete")
READ_ENGINES = ("auto", "io_uring", "threads")
UNIX_PATH_MAX = 107  # sun_path is 108 bytes, NUL included

# The settings' groups, in the order of `pleserver serve --help` and of
# deploy/config.toml's sections: key → (title, what the group is about).
GROUPS: dict[str, tuple[str, str]] = {
    "model": ("model and socket", "What to serve, and where clients connect."),
    "access": (
        "access",
        "Who may connect besides root and the server's own user (decided from the "
        "peer's credentials, SO_PEERCRED).",
    ),
    "channels": (
        "channels and limits",
        "One channel (shared memory) per client session; each vLLM worker holds one.",
    ),
    "sessions": ("sessions", "Sessions that hold a slot without using it are closed."),
    "io": ("io and cache", "How rows are read: io mode, row cache, miss engine."),
    "hotset": (
        "hot set and prewarm",
        "Refilling the row cache after a restart (direct, buffered), or the page "
        "cache at start (mmap).",
    ),
    "serving": ("serving loop", "The threads that answer requests, and how they wait."),
    "ops": ("logging and metrics", "The log, and the Prometheus endpoint."),
}
# A duration is a number in its setting's unit (the one its name ends with:
# spin_us in µs, hello_timeout_s in s), or a string of numbers with units,
# "500ms", "2s", "50us", "1m30s". Unit → seconds.
DURATION_UNITS: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def _setting(
    default: Any,
    kind: str,
    help: str,
    *,
    minimum: float | None = None,
    choices: tuple[str, ...] = (),
    optional: bool = False,
    flag: str | None = None,
    metavar: str | None = None,
    group: str | None = None,
    unit: str | None = None,
) -> Any:
    """A setting's field. ``group`` (a key of ``GROUPS``) places it in ``serve
    --help`` and in deploy/config.toml; left out, it is the group of the field
    before it. ``unit``: a duration's unit (``DURATION_UNITS``), the one a bare
    number is read in."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"no settings group {group!r}: one of {', '.join(GROUPS)}")
    if (kind == "duration") != (unit is not None) or (unit and unit not in DURATION_UNITS):
        raise ValueError(f"a duration, and only a duration, has a unit: {kind!r}, {unit!r}")
    meta = {
        "kind": kind,
        "help": help,
        "minimum": minimum,
        "choices": choices,
        "optional": optional,
        "flag": flag,
        "metavar": metavar,
        "group": group,
        "unit": unit,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServerConfig:
    model: str = _setting(
        "",
        "path",
        "Model directory holding the safetensors checkpoint (required).",
        metavar="DIR",
        group="model",
    )
    socket: str = _setting(
        p.DEFAULT_SOCKET,
        "socket",
        "Control socket path; the systemd unit's RuntimeDirectory (/run/ple-server) holds it.",
        metavar="PATH",
    )
    socket_mode: int = _setting(
        0o666,
        "mode",
        "Mode of the socket file. Access is decided from the peer's "
        "credentials (allow_uids/allow_gids), so the file itself may be open to all.",
        metavar="OCTAL",
    )
    allow_uids: list[int] = _setting(  # noqa: RUF009 - a field with a default_factory
        [],
        "uids",
        "Users (names or uids) that may connect, besides the server's own uid and root.",
        flag="--allow-uid",
        metavar="USER",
        group="access",
    )
    allow_gids: list[int] = _setting(  # noqa: RUF009
        [],
        "gids",
        "Groups (names or gids) whose members (primary or supplementary) may connect.",
        flag="--allow-gid",
        metavar="GROUP",
    )
    max_clients: int = _setting(
        64,
        "int",
        "Clients with a channel at most at once (each vLLM worker holds one); one "
        "session more is accepted, for `pleserver stats`. The last 2 are kept for root "
        "and the server's own uid.",
        minimum=1,
        group="channels",
    )
    max_clients_per_uid: int = _setting(
        32,
        "int",
        "Sessions (with a channel or not) one uid may hold at once, root and the "
        "server's own uid excepted; past it a new one gets TOO_MANY_CLIENTS. 32, half "
        "the default max_clients, so that one uid cannot lock out the others; raise it "
        "when every vLLM worker of the host runs as one uid and needs more.",
        minimum=1,
    )
    max_capacity: int = _setting(
        262144, "int", "Largest rows-per-request a client may ask for its channel.", minimum=1
    )
    default_capacity: int = _setting(
        p.DEFAULT_CAPACITY,
        "int",
        "Rows per request of a channel whose client asks "
        "for no capacity (lowered to max_capacity when only that is set).",
        minimum=1,
    )
    max_depth: int = _setting(
        p.MAX_DEPTH,
        "int",
        f"Most slots (requests in flight) a client may ask for "
        f"(the protocol allows {p.MAX_DEPTH}).",
        minimum=1,
    )
    default_depth: int = _setting(
        p.DEFAULT_DEPTH,
        "int",
        "Slots of a channel whose client asks for no depth "
        "(lowered to max_depth when only that is set).",
        minimum=1,
    )
    max_channel_bytes: int = _setting(
        1 << 30, "size", "Largest shared-memory segment one client may ask for.", minimum=1
    )
    max_channel_memory: int | None = _setting(
        None,
        "size",
        "Bytes of channel segments at most, all clients together; an "
        "open_channel past it gets NO_RESOURCES (none: 3/4 of the room under the "
        "service's memory limit, MemoryMax=, or of MemAvailable, at start, once the row "
        "cache has taken its budget).",
        minimum=0,
        optional=True,
    )
    chunk_rows: int = _setting(
        4096,
        "int",
        "Rows the serving loop gathers for one client before it looks at "
        "the others: a small request waits for at most one such chunk.",
        minimum=1,
        group="serving",
    )
    hint_queue_rows: int = _setting(
        65536,
        "int",
        "Prefetch hints: row ids queued to be read into the row cache, at most, "
        "all clients together; a hint past it is dropped (and counted). Hints are "
        "read only while no lookup waits for the disk.",
        minimum=1,
    )
    hint_rate: int = _setting(
        4000,
        "int",
        "Prefetch hints: hint requests the serving loop takes at most a second, all "
        "clients together, each channel's in turn (a hint of more than 1 024 ids counts "
        "once more for each further 1 024); past it a hint waits in its slot. vLLM's "
        "prompt-ahead sends a few a prompt; a flood of hints waits instead of keeping "
        "the loop from lookups.",
        minimum=1,
    )
    hello_timeout_s: float = _setting(
        5.0,
        "duration",
        "A session that has not said hello this long after connecting is closed.",
        minimum=0.01,
        group="sessions",
        unit="s",
    )
    idle_timeout_s: float = _setting(
        60.0,
        "duration",
        "A session without a channel that sends nothing for this long is closed.",
        minimum=0.01,
        unit="s",
    )
    frame_timeout_s: float = _setting(
        10.0,
        "duration",
        "A control frame must arrive whole within this long of its "
        "first byte, else the session is closed.",
        minimum=0.01,
        unit="s",
    )
    prewarm: str = _setting(
        "none",
        "choice",
        "'none' or 'full': read the tables into the page cache at "
        "start (in the background, after readiness).",
        choices=PREWARM_MODES,
        group="hotset",
    )
    prewarm_budget: int | None = _setting(
        None, "size", "Bytes at most to prewarm (none: the whole tables).", minimum=0, optional=True
    )
    prewarm_reserve: int = _setting(
        4 << 30, "size", "Stop prewarming when MemAvailable falls under this many bytes.", minimum=0
    )
    io: str = _setting(
        "auto",
        "choice",
        "How rows are read: 'direct' (row cache, misses read with "
        "O_DIRECT), 'buffered' (row cache, misses read through the page cache), 'mmap' "
        "(the files mapped; for tables that fit in memory), or 'auto': mmap when the "
        "tables fit in cache_size, or without it in this box's default budget (from its "
        "total memory, never from what is free at start), direct otherwise.",
        choices=IO_MODES,
        group="io",
    )
    cache_size: int | None = _setting(
        None,
        "size",
        "Bytes of the row cache (direct and buffered modes; auto compares "
        "the tables against it). None: a quarter of the box's memory (MemTotal, or the "
        "cgroup's limit when smaller), at most a quarter of the memory available at start, "
        "each less prewarm_reserve; on unified memory at most half of what vLLM's default "
        "0.9 share and 6 GiB for the system leave; at most what the tables need.",
        minimum=64 << 10,
        optional=True,
    )
    gpu_memory: str = _setting(
        "auto",
        "choice",
        "Whether the GPU allocates from this RAM: 'unified' (DGX Spark, GX10, Jetson), "
        "'discrete' (a GPU with memory of its own, or none), or 'auto': detected, the log "
        "says how. On unified memory the default cache_size leaves vLLM its default "
        "share (`pleserver plan` sizes it for another).",
        choices=GPU_MEMORY_MODES,
    )
    cache_hugepages: bool = _setting(
        True,
        "bool",
        "Back the row cache with huge pages where the kernel has them "
        "(fewer TLB misses on random rows).",
    )
    cache_mlock: bool = _setting(
        False, "bool", "Lock the row cache in memory (needs LimitMEMLOCK= above cache_size)."
    )
    resident_scales: bool = _setting(
        True,
        "bool",
        "In direct and buffered io, keep a table's scale segments (an NVFP4 table's block "
        "scales, an MXFP8 Engram table's UE8M0 scales: every segment of a row after its "
        "values) in memory, read once at start: a missed row then costs one disk read, not "
        "two. They are 1/9 of an NVFP4 table's bytes and 1/33 of an Engram table's; the "
        "default row cache is sized from the memory left beside them.",
    )
    queue_depth: int = _setting(
        128,
        "int",
        "Disk reads in flight at most, every request together (the miss engine's queue "
        "depth); requests of at most 64 reads may put up to 64 more in flight (at most "
        "queue_depth), so a small lookup's reads never wait for a large one's to finish.",
        minimum=1,
    )
    read_engine: str = _setting(
        "auto",
        "choice",
        "Miss engine: 'io_uring', 'threads' (a pool of pread threads), "
        "or 'auto': io_uring, else threads when the kernel or a seccomp profile refuses "
        "it.",
        choices=READ_ENGINES,
    )
    read_threads: int = _setting(
        16, "int", "pread threads of the 'threads' miss engine.", minimum=1
    )
    read_buffer_memory: int | None = _setting(
        None,
        "size",
        "Bytes the miss engine's read buffers may hold, every request together "
        "(direct and buffered modes); a read past it waits for a buffer given back. "
        "None: a quarter of the room beside the row cache at start, at most what the "
        "gather threads can use (≈ 17.5 MiB each); counted before the channels' budget.",
        minimum=4 << 20,
        optional=True,
    )
    state_dir: str = _setting(
        "/var/lib/ple-server",
        "path",
        "Where the hot set (the cached row ids) is saved; "
        "the unit's StateDirectory=. Not created: when it is missing, the hot set is not "
        "saved.",
        metavar="DIR",
        group="hotset",
    )
    hotset_save_interval: float = _setting(
        600.0,
        "duration",
        "Time between saves of the hot set (0: only at stop).",
        minimum=0,
        unit="s",
    )
    gather_workers: int = _setting(
        4,
        "int",
        "Threads that answer the requests the serving loop hands off (those "
        "with cache misses, and large ones); also how many native threads split one "
        "large request.",
        minimum=1,
        group="serving",
    )
    parallel_min_rows: int = _setting(
        16384,
        "int",
        "Requests of at least this many rows are handed off whole (not "
        "chunked, see chunk_rows) and split over gather_workers native threads.",
        minimum=1,
    )
    gather_in_order: bool = _setting(
        True,
        "bool",
        "GPU-driven channels: begin reading a request's cache misses only once the "
        "channel's earlier requests have their rows. A step rings its PLE layers in "
        "layer order; read one after another, the first layer's rows come after its own "
        "reads alone, not after every layer's.",
    )
    dedup_min_rows: int = _setting(
        4096,
        "int",
        "mmap mode: requests of at least this many rows on a table not "
        "fully prewarmed are deduplicated and read in ascending row order.",
        minimum=1,
    )
    spin_us: int = _setting(
        2000,
        "duration",
        "How long the serving loop spins after the last lookup before it blocks "
        "(0: never spin); only after lookups of CPU-driven channels: a GPU's are "
        "looked for every gpu_poll_us, and a hint's client waits for nothing.",
        minimum=0,
        unit="us",
    )
    gpu_poll_us: int = _setting(
        50,
        "duration",
        "How often the serving loop looks at the doorbells of GPU-driven "
        "channels once it stops spinning (a GPU cannot wake it); after 0.1 s "
        "without a lookup's doorbell (hints do not count), every millisecond.",
        minimum=1,
        unit="us",
    )
    max_gpu_slots_per_uid: int = _setting(
        1024,
        "int",
        "GPU-driven slots (the depths of GPU-driven channels) one uid may hold "
        "at once, all its sessions together: the serving loop polls them, since a GPU "
        "cannot wake it. An open_channel past it gets CHANNEL_LIMIT.",
        minimum=1,
    )
    idle_wait: str = _setting(
        "auto",
        "choice",
        "How the idle serving loop waits for submits: futex_waitv "
        "(sleeps on every channel at once; Linux 5.16+), poll (looks every 0.5 ms), or "
        "auto (futex_waitv where the kernel has it).",
        choices=IDLE_WAITS,
    )
    watchdog_s: float | None = _setting(
        None,
        "duration",
        "Longest gap between systemd watchdog pings (none: half of the "
        "unit's WatchdogSec, from WATCHDOG_USEC); the serving loop pings at least once a "
        "second either way.",
        minimum=0.01,
        optional=True,
        unit="s",
    )
    metrics_address: str | None = _setting(
        None,
        "address",
        "host:port for the Prometheus endpoint (none: disabled).",
        optional=True,
        metavar="HOST:PORT",
        group="ops",
    )
    metrics_max_connections: int = _setting(
        32,
        "int",
        "Connections to the metrics port at most at once (a scraper and the probes "
        "need a few). Past it a new one takes the place of the one sending its request "
        "head the longest, of the address holding the most such, so half-sent requests "
        "cannot keep a probe or a scrape out; it gets 503 only when every place holds a "
        "whole request. /metrics requests hold 3/4 of the places at most, one address "
        "half of that.",
        minimum=1,
    )
    metrics_timeout_s: float = _setting(
        5.0,
        "duration",
        "A metrics request must arrive whole, and its answer be taken, within this "
        "long, else its connection is closed.",
        minimum=0.01,
        unit="s",
    )
    health_socket: str | None = _setting(
        None,
        "socket",
        "Unix socket answering /healthz and /readyz for exec probes (`pleserver health "
        "[--ready] PATH`), for root and the server's own uid only (mode 0600): unlike "
        "the metrics port, no other local user can make a probe through it fail. "
        "None: no health socket (the metrics port still answers both).",
        optional=True,
        metavar="PATH",
    )
    lookup_trace: str | None = _setting(
        None,
        "path",
        "Keep when each answered request was admitted, gathered, handed to a worker "
        "and answered, and write these records (NumPy .npy, at most 4 M of 48 bytes) "
        "to this file when the server stops: for finding where a client's step waits "
        "(bench/real_vllm/coordinator.py reads it). None: no trace.",
        optional=True,
        metavar="FILE",
    )
    log_level: str = _setting(
        "INFO", "choice", "What the log shows: INFO and above by default.", choices=LOG_LEVELS
    )
    log_format: str = _setting(
        "text",
        "choice",
        "'text': one line per entry, as a person reads it; 'json': one JSON object per "
        "line with the journal's field names (MESSAGE, PRIORITY, LOGGER, TIMESTAMP, …), "
        "for log shippers. On the journal, text lines drop their timestamp, and either "
        "format keeps its priority prefix.",
        choices=LOG_FORMATS,
    )


@dataclass(frozen=True)
class Setting:
    """One configuration key, as the loader and the command line see it."""

    name: str
    kind: str
    help: str
    default: Any
    minimum: float | None
    choices: tuple[str, ...]
    optional: bool
    flag: str
    metavar: str | None
    group: str  # a key of GROUPS
    unit: str | None  # a duration's unit

    @property
    def repeatable(self) -> bool:
        return self.kind in ("uids", "gids")

    @property
    def env(self) -> str:
        """Its environment variable: ``PLE_SERVER_MAX_CLIENTS``."""
        return ENV_PREFIX + self.name.upper()

    def format(self, value: Any) -> str:
        """A value as a person writes it: ``1G``, ``2ms``, ``0o666``, ``auto``."""
        if value is None:
            return "none"
        if isinstance(value, list):
            return ", ".join(str(v) for v in value) or "none"
        if self.kind == "size":
            return format_size(value)
        if self.kind == "duration":
            assert self.unit is not None
            return format_duration(value * DURATION_UNITS[self.unit])
        if self.kind == "mode":
            return f"0o{value:03o}"
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)


SETTINGS: dict[str, Setting] = {}
_group = next(iter(GROUPS))
for _f in fields(ServerConfig):
    _m = _f.metadata
    _group = _m["group"] or _group  # left out: the group of the field before
    SETTINGS[_f.name] = Setting(
        _f.name,
        _m["kind"],
        _m["help"],
        _f.default_factory() if callable(_f.default_factory) else _f.default,
        _m["minimum"],
        _m["choices"],
        _m["optional"],
        _m["flag"] or "--" + _f.name.replace("_", "-"),
        _m["metavar"],
        _group,
        _m["unit"],
    )
    # $PLE_SERVER_CONFIG names the file: a setting by that name could never be
    # set from the environment. ($PLE_SERVER_SOCKET is the socket setting's, on
    # purpose: module docstring.)
    if SETTINGS[_f.name].env == CONFIG_ENV:
        raise ValueError(f"a setting cannot be named {_f.name!r}: {CONFIG_ENV} names the file")


class ConfigError(ValueError):
    """The configuration is invalid; ``problems`` holds one line per problem.
    ``values``: the settings that did parse (name → value), so that ``serve``
    can report the error in the log format asked for."""

    def __init__(self, problems: list[str], values: Mapping[str, Any] | None = None) -> None:
        self.problems = problems
        self.values = dict(values or {})
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


@dataclass
class LoadedConfig:
    """The effective configuration and where each value came from."""

    config: ServerConfig
    sources: dict[str, str]  # key → "default", the file's path, "$VARIABLE" or the flag
    file: str | None  # the file that was read, None when none was

    def to_dict(self) -> dict[str, Any]:
        return asdict(self.config)

    def to_toml(self) -> str:
        """The effective configuration as a TOML file, each key's source beside it."""
        layers = " < ".join(
            [
                "defaults",
                *([self.file] if self.file else []),
                *(["environment"] if any(s.startswith("$") for s in self.sources.values()) else []),
                *(
                    ["command line"]
                    if any(s.startswith("--") for s in self.sources.values())
                    else []
                ),
            ]
        )
        lines = [f"# effective ple-server configuration ({layers})"]
        for name, value in self.to_dict().items():
            source = self.sources[name]
            if value is None:
                lines.append(f"# {name} = (none)".ljust(40) + f"  # {source}")
            else:
                lines.append(f"{name} = {_toml_value(name, value)}".ljust(40) + f"  # {source}")
        return "\n".join(lines) + "\n"


# -------------------------------------------------------------------- loading
def env_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings ``environ`` gives (setting name → raw value): each
    ``PLE_SERVER_<KEY>`` that is set and not empty."""
    return {name: environ[s.env] for name, s in SETTINGS.items() if environ.get(s.env, "").strip()}


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A note for each ``PLE_SERVER_*`` variable that is no setting (a typo),
    with the setting it most likely means. Not an error: the environment is
    shared with other programs, and a variable of the prefix may be theirs."""
    from pleserver.host import MEMINFO_ENV  # (states the memory figures: not a setting)

    known = {s.env for s in SETTINGS.values()} | {CONFIG_ENV, MEMINFO_ENV}
    notes = []
    for var in sorted(environ):
        if var.startswith(ENV_PREFIX) and var not in known:
            close = difflib.get_close_matches(var, sorted(known), n=1)
            hint = (
                f"did you mean {close[0]}?"
                if close
                else "`pleserver serve --help` lists each setting's variable"
            )
            notes.append(f"{var} is not a setting's variable and is ignored ({hint})")
    return notes


def load_config(
    path: str | None = None,
    flags: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, Any] | None = None,
    default_path: str = DEFAULT_CONFIG_PATH,
) -> LoadedConfig:
    """Defaults, then the file (``path``, else ``default_path`` if it exists),
    then ``env`` (setting name → raw value, as ``env_settings`` reads them from
    the environment), then ``flags`` (setting name → raw value as the command
    line gave it). Raises ``ConfigError`` naming every bad key and its source."""
    problems: list[str] = []
    raw: dict[str, tuple[Any, str]] = {}  # name → (raw value, source)
    file = path or default_path
    explicit = path is not None
    data: dict[str, Any] | None = None
    try:
        with open(file, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(
                [
                    f"{file}: no such config file; create it (deploy/config.toml "
                    "in the source tree is a documented example) or name "
                    "another file"
                ]
            ) from None
    except IsADirectoryError:
        raise ConfigError([f"{file}: is a directory, not a config file"]) from None
    except PermissionError:
        raise ConfigError(
            [
                f"{file}: not readable by uid {os.geteuid()}; make it readable "
                "(e.g. chmod 0644, or group ple-server)"
            ]
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{file}: not valid TOML: {exc}"]) from None
    except OSError as exc:
        raise ConfigError([f"{file}: cannot read it: {exc.strerror or exc}"]) from None
    if data is not None:
        for key, value in data.items():
            if key in SETTINGS:
                raw[key] = (value, file)
            else:
                problems.append(f"{file}: unknown key {key!r}{_suggest(key, value)}")
    for layer, named in ((env, "env"), (flags, "flag")):
        for name, value in (layer or {}).items():
            if name not in SETTINGS:
                raise ValueError(f"no setting named {name!r}")  # a caller's bug, not the user's
            s = SETTINGS[name]
            raw[name] = (value, "$" + s.env if named == "env" else s.flag)

    values: dict[str, Any] = {}
    sources = {name: "default" for name in SETTINGS}
    for name, (value, source) in raw.items():
        try:
            values[name] = _parse(SETTINGS[name], value)
            sources[name] = source
        except _Invalid as exc:
            problems.append(f"{_where(source, name)}: {exc}")
    config = ServerConfig(**values)
    problems += _check_together(config, sources)
    if problems:
        raise ConfigError(problems, values)
    return LoadedConfig(config, sources, file if data is not None else None)


def parse_size(text: str | int) -> int:
    """``8G``, ``512M``, ``1.5T``, ``64KiB``, ``4096`` → bytes (binary units).
    Raises ``ValueError`` for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (examples: 8G, 512M, 4096)")
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        number = float(s[: len(s) - len(unit)])
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"not a size: {text!r} (examples: 8G, 512M, 4096)")
    return int(number * units[unit])


_DURATION_PART = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str | float, unit: str = "s") -> float:
    """A duration in ``unit`` (a key of ``DURATION_UNITS``): a number is in
    ``unit`` already; a string is a number in ``unit`` (``"2000"``) or numbers
    with units, ``"500ms"``, ``"2s"``, ``"50us"``, ``"1m30s"``, ``"-1s"``.
    Raises ``ValueError`` for anything else."""
    how = 'a number, or one with a unit: "500ms", "2s", "50us", "1m30s"'
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    elif isinstance(text, str):
        body = text.strip()
        sign = -1.0 if body.startswith("-") else 1.0
        body = body.removeprefix("-").removeprefix("+")
        try:
            value = float(body)  # no unit: the setting's own
        except ValueError:
            seconds, end = 0.0, 0
            for m in _DURATION_PART.finditer(body):
                if m.start() != end:
                    break
                seconds += float(m.group(1)) * DURATION_UNITS[m.group(2)]
                end = m.end()
            if end == 0 or end != len(body):
                raise ValueError(f"not a duration: {text!r} ({how})") from None
            value = seconds / DURATION_UNITS[unit]
        value *= sign
    else:
        raise ValueError(f"not a duration: {text!r} ({how})")
    if not math.isfinite(value):
        raise ValueError(f"not a finite duration: {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """Seconds in the largest unit that keeps a whole number, as
    ``parse_duration`` reads it back: ``2ms``, ``50us``, ``10m``, ``0.25s``."""
    if seconds == 0:
        return "0s"
    for unit in ("h", "m", "s", "ms", "us", "ns"):
        count = seconds / DURATION_UNITS[unit]
        if abs(count) >= 1 and math.isclose(count, round(count), rel_tol=1e-9, abs_tol=1e-9):
            return f"{round(count)}{unit}"
    return f"{seconds:g}s"


def format_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number, as
    ``parse_size`` reads it back: ``1G``, ``64M``, ``4096``."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def parse_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9478"``, ``"[::1]:9478"``, ``"localhost:0"`` → (host, port).

    An IPv6 address goes in brackets: unbracketed, ``::1:9478`` could be the
    address ``::1:9478`` with no port. Raises ``ValueError`` saying what is wrong."""
    how = "write it like 127.0.0.1:9478, [::1]:9478 or localhost:9478"
    if not isinstance(text, str):
        raise ValueError(f'must be "host:port" ({how}), got {text!r}')
    host, sep, port = text.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not port or text.strip().endswith("]"):
        why = "no port"
    elif not host:
        why = "no host"
    elif not bracketed and ("[" in host or "]" in host):
        why = "unbalanced brackets around the host"
    elif not bracketed and ":" in host:
        why = f"an IPv6 address goes in brackets: [{host}]:{port}"
    elif not (port.isascii() and port.isdigit() and int(port) <= 65535):
        why = f"the port {port!r} is not a number from 0 to 65535"
    else:
        return host, int(port)
    raise ValueError(f'{text!r} is not "host:port" ({why}); {how}')


# ------------------------------------------------------------------- parsing
class _Invalid(ValueError):
    pass


def _where(source: str, name: str) -> str:
    """How a problem names its value: ``--flag``, ``$PLE_SERVER_KEY`` or ``file: key``."""
    return source if source.startswith(("--", "$")) else f"{source}: {name}"


def _suggest(key: str, value: Any) -> str:
    if isinstance(value, dict):
        return " (settings are top-level keys; this file has a [table] section)"
    close = difflib.get_close_matches(key, SETTINGS, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return " (the keys are listed in deploy/config.toml and `pleserver serve --help`)"


def _parse(s: Setting, value: Any) -> Any:
    if s.optional and isinstance(value, str) and value.strip().lower() in ("none", ""):
        return None
    parse = _PARSERS[s.kind]
    result = parse(s, value)
    if s.minimum is not None and result < s.minimum:
        raise _Invalid(f"must be at least {s.format(s.minimum)}, got {value!r}")
    return result


def _int(s: Setting, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _Invalid(f"must be an integer, got {value!r}")


def _size(s: Setting, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _Invalid(f'must be a size in bytes or a string like "8G", got {value!r}')
    try:
        return parse_size(value)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


def _float(s: Setting, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise _Invalid(f"must be a number, got {value!r}") from None
    else:
        raise _Invalid(f"must be a number, got {value!r}")
    if not math.isfinite(result):
        raise _Invalid(f"must be a finite number, got {value!r}")
    return result


def _duration(s: Setting, value: Any) -> float | int:
    assert s.unit is not None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Invalid(
            f'must be a duration like "500ms", "2s" or a number of {s.unit}, got {value!r}'
        )
    try:
        result = parse_duration(value, s.unit)
    except ValueError as exc:
        raise _Invalid(f"{exc}; a bare number is in {s.unit}") from None
    # Settings kept in whole units (spin_us) stay integers.
    return round(result) if isinstance(s.default, int) else result


def _choice(s: Setting, value: Any) -> str:
    if isinstance(value, str):
        for choice in s.choices:
            if value.strip().lower() == choice.lower():
                return choice
    raise _Invalid(f"must be one of {', '.join(s.choices)}; got {value!r}")


def _bool(s: Setting, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
    raise _Invalid(f"must be true or false, got {value!r}")


def _path(s: Setting, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid(f"must be a non-empty path string, got {value!r}")
    return value


def _socket(s: Setting, value: Any) -> str:
    path = _path(s, value)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise _Invalid(
            f"path is {len(os.fsencode(path))} bytes; a Unix socket path has at "
            f"most {UNIX_PATH_MAX}: choose a shorter one"
        )
    return path


def _mode(s: Setting, value: Any) -> int:
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str):
        try:
            mode = int(value.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            pass
    if mode is None or not 0 <= mode <= 0o777:
        raise _Invalid(f'must be a permission mode like 0o666 (TOML) or "0666", got {value!r}')
    return mode


def _ids(value: Any, lookup, what: str) -> list[int]:
    items = value if isinstance(value, list) else [value]
    result: list[int] = []
    for item in items:
        parts = item.split(",") if isinstance(item, str) else [item]
        for part in parts:
            if isinstance(part, str):
                part = part.strip()
                if not part:
                    continue
                if part.isdigit():
                    part = int(part)
            if isinstance(part, int) and not isinstance(part, bool):
                if part < 0:
                    raise _Invalid(f"{what} ids are not negative, got {part}")
                result.append(part)
            elif isinstance(part, str):
                try:
                    result.append(lookup(part))
                except KeyError:
                    raise _Invalid(
                        f"no {what} named {part!r} on this host; create it or give its number"
                    ) from None
            else:
                raise _Invalid(f"must be {what} names or numbers, got {item!r}")
    return list(dict.fromkeys(result))


def _uids(s: Setting, value: Any) -> list[int]:
    return _ids(value, lambda name: pwd.getpwnam(name).pw_uid, "user")


def _gids(s: Setting, value: Any) -> list[int]:
    return _ids(value, lambda name: grp.getgrnam(name).gr_gid, "group")


def _address(s: Setting, value: Any) -> str:
    try:
        parse_host_port(value)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    return value.strip()


_PARSERS: dict[str, Callable[[Setting, Any], Any]] = {
    "int": _int,
    "size": _size,
    "float": _float,
    "duration": _duration,
    "bool": _bool,
    "choice": _choice,
    "path": _path,
    "socket": _socket,
    "mode": _mode,
    "uids": _uids,
    "gids": _gids,
    "address": _address,
}


def _check_together(cfg: ServerConfig, sources: dict[str, str]) -> list[str]:
    """Checks across settings; a default that only conflicts with a set limit
    follows the limit instead."""
    problems = []
    if not cfg.model:
        problems.append(
            'model: required; set `model = "/path/to/checkpoint"` in the '
            "config file, PLE_SERVER_MODEL in the environment, or pass --model DIR"
        )
    if cfg.max_depth > p.MAX_DEPTH:
        problems.append(
            f"{_where(sources['max_depth'], 'max_depth')}: at most "
            f"{p.MAX_DEPTH} (the protocol's limit), got {cfg.max_depth}"
        )
    for name, most in (("queue_depth", 4096), ("read_threads", 256), ("gather_workers", 256)):
        if getattr(cfg, name) > most:  # the native data plane's limits
            problems.append(
                f"{_where(sources[name], name)}: at most {most}, got {getattr(cfg, name)}"
            )
    for default, limit in (("default_capacity", "max_capacity"), ("default_depth", "max_depth")):
        if getattr(cfg, default) <= getattr(cfg, limit):
            continue
        if sources[default] == "default":
            setattr(cfg, default, getattr(cfg, limit))
        else:
            problems.append(
                f"{_where(sources[default], default)}: {getattr(cfg, default)} exceeds "
                f"{limit} ({getattr(cfg, limit)}, from {sources[limit]}); lower {default} "
                f"or raise {limit}"
            )
    return problems


def _toml_value(name: str, value: Any) -> str:
    if name == "socket_mode":
        return f"0o{value:03o}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(name, v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
