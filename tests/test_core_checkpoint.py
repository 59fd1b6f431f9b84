"""Checkpoint discovery and validation: every refusal names the file, tensor and fix."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pleclient.checkpoint import CheckpointError, discover_tables
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint, write_safetensors

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


# ------------------------------------------------------------------ NVFP4
# vLLM's NVFP4 PLE layout: per shard packed E2M1 values (U8 [rows, cols/2]) and
# block scales (F8_E4M3 [rows, cols/16]), one global F32 weight_scale_2.
NVFP4 = SyntheticTable(layer=4, rows=1001, cols=32, dtype="NVFP4", parts=4, scale=0.25)
NV_PREFIX = "model.layers.4.ple.ple_embedding.ngram_embedding"
GLOBAL_SCALE = (f"{NV_PREFIX}.weight_scale_2", "F32", (), struct.pack("<f", 0.25))


def nv_shard(i: int, rows: int, cols: int = 32, values: str = "U8", scales: str = "F8_E4M3"):
    """Shard ``i``'s two tensors for a ``cols``-column NVFP4 table."""
    size = {"U8": 1, "F8_E4M3": 1, "BF16": 2}
    return [
        (
            f"{NV_PREFIX}.shard_{i}.weight",
            values,
            (rows, cols // 2),
            bytes(rows * cols // 2 * size[values]),
        ),
        (
            f"{NV_PREFIX}.shard_{i}.weight_scale",
            scales,
            (rows, cols // 16),
            bytes(rows * cols // 16 * size[scales]),
        ),
    ]


def test_nvfp4_table_is_discovered_with_its_served_row_layout(tmp_path):
    write_checkpoint(str(tmp_path), [NVFP4, BF16], files=3)
    table = discover_tables(str(tmp_path))[0]
    assert (table.layer, table.rows, table.cols, table.dtype, table.parts) == (
        4,
        1001,
        32,
        "NVFP4",
        4,
    )
    assert table.row_bytes == 16 + 2  # cols/2 packed values + cols/16 block scales
    assert table.scale == 0.25  # weight_scale_2
    assert [(s.name, s.row_bytes, s.dtype) for s in table.segments] == [
        ("values", 16, "U8"),
        ("block_scales", 2, "F8_E4M3"),
    ]
    assert [s.rows for s in table.segments[1].shards] == [251, 251, 251, 248]
    assert table.info()["dtype"] == "NVFP4" and table.info()["row_bytes"] == 18


def test_nvfp4_rows_are_half_the_size_of_fp8_rows():
    fp8 = SyntheticTable(layer=1, rows=10, cols=160, dtype="F8_E4M3")
    nvfp4 = SyntheticTable(layer=1, rows=10, cols=160, dtype="NVFP4")
    assert (fp8.row_bytes, nvfp4.row_bytes) == (160, 90)


@pytest.mark.parametrize("changed", ["values", "block_scales", "global_scale"])
def test_nvfp4_fingerprint_covers_values_block_scales_and_global_scale(tmp_path, changed):
    base, other = tmp_path / "base", tmp_path / "other"
    write_checkpoint(str(base), [NVFP4], files=1)
    write_checkpoint(str(other), [NVFP4], files=2, extra_tensor=False)
    table = discover_tables(str(other))[0]
    assert table.fingerprint == discover_tables(str(base))[0].fingerprint  # packing: same
    if changed == "global_scale":
        write_checkpoint(str(other), [dataclasses.replace(NVFP4, scale=0.5)], files=2)
    else:
        segment = {s.name: s for s in table.segments}[changed]
        shard = segment.shards[0]  # row 0 is sampled: flip one of its bytes
        with open(shard.path, "r+b") as f:
            f.seek(shard.offset)
            byte = f.read(1)[0]
            f.seek(shard.offset)
            f.write(bytes([byte ^ 0x01]))
    assert discover_tables(str(other))[0].fingerprint != discover_tables(str(base))[0].fingerprint


def test_nvfp4_without_global_scale(tmp_path):
    write_safetensors(str(tmp_path / "a.safetensors"), nv_shard(0, 5) + nv_shard(1, 5))
    text = problems_of(tmp_path)
    assert f"NVFP4 shards need {NV_PREFIX}.weight_scale_2 (the global scale)" in text


def test_nvfp4_missing_block_scales_of_one_shard(tmp_path):
    tensors = nv_shard(0, 5) + nv_shard(1, 5)[:1] + [GLOBAL_SCALE]
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    assert "missing NVFP4 block scales for shard indices 1 of 0..1" in problems_of(tmp_path)


def test_u8_shards_without_any_block_scales_say_what_nvfp4_needs(tmp_path):
    tensors = nv_shard(0, 5)[:1] + nv_shard(1, 5)[:1] + [GLOBAL_SCALE]
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    text = problems_of(tmp_path)
    assert "U8 shards without block scales" in text and "shard_<i>.weight_scale" in text


def test_nvfp4_block_scales_of_the_wrong_dtype(tmp_path):
    tensors = [*nv_shard(0, 5, scales="BF16"), GLOBAL_SCALE]
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    text = problems_of(tmp_path)
    assert "shard_0.weight_scale is BF16, but NVFP4 block scales must be F8_E4M3" in text


def test_nvfp4_block_scale_width_must_be_cols_over_16(tmp_path):
    values, scales = nv_shard(0, 5)
    scales = (scales[0], scales[1], (5, 4), bytes(20))  # 32 columns need 2, not 4
    write_safetensors(str(tmp_path / "a.safetensors"), [values, scales, GLOBAL_SCALE])
    text = problems_of(tmp_path)
    assert "has 4 block scales per row, but 32-column rows (16 packed bytes) need 2" in text


def test_nvfp4_columns_must_fill_whole_blocks(tmp_path):
    tensors = [*nv_shard(0, 5, cols=24), GLOBAL_SCALE]
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    assert "24 columns, not a multiple of the NVFP4 block size 16" in problems_of(tmp_path)


def test_nvfp4_block_scale_rows_must_match_value_rows(tmp_path):
    values, scales = nv_shard(0, 5)
    scales = (scales[0], scales[1], (4, 2), bytes(8))
    write_safetensors(str(tmp_path / "a.safetensors"), [values, scales, GLOBAL_SCALE])
    text = problems_of(tmp_path)
    assert "shard_0.weight_scale has 4 rows, but" in text and "every row needs its block" in text


def test_nvfp4_with_an_unsharded_weight_scale_is_refused(tmp_path):
    fp8_style = (f"{NV_PREFIX}.weight_scale", "F32", (), struct.pack("<f", 0.5))
    write_safetensors(str(tmp_path / "a.safetensors"), [*nv_shard(0, 5), GLOBAL_SCALE, fp8_style])
    assert "an unsharded weight_scale beside NVFP4 shards" in problems_of(tmp_path)


def test_nvfp4_block_scales_without_values(tmp_path):
    tensors = [*nv_shard(0, 5)[1:], GLOBAL_SCALE]
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    assert "block scales (shard_<i>.weight_scale) without any" in problems_of(tmp_path)


def test_every_problem_of_a_table_is_reported_at_once(tmp_path):
    """Each segment is checked on its own, and the scale whatever the shards
    hold: one run of `pleserver inspect` names every fix."""
    values, scales = nv_shard(0, 5, scales="BF16")
    write_safetensors(str(tmp_path / "a.safetensors"), [values, scales, *nv_shard(1, 5)[:1]])
    text = problems_of(tmp_path)
    assert "shard_0.weight_scale is BF16, but NVFP4 block scales must be F8_E4M3" in text
    assert "missing NVFP4 block scales for shard indices 1 of 0..1" in text
    assert f"NVFP4 shards need {NV_PREFIX}.weight_scale_2 (the global scale)" in text


def test_nvfp4_tensors_found_through_the_index(tmp_path):
    write_checkpoint(str(tmp_path), [NVFP4], files=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert any(n.endswith("shard_3.weight_scale") for n in index["weight_map"])
    assert discover_tables(str(tmp_path))[0].dtype == "NVFP4"


def test_inspect_shows_nvfp4_layout_and_global_scale(tmp_path):
    write_checkpoint(str(tmp_path), [NVFP4], files=2)
    human = run_cli("inspect", str(tmp_path))
    assert human.returncode == 0, human.stderr
    assert "NVFP4" in human.stdout
    assert "16 B values (U8 shard_<i>.weight)" in human.stdout
    assert "2 B block scales (F8_E4M3 shard_<i>.weight_scale)" in human.stdout
    assert "weight_scale_2 = 0.25" in human.stdout
    table = json.loads(run_cli("inspect", str(tmp_path), "--json").stdout)["tables"][0]
    assert (table["dtype"], table["cols"], table["row_bytes"], table["global_scale"]) == (
        "NVFP4",
        32,
        18,
        0.25,
    )
    assert [(s["tensor"], s["dtype"], s["row_bytes"]) for s in table["segments"]] == [
        ("shard_<i>.weight", "U8", 16),
        ("shard_<i>.weight_scale", "F8_E4M3", 2),
    ]


def hf_cache(tmp_path: Path, model: Path, repo: str = "acme/ple-tiny") -> Path:
    """A Hugging Face hub cache holding ``model`` as ``repo``'s main snapshot,
    laid out as huggingface_hub lays it out (refs/main names the commit)."""
    cache = tmp_path / "hub"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0123abcd")
    (root / "snapshots").mkdir()
    (root / "snapshots" / "0123abcd").symlink_to(model, target_is_directory=True)
    return cache


def test_a_hugging_face_repo_id_is_its_snapshot_in_the_local_cache(
    tmp_path, checkpoint, start_server, monkeypatch
):
    cache = hf_cache(tmp_path, checkpoint)
    env = {**os.environ, "HF_HUB_CACHE": str(cache)}
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert [t.name for t in discover_tables("acme/ple-tiny")] == [
        t.name for t in discover_tables(str(checkpoint))
    ]
    inspect = subprocess.run(
        [sys.executable, "-m", "pleserver", "inspect", "acme/ple-tiny", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert len(json.loads(inspect.stdout)["tables"]) == 2
    server = start_server(Path("acme/ple-tiny"), env={"HF_HUB_CACHE": str(cache)})
    with server.client() as client:
        assert client.lookup(1, [0, 1]).shape[0] == 2
    assert f"its snapshot {cache}" in server.log()
    # Not in the cache: the error names both readings and the download
    with pytest.raises(CheckpointError, match=r"nor a Hugging Face repo id in the local cache"):
        discover_tables("acme/not-downloaded")


# ----------------------------------------------- DeepSeek-V4.1 Engram tables
ENGRAM = SyntheticTable(layer=14, rows=1511, cols=64, dtype="MXFP8", parts=1)
ENGRAM_PREFIX = "layers.1.engram.embed"


def engram_tensors(rows: int = 7, cols: int = 64, values: str = "F8_E4M3", scale_width=None):
    """Layer 1's Engram values and scales for a ``cols``-column table."""
    width = cols // 32 if scale_width is None else scale_width
    size = {"F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2}
    return [
        (f"{ENGRAM_PREFIX}.weight", values, (rows, cols), bytes(rows * cols * size[values])),
        (f"{ENGRAM_PREFIX}.scale", "F8_E8M0", (rows, width), bytes(rows * width)),
    ]


def test_an_engram_table_is_discovered_with_its_served_row_layout(tmp_path):
    write_checkpoint(str(tmp_path), [FP8, ENGRAM], files=2)
    fp8, engram = discover_tables(str(tmp_path))
    assert fp8.dtype == "F8_E4M3"  # beside a PLE table of the other family
    assert (engram.name, engram.layer, engram.dtype) == (
        "layers.14.engram.embed",
        14,
        "MXFP8",
    )
    assert (engram.rows, engram.cols, engram.parts, engram.shard_size) == (1511, 64, 1, 1511)
    assert engram.row_bytes == 64 + 2 and engram.scale is None
    assert [(s.name, s.tensor, s.dtype, s.row_bytes) for s in engram.segments] == [
        ("values", "weight", "F8_E4M3", 64),
        ("scales", "scale", "F8_E8M0", 2),
    ]
    assert len(engram.files) == 2  # the values in one file, the scales in the other


@pytest.mark.parametrize("changed", ["values", "scales"])
def test_an_engram_fingerprint_covers_values_and_scales(tmp_path, changed):
    base, other = tmp_path / "base", tmp_path / "other"
    for path in (base, other):
        write_checkpoint(str(path), [ENGRAM], files=2)
    segment = discover_tables(str(other))[0].segments[changed == "scales"]
    part = segment.shards[0]
    with open(part.path, "r+b") as f:  # the middle row: one the fingerprint samples
        f.seek(part.offset + (part.rows // 2) * segment.row_bytes)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    assert discover_tables(str(other))[0].fingerprint != discover_tables(str(base))[0].fingerprint


@pytest.mark.parametrize(
    "tensors, problem",
    [
        (engram_tensors()[:1], f"no {ENGRAM_PREFIX}.scale (F8_E8M0, one scale per 32 columns)"),
        (engram_tensors()[1:], f"no {ENGRAM_PREFIX}.weight; the checkpoint is incomplete"),
        (
            engram_tensors(values="BF16"),
            "engram.embed.weight is BF16, but Engram values must be F8_E4M3",
        ),
        (engram_tensors(cols=48, scale_width=1), "48 columns, not a multiple of the Engram block"),
        (engram_tensors(scale_width=3), "has 3 scales per row, but 64-column rows need 2"),
        (
            engram_tensors()[:1] + engram_tensors(rows=6)[1:],
            "engram.embed.scale has 6 rows, but layers.1.engram.embed.weight has 7",
        ),
    ],
    ids=["no-scales", "no-values", "bf16-values", "partial-block", "scale-width", "rows"],
)
def test_an_engram_table_that_vllm_would_not_load_is_refused_naming_the_fix(
    tmp_path, tensors, problem
):
    write_safetensors(str(tmp_path / "a.safetensors"), tensors)
    assert problem in problems_of(tmp_path)


def test_inspect_shows_the_engram_row_layout(tmp_path):
    write_checkpoint(str(tmp_path), [ENGRAM], files=2)
    human = run_cli("inspect", str(tmp_path))
    assert human.returncode == 0, human.stderr
    assert (
        "layer 14 MXFP8: 64 columns served as 66-byte rows = 64 B values (F8_E4M3 weight) "
        "+ 2 B scales (F8_E8M0 scale)"
    ) in human.stdout
    table = json.loads(run_cli("inspect", str(tmp_path), "--json").stdout)["tables"][0]
    assert (table["dtype"], table["parts"], table["row_bytes"]) == ("MXFP8", 1, 66)
    assert "global_scale" not in table
    assert [(s["tensor"], s["dtype"], s["row_bytes"]) for s in table["segments"]] == [
        ("weight", "F8_E4M3", 64),
        ("scale", "F8_E8M0", 2),
    ]
