"""Pure parts of the sandbox: config checks, tars, cache keys, stream framing, and how a task's
end is classified (on an exec played back by a fake container). No Podman."""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from reinforge.envs.sandbox.box import (
    LABELS_ENV,
    PROTECTED_SHELL,
    LimitMechanism,
    RunStatus,
    Sandbox,
    SandboxConfig,
    _frames,
    default_podman_url,
    labels_from_env,
    make_tar,
)
from reinforge.envs.sandbox.batch import run_batch
from reinforge.envs.sandbox.pool import Job, PoolConfig


def test_config_rejects_nonsense_limits_naming_the_field():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="pids_limit"):
        SandboxConfig(pids_limit=0)
    with pytest.raises(ValueError, match="work_dir"):
        SandboxConfig(work_dir="/etc")
    with pytest.raises(ValueError, match="size"):
        PoolConfig(size=0)


def test_make_tar_keeps_contents_and_makes_dirs_wipeable():
    data = make_tar({"a/b/c.py": "print(1)", "run.sh": "#!/bin/sh\necho", "bin": b"\x00\xff"})
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert tar.extractfile("a/b/c.py").read() == b"print(1)"
        assert tar.extractfile("bin").read() == b"\x00\xff"
    assert members["a"].isdir() and members["a"].mode == 0o777
    assert members["run.sh"].mode == 0o755 and members["a/b/c.py"].mode == 0o644


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", ""])
def test_make_tar_refuses_paths_outside_the_work_dir(name):
    with pytest.raises(ValueError, match="relative path"):
        make_tar({name: "x"})


def test_cache_key_changes_with_code_tests_command_and_image_only():
    job = Job(files={"sol.py": "a", "test.py": "b"}, argv=["python3", "test.py"])
    same = Job(files={"test.py": "b", "sol.py": "a"}, argv=["python3", "test.py"])
    assert job.cache_key("img:1") == same.cache_key("img:1")
    assert job.cache_key("img:1") != job.cache_key("img:2")
    for other in (
        Job(files={"sol.py": "A", "test.py": "b"}, argv=["python3", "test.py"]),
        Job(files={"sol.py": "a", "test.py": "b"}, argv=["python3", "-O", "test.py"]),
        Job(files={"sol.py": "a", "test.py": "b"}, argv=["python3", "test.py"], stdin=b"1"),
    ):
        assert other.cache_key("img:1") != job.cache_key("img:1")


def test_frames_are_demultiplexed_in_order():
    raw = io.BytesIO(b"\x01\x00\x00\x00\x00\x00\x00\x02hi" + b"\x02\x00\x00\x00\x00\x00\x00\x03err")
    assert list(_frames(raw)) == [(1, b"hi"), (2, b"err")]


def test_podman_url_env_var_overrides_the_convention(monkeypatch):
    monkeypatch.setenv("REINFORGE_PODMAN_URL", "unix:///somewhere/podman.sock")
    assert default_podman_url() == "unix:///somewhere/podman.sock"
    monkeypatch.delenv("REINFORGE_PODMAN_URL")
    assert default_podman_url().endswith("/podman/podman.sock")


def test_sandbox_labels_come_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv(LABELS_ENV, "job=17, team = rl ,")
    assert labels_from_env() == {"job": "17", "team": "rl"}
    monkeypatch.setenv(LABELS_ENV, "job=17,oops")
    with pytest.raises(ValueError, match="'oops' is not key=value"):
        labels_from_env()


class Played(NamedTuple):
    """What one task's part of an exec does, as `FakeContainer` plays it back."""

    ran_s: float = 0.1
    status: int = 0
    stdout: bytes = b""
    stderr: bytes = b""


