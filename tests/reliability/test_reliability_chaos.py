"""`bench/chaos.py` in CI: every fault kind injected once, one at a time, into a real
cluster (`reinforge up`), then the ledger's accounting check."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.nats, pytest.mark.timeout(1200)]

ROOT = Path(__file__).parent.parent.parent


def test_every_fault_kind_recovers_and_no_task_is_lost_or_counted_twice(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from chaos import KINDS
    finally:
        sys.path.remove(str(ROOT / "bench"))
    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    try:
        out = subprocess.run(
            [sys.executable, "bench/chaos.py", "--json", "--faults", str(len(KINDS)),
             "--run", "ci-chaos", "--gap-min", "2", "--gap-max", "6", "--stall", "8"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=1100,
        )
    finally:  # even after a timeout: leave no cluster, nats-server or sandbox running
        subprocess.run([sys.executable, "-m", "reinforge", "down", "--run", "ci-chaos"],
                       env=env, cwd=ROOT, capture_output=True, timeout=120)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kinds"] == sorted(KINDS), (result, out.stderr[-3000:])
    assert result["not_recovered"] == [], out.stderr[-3000:]
    assert result["faults_injected"] == len(KINDS)
    assert result["drained"], out.stderr[-3000:]
    assert result["lost"] == 0, result["lost_examples"]
    assert result["double_counted"] == 0
    assert result["tasks_issued"] == result["trained"] + result["dropped_with_reason"]
    assert result["trained"] >= 1 and result["versions"] >= 1
    assert out.returncode == 0
