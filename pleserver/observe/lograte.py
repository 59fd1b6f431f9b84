"""Log lines that peers can trigger at will, limited per kind.

A uid that is not allowed, or a client that reconnects in a loop while the
server is full, could otherwise write megabytes of warnings a second into the
journal. Each kind (a short key such as ``"refused"``) gets ``burst`` lines per
``window_s``; the lines past that are counted, and the count is logged once the
window ends (from ``flush``, which the control loop calls at least once a
second, or from the next line of that kind).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

WINDOW_S = 10.0
BURST = 5


@dataclass
class _Window:
    started: float
    logged: int = 0
    suppressed: int = 0


class RateLimitedLog:
    def __init__(
        self, logger: logging.Logger, window_s: float = WINDOW_S, burst: int = BURST
    ) -> None:
        self.logger = logger
        self.window_s = window_s
        self.burst = burst
        self._windows: dict[str, _Window] = {}

    def log(self, kind: str, level: int, fmt: str, *args) -> None:
        now = time.monotonic()
        window = self._windows.get(kind)
        if window is not None and now - window.started >= self.window_s:
            self._close(kind, window)
            window = None
        if window is None:
            window = self._windows[kind] = _Window(now)
        if window.logged < self.burst:
            window.logged += 1
            self.logger.log(level, fmt, *args)
        else:
            window.suppressed += 1

    def flush(self) -> None:
        """Report the windows that have ended."""
        now = time.monotonic()
        for kind, window in list(self._windows.items()):
            if now - window.started >= self.window_s:
                self._close(kind, window)

    def _close(self, kind: str, window: _Window) -> None:
        del self._windows[kind]
        if window.suppressed:
            self.logger.warning(
                "%d more %s lines suppressed in the last %.0f s (at most %d per %.0f s are logged)",
                window.suppressed,
                kind,
                self.window_s,
                self.burst,
                self.window_s,
            )
