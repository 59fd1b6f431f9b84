"""The step start's wiring (``pleclient.vllm_plugin.step``) over a pipeline
stage's layer range, with layers shaped like vLLM's decoder layers (torch
modules with an optional ``ple``). The whole model, with real lookups, is
``test_vllm_plugin_model.py``; on a GPU, ``bench/gpu/step_start_check.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pleclient.vllm_plugin import step  # noqa: E402
from pleclient.vllm_plugin.identity import Expected  # noqa: E402
from pleclient.vllm_plugin.rows import TableBinding  # noqa: E402


class Ple(torch.nn.Module):
    """A PLE layer: its lookup starts are recorded."""

    def __init__(self, layer: int, started: list) -> None:
        super().__init__()
        self.layer = layer
        self.started = started
        self.binding = TableBinding(
            Expected(f"model.layers.{layer}.ple.ple_embedding", 1000, 16, ("BF16",), 4), None
        )

    def start_prefetch(self, input_ids, query_start_loc, ngram_context) -> None:
        self.started.append((self.layer, input_ids))


class DecoderLayer(torch.nn.Module):
    def __init__(self, index: int, ple: Ple | None) -> None:
        super().__init__()
        self.index = index
        self.ple = ple


def stock_start(layer, input_ids, query_start_loc, ngram_context) -> None:
    """vLLM's ``Qwen4ExpModel._start_layer_ple_prefetch``, as it is."""
    ple = getattr(layer, "ple", None)
    if ple is None:
        return
    ple.start_prefetch(input_ids, query_start_loc, ngram_context)


def forward_starts(layers, start_layer: int, end_layer: int, start, input_ids) -> None:
    """The order of ``Qwen4ExpModel.forward``'s calls: the first layer's before
    the loop, then layer i + 1's before layer i runs."""
    start(layers[start_layer], input_ids, None, None)
    for i in range(start_layer, end_layer):
        if i + 1 < end_layer:
            start(layers[i + 1], input_ids, None, None)


def model(ple_at: tuple[int, ...], started: list, count: int = 8) -> list[DecoderLayer]:
    return [DecoderLayer(i, Ple(i, started) if i in ple_at else None) for i in range(count)]


def shm_binding(layer) -> TableBinding | None:
    return layer.ple.binding if layer.ple is not None else None


def test_the_first_call_of_a_forward_starts_the_ple_layers_of_the_stage_range():
    started: list = []
    layers = model((1, 3, 6), started)
    adopted = step.adopt(layers, 2, 7, stock_start, shm_binding)  # the stage's layers 2..6
    assert adopted is not None and adopted.first is layers[2]
    assert [layer.index for layer in adopted.ple_layers] == [3, 6]
    start = step.starting_with_the_step(stock_start)
    ids = torch.arange(5)
    start(layers[2], ids, None, None)  # the forward's first call: layer 2 has no PLE
    assert [(layer, got is ids) for layer, got in started] == [(3, True), (6, True)]
    forward_starts(layers, 2, 7, start, ids)  # a whole forward: its first call, then the rest
    assert [layer for layer, _ in started] == [3, 6, 3, 6]  # once per step, nothing later
    assert [layers[i].ple.binding.with_step for i in (1, 3, 6)] == [False, True, True]


def test_layers_outside_the_range_keep_the_stock_start():
    started: list = []
    layers = model((1, 3), started)
    step.adopt(layers, 2, 8, stock_start, shm_binding)
    start = step.starting_with_the_step(stock_start)
    start(layers[1], torch.arange(3), None, None)  # another stage's layer: stock
    assert [layer for layer, _ in started] == [1]


def test_without_ple_layers_served_by_ple_server_nothing_changes():
    started: list = []
    layers = model((1, 3), started)
    assert step.adopt(layers, 0, 8, stock_start, lambda layer: None) is None
    forward_starts(layers, 0, 8, step.starting_with_the_step(stock_start), torch.arange(2))
    assert [layer for layer, _ in started] == [1, 3]  # vLLM's own one layer ahead
    assert not any(step.STEP_ATTR in layer.__dict__ for layer in layers)


def test_a_stage_without_layers_adopts_nothing():
    assert step.adopt(model((1,), []), 4, 4, stock_start, shm_binding) is None
