"""Small helpers for the wording of error messages, shared so that every message lists alike."""

from __future__ import annotations

from collections.abc import Sequence


def some_of(names: Sequence[str], shown: int = 5, quoted: bool = True) -> str:
    """The first ``shown`` of ``names``, comma-separated (``repr`` of each when ``quoted``), and how
    many more there are: a message names what went wrong without listing a whole model."""
    items = [repr(name) if quoted else str(name) for name in list(names)[:shown]]
    listed = ", ".join(items)
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"


__all__ = ["some_of"]
