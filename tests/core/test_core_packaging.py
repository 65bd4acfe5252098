"""`pip install .` (not only the editable install) gives one package, `reinforge`, whole."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent


@pytest.mark.slow
def test_a_built_wheel_installs_every_layer_under_one_package(tmp_path):
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(tmp_path / "whl"), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "whl").glob("reinforge-*.whl"))
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = (
        "import reinforge.core.actor, reinforge.actors.learner, reinforge.rl.grpo, "
        "reinforge.envs.domain, reinforge.engine.server, reinforge.kernels.paged_kv, "
        "importlib.resources as r\n"
        "import reinforge.core.actor as a; print(a.__file__)\n"
        "print(r.files('reinforge.envs.domains').joinpath('code_harness.py').is_file())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0].startswith(str(target)) and lines[1] == "True"
    assert not (target / "core").exists() and not (target / "kernels").exists()
