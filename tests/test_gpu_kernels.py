"""The GPU-driven ring and collect kernels (``pleclient.gpu_kernels``), on a machine
without a GPU: NVRTC (torch's own CUDA build ships it) compiles their source
as ``KernelStream`` does on a GPU host, ptxas (the same wheels) assembles it
for the GPUs users run, and the PTX keeps the protocol's ordering edges:
G1 and G2 (a system-scope fence before the doorbell and before the rung
word), G3 (one after the done word is read, before any row is), and the
wait-then-reset; an ERROR answer fails a device-side assertion. What the
kernels do on a GPU is checked by
``bench/gpu/channel_check.py --gpu-ops kernels`` (docs/BENCHMARKS.md)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pleclient.gpu_kernels import SOURCE, compile_source

ARCHS = ("compute_80", "compute_90")  # Ampere; Hopper and Grace Hopper


def _ptxas() -> Path:
    import nvidia

    found = sorted(
        p for root in nvidia.__path__ for p in Path(root).glob("*/bin/ptxas") if p.is_file()
    )
    assert found, "no ptxas in the nvidia wheels beside torch: the kernels cannot be assembled"
    return found[0]


def _entry(ptx: str, name: str) -> list[str]:
    """The instructions of entry ``name``, one per line, comments dropped."""
    body = ptx.split(f".entry {name}(", 1)[1].split(".entry", 1)[0]
    return [line.split("//")[0].strip() for line in body.splitlines() if line.strip()]


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request) -> tuple[str, str]:
    return request.param, compile_source(SOURCE, request.param).rstrip(b"\0").decode()


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
def test_nvrtc_gives_a_cubin_for_the_device_itself(arch):
    image = compile_source(SOURCE, arch)
    assert image[:4] == b"\x7fELF"  # what KernelStream loads first (no JIT at start)


def test_the_kernels_compile_and_assemble_for_the_gpus_users_run(ptx, tmp_path):
    arch, text = ptx
    assert ".entry slot_ring(" in text and ".entry slot_collect(" in text
    source = tmp_path / "ple.ptx"
    source.write_text(text)
    sm = arch.replace("compute_", "sm_")
    run = subprocess.run(
        [str(_ptxas()), f"-arch={sm}", str(source), "-o", str(tmp_path / "ple.cubin")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_the_ring_fences_before_the_doorbell_and_before_the_rung_word(ptx):
    lines = _entry(ptx[1], "slot_ring")
    stores = [i for i, line in enumerate(lines) if line.startswith("st.volatile.global.u32")]
    fences = [i for i, line in enumerate(lines) if line.startswith("membar.sys")]
    barrier = next(i for i, line in enumerate(lines) if line.startswith("bar.sync"))
    ids_copy = [i for i, line in enumerate(lines) if re.match(r"st\.global\.u64", line)]
    # table, count, kind, doorbell, rung: the last two each behind a fence
    # that follows every earlier store (G1, G2), and every thread's ids
    # fenced before the block's barrier.
    assert len(stores) == 5, lines
    doorbell, rung = stores[-2], stores[-1]
    assert any(stores[-3] < f < doorbell for f in fences)
    assert any(doorbell < f < rung for f in fences)
    assert ids_copy and max(ids_copy) < barrier
    assert any(max(ids_copy) < f < barrier for f in fences)


def test_the_collect_reads_rows_only_behind_the_fence_after_done(ptx):
    lines = _entry(ptx[1], "slot_collect")
    done_loads = [i for i, line in enumerate(lines) if line.startswith("ld.volatile.global.u32")]
    fence = next(i for i, line in enumerate(lines) if line.startswith("membar.sys"))
    row_loads = [i for i, line in enumerate(lines) if re.match(r"ld\.global\.(v4\.u32|u8)", line)]
    assert done_loads and max(done_loads) < fence  # G3: the poll, then the fence
    assert row_loads and min(row_loads) > fence
    # The server writes the rows while the kernel runs: no load may assume
    # read-only memory (``ld.global.nc``, what ``__restrict__`` would give).
    assert not [line for line in lines if line.startswith("ld.") and ".nc" in line.split()[0]]
    # An ERROR answer fails a device-side assertion (the compiler places its
    # call out of line; the source returns after it, before any copy).
    assert any(line.startswith("__assertfail") for line in lines)
    reset = [i for i, line in enumerate(lines) if line.startswith("st.volatile.global.u32")]
    arrive = next(i for i, line in enumerate(lines) if line.startswith("atom.global.add.u32"))
    assert reset and min(reset) > arrive  # the last block resets done, after every read
