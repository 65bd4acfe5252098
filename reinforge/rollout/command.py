"""The command line that starts the embedded rollout server, `reinforge serve`, as a child
process: the one place outside `reinforge.cli.serve` (which defines the flags) that spells
them. Light on purpose: the supervisor imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from reinforge.cli import reinforge_argv


def serve_argv(model: str, *, port: int = 0, port_file: str = "",
               weight_version: int | str | None = None, kv_cache_dtype: str = "",
               extra: Sequence[str] = ()) -> list[str]:
    """The command that starts `reinforge serve` as a child process (the supervisor's
    rollout server, a sampler's or an evaluator's own): built here only."""
    argv = reinforge_argv("serve", "--model", model, "--port", str(port))
    if port_file:
        argv += ["--port-file", port_file]
    if kv_cache_dtype:
        argv += ["--kv-cache-dtype", kv_cache_dtype]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    return [*argv, *extra]
