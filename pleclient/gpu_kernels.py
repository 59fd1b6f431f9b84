"""A GPU-driven channel's ring and collect as one CUDA kernel each.

``pleclient.gpu.CudaStream`` runs a lookup as the driver's stream operations:
the ids' copy and four or five fenced ``cuStreamWriteValue32`` to ring, then
``cuStreamWaitValue32``, the rows' and the done word's copies, the reset write
and a two-kernel check to collect: eleven operations a PLE layer, each one a
node of the captured graph that the GPU runs alone, after a fence. Inside vLLM
0.33's forward graph on an H100 they left the GPU idle about 0.22 ms a step
for four PLE layers beside the server's own answer time (0.05 ms; the torch
profiler's trace, docs/BENCHMARKS.md "What the GPU does in a decode step").

``KernelStream`` writes and waits on the very same words in the same order
(``pleclient.protocol``, "GPU-driven channels"; the edges G1-G3) from two
small kernels, compiled once per device with NVRTC and launched on the
current stream (so a CUDA graph captures them like any kernel):

* ``slot_ring`` (one block): every thread copies its share of the ids into the
  slot and fences (``__threadfence_system``); after the block's barrier one
  thread writes table, count (and kind), fences (G1), writes the doorbell,
  fences (G2) and writes the rung word.
* ``slot_collect`` (as many blocks as the rows need): one thread of each block
  polls the done word until it is OK or ERROR, then fences (G3, pairs with
  the server's E1); the block copies its share of the rows into the output.
  An ERROR fails a device-side assertion (the step fails with
  ``cudaErrorAssert``, as the memop stream's check makes it); the last block
  to finish returns the word to WAITING (wait-then-reset) and its arrival
  counter to zero.

The server sees nothing new: the same words, values and order. Host memory is
read and written through the segment's device mapping (``PinnedSegment``),
plain loads and stores ordered by system-scope fences: no atomic read-modify-
write crosses PCIe or NVLink-C2C.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import math
from pathlib import Path

from pleclient import protocol as p
from pleclient.channel import SlotView
from pleclient.errors import PleError
from pleclient.gpu import CudaStream, _check, _cuda

log = logging.getLogger(__name__)

__all__ = ["KernelStream", "SOURCE"]

RING_THREADS = 256
COLLECT_THREADS = 256
COLLECT_BYTES_PER_BLOCK = 16384
"""Each collect block copies about this much (a decode lookup of 512 rows of
320 bytes takes 10 blocks, one of 16 rows one block)."""
COLLECT_MAX_BLOCKS = 32
"""A prefill chunk's lookup (8 192 rows, 2.6 MB) copies 80 KB a block: every
block polls the done word over the link while it waits, so their number is
kept small."""

_BODY = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

/* G1, G2 (pleclient.protocol): every thread's ids, then table, count and
 * kind, are visible system-wide before the doorbell; the doorbell before the
 * rung word, the one word the server polls. */
extern "C" __global__ void slot_ring(const long long *__restrict__ ids, long long *slot_ids,
                                    u32 count, volatile u32 *table_word, u32 table,
                                    volatile u32 *count_word, volatile u32 *kind_word, u32 kind,
                                    int write_kind, volatile u32 *doorbell, volatile u32 *rung)
{
    for (u32 i = threadIdx.x; i < count; i += blockDim.x)
        slot_ids[i] = ids[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        *table_word = table;
        *count_word = count;
        if (write_kind)
            *kind_word = kind;
        __threadfence_system(); /* G1 */
        *doorbell = PLE_RUNG;
        __threadfence_system(); /* G2 */
        *rung = PLE_RUNG;
    }
}

/* G3: the rows are read only after done reads OK, behind a system-scope fence
 * (pairs with the server's release store of done, E1). */
extern "C" __global__ void slot_collect(volatile u32 *done, const unsigned char *rows,
                                       unsigned char *out, u64 nbytes, int vectors,
                                       u32 *arrived)
{
    __shared__ u32 answer;
    if (threadIdx.x == 0) {
        u32 d;
        /* Block 0 looks often; the others less, so that a large lookup's
         * blocks do not fill the link with reads of one word while the
         * server works (they start their copies at most ~2 µs late). */
        while ((d = *done) < PLE_OK) {
#if __CUDA_ARCH__ >= 700
            __nanosleep(blockIdx.x == 0 ? 128 : 2048);
#endif
        }
        __threadfence_system(); /* G3 */
        answer = d;
    }
    __syncthreads();
    if (answer != PLE_OK) {
        /* A device-side assertion, as the stream memory operations' check
         * raises: the step fails with cudaErrorAssert and this text. */
        if (threadIdx.x == 0)
            assert(answer == PLE_OK && "ple-server answered a GPU-driven lookup with an error, "
                   "or its watchdog gave up on the server: see the pleclient.gpu log");
        return;
    }
    u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 whole = vectors ? nbytes / 16 : 0;
    for (u64 i = first; i < whole; i += stride)
        ((uint4 *)out)[i] = ((const uint4 *)rows)[i];
    for (u64 i = whole * 16 + first; i < nbytes; i += stride)
        out[i] = rows[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(arrived, 1u) == gridDim.x - 1) {
            /* The last block: every block has read done and its rows. */
            __threadfence();
            *arrived = 0u;
            *done = PLE_WAITING; /* wait-then-reset */
            __threadfence_system();
        }
    }
}
"""

