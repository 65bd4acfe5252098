"""reinforge: RL post-training from verifiable rewards, as an actor system over NATS.

The sub-packages live in top-level folders of the repository (see pyproject.toml):
`reinforge.core`, `reinforge.actors`, `reinforge.kernels`, `reinforge.envs`,
`reinforge.engine`. ARCHITECTURE.md is the map.
"""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"


def _is_checkout_root(entry: str, root: Path) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == root
    except OSError:  # a vanished cwd or an unreadable entry is not the checkout
        return False


def _leave_checkout_root_off_sys_path() -> None:
    """In a source checkout, the folders `kernels/`, `core/`, `envs/`, `actors/` and
    `engine/` are this package's sub-packages, not top-level names. With the checkout root
    on `sys.path` (which `python -m ...` run from it puts first) `kernels/` would shadow
    Hugging Face's `kernels` distribution, which transformers imports: every model import
    would fail. Importing reinforge takes that entry off, whatever put it there, before
    anything of ours imports transformers. An installed (non-checkout) copy has no such
    folders beside it and is left alone."""
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return
    sys.path[:] = [entry for entry in sys.path if not _is_checkout_root(entry, root)]


_leave_checkout_root_off_sys_path()
