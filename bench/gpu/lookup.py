"""PLE row lookups onto a GPU: ple-server + pinned DMA against the alternatives.

Needs torch with CUDA (no vLLM). By default it writes a synthetic checkpoint,
starts ``pleserver serve`` on it, and for each lookup size (16, 4 096 and
131 072 rows: a decode step, a small and a large prefill) times

  shm+dma     ids → ple-server over the shm channel → rows land in the pinned
              (cudaHostRegister'ed) slot → non_blocking H2D copy → event
  pageable    the seed's path: NumPy gather from np.memmap'ed shards (page
              cache) + a pageable host→device copy
  gpu         the physical best: ``index_select`` on a GPU-resident table
  uva         vLLM's cpu_offload path: a kernel reading the table from pinned
              host memory over UVA (Triton; skipped without it)
  plugin      what the vLLM plugin runs per layer on its host route: ids
              on the GPU → host → ple-server → pinned DMA into the layer's
              output tensor, slots released on copy events

and checks that every path's rows are bit-exact on the device against the
files. Times are medians of ``--iters`` runs after warm-up, wall-clock from
ids on the host (GPU for gpu/uva, as vLLM has them) to rows usable on the GPU.

  python -m bench.gpu.lookup                         # 4 M rows × 160 B FP8 (640 MiB)
  python -m bench.gpu.lookup --rows 20000000 --dtype BF16 --json out.json
  python -m bench.gpu.lookup --socket /run/ple-server/ple.sock --model /models/X
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from bench.harness.scaffold import parser
from pleclient import PleClient
from pleclient.checkpoint import TableSpec, discover_tables
from pleclient.torch import PinnedSegment, copy_rows
from pleserver.devkit.launcher import ServerLauncher

SIZES = (16, 4096, 131072)


@dataclass
class Result:
    path: str
    rows: int
    median_ms: float
    p90_ms: float
    exact: bool | None


# ----------------------------------------------------------------------- setup
def make_checkpoint(workdir: str, rows: int, cols: int, dtype: str, parts: int) -> str:
    from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint

    path = os.path.join(workdir, "ckpt")
    write_checkpoint(
        path,
        [SyntheticTable(layer=1, rows=rows, cols=cols, dtype=dtype, parts=parts)],
        files=max(1, parts // 8),
    )
    return path


def read_table(table: TableSpec) -> np.ndarray:
    """The whole table as uint8 [rows, row_bytes] (plain reads, for references)."""
    out = np.empty((table.rows, table.row_bytes), dtype=np.uint8)
    for shard in table.shards:
        start = shard.index * table.shard_size
        with open(shard.path, "rb") as f:
            f.seek(shard.offset)
            f.readinto(memoryview(out[start : start + shard.rows]).cast("B"))
    return out


class MemmapGather:
    """The seed's gather: dedupe + sort ids, fancy-index np.memmap shards."""

    def __init__(self, table: TableSpec) -> None:
        self.table = table
        self.maps = [
            np.memmap(
                s.path, dtype=np.uint8, mode="r", offset=s.offset, shape=(s.rows, table.row_bytes)
            )
            for s in table.shards
        ]

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        uniq, inverse = np.unique(ids, return_inverse=True)
        shard = uniq // self.table.shard_size
        local = uniq - shard * self.table.shard_size
        out = np.empty((uniq.size, self.table.row_bytes), dtype=np.uint8)
        bounds = np.flatnonzero(np.diff(shard)) + 1
        for a, b in zip(
            np.concatenate(([0], bounds)), np.concatenate((bounds, [uniq.size])), strict=True
        ):
            out[a:b] = self.maps[int(shard[a])][local[a:b]]
        return out[inverse]


