"""The rollout server process a sampler or evaluator starts and owns: `reinforge serve` or
SGLang's `launch_server`, on a free port, dying with its parent. `SamplerConfig` lives here
because it describes that server; the sampler actor and the evaluator both use it.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import trio

from reinforge.actors.rollout_client import RolloutClient
from reinforge.cli import serve_argv


class SamplerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    backend: str = "embedded"
    """"embedded" (`reinforge serve`) or "sglang" (`python -m sglang.launch_server`)."""
    url: str = ""
    """Rollout server to use; "" = start one (needs `model_path`)."""
    model_path: str = ""
    """Model directory (Hugging Face format) to serve, and the default tokenizer."""
    tokenizer_path: str = ""
    """Tokenizer directory; "" = model_path, else the server's /model_info tokenizer_path."""
    initial_version: int = 0
    """Policy version of `model_path` (the server is started with --weight-version N);
    a server that reports "default" is taken to serve this version."""
    server_args: list[str] = []
    """Extra command-line arguments for the server this sampler starts."""
    server_start_timeout_s: float = 300.0
    """How long a started server may take to answer /health."""
    domains: list[str] = []
    """Task domains to take; [] = all (one input on task.*)."""
    concurrency: int = 4
    """Tasks (groups) being sampled at once."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    """Per sample (single-turn) or per turn (multi-turn)."""
    stop: list[str] = []
    """Stop strings (single-turn)."""
    chat_template: bool = True
    """Wrap the task prompt in the tokenizer's chat template (when it has one)."""
    request_timeout_s: float = 300.0
    """One /generate call, all G samples."""
    ack_wait_s: float = 600.0
    """Lease on a task: generation plus a possible weights reload."""
    sandbox: bool = True
    """Open a sandbox pool for multi-turn domains that need one (terminal)."""
    sandbox_pool_size: int = 1
    weights_poll_s: float = 10.0
    """Re-read the newest stored weights message this often (a missed core message)."""

    def __post_init__(self) -> None:
        if self.backend not in ("embedded", "sglang"):
            raise ValueError(
                f"SamplerConfig.backend must be 'embedded' or 'sglang', got {self.backend!r}"
            )
        if not self.url and not self.model_path:
            raise ValueError("SamplerConfig: set `url` (a running server) or `model_path`")
        if self.concurrency < 1 or self.max_new_tokens < 1:
            raise ValueError("SamplerConfig.concurrency and max_new_tokens must be >= 1")


# ----------------------------------------------------------------------------- the gate


def server_command(cfg: SamplerConfig, port_file: str) -> list[str]:
    """The command line that starts this sampler's rollout server."""
    if cfg.backend == "embedded":
        return serve_argv(cfg.model_path, port_file=port_file,
                          weight_version=cfg.initial_version, extra=cfg.server_args)
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
            "--host", "127.0.0.1", "--port", str(_free_port()),
            "--weight-version", str(cfg.initial_version), *cfg.server_args]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the sampler dies (even by kill -9)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A rollout server started (and stopped) by the sampler."""

    def __init__(self, cfg: SamplerConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.port_file = str(log_path.with_suffix(".port"))
        self.argv = server_command(cfg, self.port_file)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    async def wait_url(self, timeout_s: float) -> str:
        assert self.proc is not None
        with trio.move_on_after(timeout_s):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"rollout server exited with {self.proc.returncode}: "
                        f"{shlex.join(self.argv)}\n{self._log_tail()}"
                    )
                url = self._url()
                if url:
                    async with RolloutClient(url, timeout_s=5) as probe:
                        if await probe.health():
                            return url
                await trio.sleep(0.2)
        raise RuntimeError(
            f"rollout server not healthy after {timeout_s} s: {shlex.join(self.argv)}\n"
            f"{self._log_tail()}"
        )

    def _url(self) -> str:
        if self.cfg.backend == "embedded":
            try:
                return f"http://127.0.0.1:{int(Path(self.port_file).read_text())}"
            except (OSError, ValueError):
                return ""
        return f"http://127.0.0.1:{self.argv[self.argv.index('--port') + 1]}"

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ----------------------------------------------------------------------------- the actor


