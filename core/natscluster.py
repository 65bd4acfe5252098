"""A three-node (or N-node) nats-server cluster with JetStream, for multi-host runs and tests.

Each node is a plain `nats-server` process with its own config, store and log under
`data_dir/<node>/`. Clients and routes are both authenticated: clients with the run's
generated user/password (as in `natsd.py`), routes with a second generated pair, so a
stranger who can reach the cluster port cannot join the cluster. Secrets live in the
config files (mode 0600) and the credentials file (0600), never in argv.

A node may live inside a network namespace (`netns="..."`): it is then started with
`ip netns exec NS nats-server -c CONF` and listens on the namespace's own address, as a
separate machine would. Without a namespace every node listens on 127.0.0.1 with its own
ports. Routes can also run over mutual TLS (`route_tls=True`: a CA and one node
certificate are generated with `openssl` under data_dir/tls), and so can clients
(`client_tls=True`: `tls://` URLs, the credentials carry the CA to trust). What the cluster
does NOT set up: the namespaces themselves (scripts/netns.sh does that for tests).

JetStream: file storage, `sync_interval: always` (see core/natsd.py for why). A run's stream
that must survive losing a node needs three replicas: create it with
`bus.ensure_run_stream(run, replicas=3)` before the actors start (their own R1 call never
scales it down). Servers ping every `ping_interval_s` on routes and clients, so a cut link
is noticed in seconds rather than after the two-minute default.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from reinforge.core.natsd import NatsCredentials, NatsServerError, find_nats_server
from reinforge.core.ports import free_ports

CLIENT_PORT = 4222
ROUTE_PORT = 6222
MONITOR_PORT = 8222


@dataclass
class ClusterNode:
    """One member of the cluster. `host` is the address it listens on (clients and routes)."""

    name: str
    host: str = "127.0.0.1"
    netns: str = ""
    """Network namespace to run in ("" = this one)."""
    client_port: int = 0
    route_port: int = 0
    monitor_port: int = 0
    """The monitoring endpoint listens on the node's own loopback only."""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return self.url(tls=False)

    def url(self, tls: bool) -> str:
        return f"{'tls' if tls else 'nats'}://{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class NatsCluster:
    """N nats-server processes forming one JetStream cluster. `start()` blocks until healthy.

    Build it with `NatsCluster.on_loopback(data_dir, 3)` (all nodes here, distinct ports) or
    `NatsCluster.in_namespaces(data_dir, [(ns, address), ...])` (one node per namespace,
    the same well-known ports everywhere, like separate machines).
    """

    data_dir: Path
    nodes: list[ClusterNode]
    cluster_name: str = "reinforge"
    user: str = ""
    password: str = ""
    route_user: str = ""
    route_password: str = ""
    ping_interval_s: float = 1.0
    """Server pings on routes and clients; `ping_max` unanswered pings close the link."""
    ping_max: int = 3
    max_payload: str = "8MB"
    route_tls: bool = False
    """Routes over mutual TLS too (a generated CA and node certificate under data_dir/tls)."""
    client_tls: bool = False
    """Client connections over TLS (`tls://` URLs; the credentials name the CA to trust)."""

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if len(self.nodes) < 1:
            raise ValueError("a NatsCluster needs at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        self.user = self.user or "rf-" + secrets.token_hex(4)
        self.password = self.password or secrets.token_urlsafe(24)
        self.route_user = self.route_user or "rf-route-" + secrets.token_hex(4)
        self.route_password = self.route_password or secrets.token_urlsafe(24)

    # -- construction -----------------------------------------------------------------

    @classmethod
    def on_loopback(cls, data_dir: Path, size: int = 3, **kwargs: Any) -> NatsCluster:
        nodes = [ClusterNode(name=f"n{i + 1}") for i in range(size)]
        return cls(data_dir=data_dir, nodes=nodes, **kwargs)

    @classmethod
    def in_namespaces(
        cls, data_dir: Path, hosts: list[tuple[str, str]], **kwargs: Any
    ) -> NatsCluster:
        """`hosts` = [(netns, address)]: one node per namespace, listening on `address`."""
        nodes = [
            ClusterNode(
                name=f"n{i + 1}", host=addr, netns=ns, client_port=CLIENT_PORT,
                route_port=ROUTE_PORT, monitor_port=MONITOR_PORT,
            )
            for i, (ns, addr) in enumerate(hosts)
        ]
        return cls(data_dir=data_dir, nodes=nodes, **kwargs)

    # -- what clients need ----------------------------------------------------------------

    def node(self, name: str) -> ClusterNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in cluster {self.cluster_name} ({self.names})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def credentials(self, prefer: str = "") -> NatsCredentials:
        """Credentials naming every node; the `prefer`red node first (e.g. the local one)."""
        order = sorted(self.nodes, key=lambda n: n.name != prefer) if prefer else self.nodes
        first, rest = order[0], order[1:]
        tls = self.client_tls
        return NatsCredentials(
            url=first.url(tls),
            user=self.user,
            password=self.password,
            monitor_url=f"http://127.0.0.1:{first.monitor_port}",
            extra_urls=[n.url(tls) for n in rest],
            ca_file=str(self._tls_files()["ca"]) if tls else "",
        )

    # -- configuration ------------------------------------------------------------------

    def _assign_ports(self) -> None:
        """Free loopback ports for the nodes' unset ports, all distinct."""
        wanted = [(n, attr) for n in self.nodes
                  for attr in ("client_port", "route_port", "monitor_port")
                  if not getattr(n, attr)]
        for n, _ in wanted:
            if n.netns:
                raise ValueError(f"node {n.name} in netns {n.netns} needs fixed ports")
        if not wanted:
            return
        for (n, attr), port in zip(wanted, free_ports(len(wanted))):
            setattr(n, attr, port)

    def config_text(self, node: ClusterNode) -> str:
        """The nats-server config of `node` (contains secrets: written 0600)."""
        q = json.dumps
        store = self.data_dir / node.name / "js"
        routes = ",\n    ".join(
            q(f"nats-route://{self.route_user}:{self.route_password}@{o.host}:{o.route_port}")
            for o in self.nodes
            if o is not node
        )
        return (
            f"server_name: {q(node.name)}\n"
            f"host: {q(node.host)}\n"
            f"port: {node.client_port}\n"
            f'http: "127.0.0.1:{node.monitor_port}"\n'
            f'ping_interval: "{self.ping_interval_s:g}s"\n'
            f"ping_max: {self.ping_max}\n"
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f"  store_dir: {q(str(store))}\n"
            "  sync_interval: always\n"
            "}\n"
            "authorization {\n"
            f"  users = [ {{user: {q(self.user)}, password: {q(self.password)}}} ]\n"
            "}\n"
            f"{self._client_tls_block()}"
            "cluster {\n"
            f"  name: {q(self.cluster_name)}\n"
            f"  host: {q(node.host)}\n"
            f"  port: {node.route_port}\n"
            # Clients use the URLs they were given (with credentials), not gossiped ones.
            "  no_advertise: true\n"
            "  authorization {\n"
            f"    user: {q(self.route_user)}\n"
            f"    password: {q(self.route_password)}\n"
            "    timeout: 2\n"
            "  }\n"
            f"{self._route_tls_block()}"
            f"  routes = [\n    {routes}\n  ]\n"
            "}\n"
        )

    def _tls_files(self) -> dict[str, Path]:
        return make_tls_files(self.data_dir / "tls", [n.host for n in self.nodes])

    def _client_tls_block(self) -> str:
        """Clients must speak TLS (the server's certificate; clients prove themselves with
        the run's password, not a certificate)."""
        if not self.client_tls:
            return ""
        files = self._tls_files()
        q = json.dumps
        return (
            "tls {\n"
            f"  cert_file: {q(str(files['cert']))}\n"
            f"  key_file: {q(str(files['key']))}\n"
            "  timeout: 2\n"
            "}\n"
        )

    def _route_tls_block(self) -> str:
        if not self.route_tls:
            return ""
        files = self._tls_files()
        q = json.dumps
        return (
            "  tls {\n"
            f"    cert_file: {q(str(files['cert']))}\n"
            f"    key_file: {q(str(files['key']))}\n"
            f"    ca_file: {q(str(files['ca']))}\n"
            "    verify: true\n"
            "    timeout: 2\n"
            "  }\n"
        )

    def _write_config(self, node: ClusterNode) -> Path:
        d = self.data_dir / node.name
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "nats-server.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config_text(node))
        return conf

    def log_path(self, name: str) -> Path:
        return self.data_dir / name / "nats-server.log"

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Start every node that is not running; return once all of them report healthy."""
        self._assign_ports()
        started = [n.name for n in self.nodes if not n.running]
        try:
            for name in started:
                self._spawn(self.node(name))
            self.wait_healthy(timeout_s=timeout_s)
        except BaseException:  # no half-started cluster outlives a failed start
            for name in started:
                self.stop_node(name, kill=True)
            raise
        return self

    def start_node(self, name: str, timeout_s: float = 30.0) -> None:
        node = self.node(name)
        self._spawn(node)
        self.wait_healthy([name], timeout_s=timeout_s)

    def _spawn(self, node: ClusterNode) -> None:
        if node.running:
            return
        conf = self._write_config(node)
        argv = [find_nats_server(), "-c", str(conf)]
        if node.netns:
            argv = ["ip", "netns", "exec", node.netns, *argv]  # ip execs: the pid is the server
        log = open(self.log_path(node.name), "ab")  # noqa: SIM115 - owned by the child
        node.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def wait_healthy(self, names: list[str] | None = None, timeout_s: float = 30.0) -> None:
        """Poll each node's /healthz (JetStream included) until all answer 200."""
        deadline = time.monotonic() + timeout_s
        todo = [self.node(x) for x in (names or self.names)]
        while todo:
            for n in list(todo):
                if not n.running:
                    code = n.proc.returncode if n.proc else None
                    tail = self._log_tail(n.name)
                    raise NatsServerError(f"nats-server {n.name} exited with {code}:\n{tail}")
                if self.node_healthy(n.name):
                    todo.remove(n)
            if not todo:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        raise NatsServerError(
            f"cluster {self.cluster_name}: nodes {[n.name for n in todo]} not healthy within "
            f"{timeout_s} s; last log lines of {todo[0].name}:\n{self._log_tail(todo[0].name)}"
        )

    def node_healthy(self, name: str) -> bool:
        """One /healthz probe of `name` (run inside its namespace when it has one)."""
        node = self.node(name)
        url = f"http://127.0.0.1:{node.monitor_port}/healthz"
        if not node.netns:
            return _healthz(url)
        probe = subprocess.run(
            ["ip", "netns", "exec", node.netns, sys.executable, "-I", "-S", "-c", _HEALTHZ_PY,
             url],
            capture_output=True, timeout=10, check=False,
        )
        return probe.returncode == 0

    def stop_node(self, name: str, *, kill: bool = False, timeout_s: float = 10.0) -> None:
        node = self.node(name)
        if not node.running:
            return
        assert node.proc is not None
        node.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            node.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()

    def stop(self, *, kill: bool = False) -> None:
        for n in self.nodes:
            self.stop_node(n.name, kill=kill)

    def _log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_HEALTHZ_PY = (
    "import sys, urllib.request\n"
    "try:\n"
    "    r = urllib.request.urlopen(sys.argv[1], timeout=1)\n"
    "    sys.exit(0 if r.status == 200 else 1)\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


def _healthz(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False



def make_tls_files(tls_dir: Path, hosts: list[str]) -> dict[str, Path]:
    """A private CA and one certificate (server and client use) valid for `hosts`.

    Made once per directory with the `openssl` command; keys are written 0600. Every node
    presents the same certificate: what it proves is "holds the cluster's key".
    """
    tls_dir = Path(tls_dir)
    files = {"ca": tls_dir / "ca.pem", "cert": tls_dir / "node.pem", "key": tls_dir / "node.key"}
    if all(f.exists() for f in files.values()):
        return files
    tls_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tls_dir, 0o700)
    sans = sorted({*hosts, "127.0.0.1"})
    alt = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() else f"DNS:{h}" for h in sans)
    (tls_dir / "ext.cnf").write_text(
        f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "3650",
         "-subj", "/CN=reinforge cluster CA"],
        ["req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=reinforge node"],
        ["x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "node.pem", "-days", "825", "-extfile", "ext.cnf"],
    ]
    for step in steps:
        proc = subprocess.run(["openssl", *step], cwd=tls_dir, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise NatsServerError(f"openssl {step[0]} in {tls_dir} failed: {proc.stderr[-500:]}")
    for key in ("ca.key", "node.key"):
        os.chmod(tls_dir / key, 0o600)
    return files
