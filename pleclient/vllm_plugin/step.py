"""Every PLE layer's lookup starts when the step starts.

A step's n-gram ids depend only on its tokens, so every PLE layer's ids are
known before the rank's first layer runs. vLLM starts each PLE layer's lookup
one decoder layer ahead (``Qwen4ExpModel.forward`` calls
``_start_layer_ple_prefetch`` for its first layer before the layer loop, then
for layer *i + 1* before layer *i* runs); a miss read from disk then has one
layer's time to arrive. With the plugin, the first of those calls in a forward
starts the lookup of every PLE layer in this rank's layer range (its first to
its last layer: a pipeline stage starts its own layers only), each layer
hashing its own ids into its own buffer and taking its own slots; the later
calls find their layer started and do nothing. The reads of every PLE layer
then hide behind the layers before it.

``StepStart`` holds a model's: the rank's first layer, its PLE layers (in layer
order) and the model's own one-layer start (``start``), which each of them
goes through, so each still hashes with its own buffers. ``adopt`` stamps it
on the layers of the range when the model is built; ``starting_with_the_step``
is what the model's one-layer start becomes. The model family's adapter
(``qwen4_exp``) wires both to its patch points.

Why two steps' ids never mix, under CUDA graphs and torch.compile:

* The call that starts a step is fixed when the model is built: the one for
  the rank's first layer, which vLLM makes first in every forward. There is no
  count kept from call to call. A captured graph holds the step's starts at
  its beginning and replays them with each replay's ids; a compiler sees a
  branch on a constant.
* Each layer owns its lookup: its ``LayerLookups`` (one started lookup at a
  time), its ids buffer and, on the GPU-driven route, its slots. A layer's
  lookup is started once a step and finished at its layer, in stream order.
* A lookup started and never finished (a step that failed half way) is given
  up by the next start of its layer, before the new one goes out.

On the host route the layers' lookups take the session's slots in layer order
(``TableBinding.with_step``): as many as the channel holds go out at once, the
others as the earlier layers finish; raise ``VLLM_PLE_SHM_DEPTH`` to the
number of PLE layers plus one for all of them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pleclient.vllm_plugin.rows import TableBinding

STEP_ATTR = "_ple_shm_step_start"
"""The attribute of each layer in the range that holds its model's StepStart."""

Start = Callable[..., None]
"""A model's one-layer start: ``start(layer, input_ids, query_start_loc, ngram_context)``."""


class StepStart:
    """One model's PLE layers, started together by the step's first call."""

    def __init__(self, first: object, ple_layers: Sequence[object], start: Start) -> None:
        self.first = first
        self.ple_layers = list(ple_layers)
        self._start = start

    def prefetch(self, layer: object, *inputs: Any) -> None:
        """The model asks to start ``layer``'s lookup: for the rank's first
        layer, start every PLE layer's; for the others, nothing (started with
        the step)."""
        if layer is self.first:
            for ple_layer in self.ple_layers:
                self._start(ple_layer, *inputs)


def adopt(
    layers: Sequence[Any],
    start_layer: int,
    end_layer: int,
    start: Start,
    bindings: Callable[[Any], TableBinding | None],
) -> StepStart | None:
    """Stamp a ``StepStart`` on the layers ``[start_layer, end_layer)`` of a model
    just built, when any of them has a PLE layer served by ple-server
    (``bindings(layer)``: its table, or None). Returns it, or None (nothing to
    start: the model keeps its one-layer start)."""
    in_range = [layers[i] for i in range(start_layer, end_layer)]
    tables = [(layer, bindings(layer)) for layer in in_range]
    ple_layers = [layer for layer, binding in tables if binding is not None]
    if not ple_layers:
        return None
    step = StepStart(in_range[0], ple_layers, start)
    for layer, binding in tables:
        if binding is not None:
            binding.with_step = True
        layer.__dict__[STEP_ATTR] = step  # a plain attribute, not a submodule
    return step


def starting_with_the_step(start: Start) -> Start:
    """The model's one-layer start, made to start every PLE layer with the
    step on the layers ``adopt`` stamped (other layers keep ``start``)."""

    def start_layer_ple_prefetch(layer: Any, *inputs: Any) -> None:
        step = layer.__dict__.get(STEP_ATTR)
        if step is None:
            start(layer, *inputs)
        else:
            step.prefetch(layer, *inputs)

    start_layer_ple_prefetch.__doc__ = start.__doc__
    start_layer_ple_prefetch.__name__ = getattr(start, "__name__", "start")
    return start_layer_ple_prefetch
