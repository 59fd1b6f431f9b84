"""What a configuration reload (SIGHUP, ``systemctl reload ple-server``) may
change while the server serves, what needs a restart, and why.

A reload computes exactly the configuration a restart would run with — the
same file, read again, under the same environment and command-line flags
(``ConfigSource``) —
and compares it with the one in effect (``diff``). Each setting that differs
is either applied at once (``RELOADABLE`` says how, and from when) or left as
it is and reported as needing a restart (``RESTART_ONLY`` says why). One table
decides both for the server (``pleserver.server.Server.reload``) and for
``pleserver config check --against-running`` / ``--against FILE``, so the two
always say the same.

A setting is reloadable when its new value can be taken by every part that
reads it without a moment in which that part sees something inconsistent:
values read afresh by the control thread (access lists, limits, timeouts),
single numbers read once per use by the serving loop, the hint reader or the
metrics threads (one attribute store each), and the metrics endpoint, which is
replaced whole. Settings that size or build something at start — the tables,
the row cache, the miss engine, thread pools, the socket — need a restart.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pleserver.config import (
    DEFAULT_CONFIG_PATH,
    SETTINGS,
    LoadedConfig,
    ServerConfig,
    load_config,
)
from pleserver.observe.snapshot import ChangeSnapshot, ConfigSnapshot, ReloadSnapshot

# How, and from when, a reload applies each setting it may change.
_NEW_CHANNELS = "applies to channels opened from now on; open channels keep their geometry"
_DEADLINES = (
    "applies from the next deadline check (at most 0.25 s), to every session; a session "
    "with a channel is never closed for idling"
)
RELOADABLE: dict[str, str] = {
    "socket_mode": (
        "the socket file's mode is set again (chmod); the kernel checks it at connect, "
        "so open sessions are not affected"
    ),
    "allow_uids": ("applies to new connections; sessions already open stay open until they close"),
    "allow_gids": ("applies to new connections; sessions already open stay open until they close"),
    "max_clients": (
        "applies to new sessions and channels; open ones stay, even above a lower limit"
    ),
    "max_clients_per_uid": (
        "applies to new sessions; a uid's open ones stay, even above a lower limit"
    ),
    "max_capacity": _NEW_CHANNELS,
    "default_capacity": _NEW_CHANNELS,
    "max_depth": _NEW_CHANNELS,
    "default_depth": _NEW_CHANNELS,
    "max_channel_bytes": _NEW_CHANNELS,
    "max_channel_memory": (
        "applies to channels opened from now on; open channels stay, even above a lower budget"
    ),
    "max_gpu_slots_per_uid": "applies to GPU-driven channels opened from now on",
    "hello_timeout_s": _DEADLINES,
    "idle_timeout_s": _DEADLINES,
    "frame_timeout_s": _DEADLINES,
    "chunk_rows": "applies from the serving loop's next turn",
    "hint_queue_rows": (
        "applies to hints offered from now on; rows queued already stay queued "
        "(a higher bound needs a restart)"
    ),
    "hint_rate": "applies from the serving loop's next pass",
    "parallel_min_rows": "applies to requests gathered from now on",
    "dedup_min_rows": "applies to requests gathered from now on",
    "gather_in_order": "applies to requests handed off from now on",
    "spin_us": "applies from the serving loop's next pass",
    "gpu_poll_us": "applies from the serving loop's next pass",
    "watchdog_s": "applies from the serving loop's next heartbeat (at most 1 s)",
    "metrics_address": (
        "the metrics endpoint is opened on the new address before the old one closes "
        "(its own counters start again from 0)"
    ),
    "metrics_max_connections": "applies to connections accepted from now on",
    "metrics_timeout_s": "applies to connections accepted from now on",
    "log_level": "applies at once, from every thread's next log line",
    "log_format": "applies at once, from every thread's next log line",
}

# Why a setting needs a restart: what is built from it at start.
RESTART_ONLY: dict[str, str] = {
    "model": (
        "the tables are found, checked and opened at start, and clients hold their "
        "list and fingerprints"
    ),
    "socket": (
        "the control socket is bound at start, and clients and the unit find the server by its path"
    ),
    "io": (
        "the io mode decides at start how the checkpoint's files are opened and whether "
        "a row cache and a miss engine exist"
    ),
    "cache_size": (
        "the row cache is one reservation of fixed capacity, sharded and indexed for it "
        "at start; it cannot shrink or grow in place while gather workers copy rows out "
        "of it (with io = auto it also picks the io mode)"
    ),
    "gpu_memory": (
        "the row cache's default size and the io mode are decided once, at start, for the box"
    ),
    "cache_hugepages": "the row cache's memory is mapped once, at start",
    "cache_mlock": "the row cache's memory is mapped (and locked) once, at start",
    "resident_scales": (
        "the tables' scales are read into memory when they are opened, at start, and the "
        "default row cache is sized beside them"
    ),
    "queue_depth": "the miss engine's ring is sized at start",
    "read_engine": "the miss engine is chosen and built at start",
    "read_threads": "the miss engine's pread threads are started at start",
    "read_buffer_memory": (
        "the read buffers' bound is counted in the memory budget at start, before "
        "the channels' share"
    ),
    "state_dir": (
        "the hot set is refilled from the directory at start, and saved to the path given then"
    ),
    "hotset_save_interval": "the hot set's saver thread takes its interval when it starts",
    "prewarm": "the prewarm runs once, after start",
    "prewarm_budget": "the prewarm runs once, after start",
    "prewarm_reserve": ("the prewarm and the default row cache size read it once, at start"),
    "gather_workers": (
        "the gather worker threads are started with the serving loop, and the hint "
        "reader counts on their number"
    ),
    "idle_wait": "the serving loop picks how it sleeps when it starts",
    "health_socket": (
        "the health socket is bound at start, and the probes' command names its path: "
        "change both together, with a restart"
    ),
    "lookup_trace": "the trace belongs to one server's life: it is written when that server stops",
}

NO_DEFAULT_BUDGET = (
    "its default (3/4 of the memory room) is measured at start, before clients took "
    "memory; give a size to change the budget while serving"
)
LARGER_HINT_QUEUE = (
    "the hint queue is a ring of that many rows, allocated and counted in the memory "
    "budget at start; a lower bound applies at once"
)


class ReloadError(RuntimeError):
    """A reload could not apply a change it validated (a metrics address that
    cannot be bound); what it had applied is undone. ``problems``: one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Change:
    """One setting whose value differs between the configuration in effect
    (``old``) and the one a reload reads (``new``)."""

    name: str
    old: Any
    new: Any
    reloadable: bool
    note: str  # how a reload applies it, or why it needs a restart

    def describe(self) -> str:
        """One line, the same in the server's log and in ``config check``:
        ``max_clients 64 → 8: applies to new sessions …``."""
        s = SETTINGS[self.name]
        what = "" if self.reloadable else "needs a restart: "
        return f"{self.name} {s.format(self.old)} → {s.format(self.new)}: {what}{self.note}"

    def to_json(self) -> ChangeSnapshot:
        return {
            "setting": self.name,
            "old": self.old,
            "new": self.new,
            "applies": "reload" if self.reloadable else "restart",
            "note": self.note,
        }


