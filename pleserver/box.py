"""The box the server runs on, as the memory budgets see it: its memory, and
whether its GPU allocates from that same memory (unified memory) or has its
own.

Neither changes between two starts of one deployment, unlike the memory free
at the moment (``pleserver.host``), so what should not change with a
restart is decided from them (``pleserver.data.budget``): ``io = auto``'s choice
and, on unified memory, the default row cache.

- **Memory**: ``MemTotal`` of /proc/meminfo, or the memory cgroup's limit
  when that is smaller (a container's limit, systemd's ``MemoryMax=``).
  ``PLE_SERVER_MEMINFO`` names another file to read (``pleserver.host``).
- **Unified memory**, decided by the first of:

  1. the ``gpu_memory`` setting, when it says ``unified`` or ``discrete``;
  2. the model the NVIDIA driver gives a GPU
     (``/proc/driver/nvidia/gpus/*/information``): GB10 (DGX Spark, ASUS
     Ascent GX10 and the other GB10 machines), Jetson Orin and Thor share the
     RAM;
  3. the machine's DMI product name (DGX Spark, GX10); a driver model of a
     known discrete family (H100, H200, B200, L40, RTX, …) is discrete at
     once, so a GPU server never waits for nvidia-smi at start (a restart
     under running vLLM costs its workers the server's start);
  4. a Jetson's ``/etc/nv_tegra_release``;
  5. ``nvidia-smi``, only where an NVIDIA driver is loaded: a GPU that
     reports no memory of its own (``memory.total`` is ``[N/A]``, as GB10's
     is) shares the RAM; one that reports its memory has its own;
  6. else discrete, or no GPU at all.

  Whichever decided is logged at start and shown in ``stats`` (``box``), so
  a wrong answer is visible: ``gpu_memory`` corrects it.

Grace Hopper and Grace Blackwell superchips (GH200, GB200) are coherent, but
their GPU has HBM of its own, and vLLM's ``--gpu-memory-utilization`` is a
share of that HBM, not of the Grace CPU's memory: they count as discrete here
(nvidia-smi reports their HBM).
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
from dataclasses import dataclass

from pleserver.config import GPU_MEMORY_MODES
from pleserver.host import MEMINFO, cgroup_limit, meminfo_path, read_meminfo
from pleserver.observe.snapshot import BoxSnapshot
from pleserver.observe.stats import format_bytes

VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization``: on unified memory, the share
of the box's memory vLLM takes for its weights, KV cache and activations."""
SYSTEM_RESERVE = 6 << 30
"""What the OS and its services hold on a unified-memory box (DGX OS with its
desktop: deploy/README.md, Sizing), beside vLLM and ple-server."""
UNIFIED_MODELS = ("GB10", "Orin", "Thor")
"""NVIDIA GPU models (as the driver names them) that allocate from the CPU's RAM."""
UNIFIED_PRODUCTS = ("DGX Spark", "GX10")
"""DMI product names of machines built around such a GPU."""
DISCRETE_MODELS = (
    "H100", "H200", "H20", "H800", "A100", "A800", "A10", "A30", "A40", "A16", "A2 ",
    "L4", "L40", "L20", "B100", "B200", "B300", "GH200", "GB200", "GB300",
    "RTX", "GeForce", "Quadro", "TITAN", "Tesla", "T4", "V100", "P100",
)  # fmt: skip
"""NVIDIA GPU model families (as the driver names them) with memory of their
own: decided without asking nvidia-smi."""
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
SMI_TIMEOUT_S = 10.0  # nvidia-smi answers in well under a second; a stuck driver does not


