"""The memory budget: the default row cache size and the io mode auto picks."""

from __future__ import annotations

from pleclient.checkpoint import TableSpec, discover_tables
from pleserver.budget import CACHE_SHARE, MIN_CACHE_BYTES, plan, table_cache_bytes
from pleserver.memory import MemoryRoom

GIB = 1 << 30


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
