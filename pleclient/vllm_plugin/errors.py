"""Errors the plugin raises inside vLLM; each says what to do."""

from __future__ import annotations


class PleBackendError(RuntimeError):
    """VLLM_PLE_BACKEND=shm cannot serve PLE rows (no server, server lost, …)."""


class IdentityMismatch(PleBackendError):
    """The server does not serve the checkpoint vLLM loads."""


class UnsupportedVllm(PleBackendError):
    """This vLLM lacks a class the plugin patches (moved, renamed, replaced)."""


class UnsupportedCompilation(PleBackendError):
    """A vLLM compilation setting (``-cc.cudagraph_mode``) the PLE lookups'
    route cannot run under."""