# ----------------------------------------------------------------------- paths
def timed(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def bench_size(
    n: int,
    args,
    client: PleClient,
    table: TableSpec,
    reference_gpu: torch.Tensor,
    pinned_table: torch.Tensor | None,
    gather: MemmapGather,
    uva_kernel,
    plugin,
) -> list[Result]:
    rng = np.random.default_rng(n)
    ids = rng.integers(0, table.rows, n, dtype=np.int64)
    ids_gpu = torch.from_numpy(ids).cuda()
    want = reference_gpu.index_select(0, ids_gpu)
    out = torch.empty((n, table.row_bytes), dtype=torch.uint8, device="cuda")
    results = []

    def shm_dma() -> None:
        pending = []
        cap = client.capacity
        for start in range(0, n, cap):
            pending.append((start, client.submit(table.name, ids[start : start + cap])))
        for start, ticket in pending:
            copy = copy_rows(ticket.wait(), out[start : start + ticket.count])
            copy.wait()  # the slot is reused only after its DMA finished
            ticket.release()

    out.zero_()
    times = timed(shm_dma, args.iters)
    results.append(
        Result("shm+dma", n, statistics.median(times), _p90(times), bool(torch.equal(out, want)))
    )

    def pageable() -> None:
        rows = gather(ids)
        out.copy_(torch.from_numpy(rows))  # pageable source: staged, synchronous

    out.zero_()
    times = timed(pageable, args.iters)
    results.append(
        Result("pageable", n, statistics.median(times), _p90(times), bool(torch.equal(out, want)))
    )

    def resident() -> None:
        torch.index_select(reference_gpu, 0, ids_gpu, out=out)

    out.zero_()
    times = timed(resident, args.iters)
    results.append(
        Result("gpu", n, statistics.median(times), _p90(times), bool(torch.equal(out, want)))
    )

    if uva_kernel is not None and pinned_table is not None:

        def uva() -> None:
            uva_kernel(pinned_table, ids_gpu, out)

        out.zero_()
        times = timed(uva, args.iters)
        results.append(
            Result("uva", n, statistics.median(times), _p90(times), bool(torch.equal(out, want)))
        )

    lookups = plugin[1]
    typed = torch.empty((n, table.cols), dtype=lookups.binding.storage_dtype, device="cuda")

    def plugin_lookup() -> None:
        lookups.lookup(ids_gpu, typed)

    typed.view(torch.uint8).zero_()
    times = timed(plugin_lookup, args.iters)
    results.append(
        Result(
            "plugin",
            n,
            statistics.median(times),
            _p90(times),
            bool(torch.equal(typed.view(torch.uint8), want)),
        )
    )
    return results


def make_plugin(socket_path: str, model: str, table: TableSpec, capacity: int):
    """The vLLM plugin's routes, and ``table``'s layer lookups on its host
    route (no vLLM needed)."""
    from pleclient.vllm_plugin.identity import Expected
    from pleclient.vllm_plugin.lookups import LayerLookups, StoredRows
    from pleclient.vllm_plugin.routes import Routes
    from pleclient.vllm_plugin.rows import RowService
    from pleclient.vllm_plugin.settings import ShmSettings

    routes = Routes(
        RowService(ShmSettings(socket=socket_path, capacity=capacity, checkpoint=model))
    )
    binding = routes.service.bind(
        Expected(
            prefix=table.name,
            rows=table.rows,
            cols=table.cols,
            dtypes=(table.dtype,),
            parts=table.parts,
        )
    )
    return routes, LayerLookups(binding, routes, StoredRows(binding), route=routes.host)


def _p90(times: list[float]) -> float:
    return sorted(times)[max(0, math.ceil(0.9 * len(times)) - 1)]


def make_uva_kernel():
    """A Triton kernel copying rows from pinned host memory over UVA (vLLM's
    ``_lookup_ple_embedding_from_pinned_kernel``, without the TP masking)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rows_from_host(weight_ptr, ids_ptr, out_ptr, row_bytes, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.load(ids_ptr + row).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < row_bytes
        values = tl.load(weight_ptr + idx * row_bytes + offs, mask=mask)
        tl.store(out_ptr + row * row_bytes + offs, values, mask=mask)

    class HostPointer:
        """A pinned host buffer as a device pointer (UVA: the same address)."""

        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor
            self.dtype = torch.uint8

        def data_ptr(self) -> int:
            return self.tensor.data_ptr()

    def launch(pinned: torch.Tensor, ids_gpu: torch.Tensor, out: torch.Tensor) -> None:
        row_bytes = pinned.shape[1]
        rows_from_host[(ids_gpu.numel(),)](
            HostPointer(pinned), ids_gpu, out, row_bytes, BLOCK=triton.next_power_of_2(row_bytes)
        )

    return launch


# ----------------------------------------------------------------------- main
def main() -> int:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--cols", type=int, default=160)
    ap.add_argument("--dtype", default="F8_E4M3", choices=["F8_E4M3", "BF16"])
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--capacity", type=int, default=None, help="rows per request (default: the largest size)"
    )
    ap.add_argument("--model", help="serve/read this checkpoint instead of a synthetic one")
    ap.add_argument("--layer", type=int, default=None, help="the table to use (default: the first)")
    ap.add_argument("--socket", help="use this running ple-server (with --model)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu/lookup.py needs a CUDA device")
    sizes = [int(s) for s in args.sizes.split(",")]

    workdir = args.workdir or tempfile.mkdtemp(prefix="ple-bench-")
    model = args.model or make_checkpoint(workdir, args.rows, args.cols, args.dtype, args.parts)
    tables = discover_tables(model)
    table = next((t for t in tables if args.layer in (None, t.layer)), None)
    if table is None:
        raise SystemExit(f"no PLE table of layer {args.layer} in {model}")
    server = None
    socket_path = args.socket
    if socket_path is None:
        server = ServerLauncher(model, die_with_parent=True, ready_timeout=120.0).start()
        socket_path = server.socket
    device = torch.device("cuda")
    try:
        reference = read_table(table)
        reference_gpu = torch.from_numpy(reference).to(device)
        pinned_table = torch.from_numpy(reference).pin_memory()
        gather = MemmapGather(table)
        uva_kernel = make_uva_kernel()
        capacity = args.capacity or max(sizes)
        plugin = make_plugin(socket_path, model, table, min(capacity, 16384))
        with PleClient.connect(
            socket_path, capacity=capacity, depth=4, name="bench-gpu-lookup"
        ) as client:
            pinned = PinnedSegment(client.segment_buffer, device)
            try:
                probe = torch.from_numpy(np.frombuffer(client.segment_buffer, np.uint8))
                print(
                    f"table {table.name}: {table.rows} rows × {table.row_bytes} B "
                    f"{table.dtype}; channel {client.segment_buffer.nbytes >> 20} MiB "
                    f"registered={pinned.registered} is_pinned={probe.is_pinned()}; "
                    f"{torch.cuda.get_device_name()}"
                )
                del probe
                results = [
                    r
                    for n in sizes
                    for r in bench_size(
                        n,
                        args,
                        client,
                        table,
                        reference_gpu,
                        pinned_table,
                        gather,
                        uva_kernel,
                        plugin,
                    )
                ]
            finally:
                torch.cuda.synchronize()
                pinned.close()
                plugin[0].close()
    finally:
        if server is not None:
            server.close()
    print_table(results, table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "table": {
                        "rows": table.rows,
                        "row_bytes": table.row_bytes,
                        "dtype": table.dtype,
                    },
                    "results": [r.__dict__ for r in results],
                },
                f,
                indent=1,
            )
    return 0 if all(r.exact is not False for r in results) else 1


def print_table(results: list[Result], table: TableSpec) -> None:
    paths = list(dict.fromkeys(r.path for r in results))
    sizes = list(dict.fromkeys(r.rows for r in results))
    print("\n| rows | " + " | ".join(f"{p} ms (p90)" for p in paths) + " | bit-exact |")
    print("|---:|" + "---:|" * len(paths) + "---|")
    for n in sizes:
        row = {r.path: r for r in results if r.rows == n}
        cells = [
            f"{row[p].median_ms:.3f} ({row[p].p90_ms:.3f})" if p in row else "–" for p in paths
        ]
        exact = all(r.exact for r in row.values())
        print(f"| {n} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    print(
        f"\nrow size {table.row_bytes} B; shm+dma = server round trip + pinned H2D; "
        "pageable = NumPy memmap gather + pageable copy (the seed); plugin = the vLLM "
        "plugin's lookup (16384-row requests, GPU ids)"
    )


if __name__ == "__main__":
    sys.exit(main())
