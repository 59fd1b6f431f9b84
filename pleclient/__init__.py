"""pleclient: look PLE rows up from a running ple-server over shared memory."""

from pleclient.client import PleClient, TableInfo, Ticket
from pleclient.errors import (
    AccessDenied,
    LookupTimeout,
    PleError,
    ProtocolMismatch,
    RequestError,
    ServerGone,
    ServerUnavailable,
)

__all__ = [
    "PleClient",
    "TableInfo",
    "Ticket",
    "PleError",
    "ServerUnavailable",
    "ProtocolMismatch",
    "AccessDenied",
    "RequestError",
    "LookupTimeout",
    "ServerGone",
]