@dataclass(frozen=True)
class Box:
    """Memory in bytes (None: not readable); ``why``: what decided ``unified``."""

    total: int | None  # MemTotal
    cgroup_limit: int | None  # the memory cgroup's limit, None when there is none
    unified: bool
    why: str
    guessed: bool = False  # an NVIDIA GPU that none of the signs places: logged as a warning

    @property
    def memory(self) -> int | None:
        """What this server may use at most: ``total``, or the cgroup's limit
        when smaller."""
        known = [m for m in (self.total, self.cgroup_limit) if m is not None]
        return min(known) if known else None

    @property
    def gpu_memory(self) -> str:
        return "unified" if self.unified else "discrete"

    def describe_memory(self) -> str:
        total = "MemTotal " + (
            format_bytes(self.total) if self.total is not None else "not readable"
        )
        if self.cgroup_limit is not None and (self.total is None or self.cgroup_limit < self.total):
            return f"cgroup limit {format_bytes(self.cgroup_limit)}, {total}"
        return total

    def describe(self) -> str:
        return f"{self.describe_memory()}; {self.gpu_memory} GPU memory ({self.why})"

    def to_json(self) -> BoxSnapshot:
        return {
            "memory_bytes": self.memory,
            "total_bytes": self.total,
            "cgroup_limit_bytes": self.cgroup_limit,
            "gpu_memory": self.gpu_memory,
            "gpu_memory_reason": self.why,
        }


def this_box(gpu_memory: str = "auto") -> Box:
    """This machine, with ``gpu_memory`` (the setting) over the detection."""
    total = read_meminfo("MemTotal")
    guessed = False
    if gpu_memory == "auto":
        unified, why, guessed = detect_unified()
    elif gpu_memory in ("unified", "discrete"):
        unified, why = gpu_memory == "unified", "gpu_memory setting"
    else:
        raise ValueError(f"gpu_memory: one of {', '.join(GPU_MEMORY_MODES)}, got {gpu_memory!r}")
    if meminfo_path() != MEMINFO:
        why += f"; memory figures from {meminfo_path()}"
    return Box(total, cgroup_limit(), unified, why, guessed)


@functools.cache
def detect_unified() -> tuple[bool, str, bool]:
    """(whether this machine's GPU allocates from its RAM, what said so,
    whether that is a guess): the order of the module's docstring, once per
    process."""
    models = _driver_models()
    said = models_say(models)
    if said is not None and said[0]:
        return (*said, False)
    product = read_text("/sys/class/dmi/id/product_name").strip()
    if any(name in product for name in UNIFIED_PRODUCTS):
        return True, f"detected: {product}, the machine's product name", False
    if os.path.exists("/etc/nv_tegra_release"):
        return True, "detected: NVIDIA Jetson (/etc/nv_tegra_release)", False
    if said is not None:
        return (*said, False)
    if models:
        found = _smi_memory()
        if found is not None:
            return (*found, False)
        return (
            False,
            f"guessed: {', '.join(models)} is no GPU known to share this RAM, and "
            'nvidia-smi did not say; set gpu_memory = "unified" if it does',
            True,
        )
    return False, "not detected: no NVIDIA GPU sharing this RAM found", False


def models_say(models: list[str]) -> tuple[bool, str] | None:
    """What the driver's GPU models alone say: (unified, why) for a known
    unified model, or when every one is of a known discrete family; else None."""
    for model in models:
        if any(name in model for name in UNIFIED_MODELS):
            return True, f"detected: {model}, as the NVIDIA driver names it"
    if models and all(any(name in m for name in DISCRETE_MODELS) for m in models):
        return False, f"detected: {', '.join(models)}, with memory of its own"
    return None


def _driver_models() -> list[str]:
    models = []
    for path in sorted(glob.glob(os.path.join(NVIDIA_GPUS, "*", "information"))):
        for line in read_text(path).splitlines():
            if line.startswith("Model:"):
                models.append(line.partition(":")[2].strip())
    return models


def _smi_memory() -> tuple[bool, str] | None:
    """What nvidia-smi says of the GPUs' own memory, or None when it cannot
    be asked."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    if not gpus:
        return None
    own = [(name.strip(), size.strip()) for name, size in gpus if "N/A" not in size]
    if own:
        name, size = own[0]
        return False, f"detected: nvidia-smi reports {size} of {name}'s own memory"
    return True, f"detected: nvidia-smi reports no memory of {gpus[0][0].strip()}'s own"


def read_text(path: str) -> str:
    """A kernel or sysfs file's text; empty when it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
