"""The memory budget: the default row cache size and the io mode auto picks,
from the box and from the room at start; the request path's bound and what
it leaves the channels."""

from __future__ import annotations

import dataclasses

import pytest

from pleclient.checkpoint import Segment, TableSpec, discover_tables
from pleserver.box import SYSTEM_RESERVE, Box
from pleserver.data.budget import (
    CACHE_SHARE,
    CHANNEL_SHARE,
    MIN_CACHE_BYTES,
    READ_SHARE,
    UNIFIED_CACHE_SHARE,
    RequestMemory,
    default_channel_budget,
    overcommitted,
    plan,
    read_buffer_budget,
    table_cache_bytes,
)
from pleserver.data.tables import scale_bytes
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint
from pleserver.host import MEMINFO_ENV, MemoryRoom, cgroup_limit

GIB = 1 << 30
MIB = 1 << 20
# Qwen3.8-Flash-Next geometry: 44 GiB of FP8 rows.
FP8_TABLE = TableSpec(
    "t", 1, "F8_E4M3", 160, 320_000_000, 16, 20_000_000, [Segment("rows", 160, [], "F8_E4M3")]
)
DGX_SPARK = 127_600_748 << 10  # MemTotal of a DGX Spark: 121.69 GiB
BIG_BOX = Box(256 * GIB, None, False, "stated")


def test_the_default_cache_is_a_share_of_available_memory_less_the_reserve():
    # On a box of 64 GiB with 24 GiB free: the room at start, not the box, bounds it.
    box = Box(64 * GIB, None, False, "stated")
    budget = plan([FP8_TABLE], "auto", None, 4 * GIB, box, MemoryRoom(None, None, 24 * GIB))
    assert budget.cache_bytes == int(20 * GIB * CACHE_SHARE)
    assert budget.cache_reason == (
        "default: 25% of the memory available at start "
        "(MemAvailable 24.00 GiB) less the 4.00 GiB reserve "
        "(prewarm_reserve), below the box's 15.00 GiB"
    )
    assert budget.io == "direct" and "exceed" in budget.io_reason


def test_a_cgroup_limit_is_the_boxs_memory():
    """The service's limit is fixed for the deployment, as the box is."""
    limited = Box(24 * GIB, 8 * GIB, False, "stated")
    budget = plan([FP8_TABLE], "auto", None, 4 * GIB, limited, MemoryRoom(8 * GIB, 0, 23 * GIB))
    assert budget.cache_bytes == GIB
    assert budget.cache_reason == (
        "default: 25% of the box's memory (cgroup limit 8.00 GiB, MemTotal 24.00 GiB) "
        "less the 4.00 GiB reserve (prewarm_reserve)"
    )


def test_on_unified_memory_the_default_cache_leaves_vllm_its_share():
    """A DGX Spark with 115 GiB free at start: not a quarter of that (28 GiB)
    but half of what vLLM's 0.9 and the system's 6 GiB leave."""
    box = Box(DGX_SPARK, None, True, "detected: NVIDIA GB10")
    budget = plan([FP8_TABLE], "auto", None, 4 * GIB, box, MemoryRoom(None, None, 115 * GIB))
    left = DGX_SPARK - int(0.9 * DGX_SPARK) - SYSTEM_RESERVE
    assert budget.cache_bytes == int(left * UNIFIED_CACHE_SHARE)
    assert 3 * GIB < budget.cache_bytes < 3.1 * GIB
    assert budget.cache_reason == (
        "default: unified memory (detected: NVIDIA GB10): 50% of what vLLM's default share "
        "and the system leave, (1 − 0.9) × 121.69 GiB − 6.00 GiB = 6.17 GiB"
    )
    assert budget.io == "direct" and "3.08 GiB budget (unified memory" in budget.io_reason


