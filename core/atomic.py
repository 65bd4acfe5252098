"""Writing a small file so that a reader, or a restart after a crash, sees either the old
content or the new one, never half of either.

The bytes go to a uniquely named temporary file in the same directory (a rename is atomic
only within one file system; a unique name lets two processes write the same file without
truncating each other's temporary), are flushed to disk, renamed over the target, and the
directory is synced so that the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import msgspec


def write_atomic(path: str | Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably (file mode `mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_json_atomic(path: str | Path, obj: Any, *, mode: int = 0o644) -> None:
    """`write_atomic` of `obj` as JSON (msgspec's encoder: Structs, dicts, lists)."""
    write_atomic(path, msgspec.json.encode(obj), mode=mode)


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory (a directory: so the names created or renamed in it are
    on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
