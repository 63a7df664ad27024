"""Validation errors of a topology file, each tied to the path of its field.

A `TopologyError` carries every problem found in one pass, so an operator
fixes a file in one edit instead of one error per `topoctl apply`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldError:
    """One problem. `path` is e.g. "workers[2].id", "settings.fsync", "" (root)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class TopologyError(ValueError):
    """A topology was rejected; `errors` lists every problem, in file order."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors: list[FieldError] = list(errors)
        if not self.errors:
            raise ValueError("TopologyError needs at least one FieldError")
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default exception pickling would call __init__ with the message
        # string; errors travel between processes, so rebuild from the list.
        return (type(self), (self.errors,))

    def to_list(self) -> list[dict[str, str]]:
        return [{"path": e.path, "message": e.message} for e in self.errors]
