"""Which ple-server of this host serves the checkpoint vLLM loads.

A host may run one server per model (``ple-server@NAME.service``, socket
``/run/ple-server/NAME.sock``). Without ``VLLM_PLE_SHM_SOCKET``, the plugin
asks every socket in the socket directory for its tables (the server's hello
answer: no channel is opened) and picks the server whose table fingerprints
are exactly those of the checkpoint: the name of a socket means nothing to it,
so no naming rule can pick the wrong model.

* one server matches: that one;
* several match (the same checkpoint served twice): the first by name, logged;
* none matches, but only one server answers: that one, so that the identity
  check names the difference (the single-server host, as before);
* otherwise: an error listing what each socket serves.
"""

from __future__ import annotations

import dataclasses
import logging

from pleclient import PleClient, PleError, TableInfo
from pleclient.client import sockets_in as client_sockets_in
from pleclient.vllm_plugin import identity
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.settings import (
    DEFAULT_SOCKET_DIR,
    ENV_SOCKET,
    ENV_SOCKET_DIR,
    ShmSettings,
)

log = logging.getLogger("pleclient.vllm_plugin")


def sockets_in(directory: str) -> list[str]:
    """The Unix sockets in ``directory``, by name (``pleclient.client.sockets_in``)."""
    try:
        return client_sockets_in(directory)
    except OSError as exc:
        raise PleBackendError(
            f"VLLM_PLE_BACKEND=shm cannot list the ple-server socket "
            f"directory {directory}: {exc}; set {ENV_SOCKET} to the "
            "server's socket"
        ) from None


def with_socket(settings: ShmSettings, checkpoint_dir: str) -> ShmSettings:
    """``settings`` with a socket: its own, or (several servers per host) the
    one whose server serves ``checkpoint_dir`` (``find_socket``)."""
    if settings.socket is not None:
        return settings
    found = find_socket(checkpoint_dir, settings.socket_dir, settings.connect_timeout)
    return dataclasses.replace(settings, socket=found)


def find_socket(
    checkpoint_dir: str, directory: str = DEFAULT_SOCKET_DIR, timeout: float = 5.0
) -> str:
    """The socket of the server serving ``checkpoint_dir``'s PLE tables."""
    wanted = {t.fingerprint for t in identity.checkpoint_tables(checkpoint_dir)}
    answers: dict[str, list[TableInfo] | str] = {}
    for path in sockets_in(directory):
        try:
            answers[path] = PleClient.query_tables(path, timeout=timeout)
        except PleError as exc:  # stale socket, not allowed, another protocol
            answers[path] = str(exc)
    serving = {path: tables for path, tables in answers.items() if not isinstance(tables, str)}
    matches = [
        path for path, tables in serving.items() if {t.fingerprint for t in tables} == wanted
    ]
    if matches:
        if len(matches) > 1:
            log.info(
                "PLE backend shm: %s all serve %s; using %s",
                ", ".join(matches),
                checkpoint_dir,
                matches[0],
            )
        log.info("PLE backend shm: %s serves %s", matches[0], checkpoint_dir)
        return matches[0]
    if len(serving) == 1:
        return next(iter(serving))
    if not answers:
        raise PleBackendError(
            f"VLLM_PLE_BACKEND=shm: no ple-server socket in {directory}. Start the server "
            "(`systemctl start ple-server`, or ple-server@NAME for one of several models), "
            f"or set {ENV_SOCKET} to its socket ({ENV_SOCKET_DIR} to the directory)."
        )
    seen = "; ".join(
        f"{path}: {answer}"
        if isinstance(answer, str)
        else f"{path}: {len(answer)} tables, fingerprints "
        + ", ".join(t.fingerprint[:11] for t in answer)
        for path, answer in answers.items()
    )
    raise PleBackendError(
        f"VLLM_PLE_BACKEND=shm: no ple-server in {directory} serves the checkpoint vLLM "
        f"loads ({checkpoint_dir}: fingerprints "
        f"{', '.join(sorted(f[:11] for f in wanted))}). Seen: {seen}. Start a server "
        f"with --model {checkpoint_dir}, or set {ENV_SOCKET} to its socket."
    )
