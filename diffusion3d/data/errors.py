"""The data layer's errors: one line naming the file, or every bad file at once."""

from __future__ import annotations

from collections.abc import Sequence


class DataError(ValueError):
    """Bad input data; the message starts with the offending file or folder."""


class DataProblems(DataError):
    """Several bad inputs at once: ``errors`` holds one line per bad file, ``summary`` the count.

    ``str()`` is the lines themselves (a single bad file: its one line, as a plain DataError)."""

    def __init__(self, errors: Sequence[str], summary: str) -> None:
        self.errors, self.summary = list(errors), summary
        super().__init__("\n".join(self.errors))


def raise_all(errors: list[str], what: str) -> None:
    """Nothing, one DataError (one bad input) or DataProblems (several: one line each, then the count)."""
    if len(errors) == 1:
        raise DataError(errors[0])
    if errors:
        raise DataProblems(errors, f"{len(errors)} {what}")
