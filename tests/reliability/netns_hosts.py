"""Processes on the simulated hosts of the multi-host tests (network namespaces, made by
scripts/netns.sh through the `netns_lab` fixture), and reading what their observer prints.

A process runs inside its host's namespace (`ip netns exec`). Given a host name, it also
runs in UTS and mount namespaces of its own: `hostname` answers that name, and each of the
`hidden` folders is covered by an empty tmpfs, so a host sees its own folder, not another
host's, as on separate machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

APART = 'hostname "$1"; shift; for d in "$@"; do [ "$d" = -- ] && break; \
mount -t tmpfs -o size=4k hidden "$d"; shift; done; shift; exec "$@"'


class Procs:
    """Processes started inside namespaces; all killed (by pid) at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, netns: str, argv: list[str], *, hostname: str = "",
              hidden: tuple[Path, ...] = (), env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        """Run `argv` on host `netns`; with a `hostname`, apart (see above)."""
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        if hostname:
            argv = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", APART,
                    "sh", hostname, *map(str, hidden), "--", *argv]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, *argv],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, **(env or {})),
        )
        log.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def wait_for(path: Path, cond, what: str, timeout_s: float, procs: Procs) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        evs = events(path)
        if cond(evs):
            return evs
        dead = [n for n, p in procs.procs.items() if p.poll() is not None]
        if dead:
            pytest.fail(f"process {dead[0]} exited while waiting for {what}:\n"
                        f"{procs.log(dead[0])[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}; observer said:\n"
                f"{path.read_text(errors='replace')[-3000:]}")




def finish_and_account(procs: Procs, obs_out: Path, finish: Path, timeout_s: float
                       ) -> tuple[list[dict], dict[str, int]]:
    """Tell the observer to make its final accounting (FINISH_FLAG) and wait for it; returns
    its events and the exit codes of any other process that has ended meanwhile."""
    finish.touch()
    evs = wait_for(obs_out, lambda ev: any(e["event"] == "final" for e in ev),
                   "the final accounting", timeout_s, procs)
    exited = {n: p.returncode for n, p in procs.procs.items()
              if n != "observer" and p.poll() is not None}
    return evs, exited
