"""The plugin's log lines in vLLM's log, in vLLM's format and at its level.

vLLM's logging configuration gives handlers to its ``vllm`` logger alone, and
applies it in each process only once that process starts its part (the API
server from its arguments, the engine core and each worker at their start),
after plugins were loaded, sometimes more than once. Left alone, a plugin's
INFO lines (which route a worker took, which table a layer is served from)
reach no handler in ``vllm serve``, and its warnings come out in Python's bare
default format. ``join_vllm_logging`` gives the ``pleclient`` logger one
handler that hands each record to the ``vllm`` logger's handlers, at its
level, as they are when the record is made, so a later reconfiguration is
followed; before vLLM configured anything, records go where Python would send
them (the root logger's handlers at its level, else its last resort).
"""

from __future__ import annotations

import logging

PLUGIN_LOGGER = "pleclient"


class ToVllmHandlers(logging.Handler):
    """Hands a record to the ``vllm`` logger's handlers of the moment, at that
    logger's level of the moment (``--log-level`` reaches it in each process,
    the environment only at the start); where it has no handler, to the root
    logger's, at the root's level (Python's last resort without them)."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        sink = vllm if vllm.handlers else logging.getLogger()
        if record.levelno < sink.getEffectiveLevel():
            return
        handlers = sink.handlers
        if not handlers and logging.lastResort is not None:
            handlers = [logging.lastResort]
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def join_vllm_logging() -> bool:
    """Route the ``pleclient`` logger's records through vLLM's handlers; returns
    whether it did. Nothing is changed where logging is not vLLM's default
    configuration: ``VLLM_CONFIGURE_LOGGING=0`` (logging is the host
    program's), ``VLLM_LOGGING_CONFIG_PATH`` (the operator's own configuration,
    which names what it wants of ``pleclient``), or a ``pleclient`` logger
    that something configured already (a handler or a level of its own); a
    second call changes nothing either."""
    try:
        import vllm.envs as envs

        configured, own_file = envs.VLLM_CONFIGURE_LOGGING, envs.VLLM_LOGGING_CONFIG_PATH
    except (ImportError, AttributeError):  # a vLLM without these: its logging is its own
        return False
    ours = logging.getLogger(PLUGIN_LOGGER)
    if not configured or own_file or ours.handlers or ours.level != logging.NOTSET:
        return False
    ours.addHandler(ToVllmHandlers())
    # Every record reaches the handler, which applies vLLM's level of the moment.
    ours.setLevel(logging.DEBUG)
    ours.propagate = False  # as vLLM's own logger: a root handler would print each line twice
    return True
