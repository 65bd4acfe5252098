"""An RL run across three simulated machines that share no folder; one is cut off in the
middle of a weight transfer.

Layout (scripts/netns.sh: one network namespace per host, one private switch; each host's
processes also run in a mount namespace where the other hosts' folders are hidden):
    h1  10.77.0.1   nats n1, `reinforge up`: the scheduler and the learner
    h2  10.77.0.2   nats n2, `reinforge attach`: a sampler and the rollout server it starts
    h3  10.77.0.3   nats n3, `reinforge attach`: a verifier; the observer
Routes and clients run over TLS. `reinforge up` makes the run's stream with three replicas
(`stream_replicas = 3`) and stores the run's settings in it; the attached actors join with
them. The learner puts each version into the run's object store (`publish_weights =
"store"`, three replicas like the stream); the sampler, which cannot see the learner's
folder, fetches every version from there, each file's SHA-256 checked. h2 reaches the
cluster through n1 first, so every byte of a fetch crosses its cable; once the run is
going the cable is throttled, so a fetch takes a second or more, and h2 is cut off while
one is writing the model's file. The fetch waits and then resumes at the chunk it was
waiting for: the same file grows on after the heal and becomes the version, no load fails.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import msgspec
import pytest
from reinforge.core import subjects
from reinforge.core.natscluster import NatsCluster

from netns_hosts import Procs, events, finish_and_account, wait_for

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(420)]

HERE = Path(__file__).resolve().parent
OBSERVER = HERE / "multihost_rl_observer.py"
DOMAIN = "vowels=multihost_domain:VowelsDomain"
CUT_S = 12.0
THROTTLE = "4mbit"  # a version of the test's tiny policy (about 0.6 MB) takes over a second
CHUNK = 128 * 1024  # what nats-py puts in one chunk of an object; a fetch asks for one at a time


def host_config(run: str, h1: Path, creds: Path, url: str) -> str:
    """h1's `reinforge up` config. The learner keeps 10 versions: the one h2 fetches when it
    is cut off must outlive the versions trained meanwhile from rollouts already out."""
    return f"""
nats_url = "{url}"
nats_creds = "{creds}"
stream_replicas = 3

[run]
name = "{run}"
group_size = 4
groups_per_version = 1
max_staleness = 4

[[actors]]
spec = "reinforge.actors.scheduler:Scheduler"
config = {{ domains = {{ vowels = 1.0 }}, domain_specs = ["{DOMAIN}"], max_in_flight = 2 }}

