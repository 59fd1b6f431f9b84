"""vLLM-shaped package trees, for the plugin's checks against a vLLM it cannot patch.

``write_tree(root, layout)`` writes a package ``vllm`` under ``root`` with the
modules the plugin patches, laid out as vLLM 0.33 lays them out (classes
reduced to names, imports between modules kept: a model module imports its
PLE layer module, which imports the n-gram embedding module), then changed as
``layout`` says. A scenario process with ``root`` first on ``PYTHONPATH``
imports this tree as ``vllm``. It is written by hand, not derived from the
plugin's own target list, so that the checks are tested against a layout, not
against themselves.
"""

from __future__ import annotations

import os
import textwrap

VERSION = "0.34.0"
"""The fake vLLM's version: one the plugin was not tested with."""

_QWEN4_NGRAM = """\
    class Qwen4ExpPLEDeviceEmbedding: ...
    class Qwen4ExpPLEPinnedHostEmbedding: ...
    class Qwen4ExpNGramEmbedding: ...
"""
_QWEN4_MODEL = """\
    from .ple_layer import Qwen4ExpPLELayer
    class Qwen4ExpForCausalLM: ...
    class Qwen4ExpForConditionalGeneration: ...
    class Qwen4ExpModel:
        @staticmethod
        def _start_layer_ple_prefetch(*args): ...
"""
_QWEN4_MTP = """\
    from .model import Qwen4ExpForCausalLM
    class Qwen4ExpMTP: ...
"""

BASE: dict[str, str] = {
    "vllm/__init__.py": f'__version__ = "{VERSION}"\n',
    "vllm/envs.py": "environment_variables = {}\n",
    "vllm/models/__init__.py": "",
    "vllm/models/qwen4_exp/__init__.py": "",
    "vllm/models/qwen4_exp/nvidia/__init__.py": "",
    "vllm/models/qwen4_exp/nvidia/ngram_embedding.py": _QWEN4_NGRAM,
    "vllm/models/qwen4_exp/nvidia/ple_layer.py": """\
        from .ngram_embedding import Qwen4ExpNGramEmbedding
        class Qwen4ExpPLELayer: ...
    """,
    "vllm/models/qwen4_exp/nvidia/model.py": _QWEN4_MODEL,
    "vllm/models/qwen4_exp/nvidia/mtp.py": _QWEN4_MTP,
    "vllm/models/qwen4_exp/amd/__init__.py": "",
    "vllm/models/qwen4_exp/amd/ple_layer.py": _QWEN4_NGRAM + "    class Qwen4ExpPLELayer: ...\n",
    "vllm/models/qwen4_exp/amd/model.py": _QWEN4_MODEL,
    "vllm/models/qwen4_exp/amd/mtp.py": _QWEN4_MTP,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/model_loader/__init__.py": "",
    "vllm/model_executor/model_loader/weight_utils.py": """\
        def should_skip_weight(weight_name, *args, **kwargs):
            return False
    """,
    "vllm/config/__init__.py": "",
    "vllm/config/compilation.py": """\
        class CompilationConfig:
            def set_splitting_ops_for_v1(self, *args, **kwargs): ...
    """,
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/core/sched/scheduler.py": """\
        class Scheduler:
            def add_request(self, request): ...
            def schedule(self): ...
    """,
}

NVIDIA = "vllm/models/qwen4_exp/nvidia"

LAYOUTS: dict[str, dict[str, str | None]] = {
    # Every module and class where vLLM 0.33 has them (another version number).
    "as_0_33": {},
    # The n-gram embedding moved into a subpackage; the model imports it there.
    "moved": {
        f"{NVIDIA}/ngram_embedding.py": None,
        f"{NVIDIA}/ple/__init__.py": "",
        f"{NVIDIA}/ple/ngram.py": _QWEN4_NGRAM,
        f"{NVIDIA}/ple_layer.py": """\
            from .ple.ngram import Qwen4ExpNGramEmbedding
            class Qwen4ExpPLELayer: ...
        """,
    },
    # No package of a PLE model at all (a vLLM without Qwen4Exp).
    "no_ple_model": {path: None for path in BASE if path.startswith("vllm/models/qwen4_exp/")},
    # The module is there, one storage class was renamed.
    "renamed_storage": {
        f"{NVIDIA}/ngram_embedding.py": """\
            class Qwen4ExpPLEDeviceEmbedding: ...
            class Qwen4ExpPLEUvaEmbedding: ...
            class Qwen4ExpNGramEmbedding: ...
        """
    },
    # The old module is still there, but the PLE layer now imports a new one.
    "replaced": {
        f"{NVIDIA}/ngram_embedding_v2.py": _QWEN4_NGRAM,
        f"{NVIDIA}/ple_layer.py": """\
            from .ngram_embedding_v2 import Qwen4ExpNGramEmbedding
            class Qwen4ExpPLELayer: ...
        """,
    },
}


def write_tree(root: str, layout: str) -> str:
    """Write the tree of ``layout`` under ``root``; returns ``root``."""
    files: dict[str, str | None] = {**BASE, **LAYOUTS[layout]}
    for path, source in files.items():
        if source is None:
            continue
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(textwrap.dedent(source))
    return root
