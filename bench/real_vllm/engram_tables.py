"""Stock vLLM's DeepSeek-V4.1 Engram tables, from the checkpoint the shm cell serves.

The whole-model DeepSeek-V4.1 of ``pleserver.devkit.deepseek_v41 --whole-model``
keeps only its Engram tables in safetensors: every other weight is vLLM's
``load_format="dummy"`` draw, which seeds each tensor alike, so a stock engine
and a shm engine hold the same numbers everywhere but in the tables. A shm
engine reads the tables through ple-server; a stock engine gets them from here,
through the model's own ``load_weights`` (its name mapping and head-shard
loader, the path a real checkpoint takes), after the engine has started. The
copy lands in the parameters' own storage, so the CUDA graphs captured at start
read the rows copied in.

It is a worker extension (``LLM(worker_extension_cls=EXTENSION)``), so the
call reaches the worker by name through ``LLM.collective_rpc`` under V1
multiprocessing too, with no pickled function.
"""

from __future__ import annotations

import re
from pathlib import Path

EXTENSION = "bench.real_vllm.engram_tables.CheckpointEngramTables"
# vLLM 0.33's own filter for these tensors (weight_utils.py's instanttensor regex)
ENGRAM_TENSOR = re.compile(r"(?:^|\.)engram\.embed\.(?:weight|scale)$")


def engram_tensor_files(model_dir: Path) -> dict[str, Path]:
    """Each Engram tensor's name in the checkpoint and the file that holds it
    (the safetensors headers, as ple-server's discovery reads them)."""
    from pleclient.checkpoint import checkpoint_files, read_header

    found = {
        name: Path(path)
        for path in checkpoint_files(str(model_dir))[0]
        for name in read_header(path)[0]
        if ENGRAM_TENSOR.search(name)
    }
    if not found:
        raise FileNotFoundError(
            f"{model_dir}: no Engram tensor (layers.<L>.engram.embed.weight/.scale) in its "
            "safetensors; write it with python -m pleserver.devkit.deepseek_v41 --whole-model"
        )
    return found


class CheckpointEngramTables:
    """Methods vLLM mixes into its GPU worker (``worker_extension_cls``)."""

    def load_engram_tables(self, model_dir: str) -> dict:
        """Load the checkpoint's Engram tensors into this worker's model; what was
        loaded, by vLLM parameter name, with each tensor's shape."""
        from safetensors import safe_open

        tensors = {}
        for name, path in sorted(engram_tensor_files(Path(model_dir)).items()):
            with safe_open(str(path), framework="pt") as f:
                tensors[name] = f.get_tensor(name)  # (the small model's: 0.2 GB in all)
        # the worker's model, out of any CUDA graph wrapper (vLLM's default graphs
        # wrap it, and a wrapper is no nn.Module)
        model = self.get_model()  # type: ignore[attr-defined]
        loaded = model.load_weights(iter(tensors.items()))
        params = dict(model.named_parameters())
        wanted = {param_name(n): n for n in tensors}
        if not set(wanted) <= set(loaded):
            raise RuntimeError(
                f"the model's load_weights took {sorted(n for n in loaded if '.engram.' in n)} "
                f"of {sorted(wanted)}: its name mapping did not take every Engram tensor"
            )
        for name, tensor_name in wanted.items():  # the bytes landed where the graphs read
            check_rows(params[name], tensors[tensor_name], name)
        return {n: list(params[n].shape) for n in sorted(wanted)}


def param_name(tensor_name: str) -> str:
    """vLLM's parameter of a checkpoint Engram tensor (its DeepSeek-V4.1 mapper:
    ``layers.L.engram.embed.weight`` → ``…embed_tokens.weight``, ``.scale`` →
    ``…embed_tokens.weight_scale_inv``, under the vision wrapper's prefix)."""
    layer_part, _, kind = tensor_name.rpartition(".embed.")
    param = {"weight": "weight", "scale": "weight_scale_inv"}[kind]
    return f"language_model.model.{layer_part}.embed_tokens.{param}"


def check_rows(param, tensor, name: str) -> None:
    """The first and last rows of ``param`` (this rank's rows, from its
    ``engram_vocab_start``) equal the checkpoint's, byte for byte."""
    import torch

    start = int(getattr(param, "engram_vocab_start", 0))
    rows = param.shape[0]
    for r in (0, rows - 1):
        got = param.data[r].view(torch.uint8).cpu()
        want = tensor[start + r].view(torch.uint8)
        if not torch.equal(got, want):
            raise RuntimeError(f"{name}: row {r} differs from the checkpoint after the copy")
