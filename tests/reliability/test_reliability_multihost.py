"""A three-node NATS cluster with actors on two simulated hosts; one host is cut off and back.

Layout (scripts/netns.sh: one namespace per host, one private switch):
    h1  10.77.0.1   nats n1, EchoSource, EchoActor
    h2  10.77.0.2   nats n2, EchoActor                 <- cut off the switch, then healed
    h3  10.77.0.3   nats n3, the observer (multihost_observer.py)
Routes between the hosts run over mutual TLS. The run's stream has three replicas. While h2 is away, n1 and n3 keep a quorum, so the
source keeps publishing and h1's actor takes over h2's unacknowledged work after its ack
wait. When h2 returns, its actor's late outputs carry the same message ids and are
dropped as duplicates. Accounting: every input the source got acknowledged appears in
the output exactly once, and outputs were stored while h2 was cut off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trio
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.bus import open_bus
from reinforge.core.natscluster import NatsCluster
from reinforge.core.natsd import find_nats_server
from reinforge.core.ports import free_ports

from netns_hosts import Procs, finish_and_account, wait_for

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(180)]

ECHO = "reinforge.actors.echo:EchoActor"
SOURCE = "reinforge.actors.echo:EchoSource"
OBSERVER = Path(__file__).with_name("multihost_observer.py")

N_MSGS = 600
RATE_PER_S = 30.0
CUT_S = 15.0
# 0.1 s of pretend work, 4 at a time: the cut host always holds unacknowledged work.
ECHO_SETS = ("concurrency=4", "delay_s=0.1")


def actor(spec: str, run: str, creds: Path, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "reinforge", "actor", "run", spec, "--run", run,
            "--creds", str(creds)]
    for s in sets:
        argv += ["--set", s]
    return argv


def last_progress(evs: list[dict]) -> dict:
    prog = [e for e in evs if e["event"] == "progress"]
    return prog[-1] if prog else {"unique": 0}


def test_cutting_one_host_off_and_back_keeps_the_run_going_without_loss_or_duplicates(
    netns_lab, tmp_path
):
    run = "mh" + netns_lab.prefix[2:]
    hosts = [(netns_lab.host(i + 1), addr) for i, addr in enumerate(netns_lab.addresses)]
    cluster = NatsCluster.in_namespaces(tmp_path / "nats", hosts, cluster_name=run,
                                        route_tls=True, client_tls=True)
    procs = Procs(tmp_path)
    creds = {}
    for i, node in enumerate(cluster.nodes, start=1):
        creds[i] = tmp_path / f"nats-h{i}.json"
        cluster.credentials(prefer=node.name).write(creds[i])
    obs_out = tmp_path / "observer.log"
    finish = tmp_path / "finish"
    try:
        cluster.start(timeout_s=30)
        procs.start("observer", netns_lab.host(3),
                    [sys.executable, str(OBSERVER), str(creds[3]), run, str(N_MSGS),
                     str(finish), "150"])
        ready = wait_for(obs_out, lambda ev: any(e["event"] == "ready" for e in ev),
                         "the R3 stream", 30, procs)
        assert next(e for e in ready if e["event"] == "ready")["replicas"] == 3

        procs.start("echo-h1", netns_lab.host(1), actor(ECHO, run, creds[1], *ECHO_SETS))
        procs.start("echo-h2", netns_lab.host(2), actor(ECHO, run, creds[2], *ECHO_SETS))
        procs.start("source-h1", netns_lab.host(1),
                    actor(SOURCE, run, creds[1], f"count={N_MSGS}", f"rate_per_s={RATE_PER_S}"))
        wait_for(obs_out, lambda ev: last_progress(ev)["unique"] >= 60,
                 "the first outputs", 60, procs)

        cut_at = time.time()
        netns_lab.cut(2)
        time.sleep(CUT_S)
        healed_at = time.time()
        netns_lab.heal(2)

        wait_for(obs_out, lambda ev: last_progress(ev)["unique"] >= N_MSGS,
                 f"all {N_MSGS} outputs", 90, procs)
        # Give h2's actor time to reconnect and push its stale in-flight outputs (they must
        # dedupe) before the final count.
        time.sleep(6.0)
        evs, exited = finish_and_account(procs, obs_out, finish, 30)
    finally:
        procs.kill_all()
        cluster.stop(kill=True)

    final = next(e for e in evs if e["event"] == "final")
    # The source's acknowledged inputs: each stored once.
    assert sorted(final["in"]) == list(range(N_MSGS))
    # Every one of them came out exactly once: nothing lost, no duplicate stored.
    assert sorted(final["out"]) == list(range(N_MSGS))
    assert final["messages"] == 2 * N_MSGS
    assert final["others"] == {}
    # The work queue is drained, and the cut host's unacknowledged work went round again.
    assert (final["pending"], final["ack_pending"]) == (0, 0)
    assert final["deliveries"] > N_MSGS
    assert final["replicas"] == 3
    # The run went on while h2 was away: outputs were stored during the cut ...
    during = [t for t in final["out_t"] if cut_at + 1.0 < t < healed_at]
    assert len(during) >= 30, f"only {len(during)} outputs stored during the {CUT_S} s cut"
    # ... and the cluster really lost n2 for a while (it was no longer a current peer).
    cut_views = [e for e in evs if e["event"] == "progress" and cut_at + 4 < e["t"] < healed_at]
    assert any(
        e.get("leader") != "n2" and not e.get("peers", {}).get("n2", {}).get("current", True)
        for e in cut_views
    ), f"n2 never showed as lagging during the cut: {cut_views[-3:]}"
    # No actor process died of the partition (a crash would not count as "continued").
    assert exited == {}


# -- the same cluster on loopback (no namespaces, no root): fast checks -------------------


@pytest.fixture
def loopback_cluster(tmp_path):
    find_nats_server()  # a missing binary fails here with the install hint
    cluster = NatsCluster.on_loopback(tmp_path / "nats", 3, cluster_name="rf-loop")
    cluster.start(timeout_s=30)
    yield cluster
    cluster.stop(kill=True)


def routez(cluster: NatsCluster, name: str) -> dict:
    node = cluster.node(name)
    with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/routez", timeout=2) as r:
        return json.loads(r.read())


def route_peers(cluster: NatsCluster, name: str) -> set[str]:
    return {r.get("remote_name", "") for r in routez(cluster, name)["routes"]}


def test_cluster_credentials_name_every_node_nearest_first_and_stay_private(
    loopback_cluster, tmp_path
):
    c = loopback_cluster
    creds = c.credentials(prefer="n2")
    assert creds.url == c.node("n2").client_url
    assert set(creds.extra_urls) == {c.node("n1").client_url, c.node("n3").client_url}
    assert [u.split("@")[1] for u in creds.auth_urls()] == [
        u.removeprefix("nats://") for u in [creds.url, *creds.extra_urls]
    ]
    path = tmp_path / "creds.json"
    creds.write(path)
    assert path.stat().st_mode & 0o777 == 0o600
    for node in c.nodes:
        conf = c.data_dir / node.name / "nats-server.conf"
        assert conf.stat().st_mode & 0o777 == 0o600
        cmdline = Path(f"/proc/{node.proc.pid}/cmdline").read_bytes().decode()
        assert c.password not in cmdline and c.route_password not in cmdline
    # every node routes to both others
    for node in c.nodes:
        assert route_peers(c, node.name) == set(c.names) - {node.name}


REFUSED = "Router connection closed: Authentication Failure"


def test_a_server_without_the_route_password_cannot_join_the_cluster(loopback_cluster, tmp_path):
    c = loopback_cluster
    n1 = c.node("n1")
    conf = tmp_path / "rogue.conf"
    client_port, route_port = free_ports(2)
    conf.write_text(
        f'server_name: "rogue"\nhost: 127.0.0.1\nport: {client_port}\n'
        f'cluster {{\n  name: "{c.cluster_name}"\n  host: 127.0.0.1\n  port: {route_port}\n'
        f'  routes = ["nats-route://{c.route_user}:wrong-password@127.0.0.1:{n1.route_port}"]\n}}\n'
    )
    log = tmp_path / "rogue.log"
    with open(log, "wb") as out:
        rogue = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if REFUSED in c.log_path("n1").read_text(errors="replace"):
                break
            time.sleep(0.1)
        assert REFUSED in c.log_path("n1").read_text(errors="replace")
        assert "Authorization Violation" in log.read_text(errors="replace")
        assert rogue.poll() is None  # it kept trying: refused, not crashed
        # n1 keeps its routes to the real members (a route of a fresh cluster may still be
        # reconnecting: seen once as {"n3"} on a loaded machine, so it gets a moment)
        deadline = time.monotonic() + 15
        while route_peers(c, "n1") != {"n2", "n3"} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert route_peers(c, "n1") == {"n2", "n3"}
    finally:
        rogue.kill()
        rogue.wait(timeout=10)


def test_an_actor_starting_with_the_r1_default_never_scales_an_r3_stream_down(
    loopback_cluster, run_name
):

    async def main():
        async with open_bus(loopback_cluster.credentials()) as bus:
            name = await bus.ensure_run_stream(run_name, replicas=3)
            await bus.ensure_run_stream(run_name)  # what every actor does at start
            info = await bus.stream_info(name)
            assert info.config.num_replicas == 3
            assert len(info.cluster.replicas) == 2  # two followers beside the leader

    trio.run(main)


def test_the_weights_bucket_is_kept_three_times_and_outlives_the_node_that_led_it(
    loopback_cluster, run_name, tmp_path
):
    """The learner's bucket takes the run stream's replica count: with the node that led it
    killed, a host still fetches the version whole from the other two."""
    from reinforge.core.weights import fetch_version, put_version

    model = tmp_path / "v1"
    model.mkdir()
    (model / "model.safetensors").write_bytes(os.urandom(400_000))
    bucket = subjects.weights_bucket(run_name)

    async def put() -> tuple[int, str]:
        async with open_bus(loopback_cluster.credentials()) as bus:
            await bus.ensure_run_stream(run_name, replicas=3)
            await put_version(bus, run_name, 1, model)
            info = await bus.stream_info(f"OBJ_{bucket}")
            return info.config.num_replicas, info.cluster.leader

    async def fetch(prefer: str):
        async with open_bus(loopback_cluster.credentials(prefer=prefer)) as bus:
            return await fetch_version(bus, bucket, 1, tmp_path / "fetched" / "v1")

    replicas, leader = trio.run(put)
    assert replicas == 3
    loopback_cluster.stop_node(leader, kill=True)
    fetched = trio.run(fetch, next(n for n in loopback_cluster.names if n != leader))
    assert (fetched.path / "model.safetensors").read_bytes() == \
        (model / "model.safetensors").read_bytes()


def test_killing_the_node_under_the_actors_fails_them_over_without_loss(
    loopback_cluster, run_name, spawn, tmp_path
):

    c = loopback_cluster
    n_msgs = 300
    near_n1 = tmp_path / "n1.json"
    c.credentials(prefer="n1").write(near_n1)
    out_subject = subjects.echo(run_name, "out")

    async def main():
        async with open_bus(c.credentials(prefer="n3")) as bus:
            stream = await bus.ensure_run_stream(run_name, replicas=3)
            spawn("actor", "run", ECHO, "--run", run_name, "--creds", str(near_n1),
                  "--set", "concurrency=4", "--set", "delay_s=0.05")
            spawn("actor", "run", SOURCE, "--run", run_name, "--creds", str(near_n1),
                  "--set", f"count={n_msgs}", "--set", "rate_per_s=40")
            seen: dict[int, int] = {}
            killed = False
            async with bus.pull_consumer(stream=stream, durable="watch", max_deliver=1000,
                                         filter_subject=out_subject) as consumer:
                with trio.fail_after(90):
                    while len(set(seen.values())) < n_msgs:
                        batch = await consumer.fetch(256, timeout_s=0.5)
                        for d in batch:
                            seen[d.stream_seq] = m.decode(d.data).seq
                        await consumer.ack(batch)
                        if not killed and len(seen) >= 50:
                            killed = True
                            before_kill = len(seen)
                            c.stop_node("n1", kill=True)  # the actors' own node
                            await trio.sleep(5)
                            await trio.to_thread.run_sync(c.start_node, "n1")
            assert killed and before_kill < n_msgs
            ins = [m.decode(d.data).seq async for d in bus.read_stream(
                stream, filter_subject=subjects.echo(run_name, "in"))]
            outs = [m.decode(d.data).seq async for d in bus.read_stream(
                stream, filter_subject=out_subject)]
            assert sorted(ins) == list(range(n_msgs))
            assert sorted(outs) == list(range(n_msgs))

    trio.run(main)


def test_routes_over_mutual_tls_form_the_cluster_and_refuse_a_plain_text_peer(tmp_path):
    find_nats_server()
    c = NatsCluster.on_loopback(tmp_path / "nats", 3, cluster_name="rf-tls", route_tls=True)
    c.start(timeout_s=30)
    try:
        for node in c.nodes:
            assert route_peers(c, node.name) == set(c.names) - {node.name}
        conf = (c.data_dir / "n1" / "nats-server.conf").read_text()
        assert "verify: true" in conf
        assert (c.data_dir / "tls" / "node.key").stat().st_mode & 0o777 == 0o600
        # a peer with the right route password but no certificate is still refused
        n1 = c.node("n1")
        rogue_conf = tmp_path / "rogue.conf"
        client_port, route_port = free_ports(2)
        rogue_conf.write_text(
            f'server_name: "rogue"\nhost: 127.0.0.1\nport: {client_port}\n'
            f'cluster {{\n  name: "{c.cluster_name}"\n  host: 127.0.0.1\n'
            f"  port: {route_port}\n  routes = [\"nats-route://{c.route_user}:"
            f'{c.route_password}@127.0.0.1:{n1.route_port}"]\n}}\n'
        )
        log = tmp_path / "rogue.log"
        with open(log, "wb") as out:
            rogue = subprocess.Popen([find_nats_server(), "-c", str(rogue_conf)], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            refused = "TLS route handshake error"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and refused not in c._log_tail("n1", 20000):
                time.sleep(0.1)
            assert refused in c._log_tail("n1", 20000)
            assert rogue.poll() is None
            assert route_peers(c, "n1") == {"n2", "n3"}
        finally:
            rogue.kill()
            rogue.wait(timeout=10)
    finally:
        c.stop(kill=True)


def test_clients_over_tls_trust_the_cluster_ca_and_a_plain_text_client_is_refused(tmp_path):
    import socket

    import msgspec

    from reinforge.core.bus import BusError

    find_nats_server()
    c = NatsCluster.on_loopback(tmp_path / "nats", 2, cluster_name="rf-ctls", route_tls=True,
                                client_tls=True)
    run = "ctls"

    async def main(creds):
        async with open_bus(creds) as bus:  # encrypted, verified against the cluster's CA
            stream = await bus.ensure_run_stream(run)
            await bus.publish_durable(subjects.echo(run, "x"), m.Echo(seq=7), msg_id="e7")
            last = await bus.last_message(stream, subjects.echo(run, "x"))
            assert m.decode(last.data).seq == 7
        untrusted = msgspec.structs.replace(creds, extra_urls=[], ca_file="")
        with pytest.raises(BusError, match="CERTIFICATE_VERIFY_FAILED"):  # not the system's CA
            async with open_bus(untrusted, connect_timeout_s=3):
                pass

    c.start(timeout_s=30)
    try:
        creds = c.credentials(prefer="n1")
        assert creds.url.startswith("tls://") and Path(creds.ca_file).is_file()
        # the server demands TLS of every client before anything else (no plain-text session)
        n1 = c.node("n1")
        with socket.create_connection((n1.host, n1.client_port), timeout=5) as sock:
            info = json.loads(sock.recv(4096).decode().removeprefix("INFO ").strip())
        assert info["tls_required"] is True
        trio.run(main, creds)
    finally:
        c.stop(kill=True)


def test_a_cluster_that_fails_to_start_leaves_no_node_running_and_its_ports_are_distinct(tmp_path):
    import socket

    find_nats_server()
    c = NatsCluster.on_loopback(tmp_path / "nats", 3, cluster_name="rf-fail")
    with socket.socket() as taken:  # n2's client port is already in use: n2 cannot start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        c.node("n2").client_port = taken.getsockname()[1]
        with pytest.raises(Exception, match="n2 exited"):
            c.start(timeout_s=30)
    assert [n.name for n in c.nodes if n.running] == []
    ports = [getattr(n, a) for n in c.nodes for a in ("client_port", "route_port", "monitor_port")]
    assert len(set(ports)) == 9
