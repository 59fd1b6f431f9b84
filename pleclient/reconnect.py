"""Waiting for a ple-server that went away: connect again with backoff.

A server restarts under its clients (``systemctl restart``, an upgrade, a
crash and ``Restart=on-failure``): the socket disappears or refuses for the
second or two it takes to start again. ``reconnect_within`` tries ``connect``
at once, then after ``FIRST_DELAY_S``, doubling up to ``MAX_DELAY_S``, until
``window_s`` after the first failure, and raises ``ServerUnavailable`` past
it. A server that refuses for want of room (``TooManyClients``: every client
slot taken, or this uid's) is waited for the same way: slots free as other
clients close, and as the sessions of a worker that restarted end.
``PleClient.reconnect`` and the vLLM plugin's sessions use it, so that no user
of the client writes this loop again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from pleclient.errors import (
    LookupTimeout,
    ProtocolMismatch,
    ServerGone,
    ServerUnavailable,
    TooManyClients,
)

TRANSIENT = (ServerGone, ServerUnavailable, LookupTimeout, TooManyClients)
"""Failures that a restarted server, or a slot freed on a full one, cures;
anything else (a uid not allowed, a bad request) fails at once."""
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0
DEFAULT_WINDOW_S = 30.0

T = TypeVar("T")


class ReconnectWindowPassed(ServerUnavailable):
    """The server did not come back within the window; ``last`` is the last
    try's error."""

    def __init__(self, message: str, last: Exception) -> None:
        super().__init__(message)
        self.last = last


def reconnect_within(
    connect: Callable[[], T],
    *,
    window_s: float,
    socket: str | None,
    cause: Exception | None = None,
    failed_since: float | None = None,
) -> T:
    """``connect()`` until it succeeds, sleeping between tries; a try that
    fails with a transient error, or with another protocol (a server being
    replaced), is tried again. Past ``window_s`` after ``failed_since``
    (default: now) raises ``ReconnectWindowPassed`` naming ``socket``, the
    ``cause`` and the last error, and the fix."""
    failed_since = time.monotonic() if failed_since is None else failed_since
    delay = FIRST_DELAY_S
    last: Exception | None = cause
    while True:
        try:
            return connect()
        except (*TRANSIENT, ProtocolMismatch) as exc:
            last = exc
        remaining = failed_since + window_s - time.monotonic()
        if remaining <= 0 and isinstance(last, TooManyClients):
            raise ReconnectWindowPassed(
                f"ple-server at {socket} had no room for this client for {window_s:.0f} s "
                f"(last error: {last}). Close idle clients, or raise max_clients or "
                "max_clients_per_uid in its config",
                last,
            ) from None
        if remaining <= 0:
            went = f" went away ({cause})" if cause is not None else " is not there"
            raise ReconnectWindowPassed(
                f"ple-server at {socket}{went} and did not come back within "
                f"{window_s:.0f} s (last error: {last}). Start it: `systemctl start "
                "ple-server`",
                last if last is not None else ServerUnavailable("never tried"),
            ) from None
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, MAX_DELAY_S)
