"""Helpers for the vLLM plugin tests: real vLLM modules built in scenario processes.

Each scenario runs in a fresh Python process (vLLM's distributed state and the
plugin's patches are per process): ``run_scenario`` starts it and returns the
JSON it prints last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ScenarioFailed(AssertionError):
    pass


def run_scenario(
    name: str,
    args: dict | None = None,
    *,
    env: dict | None = None,
    timeout: float = 240.0,
    module: str = "tests.vllm_helpers.scenarios",
) -> dict:
    """Run ``python -m <module> <name>`` (by default ``tests.vllm_helpers.scenarios``)
    and return its JSON result."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_PLE_")}
    base.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "PYTHONUNBUFFERED": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
                "TORCHINDUCTOR_CACHE_DIR", "/tmp/ple-test-inductor"
            ),
        }
    )
    base.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", module, name, json.dumps(args or {})],
        cwd=REPO,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise ScenarioFailed(
            f"scenario {name} exited with {proc.returncode}\n--- stdout\n"
            f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])