# DeepSeek-V4.1-Flash's two Engram tables: 256 B of FP8 values + 8 B of scales a row.
ENGRAM_TABLES = [
    TableSpec(
        f"layers.{layer}.engram.embed",
        layer,
        "MXFP8",
        256,
        rows,
        1,
        rows,
        [Segment("values", 256, [], "F8_E4M3"), Segment("scales", 8, [], "F8_E8M0")],
    )
    for layer, rows in ((1, 384_006_168), (14, 384_016_682))
]


def test_resident_scales_are_taken_before_the_default_cache_but_not_the_io_choice():
    """6.1 GB of scales read into memory at start: the default cache is a share
    of what they leave (of the room, of the box, of unified memory's room), and
    auto chooses the io mode as it would without them (mmap keeps none)."""
    scales = scale_bytes(ENGRAM_TABLES)
    assert scales == (384_006_168 + 384_016_682) * 8  # 6.1 GB
    box = Box(256 * GIB, None, False, "stated")
    room = MemoryRoom(None, None, 100 * GIB)
    plain = plan(ENGRAM_TABLES, "auto", None, 4 * GIB, box, room)
    kept = plan(ENGRAM_TABLES, "auto", None, 4 * GIB, box, room, resident=scales)
    assert kept.cache_bytes == int((100 * GIB - 4 * GIB - scales) * CACHE_SHARE)
    assert abs(plain.cache_bytes - kept.cache_bytes - scales * CACHE_SHARE) <= 1
    assert "and the tables' 5.72 GiB of resident scales (resident_scales)" in kept.cache_reason
    assert (kept.io, kept.io_reason) == (plain.io, plain.io_reason)
    assert kept.io == "direct"
    spark = Box(DGX_SPARK, None, True, "detected: NVIDIA GB10")
    on_spark = plan(
        ENGRAM_TABLES, "direct", None, 4 * GIB, spark, MemoryRoom(None, None, 115 * GIB), scales
    )
    left = DGX_SPARK - int(0.9 * DGX_SPARK) - SYSTEM_RESERVE - scales
    assert on_spark.cache_bytes == int(left * UNIFIED_CACHE_SHARE)
    assert "− 5.72 GiB of resident scales = " in on_spark.cache_reason
    # tables that fit the budget are served from the page cache: nothing resident
    small = [dataclasses.replace(FP8_TABLE, rows=1_000_000)]
    assert plan(small, "auto", None, 0, box, room, resident=GIB).io == "mmap"


def test_auto_chooses_by_the_box_whatever_is_free_at_start():
    # 44 GiB of tables, a 256 GiB box: the box's budget (63 GiB) holds them,
    # whether 250 GiB or 20 GiB happen to be free.
    chosen = {
        free: plan([FP8_TABLE], "auto", None, 4 * GIB, BIG_BOX, MemoryRoom(None, None, free))
        for free in (250 * GIB, 20 * GIB)
    }
    assert {b.io for b in chosen.values()} == {"mmap"}
    assert chosen[250 * GIB].io_reason == chosen[20 * GIB].io_reason
    assert "MemAvailable" not in chosen[20 * GIB].io_reason


def test_the_default_cache_never_exceeds_what_the_tables_need(checkpoint):
    specs = discover_tables(str(checkpoint))
    room = MemoryRoom(None, None, 100 * GIB)
    budget = plan(specs, "auto", None, 4 * GIB, BIG_BOX, room)
    assert budget.cache_bytes == table_cache_bytes(specs)
    assert budget.cache_reason.endswith("capped at what the tables need")
    assert budget.io == "mmap" and budget.io_reason.startswith("auto: the tables")


def test_auto_reads_directly_what_does_not_fit_and_an_explicit_mode_wins(checkpoint):
    specs = discover_tables(str(checkpoint))
    small = plan(specs, "auto", 1 << 20, 0, BIG_BOX)
    assert small.io == "direct" and "exceed" in small.io_reason
    assert small.cache_bytes == 1 << 20 and small.cache_reason == "cache_size setting"
    room = MemoryRoom(None, None, 100 * GIB)
    forced = plan(specs, "buffered", None, 0, BIG_BOX, room)
    assert forced.io == "buffered" and forced.io_reason == "io setting"


