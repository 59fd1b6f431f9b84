"""The worker's ple-server session, shared by its PLE layers.

``RowService`` is the session: it connects at the first layer's ``bind``,
checks each layer's table against the checkpoint (see ``identity``) and hands
back a ``TableBinding``, and replaces a session lost mid-run (``reconnect``).
It looks nothing up itself: the routes do (``routes``). The host route
(``host_route``) uses this session's channel; the GPU-driven route
(``gpu_route``) opens a session of its own.

Failure policy
--------------
* No server at startup: ``bind`` fails at once, naming the socket and
  ``systemctl start ple-server``. A server with no room for the worker
  (``TooManyClients``) is waited for within ``VLLM_PLE_SHM_RECONNECT_S``.
* Server gone mid-run (``ServerGone``, ``ServerUnavailable``, ``LookupTimeout``;
  at reconnect also ``TooManyClients``, a server full for now):
  the route that noticed calls ``reconnect``, which connects again with
  exponential backoff (``reconnect.ReconnectPolicy``) and checks the new
  server's tables against the checkpoint again. Past
  ``VLLM_PLE_SHM_FALLBACK_S`` it tells the route to read the lookup's rows
  from the checkpoint itself (``checkpoint_reader``), trying the server again
  at most every ``RETRY_WHILE_FALLING_BACK_S`` at later lookups; with the
  fallback off, past ``VLLM_PLE_SHM_RECONNECT_S`` it raises
  ``PleBackendError``. Rows are never zeros or stale: a request is answered
  by a verified server or from the checkpoint's own bytes, or the step fails.
* ``--load-format dummy`` with ``VLLM_PLE_SHM_ALLOW_DUMMY=1``: no server; the
  bindings are dummies, whose rows are zeros (``routes.ZeroRoute``), said once
  in the log.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from pleclient import PleClient, ProtocolMismatch, TableInfo, TooManyClients
from pleclient.checkpoint import TableSpec
from pleclient.fallback import CheckpointReader
from pleclient.families.deepseek_v41 import MXFP8
from pleclient.families.qwen4_exp import NVFP4
from pleclient.vllm_plugin import discovery, identity
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.reconnect import TRANSIENT, ReconnectPolicy
from pleclient.vllm_plugin.settings import (
    ENV_ALLOW_DUMMY,
    ENV_BACKEND,
    ENV_SOCKET,
    ShmSettings,
)

log = logging.getLogger("pleclient.vllm_plugin")

RETRY_WHILE_FALLING_BACK_S = 0.25
"""While lookups are read from the checkpoint: how often one of them tries
the server first (a try costs one connect; a restart is caught within this)."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    NVFP4: torch.uint8,  # served rows: packed values, then block scales (``nvfp4``)
    MXFP8: torch.uint8,  # served rows: FP8 values, then UE8M0 scales (``mxfp8``)
}


@dataclass(eq=False)
class TableBinding:
    """One PLE layer's table on the server, verified against the checkpoint."""

    expected: identity.Expected
    info: TableInfo | None  # None: dummy mode (no server)
    checkpoint: TableSpec | None = None
    checkpoint_dir: str = ""
    max_ids: int = 0  # the layer's largest lookup (0: not known)
    # Its lookups start with the step's other PLE layers and finish in layer
    # order (``step``): the host route then gives them slots in that order.
    with_step: bool = False

    @property
    def dummy(self) -> bool:
        return self.info is None

    @property
    def storage_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.info.dtype if self.info else self.expected.dtypes[0]]

    @property
    def row_bytes(self) -> int:
        if self.info is not None:
            return self.info.row_bytes
        return self.expected.row_bytes(self.expected.dtypes[0])


