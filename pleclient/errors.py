"""Exceptions raised by the client; each message says what went wrong and what to do."""

from __future__ import annotations


class PleError(Exception):
    """Base class of every pleclient error."""


class ServerUnavailable(PleError):
    """No ple-server answers on the socket (not running, wrong path, no permission)."""


class ProtocolMismatch(PleError):
    """The server speaks another protocol version, or sent something unexpected."""


class AccessDenied(PleError):
    """The server refused this process (uid/gid not allowed, too many clients)."""


class TooManyClients(AccessDenied):
    """The server has no room for this process now: every client slot is
    taken (``max_clients``, the last ones kept for root and the server's own
    uid), this uid holds ``max_clients_per_uid`` sessions, or it connected
    faster than the server admits. Transient, unlike a uid that is not
    allowed: it clears as other clients close, so reconnecting retries it
    (``pleclient.reconnect.TRANSIENT``). An ``AccessDenied``, as before it had
    a class of its own."""


class RequestError(PleError):
    """The server rejected one request; the session stays usable."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


class LookupTimeout(PleError, TimeoutError):
    """A request was not answered in time."""


class ServerGone(PleError):
    """The server closed the session (shutdown, restart or crash)."""