def test_a_machine_short_of_memory_still_gets_a_minimum_cache(checkpoint):
    specs = discover_tables(str(checkpoint))
    budget = plan(specs, "auto", None, 4 * GIB, BIG_BOX, MemoryRoom(None, None, GIB))
    assert budget.cache_bytes == min(MIN_CACHE_BYTES, table_cache_bytes(specs))
    tiny = Box(4 * GIB, None, True, "stated")  # vLLM's share leaves it nothing
    budget = plan(specs, "direct", None, 0, tiny, MemoryRoom(None, None, 4 * GIB))
    assert budget.cache_bytes == min(MIN_CACHE_BYTES, table_cache_bytes(specs))


def test_the_read_buffers_take_a_share_of_the_room_beside_the_cache_within_their_bounds():
    full, least = 157 * MIB, 3 * MIB
    assert read_buffer_budget(None, 100 * MIB, full, least) == (
        int(100 * MIB * READ_SHARE),
        "default: 25% of the room beside the row cache",
    )
    assert read_buffer_budget(None, 64 * GIB, full, least)[0] == full  # a large host
    assert read_buffer_budget(None, 4 * MIB, full, least)[0] == least  # a tiny limit
    assert read_buffer_budget(None, None, full, least)[0] == full  # nothing known
    assert read_buffer_budget(64 * MIB, 4 * MIB, full, least) == (
        64 * MIB,
        "read_buffer_memory setting",
    )
    assert read_buffer_budget(MIB, None, full, least)[0] == least


def test_the_channels_get_their_share_of_what_the_cache_and_the_request_path_leave():
    """200 MiB less 25 MiB in use, a 48 MiB row cache to come, the request
    path's 45 MiB and BF16 rows: the channels and their id copies fit in 3/4
    of the rest, and all of it together fits the room."""
    room = MemoryRoom(200 * MIB, 25 * MIB, 20 * GIB)
    request = RequestMemory(32 * MIB, "default", 10 * MIB, 3 * MIB, 8 / (8 + 320))
    limit = default_channel_budget(room, 48 * MIB, request)
    assert limit is not None and limit % MIB == 0
    rest = 175 * MIB - 48 * MIB - 45 * MIB
    assert limit * (1 + request.ids_share) <= rest * CHANNEL_SHARE
    assert limit > rest * CHANNEL_SHARE * 0.95 - MIB
    assert overcommitted(room, 48 * MIB, request, limit) is None
    # Without the request path counted (as before), the channels took its room.
    assert default_channel_budget(room, 48 * MIB) == int(127 * MIB * CHANNEL_SHARE) >> 20 << 20


def test_budgets_past_the_room_are_named_with_their_numbers():
    room = MemoryRoom(200 * MIB, 25 * MIB, None)
    request = RequestMemory(130 * MIB, "read_buffer_memory setting", 10 * MIB, 3 * MIB, 0.0)
    assert default_channel_budget(room, 48 * MIB, request) == 0  # nothing left for channels
    why = overcommitted(room, 48 * MIB, request, 0)
    assert why is not None
    assert "the request path's 143.00 MiB" in why and "need 191.00 MiB" in why
    assert "read_buffer_memory" in why and "MemoryMax=" in why
    assert overcommitted(MemoryRoom(None, None, None), 48 * MIB, request, 0) is None


# ------------------------------------------------------- a real server's box
BIG_TABLES = (SyntheticTable(layer=1, rows=1_000_003, cols=160, dtype="F8_E4M3", parts=4),)
"""160 MB of rows: more than the 64 MiB a default row cache is at least, so
that the box, not that minimum, decides."""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("big-ckpt")
    write_checkpoint(str(path), BIG_TABLES, files=1)
    return path