SOURCE = (
    f"#define PLE_RUNG {int(p.Doorbell.RUNG)}u\n"
    f"#define PLE_OK {int(p.Done.OK)}u\n"
    f"#define PLE_WAITING {int(p.Done.WAITING)}u\n" + _BODY
)
"""The kernels' CUDA source, the protocol's word values defined in it."""

_NVRTC_SUCCESS = 0


def _nvrtc() -> ctypes.CDLL:
    """NVRTC, as torch's CUDA build ships it (torch has loaded it by then)."""
    import torch

    major = int((torch.version.cuda or "12").split(".")[0])
    errors = []
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    # Not loaded yet by soname: the nvidia wheels beside torch, then a toolkit.
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        names += sorted(str(x) for x in Path(root).glob(f"*/lib/libnvrtc.so.{major}*"))
    names += sorted(glob.glob(f"/usr/local/cuda*/lib64/libnvrtc.so.{major}*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(vp),
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_int,
            vp,
            vp,
        ]
        lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetPTXSize.argtypes = [vp, ctypes.POINTER(sz)]
        lib.nvrtcGetPTX.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [vp, ctypes.POINTER(sz)]
        lib.nvrtcGetCUBIN.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcGetProgramLogSize.argtypes = [vp, ctypes.POINTER(sz)]
        lib.nvrtcGetProgramLog.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]
        return lib
    raise PleError(f"NVRTC cannot be loaded ({'; '.join(errors)})")


def compile_source(source: str, arch: str) -> bytes:
    """``source`` compiled by NVRTC for ``arch``: PTX for a virtual architecture
    (``compute_90``), a cubin for a real one (``sm_90``)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ple.cu", 0, None, None):
        raise PleError("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture={arch}".encode()]
        argv = (ctypes.c_char_p * len(options))(*options)
        result = lib.nvrtcCompileProgram(prog, len(options), argv)
        if result != _NVRTC_SUCCESS:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, text)
            raise PleError(
                f"NVRTC could not compile the ring and collect kernels for {arch}: {text.value!r}"
            )
        cubin = arch.startswith("sm_")
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if cubin
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        size = ctypes.c_size_t()
        get_size(prog, ctypes.byref(size))
        image = ctypes.create_string_buffer(size.value)
        get(prog, image)
        return image.raw if cubin else image.raw.rstrip(b"\0") + b"\0"
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class _Kernels:
    """The two kernels loaded in the current context of ``device``."""

    def __init__(self, device) -> None:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        lib = _cuda()
        self._lib = lib
        self.module = ctypes.c_void_p()
        # A cubin for the device itself (no JIT at start, and no PTX newer
        # than the driver reads); PTX for the driver to compile where NVRTC
        # does not know the device's architecture.
        errors = []
        for arch in (f"sm_{major}{minor}", f"compute_{major}{minor}"):
            try:
                image = compile_source(SOURCE, arch)
                with torch.cuda.device(device):
                    _check(
                        lib.cuModuleLoadData(ctypes.byref(self.module), image),
                        f"cuModuleLoadData ({arch})",
                    )
                break
            except PleError as exc:
                errors.append(str(exc))
        else:
            raise PleError("; ".join(errors))
        self.ring = self._function(b"slot_ring")
        self.collect = self._function(b"slot_collect")

    def _function(self, name: bytes) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        _check(self._lib.cuModuleGetFunction(ctypes.byref(fn), self.module, name), name.decode())
        return fn

    def launch(self, fn, blocks: int, threads: int, stream, args: list) -> None:
        """``args``: ctypes values, in the kernel's order."""
        params = (ctypes.c_void_p * len(args))(
            *[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args]
        )
        _check(
            self._lib.cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, stream, params, None),
            "cuLaunchKernel",
        )

    def close(self) -> None:
        if self.module:
            self._lib.cuModuleUnload(self.module)
            self.module = ctypes.c_void_p()


