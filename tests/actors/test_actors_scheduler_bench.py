"""bench/scheduler.py: what it times is the scheduler, not the memory tracer beside it."""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

from reinforge.actors.scheduler import Scheduler

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scheduler.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_scheduler", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timed_batches_run_without_tracemalloc_and_memory_is_still_measured(
        monkeypatch, tmp_path):
    traced_calls: list[bool] = []
    plan = Scheduler._plan

    def recording_plan(self, now):
        traced_calls.append(tracemalloc.is_tracing())
        return plan(self, now)

    monkeypatch.setattr(Scheduler, "_plan", recording_plan)
    row = load_bench().measure(n_domains=5, batch=4, repeats=3, tmp=str(tmp_path))
    # one traced batch for the peak, then the three timed ones untraced
    assert traced_calls == [True, False, False, False]
    assert row["domains"] == 5 and row["peak_mib"] > 0 and row["plan_batch_ms"] > 0
