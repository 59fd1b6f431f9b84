"""How a vLLM worker waits for a ple-server that went away.

Tries to connect again with exponential backoff (``FIRST_DELAY_S``, doubling
up to ``MAX_DELAY_S``) until ``window_s`` after the first failure, then gives
up with a ``PleBackendError``: a forward step fails rather than use rows of no
verified server. The window is ``VLLM_PLE_SHM_RECONNECT_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pleclient import LookupTimeout, ProtocolMismatch, ServerGone, ServerUnavailable
from pleclient.vllm_plugin.errors import PleBackendError

TRANSIENT = (ServerGone, ServerUnavailable, LookupTimeout)
"""Failures that a restarted server cures; anything else fails at once."""
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0

T = TypeVar("T")


class ReconnectPolicy:
    """Exponential backoff within a window counted from the first failure."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s

    def reconnect(
        self, connect: Callable[[], T], *, socket: str | None, cause: Exception, failed_since: float
    ) -> T:
        """``connect()`` until it succeeds, sleeping between tries; a try that
        fails with a transient error or another protocol (a server being
        replaced) is tried again. Past the window raises ``PleBackendError``
        naming ``socket``, ``cause`` and the last error."""
        delay = FIRST_DELAY_S
        last: Exception = cause
        while True:
            try:
                return connect()
            except (*TRANSIENT, ProtocolMismatch) as exc:
                last = exc
            remaining = failed_since + self.window_s - time.monotonic()
            if remaining <= 0:
                raise PleBackendError(
                    f"VLLM_PLE_BACKEND=shm: ple-server at {socket} went away ({cause}) "
                    f"and did not come back within {self.window_s:.0f} s (last error: "
                    f"{last}). PLE rows cannot be served, so this step fails rather than "
                    "use wrong rows. Restart it: `systemctl start ple-server`; raise "
                    "VLLM_PLE_SHM_RECONNECT_S to wait longer."
                ) from None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, MAX_DELAY_S)
