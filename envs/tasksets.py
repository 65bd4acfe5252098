"""Users' own task files ("verifiable reward sets"): JSONL, one task per line.

Every line is a JSON object. Blank lines and lines starting with `#` are skipped.
A malformed line is refused with `TaskFileError("FILE:LINE: what is wrong")`:
nothing is loaded from a file with a bad line, so a typo never silently
shrinks a training set. Each domain documents its own row schema (see the
`*Row` Structs in the domain modules) and turns a row into a `TaskSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class TaskFileError(ValueError):
    """A task file that cannot be used; the message starts with `FILE:LINE:`."""


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (`FILE:LINE`, row) for each object line; raise TaskFileError on a bad line."""
    path = Path(path)
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot open task file: {exc.strerror}") from None
    decoder = msgspec.json.Decoder()
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            stripped = raw.strip()
            if not stripped or stripped.startswith(b"#"):
                continue
            try:
                row = decoder.decode(stripped)
            except msgspec.DecodeError as exc:
                raise TaskFileError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise TaskFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def decode_row(row: Mapping[str, Any], row_type: type[T], *, where: str) -> T:
    """Convert a decoded row to the domain's row Struct; errors name the line and field."""
    try:
        return msgspec.convert(row, row_type)
    except msgspec.ValidationError as exc:
        raise TaskFileError(f"{where}: {exc}") from None


def load_jsonl(path: str | Path, build: Callable[[Mapping[str, Any], str], T]) -> list[T]:
    """Build one item per row with `build(row, where)`; any error names its line."""
    items = []
    for where, row in iter_jsonl(path):
        try:
            items.append(build(row, where))
        except TaskFileError:
            raise
        except (ValueError, TypeError) as exc:
            raise TaskFileError(f"{where}: {exc}") from None
    return items
