"""Pure parts of the sandbox: config checks, tars, cache keys, stream framing. No Podman."""

from __future__ import annotations

import io
import tarfile

import pytest

from reinforge.envs.sandbox import (
    LABELS_ENV,
    SandboxConfig,
    _end_status,
    _frames,
    default_podman_url,
    labels_from_env,
    make_tar,
)
from reinforge.envs.sandbox_pool import Job, PoolConfig


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


def test_end_marker_parsing_gives_status_and_length():
    assert _end_status(b"out\nMARK 3\n", b"MARK") == (3, 8)
    assert _end_status(b"out\nMARK x\n", b"MARK") is None
    assert _end_status(b"out", b"MARK") is None


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
