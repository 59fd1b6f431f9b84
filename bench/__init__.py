"""The benchmarks, each run as ``python -m bench.<name>`` from the repository
root. What every one of them needs (a work directory, a synthetic checkpoint,
servers, the machine and commit measured, the load beside the timed client,
the JSON and the footer, the clean-up) is in ``bench.harness``; a script keeps
only its cases and its report."""
