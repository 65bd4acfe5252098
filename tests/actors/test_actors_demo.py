"""A shortened `reinforge demo` end to end: the real cluster, through `reinforge up`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent


@pytest.mark.slow
@pytest.mark.nats
@pytest.mark.podman
@pytest.mark.timeout(900)
def test_a_short_demo_advances_versions_scores_every_domain_and_writes_the_report(
        tmp_path, podman_url):
    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "reinforge", "demo", "--minutes", "4", "--run", "ci-demo",
             "--domains", "math,code,docqa", "--groups-per-batch", "1", "--eval-k", "2",
             "--eval-tasks-per-tier", "2", "--json"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=840,
        )
    finally:  # even after a timeout: leave no cluster, nats-server or sandbox running
        subprocess.run([sys.executable, "-m", "reinforge", "down", "--run", "ci-demo"],
                       env=env, cwd=ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["eval_before"]) == set(result["eval_after"]) == {"math", "code", "docqa"}
    assert result["samples"] > 0
    # code is checked in the sandbox: its checks must have run, not all failed as infra
    code = result["outcomes"]["code"]
    assert sum(n for outcome, n in code.items() if outcome != "infra_error") > 0, code
    assert result["versions"] >= 1, out.stderr[-3000:]
    run_dir = Path(result["run_dir"])
    scored = set()
    for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "scored":
            scored.add(rec["domain"])
    assert scored == {"math", "code", "docqa"}
    report = Path(result["report"])
    assert report.exists() and "reward" in report.read_text().lower()
    assert len(list(report.parent.glob("*.png"))) >= 3
    # the demo's cluster was stopped: nothing of the run is left on this host
    import psutil

    left = []
    for proc in psutil.process_iter(["pid"]):
        try:
            e = proc.environ()
        except (psutil.Error, OSError):
            continue
        if e.get("REINFORGE_RUN") == "ci-demo" and e.get("REINFORGE_HOME") == env["REINFORGE_HOME"]:
            left.append(proc.pid)
    assert left == []


def test_the_demo_names_a_domain_whose_every_check_was_an_infrastructure_error():
    from reinforge.actors.demo import infra_only_domains

    outcomes = {"math": {"pass": 3, "fail": 9}, "code": {"infra_error": 40},
                "docqa": {"fail": 2, "infra_error": 5}}
    assert infra_only_domains(outcomes) == {"code": 40}
