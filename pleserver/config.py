"""ple-server settings: one dataclass, every field documented with its default."""

from __future__ import annotations

from dataclasses import dataclass, field

from pleclient import protocol as p


@dataclass
class ServerConfig:
    model: str = ""
    """Model directory holding the safetensors checkpoint (required)."""
    socket: str = p.DEFAULT_SOCKET
    """Control socket path; the systemd unit's RuntimeDirectory holds it."""
    socket_mode: int = 0o666
    """Mode of the socket file. Access is decided from the peer's credentials
    (``allow_uids``/``allow_gids``), so the file itself may be open to all."""
    allow_uids: list[int] = field(default_factory=list)
    """Uids that may connect, besides the server's own uid and root."""
    allow_gids: list[int] = field(default_factory=list)
    """Gids (primary or supplementary) whose members may connect."""
    client_group: int | None = None
    """Group that shares a session's semaphores with a client of another uid when
    the server cannot chown them to the client (it lacks CAP_CHOWN)."""
    max_clients: int = 64
    max_capacity: int = 262144
    """Largest rows-per-request a client may ask for its channel."""
    default_capacity: int = p.DEFAULT_CAPACITY
    max_depth: int = p.MAX_DEPTH
    default_depth: int = p.DEFAULT_DEPTH
    max_channel_bytes: int = 1 << 30
    """Largest shared-memory segment one client may ask for."""
    prewarm: str = "none"
    """``none`` or ``full``: read the tables into the page cache at start."""
    prewarm_budget: int | None = None
    """Bytes at most to prewarm (None: the whole tables)."""
    prewarm_reserve: int = 4 << 30
    """Stop prewarming when MemAvailable falls under this many bytes."""
    gather_workers: int = 4
    """Threads for large gathers (page faults overlap across threads)."""
    parallel_min_rows: int = 16384
    """Requests of at least this many rows are split over the gather threads."""
    dedup_min_rows: int = 4096
    """Requests of at least this many rows on a table not fully prewarmed are
    deduplicated and read in ascending row order."""
    spin_us: int = 2000
    """How long the serving loop spins after the last request before it blocks."""
    watchdog_s: float | None = None
    """Watchdog interval (systemd sets WATCHDOG_USEC; this overrides)."""
    metrics_address: str | None = None
    """``host:port`` for the Prometheus endpoint; None disables it."""
    log_level: str = "INFO"
