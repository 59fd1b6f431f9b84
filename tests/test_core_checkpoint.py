"""Checkpoint discovery and validation: every refusal names the file, tensor and fix."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pleclient.checkpoint import CheckpointError, discover_tables
from pleserver.synthetic import SyntheticTable, write_checkpoint, write_safetensors

FP8 = SyntheticTable(layer=2, rows=1001, cols=16, dtype="F8_E4M3", parts=4, scale=0.5)
BF16 = SyntheticTable(layer=5, rows=999, cols=16, dtype="BF16", parts=3)
PREFIX = "model.layers.2.ple.ple_embedding.ngram_embedding"


def problems_of(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        discover_tables(str(path))
    return "\n".join(info.value.problems)


def shard(i: int, rows: int, cols: int = 16, dtype: str = "F8_E4M3", prefix: str = PREFIX):
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
    return (f"{prefix}.shard_{i}.weight", dtype, (rows, cols), bytes(rows * cols * size))


SCALE = (f"{PREFIX}.weight_scale", "F32", (), struct.pack("<f", 0.5))


def test_discovers_every_table_with_geometry(tmp_path):
    write_checkpoint(str(tmp_path), [FP8, BF16], files=3)
    tables = discover_tables(str(tmp_path))
    assert [(t.layer, t.rows, t.cols, t.dtype, t.parts, t.row_bytes) for t in tables] == [
        (2, 1001, 16, "F8_E4M3", 4, 16),
        (5, 999, 16, "BF16", 3, 32),
    ]
    assert tables[0].scale == 0.5 and tables[1].scale is None
    assert tables[0].shard_size == 251
    assert [s.rows for s in tables[0].shards] == [251, 251, 251, 248]


def test_glob_is_used_without_an_index(tmp_path):
    write_checkpoint(str(tmp_path), [FP8], files=2, index=False)
    assert [t.layer for t in discover_tables(str(tmp_path))] == [2]


def test_fingerprint_ignores_file_packing_but_not_content(tmp_path):
    one, two, other = tmp_path / "one", tmp_path / "two", tmp_path / "other"
    write_checkpoint(str(one), [FP8], files=1)
    write_checkpoint(str(two), [FP8], files=4, extra_tensor=False)
    write_checkpoint(str(other), [FP8], files=1, seed=7)
    fp = [discover_tables(str(d))[0].fingerprint for d in (one, two, other)]
    assert fp[0] == fp[1] != fp[2]


def test_missing_shard_index(tmp_path):
    write_safetensors(
        str(tmp_path / "a.safetensors"), [shard(0, 251), shard(1, 251), shard(3, 248), SCALE]
    )
    assert "missing shard indices 2 of 0..3" in problems_of(tmp_path)


def test_duplicate_shard_in_two_files(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 5), shard(1, 5), SCALE])
    write_safetensors(str(tmp_path / "b.safetensors"), [shard(1, 5)])
    text = problems_of(tmp_path)
    assert "duplicate shard" in text and "a.safetensors" in text and "b.safetensors" in text


def test_row_counts_must_follow_the_ceil_layout(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 10), shard(1, 12), SCALE])
    text = problems_of(tmp_path)
    assert f"{PREFIX}.shard_0.weight has 10 rows, expected 11" in text


def test_mixed_dtypes(tmp_path):
    write_safetensors(
        str(tmp_path / "a.safetensors"), [shard(0, 5), shard(1, 5, dtype="BF16"), SCALE]
    )
    assert "mixed dtypes ['BF16', 'F8_E4M3']" in problems_of(tmp_path)


def test_mixed_widths(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 5), shard(1, 5, cols=8), SCALE])
    assert "mixed widths [8, 16]" in problems_of(tmp_path)


def test_data_size_must_match_shape(tmp_path):
    path = tmp_path / "a.safetensors"
    write_safetensors(str(path), [shard(0, 5), SCALE])
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[f"{PREFIX}.shard_0.weight"]["shape"] = [6, 16]
    write_raw_header(path, header, bytes(raw[8 + n :]))
    assert "80 data bytes, but shape [6, 16] × 1 bytes is 96" in problems_of(tmp_path)


def write_raw_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_malformed_json_header(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 6) + b"{nope}" + bytes(8))
    text = problems_of(tmp_path)
    assert "a.safetensors: malformed safetensors header" in text and "fetch it again" in text


def test_header_length_past_end_of_file(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    assert "header length 1099511627776 runs past the end" in problems_of(tmp_path)


def test_offsets_outside_the_file(tmp_path):
    path = tmp_path / "a.safetensors"
    write_safetensors(str(path), [shard(0, 5), SCALE])
    path.write_bytes(path.read_bytes()[:-40])  # truncated download
    assert "lie outside the file" in problems_of(tmp_path)


def test_fp8_without_scale(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 5), shard(1, 5)])
    assert f"F8_E4M3 shards need {PREFIX}.weight_scale" in problems_of(tmp_path)


def test_unsupported_dtype(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 5, dtype="F32")])
    assert "unsupported dtype F32" in problems_of(tmp_path)


def test_index_naming_a_missing_file(tmp_path):
    write_checkpoint(str(tmp_path), [FP8], files=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    assert "model-00002-of-00002.safetensors, which does not exist" in problems_of(tmp_path)


def test_directory_without_tables(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [("x.weight", "F32", (1,), bytes(4))])
    assert "no PLE tables" in problems_of(tmp_path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_inspect_prints_tables_and_json(tmp_path):
    write_checkpoint(str(tmp_path), [FP8, BF16], files=2)
    human = run_cli("inspect", str(tmp_path))
    assert human.returncode == 0
    assert "F8_E4M3" in human.stdout and "BF16" in human.stdout
    data = json.loads(run_cli("inspect", str(tmp_path), "--json").stdout)
    assert data["ok"] and [t["layer"] for t in data["tables"]] == [2, 5]
    assert data["tables"][0]["shards"] == 4 and len(data["tables"][0]["fingerprint"]) == 32


def test_inspect_reports_validation_errors(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), [shard(0, 5), shard(1, 5)])
    result = run_cli("inspect", str(tmp_path), "--json")
    assert result.returncode == 1
    assert any("weight_scale" in p for p in json.loads(result.stdout)["problems"])
