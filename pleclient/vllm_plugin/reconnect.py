"""How a vLLM worker waits for a ple-server that went away.

Tries to connect again with exponential backoff (``pleclient.reconnect``)
until ``window_s`` after the first failure, then gives up with a
``PleBackendError``: a forward step fails rather than use rows of no verified
server, unless the worker's own reads take over first (``fallback``). The
window is ``VLLM_PLE_SHM_RECONNECT_S``. A server with no room for the worker
(``TooManyClients``) is retried within the window too: it is full for now,
not refusing this uid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pleclient.errors import TooManyClients
from pleclient.reconnect import TRANSIENT, ReconnectWindowPassed, reconnect_within
from pleclient.vllm_plugin.errors import PleBackendError

__all__ = ["TRANSIENT", "ReconnectPolicy"]

T = TypeVar("T")


class ReconnectPolicy:
    """Exponential backoff within a window counted from the first failure."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s

    def reconnect(
        self, connect: Callable[[], T], *, socket: str | None, cause: Exception, failed_since: float
    ) -> T:
        """``connect()`` until it succeeds; past the window raises
        ``PleBackendError`` naming ``socket``, ``cause`` and the last error."""
        try:
            return reconnect_within(
                connect,
                window_s=self.window_s,
                socket=socket,
                cause=cause,
                failed_since=failed_since,
            )
        except ReconnectWindowPassed as exc:
            if isinstance(exc.last, TooManyClients):
                raise PleBackendError(
                    f"VLLM_PLE_BACKEND=shm: ple-server at {socket} had no room for this "
                    f"worker for {self.window_s:.0f} s (last error: {exc.last}). PLE rows "
                    "cannot be served, so this step fails rather than use wrong rows. "
                    "Close idle clients of the server, or raise its max_clients or "
                    "max_clients_per_uid; raise VLLM_PLE_SHM_RECONNECT_S to wait longer."
                ) from None
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: ple-server at {socket} went away ({cause}) "
                f"and did not come back within {self.window_s:.0f} s (last error: "
                f"{exc.last}). PLE rows cannot be served, so this step fails rather than "
                "use wrong rows. Restart it: `systemctl start ple-server`; raise "
                "VLLM_PLE_SHM_RECONNECT_S to wait longer, or let the worker read rows "
                "itself meanwhile (VLLM_PLE_SHM_FALLBACK_S)."
            ) from None