class FakeContainer:
    """Podman's exec API for one container, as far as a task's exec uses it, with the exec's
    wrapper played back: per task, its start marker, `ran_s` seconds on the sandbox's clock, its
    output and its end markers, in frames of `frame_bytes`. No Podman: durations are exact, so
    the rules at the deadline are checked exactly (a real run can't end 10 ms before its
    deadline on demand)."""

    id = name = "fake"
    status = "running"

    def __init__(self, monkeypatch, tasks: list[Played], frame_bytes: int):
        self.client = self
        self.tasks = tasks
        self.frame_bytes = frame_bytes
        self.skew = 0.0
        self.pending = b""
        real = time.monotonic
        monkeypatch.setattr(time, "monotonic", lambda: real() + self.skew)

    def post(self, url, data, **_):
        if url.endswith("/exec"):
            env = dict(e.split("=", 1) for e in json.loads(data)["Env"])
            count = sum(bool(re.fullmatch(r"RF_M\d+", k)) for k in env)
            self.marks = [env.get("RF_MARK") or env[f"RF_M{i}"] for i in range(max(count, 1))]
            self.frames = self.playback()
            return SimpleNamespace(raise_for_status=lambda: None, json=lambda: {"Id": "exec"})
        return SimpleNamespace(raise_for_status=lambda: None, raw=self, close=lambda: None)

    def reload(self) -> None:  # its state is `status`: running
        pass

    def read(self, n: int) -> bytes:  # the exec's multiplexed stream, played as it is read
        if not self.pending:
            self.pending = next(self.frames, b"")
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def playback(self):
        for mark, task in zip((m.encode() for m in self.marks), self.tasks, strict=True):
            yield from self.frames_of(1, mark + b"\n")
            self.skew += task.ran_s
            yield from self.frames_of(1, task.stdout + b"\n%s %d\n" % (mark, task.status))
            yield from self.frames_of(2, task.stderr + b"\n%s\n" % mark)

    def frames_of(self, stream: int, data: bytes):
        for at in range(0, len(data), self.frame_bytes):
            chunk = data[at : at + self.frame_bytes]
            yield bytes([stream, 0, 0, 0]) + len(chunk).to_bytes(4, "big") + chunk


def fake_box(monkeypatch, tasks: list[Played], *, frame_bytes: int = 65536) -> Sandbox:
    fake = FakeContainer(monkeypatch, tasks, frame_bytes)
    config = SandboxConfig(timeout_s=2.0, exec_reap_s=0)
    return Sandbox(
        fake, fake, config, uid=20001, limits=LimitMechanism.RLIMIT, shell=PROTECTED_SHELL
    )


def test_each_tasks_output_and_status_are_cut_at_its_markers_however_the_stream_is_chunked(
    monkeypatch,
):
    played = [
        Played(status=0, stdout=b"o0", stderr=b"e0\n"),
        Played(status=3, stdout=b"\n" * 40 + b"reinforge-", stderr=b""),
    ]
    box = fake_box(monkeypatch, played, frame_bytes=3)
    results = run_batch(box, [Job(argv=["a"]), Job(argv=["b"])])
    assert [(r.exit_code, r.stdout, r.stderr) for r in results] == [
        (0, b"o0", b"e0\n"),
        (3, b"\n" * 40 + b"reinforge-", b""),
    ]
    assert [r.stdout_bytes for r in results] == [2, 50]


@pytest.mark.parametrize(
    ("ran_s", "status"), [(1.99, RunStatus.TIMEOUT), (1.0, RunStatus.NONZERO_EXIT)]
)
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batch"])
def test_a_sigkill_at_the_deadline_is_a_timeout_in_a_batch_as_in_a_single_run(
    monkeypatch, batched, ran_s, status
):
    # rlimit mode: RLIMIT_CPU ends in SIGKILL, which only its timing tells from the candidate's own
    if batched:
        box = fake_box(monkeypatch, [Played(), Played(ran_s=ran_s, status=137)])
        first, result = run_batch(box, [Job(argv=["true"]), Job(argv=["spin"])])
        assert first.ok
    else:
        box = fake_box(monkeypatch, [Played(ran_s=ran_s, status=137)])
        result = box.run_task({}, ["spin"])
    assert (result.status, result.exit_code) == (status, 137)
    assert result.timed_out is (status is RunStatus.TIMEOUT)


@pytest.mark.parametrize("closed", [EOFError(), BrokenPipeError(32, "Broken pipe")])
def test_unit_fake_pipes_a_session_whose_sandbox_is_gone_says_it_died_however_the_pipe_ends(
        closed):
    """Whether the request's write or its read finds the killed container first is a race:
    either way the episode is told the sandbox died (an infrastructure error)."""
    from reinforge.envs.sandbox.box import LimitMechanism
    from reinforge.envs.sandbox.session import SandboxSession, SessionEnded

    class GonePipes:  # a stand-in for the attached exec's pipes, closed under us
        def send(self, data: bytes) -> None:
            if isinstance(closed, BrokenPipeError):
                raise closed

        def read_frame(self, deadline: float) -> bytes:
            raise EOFError

        def close(self) -> None:
            pass

    box = SimpleNamespace(name="rf-sandbox-x", limits=LimitMechanism.CGROUP, host_uid=None,
                          config=SimpleNamespace(memory_poll_s=0.1), alive=lambda: False,
                          kill=lambda: None)
    session = SandboxSession(box, GonePipes(), {})
    with pytest.raises(SessionEnded) as ended:
        session.request({"op": "run"}, timeout_s=1.0)
    assert ended.value.infra and "died" in str(ended.value), ended.value