class KernelStream:
    """The words written and waited on by two kernels on the current CUDA
    stream of ``device`` (see the module docstring); the same segment mapping
    as ``pleclient.gpu.CudaStream``."""

    ops = "kernels"

    def __init__(self, client, device) -> None:
        import torch

        # The segment's mapping and addresses are CudaStream's; only the
        # operations on the stream differ.
        self._memops = CudaStream(client, device)
        self.device = self._memops.device
        self._torch = torch
        self._layout = client.channel.layout
        try:
            self._arrived = torch.zeros(self._layout.depth, dtype=torch.int32, device=self.device)
            # Zeroed before any collect runs, whatever stream that is on.
            torch.cuda.current_stream(self.device).synchronize()
            self._kernels = _Kernels(self.device)
        except BaseException:
            self._memops.close()
            raise

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self._torch.cuda.current_stream(self.device).cuda_stream)

    def ring(self, slot: SlotView, table: int, ids, count: int, kind: int | None = None) -> None:
        m = self._memops
        slot_base = m._base + self._layout.slot_offset(slot.index)
        u32, u64 = ctypes.c_uint32, ctypes.c_uint64
        self._kernels.launch(
            self._kernels.ring,
            1,
            RING_THREADS,
            self._stream(),
            [
                u64(ids.data_ptr()),
                u64(slot_base + self._layout.ids_offset),
                u32(count),
                u64(m._address(slot, p.SL_TABLE)),
                u32(table),
                u64(m._address(slot, p.SL_COUNT)),
                u64(m._address(slot, p.SL_KIND)),
                u32(0 if kind is None else kind),
                ctypes.c_int(kind is not None),
                u64(m._address(slot, p.SL_DOORBELL)),
                u64(m._rung_address),
            ],
        )

    def collect(self, slot: SlotView, out, count: int, row_bytes: int) -> None:
        m = self._memops
        rows = m._base + self._layout.slot_offset(slot.index) + self._layout.rows_offset
        nbytes = count * row_bytes
        blocks = max(1, min(COLLECT_MAX_BLOCKS, math.ceil(nbytes / COLLECT_BYTES_PER_BLOCK)))
        vectors = rows % 16 == 0 and out.data_ptr() % 16 == 0
        arrived = self._arrived[slot.index : slot.index + 1]
        self._kernels.launch(
            self._kernels.collect,
            blocks,
            COLLECT_THREADS,
            self._stream(),
            [
                ctypes.c_uint64(m._address(slot, p.SL_DONE)),
                ctypes.c_uint64(rows),
                ctypes.c_uint64(out.data_ptr()),
                ctypes.c_uint64(nbytes),
                ctypes.c_int(vectors),
                ctypes.c_uint64(arrived.data_ptr()),
            ],
        )

    def close(self) -> None:
        """Only once no enqueued lookup can still run."""
        self._kernels.close()
        self._memops.close()
