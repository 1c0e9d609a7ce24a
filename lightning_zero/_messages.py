"""Small helpers for the wording of error messages, shared so that every message lists alike."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def some_of(names: Sequence[str], shown: int = 5, quoted: bool = True) -> str:
    """The first ``shown`` of ``names``, comma-separated (``repr`` of each when ``quoted``), and how
    many more there are: a message names what went wrong without listing a whole model."""
    items = [repr(name) if quoted else str(name) for name in list(names)[:shown]]
    listed = ", ".join(items)
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"


def unwritable_directory(directory: Path) -> str | None:
    """Why files cannot be written into ``directory`` (made, with its parents, if missing), or
    None: checked before the work whose result would go there, not after it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{str(directory)!r} cannot be made a directory ({error})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{str(directory)!r} is not writable"
    return None


__all__ = ["some_of", "unwritable_directory"]