def stated_box(path, total: int, available: int) -> dict[str, str]:
    """The environment that states a box of ``total`` bytes with ``available``
    free to a server (``PLE_SERVER_MEMINFO``), in /proc/meminfo's format."""
    path.write_text(
        f"MemTotal:       {total >> 10} kB\n"
        f"MemFree:        {available >> 10} kB\n"
        f"MemAvailable:   {available >> 10} kB\n"
    )
    limit = cgroup_limit()
    if limit is not None and limit < total:  # the limit would be the box
        pytest.skip(f"this test's cgroup limit ({limit} bytes) is below the stated box's memory")
    return {MEMINFO_ENV: str(path)}


def test_a_server_on_unified_memory_takes_a_small_fixed_cache_and_says_why(
    start_server, big_checkpoint, tmp_path
):
    """62 GiB of unified memory, 60 GiB of it free at start: vLLM's 0.9 and
    the system's 6 GiB leave 205 MiB; the row cache takes half, not a
    quarter of what is free (14 GiB)."""
    total = 62 * GIB
    env = stated_box(tmp_path / "meminfo", total, 60 * GIB)
    server = start_server(
        big_checkpoint, "--gpu-memory", "unified", "--state-dir", str(tmp_path), env=env
    )
    with server.client() as client:
        plane = client.stats()["dataplane"]
    expected = int((total - int(0.9 * total) - SYSTEM_RESERVE) * UNIFIED_CACHE_SHARE)
    assert plane["cache"]["budget_bytes"] == expected
    why = f"gpu_memory setting; memory figures from {tmp_path / 'meminfo'}"
    assert plane["cache"]["budget_reason"] == (
        f"default: unified memory ({why}): 50% of what vLLM's default share and the "
        "system leave, (1 − 0.9) × 62.00 GiB − 6.00 GiB = 204.80 MiB"
    )
    assert plane["box"] == {
        "memory_bytes": total,
        "total_bytes": total,
        "cgroup_limit_bytes": None,
        "gpu_memory": "unified",
        "gpu_memory_reason": why,
    }
    assert plane["io"] == "direct" and "exceed the 102.40 MiB budget" in plane["io_reason"]
    log = server.log()
    assert f"box: MemTotal 62.00 GiB; unified GPU memory ({why})" in log
    assert "row cache: 102.4 MiB" in log and "(default: unified memory (" in log


def test_io_auto_chooses_the_same_for_the_same_box_whatever_is_free(
    start_server, big_checkpoint, tmp_path
):
    """A 16 GiB box: its budget (a quarter of 16 GiB less the 4 GiB reserve)
    holds the 160 MB tables, with 15 GiB free at start or 300 MiB. (Decided
    from what was free, the second start read them with O_DIRECT instead.)"""
    chosen = []
    for free in (15 * GIB, 300 * MIB):
        env = stated_box(tmp_path / f"meminfo-{free}", 16 * GIB, free)
        server = start_server(big_checkpoint, "--state-dir", str(tmp_path), env=env)
        with server.client() as client:
            plane = client.stats()["dataplane"]
        assert server.stop() == 0, server.log_tail()
        chosen.append((plane["io"], plane["io_reason"]))
    assert (
        chosen[0]
        == chosen[1]
        == (
            "mmap",
            "auto: the tables (152.59 MiB) fit in the 3.00 GiB budget (25% of the box's memory "
            "(MemTotal 16.00 GiB) less the 4.00 GiB reserve (prewarm_reserve)), so the page "
            "cache serves them",
        )
    )


@pytest.mark.parametrize(
    "models, unified",
    [
        (["NVIDIA GB10"], True),
        (["NVIDIA H200"], False),  # no nvidia-smi at start on a GPU server
        (["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"], False),
        (["NVIDIA GH200 480GB"], False),  # its own HBM is what vLLM shares out
        (["NVIDIA GeForce RTX 4090"], False),
        (["NVIDIA Some Future GPU"], None),  # unknown: nvidia-smi is asked
        ([], None),
    ],
)
def test_the_drivers_gpu_model_decides_the_box_where_it_can(models, unified):
    from pleserver.box import models_say

    said = models_say(models)
    assert (said[0] if said else None) == unified, said
