"""A ple-server restart, or a crash with no restart, under a generation in
vLLM's own classes: a stall, never a failed step, and never a wrong row.

One scenario process builds the whole tiny Qwen4Exp model with vLLM 0.33's
loader on CPU twice, stock and with ``VLLM_PLE_BACKEND=shm``, and runs the
steps of a generation (a prefill, then a token per request per step) through
both, comparing every PLE layer's output bit for bit. Its ple-server is
SIGKILLed while a step's lookups are on their way:

* ``restart``: started again 0.4 s later, and killed again between two later
  steps. On the host route the worker reconnects and submits again; on the
  GPU-driven route (its CPU stand-in) the new server adopts the channel and
  answers the lookups that were waiting in it.
* ``fallback``: not started again until the last step: past
  ``VLLM_PLE_SHM_FALLBACK_S`` the worker reads the rows from the checkpoint
  itself (the host route's lookups, or the GPU route's watchdog), then goes
  back to the server for the last step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm_helpers import run_scenario

STEPS = 6
KILL_STEP = 1


@pytest.mark.parametrize("route", ["host", "gpu-driven"])
@pytest.mark.parametrize("mode", ["restart", "fallback"])
def test_a_generation_survives_a_killed_server(qwen4_checkpoints, tmp_path, route, mode):
    socket = str(tmp_path / "ple.sock")
    env = {
        "VLLM_PLE_BACKEND": "shm",
        "VLLM_PLE_SHM_SOCKET": socket,
        "VLLM_PLE_SHM_CHECKPOINT": qwen4_checkpoints.bf16,
        "VLLM_PLE_SHM_FALLBACK_S": "30" if mode == "restart" else "0.3",
        "VLLM_PLE_SHM_GPU_PATH": "standin" if route == "gpu-driven" else "off",
    }
    result = run_scenario(
        "restart_mid_generation",
        {
            "model": qwen4_checkpoints.bf16,
            "log": str(tmp_path / "server.log"),
            "mode": mode,
            "steps": STEPS,
            "kill_step": KILL_STEP,
            "restart_after": 0.4,
        },
        env=env,
        timeout=400,
    )
    assert result["steps"] == [True] * STEPS, result  # every step's rows bit for bit
    assert ("gpu-driven" in result["route"]) == (route == "gpu-driven"), result["route"]
    assert not result["lost"]  # back on a server at the end
    assert result["last_server_requests"] > 0  # and the last step went to it
    stalled = result["stalls"][KILL_STEP]
    if mode == "restart":
        assert result["fallback_rows"] == 0, result  # the new server answered everything
        assert stalled >= 0.4, result["stalls"]  # the lookups waited for it
        if route == "gpu-driven":  # the waiting lookups, answered by the adopting server
            assert [e["ended"] for e in result["events"]] == ["adopted", "adopted"], result
            assert all(e["stall_s"] < 5 for e in result["events"]), result["events"]
    else:
        assert result["fallback_rows"] > 0, result  # the worker read rows itself
        assert 0.3 <= stalled < 10, result["stalls"]
        if route == "gpu-driven":
            (event,) = result["events"]
            assert event["ended"] == "adopted" and 0.3 <= event["stall_s"] < 5, event
