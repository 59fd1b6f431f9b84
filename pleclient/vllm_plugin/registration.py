"""``register()``: the ``vllm.general_plugins`` entry point, and patch-on-import.

vLLM calls ``register()`` once in every process it starts (API server, engine
core, workers); it may be called again (tests, nested launches), so it is
re-entrant. It first declares the plugin's ``VLLM_PLE_*`` variables to vLLM
whenever one is set (``declare_variables``). With ``VLLM_PLE_BACKEND`` unset or
``vllm`` it then returns and changes nothing else. With ``shm`` it checks that
this vLLM has every module it patches (``compat.check_layout``) and installs
an import hook: when vLLM imports one of the modules in ``TARGETS``, the
matching adapter patches it right after the module's own code ran (modules
already imported are patched at once). Nothing is imported ahead of vLLM, so
the API server process never loads model code it does not use, and the patch
cannot be undone by a later import order.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType

from pleclient.vllm_plugin import compat, settings
from pleclient.vllm_plugin.compat import DEEPSEEK_V41, QWEN4_EXP, QWEN38_FLASH_NEXT, Target
from pleclient.vllm_plugin.errors import PleBackendError
from pleclient.vllm_plugin.logs import join_vllm_logging

log = logging.getLogger("pleclient.vllm_plugin")

QWEN4_EXP_STORAGE = ("Qwen4ExpPLEDeviceEmbedding", "Qwen4ExpPLEPinnedHostEmbedding")
"""The row storage classes ``Qwen4ExpNGramEmbedding`` picks from its module's
namespace (pinned host with Engram ``cpu_offload``, else device)."""
_QWEN4_NGRAM = ("Qwen4ExpNGramEmbedding", *QWEN4_EXP_STORAGE)
_QWEN4_MODELS = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
_SEED_NGRAM = ("Qwen3_8FlashNextNGramEmbedding", "VocabParallelEmbedding")

_ADAPTERS = "pleclient.vllm_plugin"
TARGETS: dict[str, Target] = {
    # Qwen4Exp (vLLM 0.33): storage of the n-gram embedding, per platform.
    f"{QWEN4_EXP}.nvidia.ngram_embedding": Target(
        f"{_ADAPTERS}.qwen4_exp:patch_nvidia", _QWEN4_NGRAM, QWEN4_EXP, "nvidia"
    ),
    f"{QWEN4_EXP}.amd.ple_layer": Target(
        f"{_ADAPTERS}.qwen4_exp:patch_amd", _QWEN4_NGRAM, QWEN4_EXP, "amd"
    ),
    # Model classes: declare the shard tensors unused, so the loader skips them.
    # Each imports its platform's n-gram embedding: that one, and no other.
    # nvidia's: every PLE layer's lookup also starts with the step (step.py).
    f"{QWEN4_EXP}.nvidia.model": Target(
        f"{_ADAPTERS}.qwen4_exp:patch_model",
        (*_QWEN4_MODELS, "Qwen4ExpModel"),
        QWEN4_EXP,
        "nvidia",
        implies=(f"{QWEN4_EXP}.nvidia.ngram_embedding",),
    ),
    f"{QWEN4_EXP}.amd.model": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        _QWEN4_MODELS,
        QWEN4_EXP,
        "amd",
        implies=(f"{QWEN4_EXP}.amd.ple_layer",),
    ),
    f"{QWEN4_EXP}.nvidia.mtp": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("Qwen4ExpMTP",),
        QWEN4_EXP,
        "nvidia",
        implies=(f"{QWEN4_EXP}.nvidia.ngram_embedding",),
    ),
    f"{QWEN4_EXP}.amd.mtp": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("Qwen4ExpMTP",),
        QWEN4_EXP,
        "amd",
        implies=(f"{QWEN4_EXP}.amd.ple_layer",),
    ),
    # DeepSeek-V4.1 (vLLM 0.33): the Engram layer (one class for both
    # platforms): its storage, its lookup's start and its rows.
    f"{DEEPSEEK_V41}.common.engram": Target(
        f"{_ADAPTERS}.deepseek_v41:patch_engram_module",
        (
            "Engram._create_embedding",
            "Engram.prepare_embeddings",
            "Engram._ready_rows",
            "Engram.embed",
        ),
        DEEPSEEK_V41,
    ),
    # Its model classes: the Engram tables declared unused, so the loader skips them.
    f"{DEEPSEEK_V41}.nvidia.vl_model": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("DeepseekV41ForCausalLM",),
        DEEPSEEK_V41,
        "nvidia",
        implies=(f"{DEEPSEEK_V41}.common.engram",),
    ),
    f"{DEEPSEEK_V41}.nvidia.model": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("DeepseekV41LLMForCausalLM",),
        DEEPSEEK_V41,
        "nvidia",
        implies=(f"{DEEPSEEK_V41}.common.engram",),
    ),
    f"{DEEPSEEK_V41}.amd.vl_model": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("DeepseekV41ForCausalLM",),
        DEEPSEEK_V41,
        "amd",
        implies=(f"{DEEPSEEK_V41}.common.engram",),
    ),
    f"{DEEPSEEK_V41}.amd.model": Target(
        f"{_ADAPTERS}.loader:patch_model_module",
        ("DeepseekV41LLMForCausalLM",),
        DEEPSEEK_V41,
        "amd",
        implies=(f"{DEEPSEEK_V41}.common.engram",),
    ),
    # Shards in files shared with other tensors: skipped before they are read.
    "vllm.model_executor.model_loader.weight_utils": Target(
        f"{_ADAPTERS}.loader:patch_weight_utils", ("should_skip_weight",)
    ),
    # Lookups outside piecewise CUDA graphs.
    "vllm.config.compilation": Target(
        f"{_ADAPTERS}.compilation:patch_compilation_module",
        ("CompilationConfig.set_splitting_ops_for_v1",),
    ),
    # Prompt-ahead: the engine core's scheduler hints each prompt's rows.
    "vllm.v1.core.sched.scheduler": Target(
        f"{_ADAPTERS}.prompt_ahead:patch_scheduler_module",
        ("Scheduler.add_request", "Scheduler.schedule"),
    ),
    # The seed's interface (qwen38-flash-next vLLM builds).
    f"{QWEN38_FLASH_NEXT}.nvidia.ple_layer": Target(
        f"{_ADAPTERS}.qwen38_flash_next:patch_module", _SEED_NGRAM, QWEN38_FLASH_NEXT, "nvidia"
    ),
    f"{QWEN38_FLASH_NEXT}.amd.ple_layer": Target(
        f"{_ADAPTERS}.qwen38_flash_next:patch_module", _SEED_NGRAM, QWEN38_FLASH_NEXT, "amd"
    ),
}

_lock = threading.RLock()
_finder: _PatchOnImport | None = None


def register() -> None:
    """Entry point: activate the selected PLE backend in this process."""
    selected = settings.backend()  # raises SettingsError on a bad value
    declare_variables()
    if selected == settings.BACKEND_VLLM:
        return
    settings.ShmSettings.from_env()  # validate every knob now, in every process
    require_native()
    compat.check_layout(TARGETS)  # raises UnsupportedVllm, naming what is missing
    join_vllm_logging()
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


def require_native() -> None:
    """The client's native module, or PleBackendError with the fix. Raised
    from ``register``, it stops vLLM: an import error of the entry point
    itself would only be logged, and vLLM would run on with its own table
    while ``VLLM_PLE_BACKEND=shm`` says otherwise."""
    try:
        importlib.import_module("pleclient.channel")
    except ImportError as exc:
        raise PleBackendError(
            f"VLLM_PLE_BACKEND=shm, but pleclient cannot be used here: {exc}. Install "
            "pleserver into vLLM's environment from a wheel or with `pip install .` (a "
            "source checkout on PYTHONPATH has no built native module), or unset "
            "VLLM_PLE_BACKEND to keep vLLM's own table"
        ) from None


def declare_variables() -> bool:
    """Add the plugin's variables to ``vllm.envs.environment_variables``, vLLM's
    registry of its own, when one of them is set; returns whether it did.

    ``EngineArgs.create_engine_config`` checks the environment against that
    registry (``Platform.validate_environ``): it warns about each ``VLLM_*``
    name it does not know, and ``--fail-on-environ-validation`` refuses to
    start. It runs in the process that builds the config (the API server, or
    ``LLM``), after ``EngineArgs.__post_init__`` loaded the plugins. The engine
    core and the workers load them too: the registry also makes up the key of
    vLLM's compile cache there (``envs.compile_factors()``), so a model
    compiled with the stock table is never reused with ``shm``. With none of
    the variables set, vLLM's registry stays as it was."""
    if not any(name in os.environ for name in settings.VARIABLES):
        return False
    import vllm.envs

    registry = getattr(vllm.envs, "environment_variables", None)
    if not isinstance(registry, dict):
        log.debug("PLE backend: this vLLM has no environment registry to declare to")
        return False
    for name in settings.VARIABLES:
        # The raw value, as vLLM's own string variables: the plugin parses and
        # checks them itself (settings.ShmSettings).
        registry.setdefault(name, functools.partial(os.environ.get, name))
    return True


def is_registered() -> bool:
    return _finder is not None


def apply_patch(name: str, module: ModuleType) -> None:
    """Run the adapter for ``name`` on its module (idempotent per module);
    raises ``UnsupportedVllm`` when the module lacks what the adapter patches,
    or loaded without the PLE modules it should have imported."""
    with _lock:
        target = TARGETS[name]
        done: set[str] = module.__dict__.setdefault("_ple_shm_patched_by", set())
        if target.adapter in done:
            return
        missing = [r for r in target.requires if not compat.has_attribute(module, r)]
        if missing:
            raise compat.unsupported(
                f"{name} has no {', '.join(missing)}, which the plugin patches"
            )
        _resolve(target.adapter)(module)
        done.add(target.adapter)
        for implied in target.implies:
            implied_module = sys.modules.get(implied)
            if implied_module is None:
                raise compat.unsupported(
                    f"{name} loaded without importing {implied}, whose classes the "
                    "plugin patches: this vLLM builds its PLE layers from other classes"
                )
            apply_patch(implied, implied_module)


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
