"""Which vLLM the plugin supports, and the checks that this one has what it patches.

The plugin patches vLLM classes at exact module paths (``registration.TARGETS``).
On a vLLM that moved or renamed them the patch would not apply, and vLLM would
hold and read the whole PLE table (44–95 GiB) itself. So with
``VLLM_PLE_BACKEND=shm`` each way of missing a target fails with
``UnsupportedVllm``, naming what is missing and the supported versions:

* at ``register()``, in every process, before anything is imported:
  ``check_layout`` finds each target module of the model families this vLLM
  has, for the platform it runs on, on disk (no module body runs), and fails
  when one is missing or no supported family is there at all;
* when vLLM imports a target: the names the adapter patches must be defined
  there (``registration.apply_patch``);
* when a model module has loaded: the modules holding its PLE classes must
  have been imported and patched with it, not replaced by others
  (``Target.implies``);
* when a PLE layer is built: its row storage must be the plugin's
  (``qwen4_exp``).

A vLLM of another version whose targets are all present is used, with one
warning per process.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pleclient.vllm_plugin.errors import UnsupportedVllm
from pleclient.vllm_plugin.settings import ENV_BACKEND

log = logging.getLogger("pleclient.vllm_plugin")

QWEN4_EXP = "vllm.models.qwen4_exp"
"""vLLM 0.33's Qwen4Exp package (Qwen3.8-Flash-Next's architecture)."""
DEEPSEEK_V41 = "vllm.models.deepseek_v41"
"""vLLM 0.33's DeepSeek-V4.1 package (Engram layers)."""
QWEN38_FLASH_NEXT = "vllm.models.qwen3_8_flash_next"
"""The qwen38-flash-next vLLM builds' package (the seed interface)."""

SUPPORTED_SERIES = {QWEN4_EXP: ((0, 33),), DEEPSEEK_V41: ((0, 33),)}
"""vLLM release series each family's targets were written against and tested
with; a family not listed here (the builds) is judged by its layout alone."""
SUPPORTED = (
    "vLLM 0.33.x (Qwen4Exp and DeepSeek-V4.1's Engram, NVIDIA and AMD) and the "
    "qwen38-flash-next vLLM builds"
)


@dataclass(frozen=True)
class Target:
    """A vLLM module the plugin patches, and what it must hold."""

    adapter: str
    """``"module:function"``, run on the module right after its body."""
    requires: tuple[str, ...] = ()
    """Names (``Class`` or ``Class.attribute``) the adapter patches or uses."""
    family: str | None = None
    """The model package it belongs to; None: vLLM's core, needed always."""
    platform: str | None = None
    """``"nvidia"`` (every platform but ROCm, as the family's package picks) or
    ``"amd"`` (ROCm): the only platform that builds it; None: every platform."""
    implies: tuple[str, ...] = ()
    """Targets this module's body imports: patched by the time it has loaded."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def platform() -> str:
    """Which of a family's platform packages vLLM builds here."""
    import torch

    return "amd" if torch.version.hip else "nvidia"


def unsupported(problem: str) -> UnsupportedVllm:
    """The error for ``problem``, with the way out."""
    import vllm

    where = ", ".join(getattr(vllm, "__path__", [])) or "?"
    return UnsupportedVllm(
        f"{ENV_BACKEND}=shm: {problem}. This vLLM is {vllm_version()} ({where}); the "
        f"ple-server plugin supports {SUPPORTED}. Without its patch vLLM would hold "
        "the whole PLE table and read it from the checkpoint. Install a supported "
        f"vLLM in this environment, or unset {ENV_BACKEND} to run vLLM with its own "
        "table."
    )


def check_layout(targets: Mapping[str, Target]) -> None:
    """Raise ``UnsupportedVllm`` unless every target this vLLM would build is
    there; warn once when it is not a tested version."""
    families = sorted({t.family for t in targets.values() if t.family is not None})
    present = [f for f in families if module_exists(f)]
    if not present:
        raise unsupported(
            "this vLLM has none of the model packages whose PLE layers the plugin "
            f"serves ({', '.join(families)})"
        )
    here = platform()
    missing = [
        name
        for name, t in targets.items()
        if (t.family is None or t.family in present)
        and t.platform in (None, here)
        and not module_exists(name)
    ]
    if missing:
        raise unsupported(
            "this vLLM lacks the module(s) "
            + ", ".join(missing)
            + f", whose classes the plugin patches ({here} platform)"
        )
    _warn_untested(present)


def module_exists(name: str) -> bool:
    """Whether ``name`` (under an imported top-level package) can be imported,
    found on disk without running any module body."""
    if name in sys.modules:
        return True
    parts = name.split(".")
    top = importlib.import_module(parts[0])
    path = getattr(top, "__path__", None)
    for depth in range(2, len(parts) + 1):
        if path is None:
            return False  # a plain module has no submodules
        prefix = ".".join(parts[:depth])
        module = sys.modules.get(prefix)
        if module is not None:
            path = getattr(module, "__path__", None)
            continue
        spec = importlib.machinery.PathFinder.find_spec(prefix, list(path))
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


def has_attribute(module: object, dotted: str) -> bool:
    obj = module
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


_warned = False


def _warn_untested(families: list[str]) -> None:
    global _warned
    version = vllm_version()
    series = _series(version)
    untested = [f for f in families if f in SUPPORTED_SERIES and series not in SUPPORTED_SERIES[f]]
    if untested and not _warned:
        _warned = True
        log.warning(
            "PLE backend shm: vLLM %s is not a version the plugin was tested with; it "
            "supports %s. Every module it patches is present, so it goes on; a class "
            "that is missing stops vLLM with an error naming it.",
            version,
            SUPPORTED,
        )


def _series(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return None
