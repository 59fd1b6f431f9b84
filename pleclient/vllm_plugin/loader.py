"""Keep vLLM's weight loader away from the PLE shard tensors (44–95 GiB).

Two places, both only while ``VLLM_PLE_BACKEND=shm``:

* Model classes gain ``is_unused_checkpoint_weight``: vLLM's default loader
  then drops safetensors files that hold nothing but shards before opening
  them (``filter_safetensors_files_by_weight_name``). A model that already
  declares unused weights keeps them: the two predicates are or-ed.
* ``weight_utils.should_skip_weight`` (the per-tensor filter the safetensors
  iterators consult before ``get_tensor``) also skips shard names, so shards
  that share a file with other tensors are never materialized either. Loaders
  that read whole files (``--load-format fastsafetensors``, multithreaded or
  ``eager`` loading) read such mixed files anyway; the embedding then drops
  the shard tensors it is handed.

The FP8 ``weight_scale``, NVFP4's ``weight_scale_2`` and the hash buffers are
not shards: they load as usual.
"""

from __future__ import annotations

import functools
import logging
import re
from types import ModuleType
from typing import Any

import torch.nn as nn

log = logging.getLogger("pleclient.vllm_plugin")

SHARD_WEIGHT_RE = re.compile(
    r"(?:^|\.)(?:ple\.ple_embedding\.ngram_embedding\.shard_[0-9]+\.weight(?:_scale)?"
    r"|engram\.embed\.(?:weight|scale))$"
)
"""A served table's tensor name, as in the checkpoint and (relative) in the
module: a PLE shard's rows, or an NVFP4 table's block scales
(``shard_<i>.weight_scale``, as large as an eighth of the table); an Engram
table's values or scales (``engram.embed.weight``, ``.scale``: vLLM's own
instanttensor filter). The global scales are not shards: they load."""


def is_ple_shard(name: str) -> bool:
    return SHARD_WEIGHT_RE.search(name) is not None


MODEL_CLASS_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "MTP")
"""The classes vLLM instantiates as models (the loader asks those only)."""


def patch_model_module(module: ModuleType) -> None:
    """Declare the shard tensors unused on every model class of ``module``."""
    for obj in list(vars(module).values()):
        if (
            isinstance(obj, type)
            and issubclass(obj, nn.Module)
            and obj.__module__ == module.__name__
            and obj.__name__.endswith(MODEL_CLASS_SUFFIXES)
        ):
            declare_shards_unused(obj)


def declare_shards_unused(cls: Any) -> None:  # a vLLM class, patched in place
    if cls.__dict__.get("_ple_shm_unused_declared"):
        return
    previous = cls.__dict__.get("is_unused_checkpoint_weight")

    if previous is None:

        def is_unused_checkpoint_weight(self, name: str) -> bool:
            parent = super(cls, self)
            inherited = getattr(parent, "is_unused_checkpoint_weight", None)
            return is_ple_shard(name) or bool(inherited and inherited(name))
    else:

        @functools.wraps(previous)
        def is_unused_checkpoint_weight(self, name: str) -> bool:
            return is_ple_shard(name) or bool(previous(self, name))

    cls.is_unused_checkpoint_weight = is_unused_checkpoint_weight
    cls._ple_shm_unused_declared = True
    log.debug("PLE shm: %s declares PLE shard tensors unused", cls.__qualname__)


def patch_weight_utils(module: Any) -> None:  # a module whose function is swapped
    """Make the safetensors iterators skip shard tensors before reading them."""
    original = module.should_skip_weight
    if getattr(original, "_ple_shm_wrapped", False):
        return

    @functools.wraps(original)
    def should_skip_weight(weight_name: str, *args, **kwargs) -> bool:
        return is_ple_shard(weight_name) or original(weight_name, *args, **kwargs)

    should_skip_weight._ple_shm_wrapped = True  # type: ignore[attr-defined]
    should_skip_weight._ple_shm_original = original  # type: ignore[attr-defined]
    module.should_skip_weight = should_skip_weight
