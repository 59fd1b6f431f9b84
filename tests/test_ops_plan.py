"""`pleserver plan`: a box's sizing beside vLLM, term by term, human and JSON;
the warnings when it does not fit; the DGX Spark config it stands behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from pleserver.box import SYSTEM_RESERVE
from pleserver.config import parse_size
from pleserver.data.budget import UNIFIED_CACHE_SHARE

REPO = Path(__file__).resolve().parent.parent
DGX_CONFIG = REPO / "deploy" / "boxes" / "dgx-spark.toml"
GIB = 1 << 30
MIB = 1 << 20
DGX_SPARK = 127_600_748 << 10  # a DGX Spark's MemTotal: 121.69 GiB
SPARK = ("--memory", "127600748K", "--unified")
FP8_TABLES = ("--tables", "44G", "--row-bytes", "160")  # Qwen3.8-Flash-Next's, in FP8


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pleserver.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def plan_json(*args: str) -> tuple[int, dict]:
    result = plan(*args, "--json")
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def line(text: str, start: str) -> str:
    """The one line of ``text`` that starts (after its indent) with ``start``."""
    found = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


def spaced(text: str) -> str:
    return re.sub(r" {2,}", "  ", text)


# ------------------------------------------------------------- arithmetic
def test_plan_prints_each_term_of_a_dgx_spark_beside_vllm():
    result = plan(*SPARK, *FP8_TABLES, "--weights", "15G")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.splitlines()[0] == "ple-server plan: 121.69 GiB, unified GPU memory (--unified)"
    assert spaced(line(out, "memory")) == "memory  121.69 GiB  --memory"
    assert spaced(line(out, "− vLLM's share")) == (
        "− vLLM's share  109.52 GiB  0.9 × 121.69 GiB (--gpu-memory-utilization)"
    )
    assert spaced(line(out, "weights")) == "weights  15.00 GiB  --weights"
    assert spaced(line(out, "KV cache and activations")) == (
        "KV cache and activations  94.52 GiB  109.52 GiB − 15.00 GiB of weights"
    )
    assert spaced(line(out, "− the system")) == "− the system  6.00 GiB  OS and services (--system)"
    assert spaced(line(out, "= left for ple-server")) == "= left for ple-server  6.17 GiB"
    assert spaced(line(out, "row cache")) == (
        "row cache  3.08 GiB  50% × 6.17 GiB left for ple-server"
    )
    assert spaced(line(out, "+ read buffers")) == (
        "+ read buffers  157.43 MiB  at most: 9 reading threads × 17.49 MiB"
    )
    assert spaced(line(out, "= ple-server in all")).endswith("of the 6.17 GiB left")
    assert line(out, 'io = "direct"').endswith(
        "# the tables (44.00 GiB) exceed the 3.08 GiB budget: a row cache of that size "
        "serves them, misses read with O_DIRECT"
    )
    assert spaced(line(out, 'cache_size = "3G"')) == (
        'cache_size = "3G"  # 50% × 6.17 GiB left for ple-server'
    )
    assert line(out, "# prewarm_budget: leave out").endswith(
        "# io = direct: the prewarm is for mmap; the row cache refills from the saved hot set"
    )
    assert "Does not fit" not in out


def test_plan_json_holds_the_same_arithmetic_to_the_byte():
    code, report = plan_json(*SPARK, *FP8_TABLES, "--weights", "15G")
    assert code == 0 and report["fits"] is True and report["warnings"] == []
    assert report["box"]["memory_bytes"] == DGX_SPARK
    assert report["box"]["gpu_memory"] == "unified"
    vllm = {t["name"]: t for t in report["vllm"]}
    share = int(0.9 * DGX_SPARK)
    assert vllm["vLLM's share"]["bytes"] == share and vllm["vLLM's share"]["sign"] == "−"
    assert vllm["KV cache and activations"]["bytes"] == share - 15 * GIB
    left = DGX_SPARK - share - SYSTEM_RESERVE
    assert vllm["left for ple-server"]["bytes"] == left
    server = report["server"]
    cache = int(left * UNIFIED_CACHE_SHARE)
    assert server[0] == {
        "name": "row cache",
        "bytes": cache,
        "sign": "",
        "how": "50% × 6.17 GiB left for ple-server",
    }
    # every part is a line, and the last is their sum
    assert server[-1]["name"] == "ple-server in all"
    assert server[-1]["bytes"] == sum(t["bytes"] for t in server[:-1])
    settings = report["settings"]
    assert settings["io"]["value"] == "direct"
    assert settings["cache_size"] == {
        "value": "3G",
        "bytes": cache,
        "why": "50% × 6.17 GiB left for ple-server",
    }
    assert settings["prewarm_budget"]["value"] is None
    assert settings["gpu_memory"]["value"] == "unified"


def test_plan_reads_the_weights_and_the_tables_from_the_checkpoint(checkpoint):
    code, report = plan_json("--model", str(checkpoint), "--memory", "16G", "--discrete")
    assert code == 0, report
    inputs = report["inputs"]
    # the conftest checkpoint: 30 bytes of a non-PLE tensor beside its two tables
    assert inputs["weights_bytes"] == 30
    assert inputs["tables_bytes"] == 20_011 * 160 + 10_007 * 320
    assert inputs["row_bytes"] == 320
    assert report["settings"]["io"]["value"] == "mmap"  # 6 MiB of tables fit
    assert report["settings"]["prewarm"]["value"] == "full"
    assert report["settings"]["prewarm_budget"]["value"] is None  # the whole tables
    vllm = {t["name"]: t for t in report["vllm"]}
    assert vllm["vLLM's share"]["bytes"] is None  # a discrete GPU's own memory
    assert vllm["left for ple-server"]["bytes"] == 16 * GIB - SYSTEM_RESERVE


def test_a_lower_utilization_leaves_room_for_a_partial_prewarm():
    utilization = ("--gpu-memory-utilization", "0.6")
    code, report = plan_json(
        "--memory", "121G", "--unified", *FP8_TABLES, *utilization, "--io", "mmap"
    )
    left = 121 * GIB - int(0.6 * 121 * GIB) - SYSTEM_RESERVE
    budget = report["settings"]["prewarm_budget"]
    beside = sum(t["bytes"] for t in report["server"][1:-1])
    assert budget["bytes"] == left - beside - 4 * GIB
    assert budget["value"] == "38G" and parse_size(budget["value"]) <= budget["bytes"]
    # the tables do not fit in it: mmap's page cache would grow past it
    assert code == 1 and len(report["warnings"]) == 1
    assert "use io = direct" in report["warnings"][0]


# ---------------------------------------------------------------- warnings
def test_plan_warns_when_vllms_share_does_not_hold_the_weights():
    code, report = plan_json(*SPARK, *FP8_TABLES, "--weights", "100G", "--kv-cache", "10G")
    assert code == 1 and report["fits"] is False
    (warning,) = report["warnings"]
    assert warning.startswith(
        "vLLM's share (0.9 × 121.69 GiB = 109.52 GiB) does not hold the weights (100.00 GiB) "
        "and the KV cache asked for (10.00 GiB)"
    )
    # (110 GiB + a GiB of activations) / 121.69 GiB = 0.912
    assert warning.endswith(
        "raise --gpu-memory-utilization to at least 0.92 (a GiB more for the activations)"
    )
    code, report = plan_json(*SPARK, *FP8_TABLES, "--weights", "100G", "--kv-cache", "20G")
    assert code == 1 and "this box cannot hold them beside the system" in report["warnings"][0]


def test_plan_warns_when_vllm_and_ple_server_exceed_the_box():
    result = plan(*SPARK, *FP8_TABLES, "--gpu-memory-utilization", "0.95", "--hot-set", "8G")
    assert result.returncode == 1
    warnings = result.stdout.split("Does not fit:\n", 1)[1]
    assert re.search(
        r"- vLLM's share and ple-server's \(\d+\.\d\d MiB\) exceed the box by \d+\.\d\d MiB: "
        r"lower --gpu-memory-utilization to 0\.94 or below",
        warnings,
    ), warnings
    assert "- the tables' hot set (8.00 GiB) will not fit in the 64.00 MiB row cache" in warnings, (
        warnings
    )


def test_another_box_must_say_whether_its_gpu_shares_its_memory():
    result = plan("--memory", "121G", *FP8_TABLES)
    assert result.returncode == 2
    assert "--memory describes a box other than this one" in result.stderr
    assert "--unified" in result.stderr and "--discrete" in result.stderr
    missing = plan("--memory", "121G", "--unified")
    assert missing.returncode == 2 and "--model DIR" in missing.stderr


def test_plan_names_a_checkpoint_it_cannot_read(tmp_path):
    code, report = plan_json("--model", str(tmp_path / "absent"), *SPARK)
    assert code == 1 and report["ok"] is False and "not a directory" in report["problems"][0]


# ------------------------------------------------------- the DGX Spark file
def test_the_dgx_spark_config_holds_what_plan_says_for_that_box():
    config = tomllib.loads(DGX_CONFIG.read_text())
    for tables in (FP8_TABLES, ("--tables", "95G", "--row-bytes", "320")):  # FP8 and BF16
        code, report = plan_json(*SPARK, *tables)
        assert code == 0, report["warnings"]
        for name, setting in report["settings"].items():
            if setting["value"] is None:
                assert name not in config, name
            else:
                assert config[name] == setting["value"], name
    # and the server's own default for that box is plan's, before rounding
    assert parse_size(config["cache_size"]) <= report["settings"]["cache_size"]["bytes"]
    assert report["settings"]["cache_size"]["bytes"] - parse_size(config["cache_size"]) < 128 * MIB
