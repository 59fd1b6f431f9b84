"""How a PLE layer's lookups reach ple-server: one ``Route`` per layer, chosen once.

A route answers three verbs, whatever it does underneath::

    handle = route.start(binding, ids)   # the request is on its way; nothing waits (not None)
    route.finish(handle, out)            # its rows, as served, into out
    route.discard(handle)                # a started lookup nobody will use

``out`` takes the rows as the server serves them, uint8 ``[count, row_bytes]``:
checking the model's output and turning served rows into its rows (a dtype
conversion, NVFP4's decode) is the caller's, done once at the storage
boundary (``lookups``). ``capturable`` says
whether the three may sit inside a captured CUDA graph; the caller runs them as
eager breaks where they may not.

The routes:

* ``HostRoute`` (``host_route``) — the session's channel, with the host in the
  loop: a round trip per request, eager breaks in graphs.
* ``GpuRoute`` (``gpu_route``) — a channel the CUDA stream rings and waits on:
  no host sync, inside captured graphs. Each layer owns its slots.
* ``ZeroRoute`` — ``--load-format dummy`` with ``VLLM_PLE_SHM_ALLOW_DUMMY=1``:
  no server, every row zero.

``Routes`` holds the worker's: the session (``RowService``) and its host route,
the GPU-driven route once chosen, the zero route. ``Routes.for_layer`` is the
one place that decides which route a layer's lookups take.

Prefetch hints ("these ids will be looked up soon") take none of these
routes: the worker looks rows up only when its step needs them, and the
prompts' rows are hinted earlier, by the engine core when a request arrives
(``prompt_ahead``), through a session of its own.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from pleclient.vllm_plugin import compilation
from pleclient.vllm_plugin.gpu_route import GpuRoute
from pleclient.vllm_plugin.host_route import HostRoute
from pleclient.vllm_plugin.rows import RowService, TableBinding
from pleclient.vllm_plugin.settings import GPU_PATH_STANDIN, ShmSettings

log = logging.getLogger("pleclient.vllm_plugin")


class Route(Protocol):
    """Where a layer's lookups go (see the module docstring)."""

    name: str
    capturable: bool

    def start(self, binding: TableBinding, ids: torch.Tensor) -> Any: ...

    def finish(self, handle: Any, out: torch.Tensor) -> None: ...

    def discard(self, handle: Any) -> None: ...


class ZeroRoute:
    """No server (``--load-format dummy`` with ``VLLM_PLE_SHM_ALLOW_DUMMY=1``):
    every row is zeros. The handle is the number of ids."""

    name = "zeros"
    capturable = True  # a fill on the device

    def start(self, binding: TableBinding, ids: torch.Tensor) -> int:
        return ids.numel()

    def finish(self, handle: int, out: torch.Tensor) -> None:
        out.zero_()

    def discard(self, handle: int) -> None:
        pass


class Routes:
    """The worker's routes: the session and its host route, the GPU-driven
    route (chosen once, at the first lookup on a CUDA device), the zero route."""

    _shared: ClassVar[Routes | None] = None

    @classmethod
    def shared(cls) -> Routes:
        """The process's routes, over a session with the environment's settings."""
        routes = cls._shared
        if routes is None or routes._pid != os.getpid():
            # Built with the first PLE layer, under vLLM's config; its graph
            # mode is read from that config when the route is chosen, after
            # vLLM's model runner settled it (the V2 runner may change it).
            config = compilation.current_compilation_config()
            routes = cls._shared = cls(
                RowService(ShmSettings.from_env()),
                full_graphs=lambda: compilation.full_graph_mode(config),
            )
            atexit.register(routes.close)
        return routes

    def __init__(
        self,
        service: RowService,
        *,
        full_graphs: str | Callable[[], str | None] | None = None,
    ) -> None:
        """``full_graphs``: the ``-cc.cudagraph_mode`` with which vLLM captures
        whole steps in CUDA graphs, if it does (``compilation.full_graph_mode``),
        or what reads it when the route is chosen: the host route cannot run
        in them, so choosing it on a CUDA device raises
        ``UnsupportedCompilation``."""
        self.service = service
        self._full_graphs = full_graphs if callable(full_graphs) else lambda: full_graphs
        self.host = HostRoute(service)
        self.zeros = ZeroRoute()
        self._gpu: GpuRoute | None = None
        self._gpu_chosen = False
        self._pid = os.getpid()

    @property
    def path(self) -> str:
        """Which route lookups on the device take: "gpu-driven", its "(CPU
        stand-in)", or "host"."""
        return self._gpu.name if self._gpu is not None else self.host.name

    def for_layer(self, binding: TableBinding, device: torch.device | None = None) -> Route:
        """The route of ``binding``'s lookups on ``device``: zeros for a dummy
        table; the GPU-driven route where it opened and holds slots for this
        layer; else the host route. ``device`` None: never GPU-driven."""
        if binding.dummy:
            return self.zeros
        if device is not None:
            gpu = self._gpu_route(device)
            if gpu is not None and gpu.serves(binding):
                return gpu
        return self.host

    def _gpu_route(self, device: torch.device) -> GpuRoute | None:
        """The GPU-driven route, chosen (and logged) at the first lookup on a
        CUDA device, once every layer is bound; CPU runs keep the host route
        unless ``VLLM_PLE_SHM_GPU_PATH=standin``."""
        if not self._gpu_chosen:
            settings = self.service.settings
            standin = settings.gpu_path == GPU_PATH_STANDIN
            if device.type != "cuda" and not standin:
                return None
            client = self.service.client
            if client is None:
                return None  # no session yet: the host route connects first
            self._gpu_chosen = True
            self._gpu = GpuRoute.choose(
                settings,
                device,
                client.socket_path,
                [b for b in self.service.bindings if not b.dummy],
                self.service.checkpoint_reader(),
            )
            full_graphs = self._full_graphs()
            if self._gpu is None and device.type == "cuda" and full_graphs:
                raise compilation.full_graphs_refused(
                    full_graphs,
                    "the host path (GPU-driven lookups are not available here: the "
                    "log line before this error says why)",
                )
        return self._gpu

    def close(self) -> None:
        """Close the routes, then the session (at exit, or in tests)."""
        if self._pid != os.getpid():
            return
        try:
            if self._gpu is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # no lookup of ours may still be enqueued
                self._gpu.close()
                self._gpu = None
            self.host.close()
        except Exception as exc:  # at exit, report and go on
            log.debug("PLE backend shm: close: %s", exc)
        self.service.close()
        if Routes._shared is self:
            Routes._shared = None


__all__ = ["Route", "Routes", "ZeroRoute"]