[[actors]]
spec = "reinforge.actors.learner:Learner"
[actors.config]
model = "{h1 / 'model'}"
checkpoint_dir = "{h1 / 'checkpoints'}"
publish_weights = "store"
torch_threads = 1
keep_last = 10
"""


def attach(spec: str, run: str, creds: Path, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "reinforge", "attach", spec, "--run", run,
            "--creds", str(creds)]
    for s in sets:
        argv += ["--set", s]
    return argv


def actor_view(evs: list[dict], actor_type: str) -> dict:
    """The newest heartbeat the observer printed for `actor_type` ({} before the first)."""
    for e in reversed(evs):
        if e["event"] == "progress" and actor_type in e["actors"]:
            return e["actors"][actor_type]
    return {}


def figure(evs: list[dict], actor_type: str, name: str) -> float:
    return actor_view(evs, actor_type).get("figures", {}).get(name, -1.0)


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # renamed or removed meanwhile
        return -1


def version(evs: list[dict]) -> int:
    prog = [e for e in evs if e["event"] == "progress"]
    return prog[-1]["version"] if prog else -1


def partial_model_file(tmp: Path) -> Path | None:
    """The model file a fetch on the host with temp folder `tmp` is writing, or None."""
    return next(tmp.glob("rf-sampler-weights-*/.v*-*/model.safetensors"), None)


def test_an_rl_run_on_three_hosts_without_a_shared_folder_survives_a_cut_mid_transfer(
    netns_lab, tiny_model_dir, tmp_path
):
    run = "rl" + netns_lab.prefix[2:]
    hosts = [(netns_lab.host(i + 1), addr) for i, addr in enumerate(netns_lab.addresses)]
    cluster = NatsCluster.in_namespaces(tmp_path / "nats", hosts, cluster_name=run,
                                        route_tls=True, client_tls=True)
    procs = Procs(tmp_path)
    h = {i: tmp_path / f"h{i}" for i in (1, 2, 3)}
    creds = {}
    # h2 goes through n1 first (then its own n2): a weight fetch crosses its cable.
    prefer = {1: "n1", 2: "n1", 3: "n3"}
    for i, folder in h.items():
        (folder / "home").mkdir(parents=True)
        (folder / "tmp").mkdir()
        c = cluster.credentials(prefer=prefer[i])
        shutil.copy(c.ca_file, folder / "ca.pem")  # each machine its own copy
        creds[i] = folder / "nats.json"
        msgspec.structs.replace(c, ca_file=str(folder / "ca.pem")).write(creds[i])
    for i in (1, 2):  # the starting policy, installed on the learner's and the sampler's host
        shutil.copytree(tiny_model_dir, h[i] / "model")
    (h[1] / "h1.toml").write_text(host_config(run, h[1], creds[1], cluster.credentials(
        prefer="n1").url))

    def on_host(i: int) -> dict:
        others = tuple(h[j] for j in h if j != i) + (tmp_path / "nats", tiny_model_dir.parent)
        env = {"REINFORGE_HOME": str(h[i] / "home"), "TMPDIR": str(h[i] / "tmp"),
               "PYTHONPATH": str(HERE)}
        return {"hostname": f"h{i}", "hidden": others, "env": env}

    obs_out = tmp_path / "observer.log"
    finish = tmp_path / "finish"
    try:
        cluster.start(timeout_s=30)
        procs.start("observer", netns_lab.host(3),
                    [sys.executable, str(OBSERVER), str(creds[3]), run, str(finish), "400"])
        procs.start("h1-up", netns_lab.host(1),
                    [sys.executable, "-m", "reinforge", "up", str(h[1] / "h1.toml")], **on_host(1))
        wait_for(obs_out, lambda ev: actor_view(ev, "learner") and actor_view(ev, "scheduler"),
                 "h1's scheduler and learner", 120, procs)
        procs.start("h2-sampler", netns_lab.host(2), attach(
            "reinforge.actors.sampler:SamplerActor", run, creds[2],
            f"model_path={h[2] / 'model'}", 'domains=["vowels"]', f'extra_domains=["{DOMAIN}"]',
            "max_new_tokens=12", "concurrency=1", "sandbox=false", "weights_poll_s=2"),
            **on_host(2))
        procs.start("h3-verifier", netns_lab.host(3), attach(
            "reinforge.actors.verifier:VerifierActor", run, creds[3], 'domains=["vowels"]',
            f'extra_domains=["{DOMAIN}"]', "sandbox=false"), **on_host(3))

        # The run goes: versions come, and the sampler fetches them from the store.
        wait_for(obs_out, lambda ev: figure(ev, "sampler", "weights_fetched") >= 1,
                 "the sampler's first fetch from the store", 180, procs)
        netns_lab.throttle(2, THROTTLE)
        full = (h[2] / "model" / "model.safetensors").stat().st_size
        assert full > 2 * CHUNK, "the test's policy is too small to be cut mid-file"
        deadline = time.monotonic() + 120
        # Cut while two chunks are still to come: the one already asked for may land after
        # the cut (the request and its answer are in flight), the one after it cannot.
        while not ((part := partial_model_file(h[2] / "tmp"))
                   and 0 < size(part) <= full - 2 * CHUNK):
            assert time.monotonic() < deadline, "no fetch of the model's file seen on h2"
            time.sleep(0.005)
        cut_at = time.monotonic()
        netns_lab.cut(2)
        at_cut = part.stat()
        time.sleep(CUT_S)
        assert 0 <= size(part) < full  # the fetch waits, its file half written
        netns_lab.heal(2)
        healed_version = version(events(obs_out))
        resumed = part.parent.with_name(part.parent.name[1:].split("-")[0]) / part.name

        evs = wait_for(obs_out, lambda ev: version(ev) >= max(healed_version + 2, 3)
                       and figure(ev, "sampler", "policy_version") >= healed_version + 1,
                       "two more versions, served on h2", 180, procs)
        assert time.monotonic() - cut_at > CUT_S
        # The fetch cut in the middle of the model's file went on with that same file.
        assert resumed.stat().st_ino == at_cut.st_ino and resumed.stat().st_size == full
        evs, exited = finish_and_account(procs, obs_out, finish, 60)
    finally:
        procs.kill_all()
        cluster.stop(kill=True)
    # what the store holds of a version: a checkpoint's top-level files (written whole)
    newest = max(int(p.name[1:]) for p in (h[1] / "checkpoints").glob("v*"))
    files = sum(1 for p in (h[1] / "checkpoints" / f"v{newest}").iterdir() if p.is_file())

    final = next(e for e in evs if e["event"] == "final")
    sampler = actor_view(evs, "sampler")
    figs = sampler["figures"]
    # Three copies of the stream and of the weights: the run outlives a node.
    assert (final["stream_replicas"], final["bucket_replicas"]) == (3, 3)
    # The learner on h1 published >= 3 versions, each in the store, its path on h1's disk.
    versions = [w["version"] for w in final["weights"]]
    assert max(versions) >= 3
    assert {w["store"] for w in final["weights"]} == {subjects.weights_bucket(run)}
    assert all(w["path"].startswith(str(h[1])) for w in final["weights"])
    # The sampler on h2 served them, fetched from the store (h1's folder is hidden there),
    # every file of every fetch checked against its SHA-256.
    assert (sampler["host"], actor_view(evs, "learner")["host"]) == ("h2", "h1")
    assert figs["policy_version"] >= 3
    assert figs["weights_fetched"] >= 3
    assert figs["weights_files_checked"] == figs["weights_fetched"] * files
    # One fetch spanned the cut and finished after it, resumed rather than started again:
    # no load failed.
    assert figs["weights_fetch_longest_s"] > CUT_S
    assert figs["weight_load_errors"] == 0
    # Nothing lost or trained twice; no message dead-lettered.
    assert len(final["trained"]) == len(set(final["trained"])) >= 3
    assert final["dead_letters"] == []
    assert exited == {}
