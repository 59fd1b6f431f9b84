"""Environment settings of the vLLM plugin, read once per process.

Every knob, its default and why:

``VLLM_PLE_BACKEND``               unset or ``vllm``: the plugin changes nothing.
                                   ``shm``: PLE rows come from a ple-server. Any other
                                   value stops vLLM with an error.
``VLLM_PLE_SHM_SOCKET``            the server's control socket. Default:
                                   ``$PLE_SERVER_SOCKET``, else the one socket in
                                   ``VLLM_PLE_SHM_SOCKET_DIR`` whose server serves
                                   the checkpoint vLLM loads (``discovery``).
``VLLM_PLE_SHM_SOCKET_DIR``        where the servers of this host listen
                                   (default ``/run/ple-server``: ple-server.service's
                                   ``ple.sock`` and every ple-server@NAME's
                                   ``NAME.sock``).
``VLLM_PLE_SHM_CONNECT_TIMEOUT=10``  seconds to connect and open the channel.
``VLLM_PLE_SHM_LOOKUP_TIMEOUT=30``   seconds one request may take before the server
                                   counts as hung (then the reconnect policy runs).
``VLLM_PLE_SHM_RECONNECT_S=30``    how long a worker keeps reconnecting (with backoff)
                                   to a server that went away mid-run before the
                                   step fails, when it does not read rows itself
                                   (``VLLM_PLE_SHM_FALLBACK_S=off``). 0 = fail at once.
``VLLM_PLE_SHM_FALLBACK_S=1``      how long lookups wait for a server that went away
                                   (a restart, an upgrade, a crash) before the worker
                                   reads their rows from the checkpoint itself: slower,
                                   bit-exact, until a server is back (it keeps trying).
                                   ``off``: never; past the reconnect window the step
                                   fails instead.
``VLLM_PLE_SHM_DEPTH=4``           the host path's channel slots (2–64). A step's PLE
                                   layers take them in layer order: PLE layers + 1
                                   slots put every layer's request out at the step's
                                   start; with fewer, later layers' requests go out as
                                   earlier layers finish.
``VLLM_PLE_SHM_CAPACITY``          rows per request (default: the server's, 16384).
                                   Larger batches are split over slots.
``VLLM_PLE_SHM_PREFETCH=1``        ask for every PLE layer's rows when the step starts
                                   (``step``), collect each at its layer
                                   (``start_prefetch``/``finalize_prefetch``). 0 = look
                                   up synchronously in ``forward``.
``VLLM_PLE_SHM_GPU_PATH=auto``     ``auto``: on a CUDA device with stream memory
                                   operations, lookups are GPU-driven (no host sync,
                                   inside captured CUDA graphs: ``gpu_route``);
                                   elsewhere the host path. ``off``: always the host
                                   path. ``standin``: the GPU-driven path's CPU
                                   stand-in, on any device (for tests).
``VLLM_PLE_SHM_GPU_OPS=kernels``   what rings and collects on the GPU-driven route:
                                   ``kernels``, two small kernels compiled with NVRTC
                                   (``pleclient.gpu_kernels``), two graph nodes a PLE
                                   layer; ``memops``, the driver's stream memory
                                   operations, eleven (the kernels' fallback where
                                   NVRTC cannot build them).
``VLLM_PLE_SHM_CHECKPOINT``        the checkpoint directory the identity check reads.
                                   Default: vLLM's ``--model`` (a local directory, or a
                                   Hugging Face repo already in the local cache).
``VLLM_PLE_SHM_PROMPT_AHEAD=arrival,scheduled``
                                   when the engine hints a prompt's rows to the server
                                   (``prompt_ahead``): at its ``arrival`` in the
                                   scheduler's queue, when its first chunk is
                                   ``scheduled`` (the rest of the prompt), both, or
                                   ``off``.
``VLLM_PLE_SHM_ALLOW_DUMMY=0``     1 = with ``--load-format dummy`` run without any
                                   server: PLE rows are zeros (logged). Off by default
                                   so that zeros never appear unasked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import overload

from pleclient import protocol

ENV_BACKEND = "VLLM_PLE_BACKEND"
BACKEND_VLLM = "vllm"
BACKEND_SHM = "shm"

ENV_SOCKET = "VLLM_PLE_SHM_SOCKET"
ENV_SOCKET_DIR = "VLLM_PLE_SHM_SOCKET_DIR"
DEFAULT_SOCKET_DIR = os.path.dirname(protocol.DEFAULT_SOCKET)
ENV_CONNECT_TIMEOUT = "VLLM_PLE_SHM_CONNECT_TIMEOUT"
ENV_LOOKUP_TIMEOUT = "VLLM_PLE_SHM_LOOKUP_TIMEOUT"
ENV_RECONNECT = "VLLM_PLE_SHM_RECONNECT_S"
ENV_FALLBACK = "VLLM_PLE_SHM_FALLBACK_S"
ENV_DEPTH = "VLLM_PLE_SHM_DEPTH"
ENV_CAPACITY = "VLLM_PLE_SHM_CAPACITY"
ENV_PREFETCH = "VLLM_PLE_SHM_PREFETCH"
ENV_CHECKPOINT = "VLLM_PLE_SHM_CHECKPOINT"
ENV_GPU_PATH = "VLLM_PLE_SHM_GPU_PATH"
GPU_PATH_STANDIN = "standin"
GPU_PATHS = ("auto", "off", GPU_PATH_STANDIN)
ENV_GPU_OPS = "VLLM_PLE_SHM_GPU_OPS"
GPU_OPS = ("memops", "kernels")  # pleclient.gpu.GPU_OPS (no torch import here)
DEFAULT_GPU_OPS = "kernels"  # pleclient.gpu.DEFAULT_GPU_OPS, which says why
ENV_ALLOW_DUMMY = "VLLM_PLE_SHM_ALLOW_DUMMY"
ENV_PROMPT_AHEAD = "VLLM_PLE_SHM_PROMPT_AHEAD"
PROMPT_AHEAD_ARRIVAL = "arrival"
PROMPT_AHEAD_SCHEDULED = "scheduled"
PROMPT_AHEAD_STAGES = (PROMPT_AHEAD_ARRIVAL, PROMPT_AHEAD_SCHEDULED)

VARIABLES = (
    ENV_BACKEND,
    ENV_SOCKET,
    ENV_SOCKET_DIR,
    ENV_CONNECT_TIMEOUT,
    ENV_LOOKUP_TIMEOUT,
    ENV_RECONNECT,
    ENV_FALLBACK,
    ENV_DEPTH,
    ENV_CAPACITY,
    ENV_PREFETCH,
    ENV_CHECKPOINT,
    ENV_GPU_PATH,
    ENV_GPU_OPS,
    ENV_ALLOW_DUMMY,
    ENV_PROMPT_AHEAD,
)
"""Every environment variable the plugin reads whose name starts with ``VLLM_``:
``registration`` declares them to vLLM, whose environment check refuses (or
warns about) ``VLLM_*`` names it does not know. ``PLE_SERVER_SOCKET`` is the
client library's and not checked by vLLM."""

