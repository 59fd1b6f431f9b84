"""Stub for the C extension built from pleserver/native/ (module.c holds its
method and type tables). Its functions and types are untyped to mypy."""

from typing import Any

def __getattr__(name: str) -> Any: ...
