"""A domain plug-in installed for real (pip, its metadata, its entry point in the
`reinforge.domains` group) is listed, samples and scores like a built-in domain."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reinforge.cli import reinforge_argv

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "reinforge-test-adder"
version = "0.1.0"

[project.entry-points."reinforge.domains"]
adder = "reinforge_test_adder:AdderDomain"

[tool.setuptools]
py-modules = ["reinforge_test_adder"]
"""

PLUGIN = '''\
"""A third-party domain: the sum of two integers."""

import json

from reinforge.envs.domain import TaskSpec, Tier, Verdict, check_tier


class AdderDomain:
    name = "adder"
    description = "add two integers"
    resource = "cpu"
    multi_turn = False
    tiers = (Tier(level=0, name="digits", description="two numbers below 10"),
             Tier(level=1, name="hundreds", description="two numbers below 1000"))

    def sample_task(self, rng, tier):
        check_tier(self, tier)
        top = 10 if tier == 0 else 1000
        return self.task_from_row({"a": rng.randrange(top), "b": rng.randrange(top),
                                   "tier": tier}, where="generated")

    def load_tasks(self, path):
        with open(path) as f:
            return [self.task_from_row(json.loads(line), where=f"{path}:{i}")
                    for i, line in enumerate(f, 1) if line.strip()]

    def task_from_row(self, row, *, where):
        a, b = int(row["a"]), int(row["b"])
        return TaskSpec(task_id=f"adder-{a}+{b}", domain=self.name, tier=int(row.get("tier", 0)),
                        prompt=f"What is {a} + {b}? Answer with the number only.",
                        spec={"a": a, "b": b}, reference=str(a + b))

    def prompt(self, task):
        return task.prompt

    async def verify(self, task, completion):
        ok = completion.strip() == str(task.spec["a"] + task.spec["b"])
        return Verdict(reward=float(ok), outcome="pass" if ok else "fail",
                       reason="the sum" if ok else "not the sum")
'''


def install_plugin(tmp_path: Path) -> Path:
    """pip-install the plug-in into a folder of its own, offline, and return that folder.

    `--target` rather than a venv: a venv made from .venv's interpreter with
    --system-site-packages would see the base interpreter's packages, not .venv's reinforge."""
    source = tmp_path / "adder"
    source.mkdir()
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "reinforge_test_adder.py").write_text(PLUGIN)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation",
                    "--no-deps", "--disable-pip-version-check", "-q", "--target", str(site),
                    str(source)], check=True, capture_output=True, timeout=300)
    return site


def reinforge(site: Path, cwd: Path, *args: str) -> str:
    """`reinforge ARGS`' stdout, run by this interpreter with the plug-in's folder on its path."""
    path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run(reinforge_argv(*args), cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_an_installed_plugin_domain_is_listed_and_scores_its_reference_1_and_a_wrong_answer_0(
    tmp_path,
):
    site = install_plugin(tmp_path)
    assert (site / "reinforge_test_adder-0.1.0.dist-info" / "entry_points.txt").is_file()

    listed = json.loads(reinforge(site, tmp_path, "envs", "list", "--json"))["domains"]
    (adder,) = [d for d in listed if d["name"] == "adder"]
    assert adder["description"] == "add two integers"
    assert [t["level"] for t in adder["tiers"]] == [0, 1]

    task = json.loads(reinforge(site, tmp_path, "envs", "sample", "--domain", "adder",
                                "--tier", "1", "-n", "1", "--seed", "7"))
    wrong = str(int(task["reference"]) + 1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**task["spec"], "tier": 1, "completion": c}) + "\n"
                            for c in (task["reference"], wrong)))
    lines = reinforge(site, tmp_path, "verify", "--domain", "adder", str(rows), "--json")
    *scored, summary = [json.loads(line) for line in lines.splitlines()]
    assert [(s["outcome"], s["reward"]) for s in scored] == [("pass", 1.0), ("fail", 0.0)]
    assert (summary["n"], summary["passed"], summary["failed"]) == (2, 1, 1)
