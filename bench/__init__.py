"""The benchmarks, each run as ``python -m bench.<kind>.<name>`` from the
repository root, grouped by kind:

- ``micro``: one path on the CPU against its floors;
- ``floods``: a bystander beside hostile or greedy peers;
- ``evals``: serving from disk end to end, and long runs;
- ``sim``: simulations over recorded traces;
- ``gpu``: on a GPU host, the lookups, a decode step and the GPU-driven route;
- ``real_vllm``: vLLM's own engine, stock against the plugin.

What every one of them needs (a work directory, a synthetic checkpoint,
servers, the machine and commit measured, the load beside the timed client,
the JSON and the footer, the clean-up) is in ``bench.harness``; a script keeps
only its cases and its report. The ``device_*.sh`` runners run them on the
GPU host."""