def classify(name: str, old: Any, new: Any) -> Change:
    """How a reload treats a change of ``name`` from ``old`` to ``new``."""
    if name == "max_channel_memory" and new is None:
        return Change(name, old, new, False, NO_DEFAULT_BUDGET)
    if name == "hint_queue_rows" and new > old:
        return Change(name, old, new, False, LARGER_HINT_QUEUE)
    if name == "metrics_address" and new is None:
        return Change(name, old, new, True, "the metrics endpoint closes")
    if name == "metrics_address" and old is None:
        return Change(name, old, new, True, "the metrics endpoint opens on that address")
    if name in RELOADABLE:
        return Change(name, old, new, True, RELOADABLE[name])
    return Change(name, old, new, False, RESTART_ONLY[name])


def diff(old: ServerConfig, new: ServerConfig) -> list[Change]:
    """Every setting that differs, in the settings' order."""
    return [
        classify(f.name, getattr(old, f.name), getattr(new, f.name))
        for f in fields(ServerConfig)
        if getattr(old, f.name) != getattr(new, f.name)
    ]


def config_from_dict(values: dict[str, Any]) -> ServerConfig:
    """A ``ServerConfig`` from a running server's settings (its stats
    ``config.settings``): keys this version does not know are left out, and
    keys it does not send keep their defaults."""
    known = {f.name for f in fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class ConfigSource:
    """Where the server's configuration came from: the file argument as
    ``serve`` had it (``--config``, else ``$PLE_SERVER_CONFIG``, else None for
    the default path), the environment's settings (name → raw value, as
    ``pleserver.config.env_settings`` reads them at start) and the command
    line's (as ``pleserver.ops.flags.given_settings`` returns them). A reload loads
    these again, so it reads what a restart would: a process's environment is
    fixed once it runs, as its command line is."""

    path: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def file(self) -> str:
        """The file a reload reads (it may not exist when it is the default)."""
        return self.path or DEFAULT_CONFIG_PATH

    def load(self) -> LoadedConfig:
        """Load it again; raises ``ConfigError`` listing every problem."""
        return load_config(self.path, self.flags, env=self.env)

    def describe(self) -> str:
        """``/etc/ple-server/config.toml; the environment's PLE_SERVER_IO and the
        command line's --socket override it``."""
        where = self.file if self.path or os.path.exists(self.file) else "defaults (no file)"
        over = []
        if self.env:
            over.append("the environment's " + ", ".join(SETTINGS[n].env for n in self.env))
        if self.flags:
            over.append("the command line's " + ", ".join(SETTINGS[n].flag for n in self.flags))
        if not over:
            return where
        verb = "overrides" if len(self.env) + len(self.flags) == 1 else "override"
        return f"{where}; {' and '.join(over)} {verb} it"


@dataclass(frozen=True)
class ReloadState:
    """The reloads so far, as stats and the metrics show them. Replaced whole
    (one reference store) on the control thread after each reload, so the
    metrics thread never reads half of one."""

    loaded_unix: float  # when the configuration in effect was last loaded whole
    reloads: int = 0  # attempts
    failed: int = 0
    last_unix: float | None = None
    last_ok: bool | None = None
    last_applied: tuple[str, ...] = ()
    last_problems: tuple[str, ...] = ()
    restart_pending: tuple[Change, ...] = ()  # changes read but not applied

    def to_json(self) -> ReloadSnapshot:
        return {
            "loaded_unix": self.loaded_unix,
            "reloads": self.reloads,
            "reloads_failed": self.failed,
            "last_reload_unix": self.last_unix,
            "last_reload_ok": self.last_ok,
            "last_reload_applied": list(self.last_applied),
            "last_reload_problems": list(self.last_problems),
            "restart_pending": [c.to_json() for c in self.restart_pending],
        }


def config_report(source: ConfigSource, config: ServerConfig, state: ReloadState) -> ConfigSnapshot:
    """The ``config`` part of the stats snapshot: where the configuration comes
    from, every setting in effect, and the reloads (``ReloadState``). Built on
    the control thread at start and after each reload, never mutated after."""
    return {
        "file": source.file,
        "file_named": source.path is not None,  # else the default path, read if it exists
        "flags": dict(source.flags),
        "env": dict(source.env),  # setting name → raw value, as for flags
        "settings": asdict(config),
        **state.to_json(),
    }


def count(n: int, what: str) -> str:
    """``1 setting``, ``3 settings``."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def format_changes(changes: list[Change]) -> str:
    """``config check --against …``'s text: what a reload applies, what needs
    a restart."""
    applied = [c for c in changes if c.reloadable]
    restart = [c for c in changes if not c.reloadable]
    if not changes:
        return "no setting differs: a reload changes nothing\n"
    lines = []
    if applied:
        lines.append("a reload (systemctl reload ple-server, or SIGHUP) applies:")
        lines += [f"  {c.describe()}" for c in applied]
    if restart:
        lines.append(
            "needs a restart (systemctl restart ple-server); a reload leaves these as they are:"
        )
        lines += [f"  {c.describe()}" for c in restart]
    return "\n".join(lines) + "\n"
