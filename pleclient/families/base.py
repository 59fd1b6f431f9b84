"""What a model family provides to find its tables (``TableFamily``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from pleclient.checkpoint import TableSpec, TensorEntry


class TableFamily(ABC):
    """One model family's table rules."""

    name: str
    """The family, in messages (``Qwen4Exp PLE``)."""
    naming: str
    """How its table tensors are named, in the message for a checkpoint
    without tables."""

    @abstractmethod
    def owns(self, tensor: str) -> bool:
        """Whether ``tensor`` (a checkpoint tensor name) is part of one of this
        family's tables: the files holding one are read."""

    @abstractmethod
    def configures(self, text_config: dict) -> bool:
        """Whether a model's config (its ``text_config``, or the config
        itself) is this family's: it names the family's hashed layers."""

    @abstractmethod
    def hasher(self, model_dir: str) -> Any:
        """The family's hasher of the checkpoint: ``layers``, each with its
        ``table`` (how its table's name ends), ``rows`` and ``row_ids(tokens,
        context)``, computed from token ids alone."""

    @abstractmethod
    def tables(self, entries: Iterable[TensorEntry]) -> tuple[list[TableSpec], list[str]]:
        """This family's tables among ``entries`` (every tensor of every file,
        in file order), each validated; and every problem found (a table with
        one is not returned)."""


def built(
    results: Iterable[tuple[TableSpec | None, list[str]]],
) -> tuple[list[TableSpec], list[str]]:
    """A family's tables and problems from each table's build (a table, or
    None and its problems)."""
    tables: list[TableSpec] = []
    problems: list[str] = []
    for table, table_problems in results:
        problems += table_problems
        if table is not None:
            tables.append(table)
    return tables, problems