MIN_DEPTH = 2  # prefetch needs the next layer's request beside the current one


class SettingsError(ValueError):
    """An environment setting of the plugin has a value it cannot use."""


def backend() -> str:
    """The selected PLE backend; raises SettingsError for an unknown value."""
    value = os.environ.get(ENV_BACKEND, "").strip().lower()
    if value in ("", BACKEND_VLLM):
        return BACKEND_VLLM
    if value == BACKEND_SHM:
        return BACKEND_SHM
    raise SettingsError(
        f"{ENV_BACKEND}={os.environ[ENV_BACKEND]!r} is not a PLE backend; use "
        f"{ENV_BACKEND}=shm to serve PLE rows from ple-server, or unset it (or "
        f"{ENV_BACKEND}=vllm) to keep vLLM's own table"
    )


@dataclass(frozen=True)
class ShmSettings:
    socket: str | None  # None: found in socket_dir by the checkpoint (discovery)
    connect_timeout: float = 10.0
    lookup_timeout: float = 30.0
    reconnect_window: float = 30.0
    fallback_after: float | None = 1.0  # None: no fallback reads
    depth: int = protocol.DEFAULT_DEPTH
    capacity: int | None = None
    prefetch: bool = True
    checkpoint: str | None = None
    allow_dummy: bool = False
    socket_dir: str = DEFAULT_SOCKET_DIR
    gpu_path: str = "auto"
    gpu_ops: str = DEFAULT_GPU_OPS  # how the GPU-driven route rings and collects
    prompt_ahead: tuple[str, ...] = PROMPT_AHEAD_STAGES

    @classmethod
    def from_env(cls) -> ShmSettings:
        socket = os.environ.get(ENV_SOCKET) or os.environ.get(protocol.SOCKET_ENV) or None
        depth = _int(ENV_DEPTH, protocol.DEFAULT_DEPTH)
        if not MIN_DEPTH <= depth <= protocol.MAX_DEPTH:
            raise SettingsError(
                f"{ENV_DEPTH}={depth}: the channel depth must lie in "
                f"[{MIN_DEPTH}, {protocol.MAX_DEPTH}]"
            )
        capacity = _int(ENV_CAPACITY, None)
        if capacity is not None and capacity < 1:
            raise SettingsError(
                f"{ENV_CAPACITY}={capacity}: must be a positive number "
                "of rows (or unset for the server's default)"
            )
        gpu_path = os.environ.get(ENV_GPU_PATH, "").strip().lower() or "auto"
        if gpu_path not in GPU_PATHS:
            raise SettingsError(f"{ENV_GPU_PATH}={gpu_path!r}: use one of {', '.join(GPU_PATHS)}")
        gpu_ops = os.environ.get(ENV_GPU_OPS, "").strip().lower() or DEFAULT_GPU_OPS
        if gpu_ops not in GPU_OPS:
            raise SettingsError(f"{ENV_GPU_OPS}={gpu_ops!r}: use one of {', '.join(GPU_OPS)}")
        return cls(
            socket=socket,
            connect_timeout=_float(ENV_CONNECT_TIMEOUT, 10.0, minimum=0.1),
            lookup_timeout=_float(ENV_LOOKUP_TIMEOUT, 30.0, minimum=0.1),
            reconnect_window=_float(ENV_RECONNECT, 30.0, minimum=0.0),
            fallback_after=_seconds_or_off(ENV_FALLBACK, 1.0),
            depth=depth,
            capacity=capacity,
            prefetch=_bool(ENV_PREFETCH, True),
            checkpoint=os.environ.get(ENV_CHECKPOINT) or None,
            allow_dummy=_bool(ENV_ALLOW_DUMMY, False),
            socket_dir=os.environ.get(ENV_SOCKET_DIR) or DEFAULT_SOCKET_DIR,
            gpu_path=gpu_path,
            gpu_ops=gpu_ops,
            prompt_ahead=_stages(ENV_PROMPT_AHEAD),
        )


@overload
def _int(name: str, default: int) -> int: ...
@overload
def _int(name: str, default: None) -> int | None: ...
def _int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None


def _stages(name: str) -> tuple[str, ...]:
    """``arrival``, ``scheduled``, both (comma-separated, the default) or ``off``."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return PROMPT_AHEAD_STAGES
    if raw in ("off", "0", "none", "no"):
        return ()
    stages = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [stage for stage in stages if stage not in PROMPT_AHEAD_STAGES]
    if unknown or not stages:
        raise SettingsError(
            f"{name}={os.environ[name]!r}: use {', '.join(PROMPT_AHEAD_STAGES)}, both "
            f"({','.join(PROMPT_AHEAD_STAGES)}, the default) or off"
        )
    return tuple(stage for stage in PROMPT_AHEAD_STAGES if stage in stages)


def _float(name: str, default: float, *, minimum: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number of seconds") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be at least {minimum}")
    return value


def _seconds_or_off(name: str, default: float) -> float | None:
    """Seconds (at least 0), or None for ``off``."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("off", "no", "none"):
        return None
    return _float(name, default, minimum=0.0)


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}: use 1 or 0")
