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


class RequestError(PleError):
    """The server rejected one request; the session stays usable."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


class LookupTimeout(PleError, TimeoutError):
    """A request was not answered in time."""


class ServerGone(PleError):
    """The server closed the session (shutdown, restart or crash)."""
