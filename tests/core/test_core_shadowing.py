"""No folder of the checkout shadows an installed distribution, however the project runs
code from the repository root: `python -m reinforge`, the `reinforge` script, the actor
children of `reinforge up`, and `python -m pytest` (what `make test` runs).

The folder that broke a fresh machine: `kernels/` shadowed Hugging Face's `kernels`
distribution, which transformers 5 imports, so every model import failed. Each entry point
here starts an actor whose module imports transformers' Qwen2 and Llama models
(`shadow_probe.py`) and reports where `kernels` came from.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
PROBE = "tests/core/shadow_probe.py:ModelImportingActor"  # relative: run from ROOT


@pytest.fixture
def installed_kernels() -> Path:
    """The `kernels` distribution's package folder: these tests mean nothing without it."""
    dist = importlib.metadata.distribution("kernels")  # transformers depends on it: locked
    return Path(dist.locate_file("kernels")).resolve()


def from_root_env(tmp_path: Path, creds_file: Path, run: str) -> dict[str, str]:
    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    for careful in ("PYTHONSAFEPATH", "REINFORGE_NATS_CREDS"):  # a user's plain shell
        env.pop(careful, None)
    env.update(PROBE_NATS_CREDS=str(creds_file), PROBE_RUN=run,
               PROBE_STARTED_FILE=str(tmp_path / "started"))
    return env


def wait_for_file(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"the probe actor did not start (exit {proc.poll()}):\n"
                         f"{log.read_text(errors='replace')[-3000:]}")


@pytest.mark.parametrize("launcher", ["python -m reinforge", "reinforge"])
def test_an_actor_importing_transformers_models_starts_from_the_repo_root(
        launcher, installed_kernels, creds_file, run_name, tmp_path):
    argv = ([sys.executable, "-m", "reinforge"] if launcher == "python -m reinforge"
            else [str(Path(sys.executable).parent / "reinforge")])
    started = tmp_path / "started"
    log = tmp_path / "probe.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*argv, "actor", "run", PROBE, "--run", run_name, "--creds", str(creds_file),
             "--set", f"started_file={started}"],
            cwd=ROOT, env=from_root_env(tmp_path, creds_file, run_name),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        origin = wait_for_file(started, proc, log, timeout_s=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert Path(origin).resolve().parent == installed_kernels


def test_reinforge_up_from_the_repo_root_starts_actor_children_that_import_models(
        installed_kernels, creds_file, run_name, tmp_path):
    started = tmp_path / "started"
    config = tmp_path / "probe.toml"
    config.write_text(f'[[actors]]\nspec = "{PROBE}"\n'
                      f'config = {{ started_file = "{started}" }}\n')
    env = from_root_env(tmp_path, creds_file, run_name)

    def reinforge(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reinforge", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    try:
        up = reinforge("up", str(config), "--run", run_name, "--detach", "--json")
        assert up.returncode == 0, up.stderr[-4000:]
        actors = json.loads(up.stdout.strip().splitlines()[-1])["actors"]
        assert [a["type"] for a in actors] == ["model-probe"]
        assert actors[0]["capabilities"] == ["imports Qwen2ForCausalLM and LlamaForCausalLM"]
    finally:
        reinforge("down", "--run", run_name)
    assert Path(started.read_text()).resolve().parent == installed_kernels


@pytest.mark.smoke
def test_python_m_pytest_from_the_repo_root_imports_models_and_starts_an_actor(
        installed_kernels, creds_file, run_name, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/core/shadow_probe.py"],
        cwd=ROOT, env=from_root_env(tmp_path, creds_file, run_name),
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "1 passed" in out.stdout
    started = tmp_path / "started"
    assert Path(started.read_text()).resolve().parent == installed_kernels


def test_a_bare_python_at_the_repo_root_imports_models_without_importing_reinforge(
        installed_kernels, tmp_path):
    # `python -c` puts the checkout root first on sys.path and nothing of ours runs before
    # transformers: before, `kernels/` was found as `kernels` and the import failed with
    # "cannot import name 'CUDAProperties' from 'kernels'". The folder now hands the name over.
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)
    out = subprocess.run(
        [sys.executable, "-c", "from transformers import LlamaForCausalLM, Qwen2ForCausalLM\n"
         "import kernels, reinforge.kernels as ours\n"
         "print(kernels.__file__); print(ours.__name__)"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs, ours = out.stdout.split()
    assert (Path(theirs).resolve().parent, ours) == (installed_kernels, "reinforge.kernels")
