"""pleclient: look PLE rows up from a running ple-server over shared memory.

``PleClient``, ``TableInfo`` and ``Ticket`` are imported on first use: they
need the native module (``pleclient._sync``), and the vLLM plugin's entry
point must import without it, so that ``VLLM_PLE_BACKEND=shm`` with a broken
install stops vLLM with the fix (vLLM only logs a plugin that fails to
import, and runs on without it).
"""

from typing import TYPE_CHECKING

from pleclient.errors import (
    AccessDenied,
    LookupTimeout,
    PleError,
    ProtocolMismatch,
    RequestError,
    ServerGone,
    ServerUnavailable,
    TooManyClients,
)

if TYPE_CHECKING:
    from pleclient.client import PleClient, TableInfo, Ticket

_FROM_CLIENT = ("PleClient", "TableInfo", "Ticket")


def __getattr__(name: str):
    if name in _FROM_CLIENT:
        from pleclient import client

        return getattr(client, name)
    raise AttributeError(f"module 'pleclient' has no attribute {name!r}")


__all__ = [
    "PleClient",
    "TableInfo",
    "Ticket",
    "PleError",
    "ServerUnavailable",
    "ProtocolMismatch",
    "AccessDenied",
    "TooManyClients",
    "RequestError",
    "LookupTimeout",
    "ServerGone",
]
