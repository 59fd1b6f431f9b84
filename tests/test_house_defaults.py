"""Defaults live in one place: ``ServerConfig``. The classes below it take
each setting from it (``from_config``, or the server's own call) and restate
none: a parameter named as a setting has no default of its own, so a default
changed in the config cannot leave another one behind."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pleserver.config import ServerConfig
from pleserver.data.hints import HintReader
from pleserver.data.plane import DataPlane, PlaneOptions
from pleserver.data.prewarm import Prewarm
from pleserver.data.serving import ServingLoop
from pleserver.data.tables import CachedTable, MappedTable, Table
from pleserver.observe.metrics import MetricsEndpoint

SETTINGS = {f.name for f in dataclasses.fields(ServerConfig)}


def restated(call) -> list[str]:
    """The parameters of ``call`` named as a setting that have a default."""
    return [
        name
        for name, param in inspect.signature(call).parameters.items()
        if name in SETTINGS and param.default is not inspect.Parameter.empty
    ]


@pytest.mark.parametrize(
    "call",
    [
        PlaneOptions,
        DataPlane.__init__,
        Table.__init__,
        MappedTable.__init__,
        CachedTable.__init__,
        ServingLoop.__init__,
        HintReader.__init__,
        Prewarm.__init__,
        MetricsEndpoint.__init__,
    ],
    ids=lambda c: c.__qualname__,
)
def test_no_setting_has_a_default_below_the_config(call):
    assert restated(call) == []


def test_plane_options_are_settings_all_of_them_from_the_config():
    fields = [f.name for f in dataclasses.fields(PlaneOptions)]
    assert set(fields) <= SETTINGS
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(PlaneOptions))
    options = PlaneOptions.from_config(ServerConfig())
    assert options.io == ServerConfig().io  # the config's default, not a copy


def test_the_check_sees_a_restated_default():
    def restating(tables, chunk_rows: int = 4096, spin_s: float = 0.002) -> None: ...

    assert restated(restating) == ["chunk_rows"]
