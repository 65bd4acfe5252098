"""`reinforge report`: plots, page and figures from a recorded metrics.jsonl, partial data too."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from reinforge.metrics import writers as mx
from reinforge.actors.monitor import MonitorState
from reinforge.metrics.report import (
    bin_width_s,
    binned,
    build_report,
    counts_per_bin,
    early_late,
    frontier,
)
from reinforge.core import messages as m

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ["reward_pass_rate.png", "eval.png", "eval_heatmap.png", "throughput.png",
             "staleness.png", "tier_mix.png", "processes.png"]


def record_run(path: Path, *, minutes: float = 10.0, evals: bool = True, learner: bool = True,
               domains: tuple[str, ...] = ("math", "code", "docqa"), seed: int = 0) -> None:
    """A run as the monitor records it (its own state and writer, on a synthetic clock):
    pass rates climb, tiers move up, one rollback, docqa never evaluated."""
    rng = random.Random(seed)
    t0 = 1_800_000_000.0
    st = MonitorState("recorded", window_s=60.0, started_at=t0)
    w = mx.JsonlWriter(path)
    w.write({"t": t0, "kind": "start", "run": "recorded"})
    version, step, n = 0, 0, 0
    ev_domains = domains[:2]
    t = t0
    end = t0 + minutes * 60
    while (t := t + rng.uniform(0.2, 0.8)) < end:
        progress = (t - t0) / (end - t0)
        if t - t0 > (version + 1) * 50:  # a new version every ~50 s
            version += 1
            w.write(st.on_weights(m.WeightsPublished(version=version, path=f"/w{version}"), t))
            if learner:
                step += 1
                w.write(st.on_stats(m.TrainStats(
                    version=version, step=step, loss=1.0 / (1 + step),
                    figures={"kl": 0.01 * step, "staleness": rng.choice([0.0, 1.0, 1.5])}), t))
            if evals and version in (1, 6, 11):
                for d in ev_domains:
                    p = min(0.2 + 0.06 * version, 1.0)
                    w.write(st.on_stats(m.EvalStats(version=version, domain=d, pass_at_1=p,
                                                    pass_at_k=min(p + 0.2, 1.0), k=4,
                                                    n_tasks=16), t))
            if version == 7:
                w.write(st.on_weights(m.Rollback(to_version=6, path="/w6", reason="planted"), t))
        d = domains[n % len(domains)]
        n += 1
        tier = min(int(progress * 3 + rng.random()), 3)
        p_pass = 0.2 + 0.8 * progress - 0.05 * tier
        outcome = (m.Outcome.INFRA_ERROR if rng.random() < 0.03
                   else m.Outcome.PASS if rng.random() < p_pass else m.Outcome.FAIL)
        rollout = m.Rollout(rollout_id=f"x{n}:0:1", task_id=f"x{n}", sample_index=0, domain=d,
                            tier=tier, prompt="p", completion="c",
                            output_ids=[0] * rng.randint(5, 40),
                            policy_version=max(version - rng.choice([0, 0, 1, 2]), 0))
        reward = 1.0 if outcome is m.Outcome.PASS else 0.0
        w.write(st.on_scored(m.ScoredRollout(rollout=rollout, reward=reward, outcome=outcome), t))
        if n % 20 == 0:
            for actor, cpu, rss in (("sampler-a1b2", 150.0, 900), ("verifier-c3d4", 40.0, 200),
                                    ("learner-e5f6", 95.0, 1500)):
                st.on_heartbeat(m.Heartbeat(
                    actor_id=actor, actor_type=actor.split("-")[0], host="h", pid=1,
                    started_at=t0,
                    process=m.ProcessFigures(cpu_percent=cpu * rng.uniform(0.8, 1.2),
                                             rss_bytes=int(rss * (1 + progress / 4)) << 20)), t)
            st.set_consumer_queues({"sampler-task_any.pending": float(rng.randint(0, 8))})
            w.write({**msgspec.to_builtins(st.snapshot(t)), "kind": "snapshot"})
    w.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run") / "metrics" / "metrics.jsonl"
    record_run(path)
    return path


# ----------------------------------------------------------------------------- maths


def test_bins_are_round_widths_and_means_per_non_empty_bin():
    assert bin_width_s(10) == 1.0 and bin_width_s(600) == 15.0 and bin_width_s(36000) == 900.0
    pts = [(100.0, 1.0), (100.5, 0.0), (103.2, 1.0)]
    assert binned(pts, 100.0, 2.0) == [(1.0, 0.5, 2), (3.0, 1.0, 1)]
    assert counts_per_bin([100.0, 100.5, 103.2, 999.0], 100.0, 2.0, 3) == [2, 1, 0]


def test_early_and_late_means_take_a_fifth_of_the_series_at_least_one_each():
    assert early_late([0, 0, 1, 1, 1, 1, 1, 1, 1, 1]) == (0.0, 1.0)
    assert early_late([0.5]) == (0.5, 0.5)
    assert early_late([]) == (None, None)


# ----------------------------------------------------------------------------- full report


def test_a_recorded_run_gives_every_plot_the_page_and_the_figures(recorded, tmp_path):
    out = tmp_path / "report"
    report = build_report(recorded, out)
    assert report.run == "recorded"
    assert report.plots == ALL_PLOTS
    for name in ALL_PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    page = (out / "report.md").read_text()
    for name in ALL_PLOTS:
        assert f"]({name})" in page
    assert "| domain | samples |" in page and "| math |" in page and "| sampler |" in page
    assert "domain docqa: no evaluation stats" in report.missing
    assert "## Missing data" in page and "docqa: no evaluation stats" in page

    # the figures agree with the records they came from
    records = list(mx.read_jsonl(recorded))
    scored = [r for r in records if r["kind"] == "scored"]
    fig = report.figures
    assert fig["samples_scored"] == len(scored)
    assert fig["infra_errors"] == sum(r["outcome"] == "infra_error" for r in scored)
    signal = [r for r in scored if r["outcome"] != "infra_error"]
    assert fig["pass_rate"] == pytest.approx(
        sum(r["outcome"] == "pass" for r in signal) / len(signal))
    assert fig["rollbacks"] == 1 and fig["policy_version"] == 11
    assert fig["train_steps"] == 11 and fig["final_loss"] == pytest.approx(1 / 12)
    assert fig["learner_kl"] == pytest.approx(0.11)
    math_ = report.domains["math"]
    assert (math_["eval_first_version"], math_["eval_last_version"]) == (1, 11)
    assert math_["eval_pass_at_1_first"] == pytest.approx(0.26)
    assert math_["eval_pass_at_1_last"] == pytest.approx(0.86)
    passes = [float(r["outcome"] == "pass") for r in signal if r["domain"] == "math"]
    fifth = len(passes) // 5
    assert math_["pass_rate_first"] == pytest.approx(sum(passes[:fifth]) / fifth)
    assert math_["pass_rate_last"] == pytest.approx(sum(passes[-fifth:]) / fifth)
    assert math_["pass_rate_last"] > math_["pass_rate_first"] + 0.3  # the recorded run improves
    assert math_["tier_last"] > math_["tier_first"]
    assert report.processes["learner"]["processes"] == 1
    assert 1500 <= report.processes["learner"]["rss_mib_max"] <= 1500 * 1.25

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["figures"]["samples_scored"] == len(scored)
    assert on_disk["plots"] == ALL_PLOTS and on_disk["missing"] == report.missing


def test_a_run_without_learner_or_evals_still_reports_and_says_what_is_missing(tmp_path):
    path = tmp_path / "m.jsonl"
    record_run(path, minutes=1.0, evals=False, learner=False, domains=("math",))
    report = build_report(path, tmp_path / "out")
    assert "eval.png" not in report.plots
    assert {"reward_pass_rate.png", "throughput.png", "staleness.png", "tier_mix.png",
            "processes.png"} <= set(report.plots)
    assert any("no learner stats" in x for x in report.missing)
    assert any("no evaluation stats" in x for x in report.missing)
    assert report.figures["final_loss"] is None and report.figures["train_steps"] == 0
    page = (tmp_path / "out" / "report.md").read_text()
    assert "### Evaluation before/after per domain\n\n_not drawn" in page


def test_an_empty_metrics_file_gives_a_page_that_says_so_and_no_stale_plots(
    recorded, tmp_path
):
    out = tmp_path / "out"
    build_report(recorded, out)  # an earlier, full report in the same folder
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"t": 5.0, "kind": "start", "run": "r"}\n')
    report = build_report(empty, out, run="r")
    assert report.plots == []
    assert not list(out.glob("*.png"))
    assert any("no scored rollouts" in x for x in report.missing)
    assert report.figures["samples_scored"] == 0 and report.figures["reward_mean"] is None
    assert "_not drawn" in (out / "report.md").read_text()


def test_a_missing_metrics_file_is_an_error_that_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics file at .*nope.jsonl"):
        build_report(tmp_path / "nope.jsonl", tmp_path / "out")


# ----------------------------------------------------------------------------- the command


def test_the_report_command_writes_into_the_run_dir_and_refuses_a_run_without_metrics(
    recorded, tmp_path
):
    home = tmp_path / "home"
    run_metrics = home / "myrun" / "metrics"
    run_metrics.mkdir(parents=True)
    (run_metrics / "metrics.jsonl").write_bytes(recorded.read_bytes())
    env = {"REINFORGE_HOME": str(home), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"}
    cmd = [sys.executable, "-c", "from reinforge.cli.report import register\n"
           "import argparse, sys\n"
           "p = argparse.ArgumentParser(); s = p.add_subparsers(); register(s)\n"
           "from reinforge.cli import UserError\n"
           "a = p.parse_args(sys.argv[1:])\n"
           "try:\n    sys.exit(a.func(a))\n"
           "except UserError as e:\n    print(e, file=sys.stderr); sys.exit(2)\n"]
    ok = subprocess.run([*cmd, "report", "myrun"], capture_output=True, text=True, env=env,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert f"report: {home / 'myrun' / 'report' / 'report.md'}" in ok.stdout
    assert "missing: domain docqa: no evaluation stats" in ok.stdout
    assert sorted(p.name for p in (home / "myrun" / "report").glob("*.png")) == sorted(ALL_PLOTS)
    bad = subprocess.run([*cmd, "report", "nothere"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert bad.returncode == 2
    assert "no metrics file at" in bad.stderr and "nothere" in bad.stderr


def test_the_frontier_sorts_domains_into_learning_mastered_and_out_of_reach():
    def ev(domain, version, p):
        return {"kind": "eval", "t": float(version), "domain": domain, "version": version,
                "pass_at_1": p}

    evals = [ev("a", 1, 0.2), ev("a", 2, 0.95), ev("b", 1, 0.0), ev("b", 2, 0.0),
             ev("c", 1, 0.5), ev("c", 2, 0.4), ev("d", 2, 0.0), ev("d", 1, 0.3)]
    assert frontier(evals) == {"a": "mastered", "b": "out of reach", "c": "learning",
                               "d": "learning"}  # d reached 0.3 once: not out of reach


def test_the_frontier_places_a_domain_answered_with_one_answer_apart_from_mastered():
    def ev(domain, version, p, share):
        return {"kind": "eval", "t": float(version), "domain": domain, "version": version,
                "pass_at_1": p, "figures": {"answer_mode_share": share}}

    # gcd: pass@1 rose to the constant answer's while one answer took over; coin: the
    # same pass@1 with answers that vary by task
    evals = [ev("gcd", 1, 0.1, 0.3), ev("gcd", 2, 0.95, 0.95), ev("coin", 1, 0.5, 0.4),
             ev("coin", 2, 0.95, 0.5), ev("none", 1, 0.0, 1.0)]
    assert frontier(evals) == {"gcd": "one answer", "coin": "mastered", "none": "out of reach"}


def test_a_run_of_forty_domains_gets_a_heatmap_and_a_frontier_table(tmp_path):
    records = [{"kind": "eval", "t": float(v * 100 + d), "domain": f"gym-{d:02d}", "version": v,
                "pass_at_1": 0.0 if d < 3 else min(1.0, d / 40 + v / 10), "pass_at_k": 1.0,
                "k": 2, "n_tasks": 4}
               for v in range(1, 6) for d in range(40) if (v + d) % 2 == 0]  # a rotation
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    report = build_report(path, tmp_path / "report", run="many")
    assert "eval_heatmap.png" in report.plots
    assert (tmp_path / "report" / "eval_heatmap.png").read_bytes().startswith(PNG_MAGIC)
    page = (tmp_path / "report" / "report.md").read_text()
    assert "### Frontier" in page and "| mastered |" in page and "| learning |" in page
    places = [v["frontier"] for v in report.domains.values()]
    assert places.count("out of reach") == 3 and len(places) == 40  # gym-00 .. gym-02


def test_a_domain_with_a_gold_check_gets_proxy_against_gold_by_version(tmp_path):
    path = tmp_path / "metrics" / "metrics.jsonl"
    st = MonitorState("rm", window_s=60.0, started_at=1_800_000_000.0)
    w = mx.JsonlWriter(path)
    for version, reward, gold in ((1, 0.55, 0.6), (5, 0.7, 0.65), (9, 0.9, 0.2)):
        t = 1_800_000_000.0 + 60 * version
        for d, figures in (("rm-synthetic", {"reward_mean": reward, "gold_pass_rate": gold}),
                           ("math", {"reward_mean": 0.5})):
            w.write(st.on_stats(m.EvalStats(version=version, domain=d, pass_at_1=reward,
                                            pass_at_k=reward, k=2, n_tasks=8,
                                            figures=figures), t))
    w.close()
    report = build_report(path, tmp_path / "report")
    rm = report.domains["rm-synthetic"]
    assert (rm["eval_reward_first"], rm["eval_reward_last"]) == (0.55, 0.9)
    assert (rm["eval_gold_first"], rm["eval_gold_last"]) == (0.6, 0.2)
    assert rm["proxy_gold_by_version"] == [[1, 0.55, 0.6], [5, 0.7, 0.65], [9, 0.9, 0.2]]
    assert "eval_gold_first" not in report.domains["math"]  # no gold check there
    assert "proxy_gold.png" in report.plots
    page = Path(report.page).read_text()
    assert "| rm-synthetic | v1 → v9 | 0.55 → 0.9 | 0.6 → 0.2 |" in page


def test_evaluations_after_a_rollback_come_last_though_their_version_numbers_are_lower(
        tmp_path):
    """v4 (epoch 0) is rolled back to v2; the learner goes on from v3 in epoch 1. The last
    evaluation is epoch 1's v3, not v4, the highest number."""
    path = tmp_path / "metrics.jsonl"
    st = MonitorState("rb", window_s=60.0, started_at=1_800_000_000.0)
    w = mx.JsonlWriter(path)
    for i, (epoch, version, p) in enumerate(((0, 2, 0.5), (0, 4, 0.1), (1, 3, 0.6))):
        w.write(st.on_stats(m.EvalStats(version=version, epoch=epoch, domain="math",
                                        pass_at_1=p, pass_at_k=p, k=2, n_tasks=8),
                            1_800_000_000.0 + 60 * i))
    w.close()
    report = build_report(path, tmp_path / "report")
    math_ = report.domains["math"]
    assert (math_["eval_first_version"], math_["eval_pass_at_1_first"]) == (2, 0.5)
    assert (math_["eval_last_version"], math_["eval_pass_at_1_last"]) == (3, 0.6)
    assert "eval_heatmap.png" in report.plots
