"""Child processes that end with the process that started them.

A command that runs others (the demo's evaluations, an actor's rollout server) must not leave
them running when it is killed: the child asks the kernel for SIGTERM at its parent's death
(`die_with_parent`, even a kill -9), and the parent turns SIGTERM into an exception
(`exit_on_sigterm`) so its clean-up runs.
"""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """A `preexec_fn`: in the child, before exec, get SIGTERM when the parent dies (Linux's
    PR_SET_PDEATHSIG; nothing elsewhere). It fires when the thread that started the child
    ends, so start such children from a thread that lives as long as they should."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread, as Ctrl-C raises KeyboardInterrupt:
    `finally` blocks run, and a `subprocess.run` under way kills its child, instead of the
    process vanishing with its children and its cluster left running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
