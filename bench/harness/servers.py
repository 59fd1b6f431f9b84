"""The server a benchmark times: a synthetic checkpoint in its work directory,
and a ``pleserver serve`` on it, started at once and waited for apart, so that
several servers prewarm while the benchmark warms its own baselines."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from bench.harness.checkout import REPO
from pleclient import PleClient
from pleserver.devkit.launcher import ServerLauncher
from pleserver.devkit.synthetic import SyntheticTable, write_checkpoint
from pleserver.observe.stats import BUCKETS_S


def write_model(workdir: str, tables: Sequence[SyntheticTable], files: int = 1) -> str:
    """The synthetic checkpoint of ``tables`` in ``workdir/model``: its path."""
    model = os.path.join(workdir, "model")
    write_checkpoint(model, list(tables), files=files)
    return model


class Server:
    """A ``pleserver serve --prewarm full`` process (``pleserver.devkit.launcher``),
    started at once and waited for by ``wait_ready``."""

    def __init__(
        self, label: str, model: str, workers: int, capacity: int, extra: list[str]
    ) -> None:
        self.label = label
        self.launched = ServerLauncher(
            model,
            "--prewarm",
            "full",
            "--max-capacity",
            str(capacity),
            *(["--gather-workers", str(workers)] if workers else []),
            *extra,
            log_level="WARNING",
            cwd=REPO,
            die_with_parent=True,
        ).start(wait=False)
        self.socket = self.launched.socket
        self.proc = self.launched.proc
        self.client: PleClient | None = None
        self.info = None  # the table's TableInfo, once connected

    def log_tail(self) -> str:
        return self.launched.log_tail()

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Until the server is ready and its full prewarm is over: its stats."""
        self.launched.wait_ready(timeout)
        state = self.launched.wait_prewarm(timeout)
        if state != "done":
            print(f"warning: server {self.label}: prewarm ended '{state}'", file=sys.stderr)
        return PleClient.query_stats(self.socket)

    def stop(self) -> None:
        close_client(self.client)
        self.client = None
        self.launched.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def close_client(client: PleClient | None) -> None:
    """Close a benchmark's client, whose server may be gone already: a failed
    goodbye is no result of the benchmark's."""
    if client is not None:
        try:
            client.close()
        except Exception:
            pass


def hist_quantiles(before: dict, after: dict) -> dict:
    """p50/p99 of the requests between two snapshots of a server histogram."""
    counts = [a - b for a, b in zip(after["buckets"], before["buckets"], strict=True)]
    total = sum(counts)
    result = {"count": total}
    for name, q in (("p50_us", 0.5), ("p99_us", 0.99)):
        seen, value = 0, None
        for i, c in enumerate(counts):
            seen += c
            if c and seen >= q * total:
                value = BUCKETS_S[i] * 1e6 if i < len(BUCKETS_S) else after["max_s"] * 1e6
                break
        result[name] = value
    return result
