"""The log: one handler on stderr, in the format the ``log_format`` setting asks.

- ``text`` (the default): ``2025-06-01 12:00:00,123 INFO pleserver.server: …``,
  as a person reads it;
- ``json``: one JSON object per line for log shippers, with the journal's
  field names, as ``journalctl -o json`` writes them (strings): ``MESSAGE``,
  ``PRIORITY`` (syslog's 0–7), ``LOGGER``, ``THREAD_NAME``, ``CODE_FILE``,
  ``CODE_LINE``, ``CODE_FUNC``, ``EXCEPTION_TEXT`` when there is a traceback
  (the names python-systemd's ``JournalHandler`` gives them), ``TIMESTAMP``
  (RFC 3339, UTC, microseconds: the journal's own is trusted, not ours to
  set), and any ``extra=`` of the call under its name in capitals. A shipper
  reading the journal and one reading these lines see the same fields.

When stderr is the journal (systemd's ``$JOURNAL_STREAM`` names it), every
line starts with a ``<N>`` priority prefix, which journald turns into the
entry's priority; text lines then drop their timestamp (journald adds its
own). That is what the journal needs whatever the format: ``log_format =
json`` there gives ``<6>{"MESSAGE": …}``, the object as the entry's message.

A reload may change the format (``set_format``): the handler stays, its
formatter is replaced in one store, so no line is half of each.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, ClassVar

# Syslog's priorities (journald's PRIORITY field) for logging's levels.
PRIORITY: dict[int, int] = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"

_handler: logging.Handler | None = None  # the one setup() installed


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (a custom level: the next one down)."""
    for level in sorted(PRIORITY, reverse=True):
        if levelno >= level:
            return PRIORITY[level]
    return PRIORITY[logging.DEBUG]


class JournalPrefix(logging.Formatter):
    """Wraps another formatter: a ``<N>`` syslog priority prefix on each of its
    lines, which journald turns into the entry's priority."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        prio = priority(record.levelno)
        return "\n".join(f"<{prio}>{line}" for line in self.inner.format(record).splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per record, the journal's field names (module docstring).

    The standard library's ``Formatter`` and ``json`` do it: what a library
    such as python-json-logger adds (renaming, reserved-attribute lists) is
    what this class must decide itself anyway (the journal's names, the
    priority, values as strings), and the daemon then needs no dependency
    for its log."""

    # A LogRecord's own attributes; any other one came from ``extra=``.
    STANDARD: ClassVar[frozenset[str]] = frozenset(
        vars(logging.makeLogRecord({})).keys() | {"message", "asctime", "taskName"}
    )

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "MESSAGE": record.getMessage(),
            "PRIORITY": str(priority(record.levelno)),
            "LOGGER": record.name,
            "TIMESTAMP": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="microseconds"
            ),
            "THREAD_NAME": record.threadName or "",
            "CODE_FILE": record.pathname,
            "CODE_LINE": str(record.lineno),
            "CODE_FUNC": record.funcName,
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["EXCEPTION_TEXT"] = record.exc_text
        if record.stack_info:
            entry["STACK_INFO"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in self.STANDARD and not key.startswith("_"):
                entry.setdefault(key.upper(), value)
        # default=str: an extra that JSON cannot hold (a path, an exception)
        # is written as its text rather than losing the line.
        return json.dumps(entry, ensure_ascii=False, default=str)


def stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd connected us to
    ($JOURNAL_STREAM names its device and inode)."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError):
        return False


def formatter(log_format: str, journal: bool) -> logging.Formatter:
    """The formatter of ``log_format`` ("text" or "json"), on the journal or not."""
    if log_format == "json":
        inner: logging.Formatter = JsonFormatter()
    elif log_format == "text":
        inner = logging.Formatter(JOURNAL_TEXT_FORMAT if journal else TEXT_FORMAT)
    else:
        raise ValueError(f"no log format {log_format!r}: text or json")
    return JournalPrefix(inner) if journal else inner


def setup(level: str, log_format: str = "text") -> None:
    """The process's log: stderr, at ``level``, in ``log_format``."""
    global _handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, stderr_is_journal()))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
    if handler in logging.getLogger().handlers:  # (basicConfig leaves a set-up log alone)
        _handler = handler


def set_format(log_format: str) -> None:
    """Switch the handler ``setup`` installed to ``log_format`` (a reload)."""
    if _handler is not None:
        _handler.setFormatter(formatter(log_format, stderr_is_journal()))
