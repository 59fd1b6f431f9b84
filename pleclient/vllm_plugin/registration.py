"""``register()``: the ``vllm.general_plugins`` entry point, and patch-on-import.

vLLM calls ``register()`` once in every process it starts (API server, engine
core, workers); it may be called again (tests, nested launches), so it is
re-entrant. With ``VLLM_PLE_BACKEND`` unset or ``vllm`` it returns at once and
changes nothing. With ``shm`` it installs an import hook: when vLLM imports one
of the modules in ``TARGETS``, the matching adapter patches it right after the
module's own code ran (modules already imported are patched at once). Nothing
is imported ahead of vLLM, so the API server process never loads model code it
does not use, and the patch cannot be undone by a later import order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType

from pleclient.vllm_plugin import settings

log = logging.getLogger("pleclient.vllm_plugin")

_ADAPTERS = "pleclient.vllm_plugin"
TARGETS: dict[str, str] = {
    # Qwen4Exp (vLLM 0.33): storage of the n-gram embedding, per platform.
    "vllm.models.qwen4_exp.nvidia.ngram_embedding": f"{_ADAPTERS}.qwen4_exp:patch_nvidia",
    "vllm.models.qwen4_exp.amd.ple_layer": f"{_ADAPTERS}.qwen4_exp:patch_amd",
    # Model classes: declare the shard tensors unused, so the loader skips them.
    "vllm.models.qwen4_exp.nvidia.model": f"{_ADAPTERS}.qwen4_exp:patch_model",  # + step start
    "vllm.models.qwen4_exp.amd.model": f"{_ADAPTERS}.loader:patch_model_module",
    "vllm.models.qwen4_exp.nvidia.mtp": f"{_ADAPTERS}.loader:patch_model_module",
    "vllm.models.qwen4_exp.amd.mtp": f"{_ADAPTERS}.loader:patch_model_module",
    # Shards in files shared with other tensors: skipped before they are read.
    "vllm.model_executor.model_loader.weight_utils": f"{_ADAPTERS}.loader:patch_weight_utils",
    # Lookups outside piecewise CUDA graphs.
    "vllm.config.compilation": f"{_ADAPTERS}.compilation:patch_compilation_module",
    # The seed's interface (qwen38-flash-next vLLM builds).
    "vllm.models.qwen3_8_flash_next.nvidia.ple_layer": (
        f"{_ADAPTERS}.qwen38_flash_next:patch_module"
    ),
    "vllm.models.qwen3_8_flash_next.amd.ple_layer": f"{_ADAPTERS}.qwen38_flash_next:patch_module",
}

_lock = threading.RLock()
_finder: _PatchOnImport | None = None


def register() -> None:
    """Entry point: activate the selected PLE backend in this process."""
    selected = settings.backend()  # raises SettingsError on a bad value
    if selected == settings.BACKEND_VLLM:
        return
    settings.ShmSettings.from_env()  # validate every knob now, in every process
    global _finder
    with _lock:
        if _finder is None:
            _finder = _PatchOnImport()
            sys.meta_path.insert(0, _finder)
            log.info("PLE backend shm: PLE rows will come from ple-server")
        for name in TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                apply_patch(name, module)


def is_registered() -> bool:
    return _finder is not None


def apply_patch(name: str, module: ModuleType) -> None:
    """Run the adapter for ``name`` on its module (idempotent per module)."""
    with _lock:
        done: set[str] = module.__dict__.setdefault("_ple_shm_patched_by", set())
        target = TARGETS[name]
        if target in done:
            return
        _resolve(target)(module)
        done.add(target)


def _resolve(target: str) -> Callable[[ModuleType], None]:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGETS through the other finders and wraps their loader so the
    adapter runs right after the module body."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):  # importlib API
        if fullname not in TARGETS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):  # importlib API
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        apply_patch(self._fullname, module)

    def __getattr__(self, name: str):  # get_source, get_code, is_package, …
        return getattr(self._loader, name)