class RowService:
    """The worker's ple-server session; a lost server is waited for as its
    ``ReconnectPolicy`` says."""

    def __init__(self, settings: ShmSettings) -> None:
        self.settings = settings
        self._pid = os.getpid()
        self._client: PleClient | None = None
        self._generation = 0
        self._bindings: list[TableBinding] = []
        self._dummy_warned = False
        self._reader: CheckpointReader | None = None
        self.lost_since: float | None = None
        """When the server went away (monotonic), while no new session is verified."""
        self._next_try = 0.0
        self.fallback_rows = 0
        """Rows the host route read from the checkpoint while no server answered."""

    @property
    def client(self) -> PleClient | None:
        """The session's client; None before the first bind and while a lost
        server is being reconnected to."""
        return self._client

    @property
    def generation(self) -> int:
        """Counts sessions: it changes on every (re)connect."""
        return self._generation

    @property
    def bindings(self) -> list[TableBinding]:
        """Every table bound so far, dummies included."""
        return list(self._bindings)

    # ------------------------------------------------------------------ setup
    def bind(self, expected: identity.Expected, max_ids: int = 0) -> TableBinding:
        """Find and verify this layer's table; fails fast without a server.
        ``max_ids``: the layer's largest lookup (sizes its GPU-driven slots)."""
        fmt = identity.load_format()
        if fmt == "dummy" and self.settings.allow_dummy:
            if not self._dummy_warned:
                log.warning(
                    "PLE backend shm with --load-format dummy and %s=1: no "
                    "ple-server is used, every PLE row is zero",
                    ENV_ALLOW_DUMMY,
                )
                self._dummy_warned = True
            binding = TableBinding(expected, None)
            self._bindings.append(binding)
            return binding
        model_dir = identity.checkpoint_dir(self.settings.checkpoint)
        spec = identity.select(
            identity.checkpoint_tables(model_dir), expected.table_suffix, model_dir
        )
        self.settings = discovery.with_socket(self.settings, model_dir)
        client = self._client or self._connect_at_startup(fmt)
        info = identity.select(
            client.tables, expected.table_suffix, f"ple-server at {client.socket_path}"
        )
        identity.verify(info, client.socket_path, spec, model_dir, expected)
        binding = TableBinding(expected, info, spec, model_dir, max_ids)
        self._bindings.append(binding)
        log.info(
            "PLE backend shm: %s <- ple-server table %s (%d rows x %d B, %s, fingerprint %s)",
            expected.prefix,
            info.name,
            info.rows,
            info.row_bytes,
            info.dtype,
            info.fingerprint,
        )
        return binding

    def _connect_at_startup(self, fmt: str | None) -> PleClient:
        try:
            return self._connect()
        except TooManyClients as exc:
            # A full server, not a missing one: slots free as other clients
            # close (a restarted vLLM's old workers, say), so wait as a reconnect does.
            log.warning(
                "PLE backend shm: ple-server at %s has no room yet (%s); retrying for up to %.0f s",
                self.settings.socket,
                exc,
                self.settings.reconnect_window,
            )
            return ReconnectPolicy(self.settings.reconnect_window).reconnect(
                self._connect,
                socket=self.settings.socket,
                cause=exc,
                failed_since=time.monotonic(),
            )
        except TRANSIENT as exc:
            hint = (
                f" (or, with --load-format dummy, set {ENV_ALLOW_DUMMY}=1 to run without PLE rows)"
                if fmt == "dummy"
                else ""
            )
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: no ple-server on {self.settings.socket}: {exc}. "
                f"Start it with `systemctl start ple-server`, or point {ENV_SOCKET} at "
                f"the socket it listens on, or unset {ENV_BACKEND} to keep the table in "
                f"vLLM{hint}."
            ) from None
        except ProtocolMismatch as exc:
            raise PleBackendError(
                f"VLLM_PLE_BACKEND=shm: ple-server on {self.settings.socket} speaks "
                f"another protocol ({exc}); install the same pleserver version in vLLM's "
                "environment and on the server"
            ) from None

    def _connect(self) -> PleClient:
        s = self.settings
        client = PleClient.connect(
            s.socket,
            timeout=s.connect_timeout,
            name=f"vllm-pid{os.getpid()}",
            capacity=s.capacity,
            depth=s.depth,
        )
        client.timeout = s.lookup_timeout
        self._client = client
        self._generation += 1
        return client

    # -------------------------------------------------------------- reconnect
    def checkpoint_reader(self) -> CheckpointReader | None:
        """The worker's own reads of its bound tables from the checkpoint
        (made once), or None where ``VLLM_PLE_SHM_FALLBACK_S=off``."""
        if self.settings.fallback_after is None:
            return None
        if self._reader is None:
            specs = [b.checkpoint for b in self._bindings if b.checkpoint is not None]
            self._reader = CheckpointReader(specs)
        return self._reader

    def reconnect(self, cause: Exception, failed_since: float) -> bool:
        """Replace the session lost to ``cause`` with a verified one: True.
        The caller has finished every use of the old session's segment (its
        device copies, its page-locking): the segment goes away here.

        With the fallback on, tries until ``VLLM_PLE_SHM_FALLBACK_S`` after the
        server went away, then once per ``RETRY_WHILE_FALLING_BACK_S``: False
        means "no server yet: read this lookup's rows with
        ``checkpoint_reader``". With it off, tries until the reconnect window
        (counted from the first failure) ends, then raises PleBackendError."""
        socket = self.settings.socket
        now = time.monotonic()
        fallback_after = self.settings.fallback_after
        if self.lost_since is None:
            self.lost_since = min(failed_since, now)
            log.warning(
                "PLE backend shm: lost ple-server at %s (%s); %s",
                socket,
                cause,
                f"reconnecting; past {fallback_after:.1f} s this worker reads rows from the "
                "checkpoint itself until it is back"
                if fallback_after is not None
                else f"reconnecting for up to {self.settings.reconnect_window:.0f} s",
            )
        self._drop_session()
        if fallback_after is None:
            # The policy of the settings in force now (they may be replaced).
            policy = ReconnectPolicy(self.settings.reconnect_window)
            client = policy.reconnect(
                self._connect, socket=socket, cause=cause, failed_since=self.lost_since
            )
        elif now - self.lost_since < fallback_after:
            try:
                client = ReconnectPolicy(fallback_after).reconnect(
                    self._connect, socket=socket, cause=cause, failed_since=self.lost_since
                )
            except PleBackendError:
                self._next_try = time.monotonic() + RETRY_WHILE_FALLING_BACK_S
                return False
        elif now < self._next_try:
            return False
        else:
            try:
                client = self._connect()
            except (*TRANSIENT, ProtocolMismatch):
                self._next_try = now + RETRY_WHILE_FALLING_BACK_S
                return False
        self._verify_again(client)
        log.warning(
            "PLE backend shm: reconnected to ple-server at %s after %.1f s%s",
            socket,
            time.monotonic() - self.lost_since,
            f" ({self.fallback_rows} rows were read from the checkpoint meanwhile)"
            if self.fallback_rows
            else "",
        )
        self.lost_since = None
        return True

    def _drop_session(self) -> None:
        """Forget the current session. Its tickets become stale (another
        generation) and are never touched again."""
        self._generation += 1
        if self._client is not None:
            self._client.close()
            self._client = None

    def _verify_again(self, client: PleClient) -> None:
        """A restarted server must still serve the checkpoint every layer loaded."""
        try:
            for binding in self._bindings:
                if binding.dummy or binding.checkpoint is None:  # a bound table has its spec
                    continue
                info = identity.select(
                    client.tables,
                    binding.expected.table_suffix,
                    f"ple-server at {client.socket_path}",
                )
                identity.verify(
                    info,
                    client.socket_path,
                    binding.checkpoint,
                    binding.checkpoint_dir,
                    binding.expected,
                )
                binding.info = info
        except PleBackendError:
            self._drop_session()
            raise

    def close(self) -> None:
        """End the session (at exit, or in tests), once its routes are closed."""
        if self._pid != os.getpid():
            return
        try:
            self._drop_session()
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        except Exception as exc:  # at exit, report and go on
            log.debug("PLE backend shm: close: %s", exc)


__all__ = ["RowService", "TableBinding", "TORCH_DTYPES"]
