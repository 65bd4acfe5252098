"""Find actor classes by spec: `pkg.module:Class`, `path/to/file.py:Class`, or an
entry-point name in the `reinforge.actors` group. No global registry: each lookup
asks Python's import system and the installed distributions' metadata.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "reinforge.actors"


class SpecError(ValueError):
    """An actor spec that does not name a loadable class."""


def resolve(spec: str) -> type[Any]:
    """The class a spec names; raises SpecError saying what was tried."""
    if ":" not in spec:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in eps:
            if ep.name == spec:
                return ep.load()
        names = sorted(ep.name for ep in eps)
        raise SpecError(
            f"{spec!r} is neither MODULE:CLASS nor a registered actor "
            f"(entry points in {ENTRY_POINT_GROUP!r}: {', '.join(names) or 'none'})"
        )
    module_part, _, class_name = spec.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.exists():
            raise SpecError(f"actor file {path} does not exist")
        mod_name = f"reinforge_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise SpecError(f"cannot import {path}")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise SpecError(f"cannot import module {module_part!r}: {exc}") from None
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise SpecError(f"module {module_part!r} has no attribute {class_name!r}") from None
    if not isinstance(cls, type):
        raise SpecError(f"{spec!r} is not a class")
    return cls
