"""The memory budget: the default row cache size and the io mode auto picks;
the request path's bound and what it leaves the channels."""

from __future__ import annotations

from pleclient.checkpoint import TableSpec, discover_tables
from pleserver.budget import (
    CACHE_SHARE,
    CHANNEL_SHARE,
    MIN_CACHE_BYTES,
    READ_SHARE,
    RequestMemory,
    default_channel_budget,
    overcommitted,
    plan,
    read_buffer_budget,
    table_cache_bytes,
)
from pleserver.memory import MemoryRoom

GIB = 1 << 30
MIB = 1 << 20


def test_the_default_cache_is_a_share_of_available_memory_less_the_reserve():
    # Qwen3.8-Flash-Next geometry: 44 GiB of FP8 rows, on a machine with 24 GiB free.
    table = TableSpec("t", 1, "F8_E4M3", 160, 320_000_000, 16, 20_000_000, [])
    budget = plan([table], "auto", None, reserve=4 * GIB, memory=MemoryRoom(None, None, 24 * GIB))
    assert budget.cache_bytes == int(20 * GIB * CACHE_SHARE)
    assert budget.cache_reason == (
        "default: 25% of the memory available at start "
        "(MemAvailable 24.00 GiB) less the 4.00 GiB reserve "
        "(prewarm_reserve)"
    )
    assert budget.io == "direct" and "exceed" in budget.io_reason


def test_the_default_cache_never_exceeds_what_the_tables_need(checkpoint):
    specs = discover_tables(str(checkpoint))
    budget = plan(specs, "auto", None, reserve=4 * GIB, memory=MemoryRoom(None, None, 100 * GIB))
    assert budget.cache_bytes == table_cache_bytes(specs)
    assert budget.cache_reason.endswith("capped at what the tables need")
    assert budget.io == "mmap" and budget.io_reason.startswith("auto: the tables")


def test_auto_reads_directly_what_does_not_fit_and_an_explicit_mode_wins(checkpoint):
    specs = discover_tables(str(checkpoint))
    small = plan(specs, "auto", 1 << 20, reserve=0)
    assert small.io == "direct" and "exceed" in small.io_reason
    assert small.cache_bytes == 1 << 20 and small.cache_reason == "cache_size setting"
    forced = plan(specs, "buffered", None, reserve=0, memory=MemoryRoom(None, None, 100 * GIB))
    assert forced.io == "buffered" and forced.io_reason == "io setting"


def test_a_machine_short_of_memory_still_gets_a_minimum_cache(checkpoint):
    specs = discover_tables(str(checkpoint))
    budget = plan(specs, "auto", None, reserve=4 * GIB, memory=MemoryRoom(None, None, GIB))
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
