"""core.atomic: the one writer of small files that must never be seen half-written."""

import json
import stat

import pytest
from reinforge.core.atomic import write_atomic, write_json_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "state.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_mode_is_the_one_asked_for(tmp_path):
    target = tmp_path / "secret.json"
    write_json_atomic(target, {"user": "u", "password": "p"}, mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert json.loads(target.read_text()) == {"user": "u", "password": "p"}
