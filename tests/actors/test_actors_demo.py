"""A shortened `reinforge demo` end to end: the real cluster, through `reinforge up`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
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
             "--model", "tiny", "--domains", "math,code,docqa", "--groups-per-version", "1",
             "--eval-k", "2",
             "--eval-tasks-per-tier", "2", "--guard-every", "10", "--json"],
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
    # every tier held out (math has 5, code and docqa 4; 2 tasks each), compared pairwise
    assert {d: c["n_tasks"] for d, c in result["changes_all_tiers"].items()} == \
        {"math": 10, "code": 8, "docqa": 8}
    # the headline compares the tiers the run trained, in every domain it trained: math
    # always has groups with signal. Code and docqa may have none: the tiny policy passed 0
    # of 1064 docqa samples in one CI run, and in another 383 of 664 code samples, but every
    # one of its 166 code groups all passed or all failed (it answers each task one way), so
    # GRPO had nothing to train on there either
    trained = set(result["trained_groups"])
    assert {"math"} <= trained <= {"math", "code", "docqa"}
    assert set(result["changes"]) == set(result["trained_tiers"]) == trained
    for d, change in result["changes"].items():
        assert change["n_tasks"] == 2 * len(result["trained_tiers"][d])
        assert sorted(map(int, result["trained_groups"][d])) == result["trained_tiers"][d]
    assert {d: len(c) for d, c in result["changes_by_tier"].items()} == \
        {"math": 5, "code": 4, "docqa": 4}
    lo, hi = result["improvement_ci95"]
    assert lo <= result["improvement"] <= hi
    # the answer prior of every trained domain verified in-process (code's is in a sandbox)
    assert set(result["answer_prior"]) == trained
    assert {d for d in trained if "prior_pass_at_1" in result["answer_prior"][d]} == \
        trained - {"code"}
    assert result["improvement_beyond_prior"]["n_tasks"] == \
        sum(c["n_tasks"] for c in result["changes"].values())
    # the forgetting guard ran inside the run, and the learner reported the mismatch
    assert [v for v in result["guard"]["versions_evaluated"] if v > 0], result["guard"]
    assert result["logp_mismatch"]["steps"] >= 1
    assert result["logp_mismatch"]["tis_weight_mean_median"] > 0
    assert result["versions"] >= 1, out.stderr[-3000:]
    run_dir = Path(result["run_dir"])
    scored, start_evals = set(), {}
    for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "scored":
            scored.add(rec["domain"])
        if rec.get("kind") == "eval" and rec["version"] == 0:  # the SFT start, offline
            start_evals[rec["domain"]] = rec["figures"]["answer_mode_share"]
    assert scored == {"math", "code", "docqa"}
    # the report's frontier reads each offline evaluation's modal answer share
    assert set(start_evals) == {"math", "code", "docqa"}
    # (the answer prior covers the trained domains: docqa's only when it was trained)
    assert {d: round(start_evals[d], 4) for d in result["answer_prior"]} == \
        {d: prior["modal_answer_share"][0] for d, prior in result["answer_prior"].items()}
    report = Path(result["report"])
    assert report.exists() and "reward" in report.read_text().lower()
    assert len(list(report.parent.glob("*.png"))) >= 3
    # the sampler's and the guard's own rollout servers logged beside their actors
    assert sorted(p.name for p in (run_dir / "logs").glob("*-rollout-server.log")) == \
        ["evaluator-ci-demo-0-rollout-server.log", "sampler-ci-demo-0-rollout-server.log"]
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
    from reinforge.cli.demo import infra_only_domains

    outcomes = {"math": {"pass": 3, "fail": 9}, "code": {"infra_error": 40},
                "docqa": {"fail": 2, "infra_error": 5}}
    assert infra_only_domains(outcomes) == {"code": 40}


def test_the_demo_summarises_the_guard_and_the_logprob_mismatch_from_the_metrics(tmp_path):
    from reinforge.cli.demo import guard_summary, logp_mismatch_summary

    def train(step, mean, mx, share, **tis):
        return {"kind": "train", "version": step, "step": step, "loss": 0.0, "figures": {
            "logp_mismatch_mean_nats": mean, "logp_mismatch_max_nats": mx,
            "logp_mismatch_share_over": share, "logp_mismatch_threshold_nats": 0.1,
            "ratio_mean": 1.0, "clip_frac": 0.0, **tis}}

    def evaluation(version, domain, p1):
        return {"kind": "eval", "version": version, "domain": domain, "pass_at_1": p1}

    metrics = tmp_path / "metrics.jsonl"
    records = [train(1, 0.02, 0.3, 0.05, tis_weight_mean=1.01, tis_capped_share=0.0),
               evaluation(3, "math", 0.4),
               {"kind": "rollback", "to_version": 2, "reason": "version 3 regressed: ..."},
               train(2, 0.04, 0.6, 0.15, tis_weight_mean=0.99, tis_capped_share=0.02),
               evaluation(6, "math", 0.5), train(3, 0.03, 0.2, 0.10, tis_weight_mean=1.0,
                                                   tis_capped_share=0.01)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    m = logp_mismatch_summary(metrics)
    assert m["steps"] == 3 and m["max_nats"] == 0.6
    assert m["mean_nats_median"] == 0.03 and m["share_over_threshold_median"] == 0.1
    assert m["tis_weight_mean_median"] == 1.0 and m["tis_capped_share_median"] == 0.01
    assert guard_summary(metrics) == {"versions_evaluated": [3, 6], "rollbacks": 1,
                                      "rollback_reasons": ["version 3 regressed: ..."],
                                      "last_pass_at_1": {"math": 0.5}}
    assert logp_mismatch_summary(tmp_path / "none.jsonl") == {"steps": 0}


def test_the_demo_knows_the_tier_of_each_held_out_task_and_the_groups_it_trained(tmp_path):
    from reinforge.cli.demo import heldout_tiers, trained_groups

    tiers = heldout_tiers(["math", "code"], 3)
    assert sorted(tiers["math"].values()) == sorted(list(range(5)) * 3)
    assert sorted(tiers["code"].values()) == sorted(list(range(4)) * 2)  # capped at 2
    assert all(t.startswith("heldout-") for t in tiers["math"])
    metrics = tmp_path / "metrics.jsonl"
    scored = lambda d, tier, task, purpose="train": {
        "kind": "scored", "domain": d, "tier": tier, "task_id": task, "purpose": purpose}
    decided = lambda d, task, fate: {"kind": "decision", "domain": d, "task_id": task,
                                     "fate": fate, "version": 1}
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        scored("math", 0, "m0@1"), scored("math", 2, "m2@1"), scored("math", 3, "m3@1"),
        scored("math", 4, "heldout-m4", "eval"), scored("code", 1, "c1@1"),
        scored("math", 2, "m2@2"),
        decided("math", "m0@1", "accepted"), decided("math", "m0@1", "trained"),
        decided("math", "m2@1", "trained"), decided("math", "m3@1", "no_signal"),
        decided("math", "m2@2", "trained"), decided("code", "c1@1", "trained")]))
    # tier 3 was sampled, but its only group had no signal: nothing of it was trained
    assert trained_groups(metrics) == {"code": {1: 1}, "math": {0: 1, 2: 2}}


def test_the_demo_headline_weights_each_tier_by_the_groups_trained_on_it():
    from reinforge.cli.demo import tier_changes, trained_change

    tier_of = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 2}
    before = {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.5, "e": 0.0}
    after = {"a": 1.0, "b": 0.5, "c": 0.5, "d": 1.0, "e": 1.0}
    by_tier = tier_changes(before, after, tier_of)
    assert {t: c.delta for t, c in by_tier.items()} == {0: 0.0, 1: 0.5, 2: 1.0}
    # tier 0: 1 group trained, tier 1: 3; tier 2 never trained, so it is left out
    headline = trained_change(by_tier, {0: 1, 1: 3})
    assert headline.delta == pytest.approx(0.375) and headline.n_tasks == 4
    # against the constant answer where it beats the start: it passes c and d
    beyond = tier_changes(before, after, tier_of, {"c": 1.0, "d": 1.0})
    assert beyond[1].delta == pytest.approx(-0.25) and beyond[0].delta == 0.0


def test_the_demo_reports_the_training_reward_at_the_start_and_the_end(tmp_path):
    from reinforge.cli.demo import train_reward_start_end

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "scored", "domain": "math", "purpose": "train", "outcome": "fail",
             "reward": 0.0}] * 3 + [{"kind": "scored", "domain": "math", "purpose": "train",
                                     "outcome": "pass", "reward": 1.0}] * 3
    rows.append({"kind": "scored", "domain": "math", "purpose": "train",
                 "outcome": "infra_error", "reward": 0.0})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_reward_start_end(metrics, n=4) == {"math": [0.25, 0.75]}


def test_the_suite_summary_counts_improved_domains_the_mean_and_the_worst_drop():
    from reinforge.cli.demo import suite_summary
    from reinforge.rl.scoring import Change

    def change(delta):
        return Change(delta=delta, ci95=(delta - 0.1, delta + 0.1), n_tasks=4)

    changes = {"gym-a": change(0.25), "gym-b": change(0.10), "gym-c": change(-0.05),
               "gym-d": change(0.0)}
    s = suite_summary(changes, {"gym-e": "a tier-0 prompt of 900 tokens (over 768)"})
    assert (s["domains"], s["improved_by_0_10"], s["worse_by_0_05"]) == (4, 2, 1)
    assert s["mean_change"] == pytest.approx(0.075)
    assert s["worst_drop"] == {"domain": "gym-c", "delta": -0.05}
    assert s["left_out"] == {"gym-e": "a tier-0 prompt of 900 tokens (over 768)"}
    assert "improved_by_0_10_beyond_prior" not in s
    # gym-a's gain was the constant answer's: beyond the prior only gym-b's counts
    beyond = {"gym-a": change(0.0), "gym-b": change(0.10), "gym-c": change(-0.05)}
    assert suite_summary(changes, {}, beyond)["improved_by_0_10_beyond_prior"] == 1


def test_the_suite_summary_names_the_falls_the_test_on_the_counts_finds():
    from reinforge.cli.demo import change_and_fall, suite_summary

    def evaluation(**domains):  # `reinforge eval --json`'s shape: (passed, verified) a task
        return {"domains": {d: {"task_pass_at_1": {t: c / n for t, (c, n) in ts.items()},
                                "task_counts": {t: [c, n] for t, (c, n) in ts.items()}}
                            for d, ts in domains.items()}}

    four = [f"t{i}" for i in range(4)]
    before = evaluation(gym_a=dict.fromkeys(four, (2, 2)), gym_b={"t0": (2, 2), "t1": (0, 2)},
                        gym_c=dict.fromkeys(four, (0, 2)))
    after = evaluation(gym_a=dict.fromkeys(four, (0, 2)), gym_b={"t0": (0, 2), "t1": (0, 2)},
                       gym_c=dict.fromkeys(four, (1, 2)))
    changes, falls = {}, {}
    for d in before["domains"]:
        changes[d], falls[d] = change_and_fall(before, after, d)
    s = suite_summary(changes, {}, falls=falls)
    # gym_a fell from 8 of 8 to 0 of 8: p = (1/6)**4; gym_b's one task of 2 samples: p = 1/6
    assert s["worse_by_0_05"] == 2
    assert s["worse_by_0_05_significant"] == {"gym_a": 0.0008}
    assert s["fall_p_values"] == {"gym_a": 0.0008, "gym_b": 0.1667}
    assert "worse_by_0_05_significant" not in suite_summary(changes, {})


def test_the_demo_names_the_domains_whose_policy_collapsed_onto_one_answer():
    from reinforge.cli.demo import answer_prior_json, collapsed_domains
    from reinforge.rl.scoring import COLLAPSED_MODE_SHARE
    from reinforge.rl.scoring import Change

    def ev(**shares):
        return {"domains": {d: {"answer_mode_share": v, "prior_pass_at_1": 0.3}
                            for d, v in shares.items()}}

    before = ev(gcd=0.25, aiw=0.4, sure=0.9)
    after = ev(gcd=0.95, aiw=0.35, sure=0.95)
    assert COLLAPSED_MODE_SHARE == 0.8
    # "sure" gave one answer before RL already: not RL's doing
    assert collapsed_domains(before, after) == ["gcd"]
    beyond = {"gcd": Change(delta=-0.1, ci95=(-0.2, 0.0), n_tasks=20)}
    assert answer_prior_json(before, after, beyond) == {"gcd": {
        "modal_answer_share": [0.25, 0.95], "prior_pass_at_1": 0.3,
        "beyond_prior": {"delta": -0.1, "ci95": [-0.2, 0.0], "n_tasks": 20}}}


def test_the_suite_takes_the_gym_families_whose_prompts_fit_and_says_why_others_do_not(
        tmp_path, monkeypatch):
    from reinforge.cli.demo import suite_domains

    monkeypatch.setenv("REINFORGE_HOME", str(tmp_path))
    domains, with_reference, left_out = suite_domains(max_prompt_tokens=768)
    assert len(domains) + len(left_out) >= 100 and len(domains) >= 80
    assert set(with_reference) <= set(domains) and "gym-boxnet" not in with_reference
    assert all(why.startswith("a tier-0 prompt of ") or " s to make one tier-0 task" in why
               for why in left_out.values())
    assert "gym-sokoban" in left_out  # about 9 s a task


def test_the_demos_kl_coefficient_and_lora_rank_reach_the_learners_config(tmp_path):
    import argparse

    from reinforge.cli.demo import cluster_config, register
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    for argv, want in ((["demo"], 0.0), (["demo", "--kl-coef", "0.05"], 0.05)):
        args = parser.parse_args(argv)
        config.write_text(cluster_config("kl", tmp_path, tmp_path / "sft", ["math"], args))
        learner, = [a for a in load_cluster_config(config).actors
                    if a.spec.endswith(":Learner")]
        assert learner.config["kl_coef"] == want
        assert "lora" not in learner.config
    config.write_text(cluster_config("kl", tmp_path, tmp_path / "sft", ["math"],
                                     parser.parse_args(["demo", "--lora-rank", "8"])))
    learner, = [a for a in load_cluster_config(config).actors if a.spec.endswith(":Learner")]
    assert learner.config["lora"] == {"r": 8, "alpha": 16.0}


def test_the_suite_anchors_the_domains_at_stake_and_the_flag_sets_or_ends_it(tmp_path):
    """The domains whose start passes something on the guard's tasks anchor the suite's
    learner at `SUITE_ANCHOR_KL_COEF`; `--anchor-kl-coef 0` turns it off, and the other demos
    anchor nothing unless told."""
    import argparse

    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    guard_start = {"domains": {"gym-aiw": {"pass_at_1": 0.25}, "gym-ab": {"pass_at_1": 0.0},
                               "gym-gcd": {"pass_at_1": 0.0625}}}
    assert demo.domains_at_stake(guard_start) == ["gym-aiw", "gym-gcd"]
    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    for argv, want in ((["demo", "--suite", "gym"], demo.SUITE_ANCHOR_KL_COEF),
                       (["demo", "--suite", "gym", "--anchor-kl-coef", "0"], None),
                       (["demo"], None), (["demo", "--anchor-kl-coef", "0.5"], 0.5)):
        config.write_text(demo.cluster_config(
            "a", tmp_path, tmp_path / "sft", ["gym-aiw", "gym-ab", "gym-gcd"],
            parser.parse_args(argv), anchor_domains=demo.domains_at_stake(guard_start)))
        learner, = [a for a in load_cluster_config(config).actors
                    if a.spec.endswith(":Learner")]
        assert learner.config.get("anchor_kl_coef") == want, argv
        assert learner.config.get("anchor_domains") == (
            None if want is None else ["gym-aiw", "gym-gcd"])
    assert demo.SUITE_ANCHOR_KL_COEF > 0


def test_the_policys_defaults_reach_the_learner_from_the_command_line_as_parsed(tmp_path):
    """A config written from the parsed command line (as `reinforge demo` and the benches
    do) takes each unset setting from one table: the tiny policy's or a pretrained one's."""
    import argparse

    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    for argv, lr, groups in (
            (["demo", "--model", "tiny"], demo.TINY_LEARNING_RATE, demo.TINY_GROUPS_PER_VERSION),
            (["demo"], demo.PRETRAINED_LEARNING_RATE, demo.PRETRAINED_GROUPS_PER_VERSION),
            (["demo", "--model", "wide", "--learning-rate", "0.5", "--groups-per-version", "3"],
             0.5, 3)):
        args = parser.parse_args(argv)
        config.write_text(demo.cluster_config("p", tmp_path, tmp_path / "sft", ["math"], args))
        loaded = load_cluster_config(config)
        learner, = [a for a in loaded.actors if a.spec.endswith(":Learner")]
        assert (learner.config["learning_rate"], loaded.run.groups_per_version) == (lr, groups)
    assert demo.TINY_GROUPS_PER_VERSION != demo.PRETRAINED_GROUPS_PER_VERSION


def test_the_demo_starts_each_curriculum_at_the_tier_its_evaluation_found_unsolved(tmp_path):
    import argparse

    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    tier_of = {"a": 0, "b": 0, "c": 1, "d": 3}
    # tier 2 was not evaluated: the rates stop before it
    assert demo.tier_pass_rates({"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.0}, tier_of) == \
        [0.75, 0.25]
    assert demo.tier_samples({"a": [2, 2], "b": [1, 2], "c": [1, 4], "d": [0, 2]},
                             tier_of) == [4, 4]
    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    config.write_text(demo.cluster_config("s", tmp_path, tmp_path / "sft", ["math", "code"],
                                          parser.parse_args(["demo"]),
                                          start_pass_rates={"math": [0.9375, 0.5]},
                                          start_samples={"math": [16, 8]}))
    scheduler, = [a for a in load_cluster_config(config).actors
                  if a.spec.endswith(":Scheduler")]
    assert scheduler.config["start_pass_rates"] == {"math": [0.9375, 0.5]}
    assert scheduler.config["start_samples"] == {"math": [16, 8]}


def test_the_suites_guard_scores_as_the_suites_evaluations_on_a_few_domains_a_version(
        tmp_path):
    """16 tasks of 2 samples, as the suite's evaluations, held out after the 16 reported;
    at p < 0.01 the guard could not flag a fall from 6 of 32 passes to 0. The other demos
    keep the cheaper guard."""
    import argparse

    from reinforge.actors.evaluator import EvaluatorConfig
    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"

    held_out = {}

    def evaluator(rotation: int, *argv: str) -> EvaluatorConfig:
        config.write_text(demo.cluster_config(
            "g", tmp_path, tmp_path / "sft", ["gym-gcd", "gym-ab"],
            parser.parse_args(["demo", *argv]), heldout_per_tier=16 if argv else 4,
            guard={"gym-gcd": 0.0, "gym-ab": 0.0}))
        loaded = load_cluster_config(config)
        held_out[rotation] = loaded.run.heldout["tasks_per_tier"]
        actor, = [a for a in loaded.actors if a.spec.endswith(":Evaluator")]
        return msgspec.convert(actor.config, EvaluatorConfig)

    suite = evaluator(demo.SUITE_GUARD_DOMAINS_PER_VERSION, "--suite", "gym")
    plain = evaluator(0)
    assert (suite.score_per_tier, suite.skip_per_tier, suite.samples, suite.drop_alpha,
            suite.domains_per_version) == (
        demo.SUITE_GUARD_TASKS_PER_TIER, demo.SUITE_EVAL_TASKS_PER_TIER,
        demo.SUITE_GUARD_SAMPLES, demo.SUITE_GUARD_DROP_ALPHA,
        demo.SUITE_GUARD_DOMAINS_PER_VERSION) == (16, 16, 2, 0.05, 5)
    defaults = EvaluatorConfig()
    assert (plain.score_per_tier, plain.samples, plain.drop_alpha,
            plain.domains_per_version) == (4, defaults.samples, defaults.drop_alpha, 0)
    assert held_out == {demo.SUITE_GUARD_DOMAINS_PER_VERSION: 32, 0: 8}
    assert (suite.domain_samples, plain.domain_samples) == ({}, {})
    config.write_text(demo.cluster_config(
        "g", tmp_path, tmp_path / "sft", ["gym-gcd", "gym-ab"],
        parser.parse_args(["demo", "--suite", "gym"]), heldout_per_tier=16,
        guard={}, guard_samples={"gym-gcd": demo.SUITE_STAKE_SAMPLES}))
    actor, = [a for a in load_cluster_config(config).actors if a.spec.endswith(":Evaluator")]
    assert msgspec.convert(actor.config, EvaluatorConfig).domain_samples == {"gym-gcd": 8}


def actor_config(tmp_path, rotation, actor, config_type):
    """`actor`'s config in the cluster the demo writes for gym-gcd, guarded with
    `rotation` domains a version (the suite's, or 0: the other demos')."""
    import argparse

    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    config.write_text(demo.cluster_config(
        "f", tmp_path, tmp_path / "sft", ["gym-gcd"],
        parser.parse_args(["demo", *(("--suite", "gym") if rotation else ())]),
        guard={"gym-gcd": 0.0}))
    found, = [a for a in load_cluster_config(config).actors if a.spec.endswith(f":{actor}")]
    return msgspec.convert(found.config, config_type)


def test_the_suites_learner_keeps_crumbs_of_credit_from_weighing_as_a_pass(tmp_path):
    from reinforge.actors.learner import LearnerConfig
    from reinforge.cli import demo

    def learner(rotation):
        return actor_config(tmp_path, rotation, "Learner", LearnerConfig)

    assert learner(demo.SUITE_GUARD_DOMAINS_PER_VERSION).advantage_scale_floor == \
        demo.SUITE_ADVANTAGE_SCALE_FLOOR == 0.25
    assert learner(0).advantage_scale_floor == LearnerConfig().advantage_scale_floor == 0.0


def test_the_suites_scheduler_probes_domains_without_signal_at_a_lower_floor(tmp_path):
    from reinforge.actors.scheduler import SchedulerConfig
    from reinforge.cli import demo

    def scheduler(rotation):
        return actor_config(tmp_path, rotation, "Scheduler", SchedulerConfig)

    assert scheduler(demo.SUITE_GUARD_DOMAINS_PER_VERSION).signal_share_floor == \
        demo.SUITE_SIGNAL_SHARE_FLOOR == 0.02
    assert scheduler(0).signal_share_floor == SchedulerConfig().signal_share_floor == 0.1


def test_the_suites_learner_steps_take_four_groups_unless_told(tmp_path):
    """The suite's sampler held new generations for a weights swap after every 2 groups;
    a step of 4 halves the swaps."""
    import argparse

    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))

    def groups_per_version(*argv):
        config = tmp_path / "demo.toml"
        config.write_text(demo.cluster_config(
            "f", tmp_path, tmp_path / "sft", ["gym-gcd"], parser.parse_args(["demo", *argv])))
        return load_cluster_config(config).run.groups_per_version

    tiny = ("--model", "tiny")
    assert groups_per_version(*tiny, "--suite", "gym") == demo.SUITE_GROUPS_PER_VERSION == 4
    assert groups_per_version(*tiny, "--suite", "gym", "--groups-per-version", "3") == 3
    assert groups_per_version(*tiny) == demo.TINY_GROUPS_PER_VERSION == 2


def test_the_guards_floors_are_written_exactly_and_the_suite_has_none(tmp_path):
    """A floor of 3/32 written as 0.0938 rolled back a version scoring exactly 3/32."""
    import argparse

    from reinforge.actors.evaluator import EvaluatorConfig
    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    start = {"domains": {"math": {"pass_at_1": 0.34375}}}
    floors = demo.guard_floors("", start)
    assert floors == {"math": 0.34375 - demo.GUARD_MARGIN} and demo.guard_floors("gym", start) == {}
    config = tmp_path / "demo.toml"
    config.write_text(demo.cluster_config("t", tmp_path, tmp_path / "sft", ["math"],
                                          parser.parse_args(["demo"]), guard=floors))
    evaluator, = [a for a in load_cluster_config(config).actors
                  if a.spec.endswith(":Evaluator")]
    assert msgspec.convert(evaluator.config, EvaluatorConfig).thresholds == {"math": 0.09375}


def test_the_suite_evaluates_many_tasks_of_few_samples():
    """A policy that gives one answer whatever the task scores what its held-out tasks
    happen to be: 16 tasks of 2 samples read it better than 4 of 8."""
    import argparse

    from reinforge.cli import UserError, demo

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    suite = parser.parse_args(["demo", "--suite", "gym"])
    assert demo.eval_sizes(suite, ["gym-gcd"]) == (
        demo.SUITE_EVAL_TASKS_PER_TIER, 2, demo.SUITE_EVAL_SAMPLES) == (16, 2, 2)
    assert demo.eval_sizes(parser.parse_args(["demo"]), ["math"]) == (20, 4, 4)
    assert demo.eval_sizes(parser.parse_args(["demo", "--suite", "gym", "--eval-samples", "8",
                                              "--eval-tasks-per-tier", "4"]),
                           ["gym-gcd"]) == (4, 2, 8)
    with pytest.raises(UserError, match="pass@4 needs at least 4 samples"):
        demo.eval_sizes(parser.parse_args(["demo", "--eval-samples", "2"]), ["math"])


def test_the_suite_measures_finely_the_domains_its_start_passes_something_of(monkeypatch):
    """Chosen on the guard's tasks; both evaluations the run reports ask for those counts.
    (`reinforge eval` itself is replaced: a unit test of the arguments the demo builds.)"""
    import types

    from reinforge.cli import demo

    start = {"domains": {"gym-gcd": {"pass_at_1": 0.0625}, "gym-ab": {"pass_at_1": 0.0},
                         "gym-aiw": {"pass_at_1": 0.5}}}
    stake = demo.stake_samples("gym", start)
    assert stake == {"gym-aiw": demo.SUITE_STAKE_SAMPLES, "gym-gcd": demo.SUITE_STAKE_SAMPLES}
    assert demo.SUITE_STAKE_SAMPLES == 8 and demo.stake_samples("", start) == {}
    asked = []

    def fake_reinforge(*argv, capture=False, timeout_s=None):
        asked.append(argv)
        return types.SimpleNamespace(returncode=0, stdout='{"domains": {}}', stderr="")

    monkeypatch.setattr(demo, "reinforge", fake_reinforge)
    demo.evaluate(Path("/m"), ["gym-ab", "gym-aiw", "gym-gcd"], 2, 16, [0], samples=2,
                  domain_samples=stake)
    argv = list(asked[0])
    assert argv[argv.index("--samples") + 1] == "2"
    assert [a for a in argv if a.startswith("--domain-samples")] == [
        "--domain-samples=gym-aiw=8", "--domain-samples=gym-gcd=8"]


def test_the_demo_hands_its_evaluation_of_the_start_to_the_guard(tmp_path):
    import argparse

    from reinforge.actors.evaluator import EvaluatorConfig
    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    before = tmp_path / "eval_before.json"
    for start, expected in ((before, str(before)), (None, "")):
        config.write_text(demo.cluster_config(
            "g", tmp_path, tmp_path / "sft", ["math"], parser.parse_args(["demo"]),
            guard={"math": 0.25}, start_scores=start))
        evaluator, = [a for a in load_cluster_config(config).actors
                      if a.spec.endswith(":Evaluator")]
        assert msgspec.convert(evaluator.config, EvaluatorConfig).start_scores == expected


def test_the_guard_chooses_its_rollbacks_on_held_out_tasks_the_demo_does_not_report(tmp_path):
    """The run holds out the reported tasks and the guard's after them; the guard scores
    only its own, so what it rolls back is not chosen on the figures the run is judged by."""
    import argparse

    from reinforge.actors.evaluator import EvaluatorConfig, first_per_tier
    from reinforge.cli import demo
    from reinforge.core.cluster import load_cluster_config
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.evalsets import HeldOutConfig, build_heldout

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    config = tmp_path / "demo.toml"
    config.write_text(demo.cluster_config(
        "g", tmp_path, tmp_path / "sft", ["math"], parser.parse_args(["demo"]),
        heldout_per_tier=5, guard={"math": 0.25}))
    loaded = load_cluster_config(config)
    evaluator, = [a for a in loaded.actors if a.spec.endswith(":Evaluator")]
    cfg = msgspec.convert(evaluator.config, EvaluatorConfig)
    held = build_heldout(DomainRegistry.default(), ["math"],
                         msgspec.convert(loaded.run.heldout, HeldOutConfig))["math"]
    reported = {t.task_id for t in first_per_tier({"math": held}, 5)["math"]}
    guarded = {t.task_id for t in first_per_tier({"math": held}, cfg.score_per_tier,
                                                 cfg.skip_per_tier)["math"]}
    assert len(reported) == 5 * 5 and len(guarded) == 5 * demo.GUARD_TASKS_PER_TIER
    assert not reported & guarded and reported | guarded == {t.task_id for t in held}


def test_a_warm_start_cached_for_one_held_out_set_is_not_another_runs():
    """A warm start trained while 4 tasks a tier were held out saw the tasks a run holding
    out 8 keeps for its guard: its cache folder names the held-out set it left out."""
    from reinforge.cli.demo import sft_name
    from reinforge.rl.evalsets import HeldOutConfig

    names = {sft_name("sft", ["math"], 150, HeldOutConfig(tasks_per_tier=n, tiers=[0]))
             for n in (4, 8)}
    assert len(names) == 2
    assert sft_name("sft", ["math"], 150) == "sft-math-150"  # nothing held out: as before
    assert sft_name("sft", ["math"], 150, HeldOutConfig(tasks_per_tier=4, tiers=[0])) == \
        sft_name("sft", ["math"], 150, HeldOutConfig(tasks_per_tier=4, tiers=[0]))


@pytest.mark.slow
def test_the_starts_evaluation_is_kept_with_the_warm_start_and_not_run_again(
        tiny_model_dir, tmp_path):
    import shutil

    from reinforge.cli import demo

    model = tmp_path / "start"
    shutil.copytree(tiny_model_dir, model)
    kept = model / "evaluations"
    first = demo.evaluate(model, ["math"], 1, 1, [0], samples=2, cache=kept)
    assert len(list(kept.glob("*.json"))) == 1
    for f in model.glob("*.safetensors"):  # a run of `reinforge eval` would now fail
        f.unlink()
    assert demo.evaluate(model, ["math"], 1, 1, [0], samples=2, cache=kept) == first
    with pytest.raises(RuntimeError, match="reinforge eval failed"):  # other draws: no copy
        demo.evaluate(model, ["math"], 1, 1, [0], samples=2, cache=kept, seed=1)


def test_a_demo_of_tool_domains_gives_its_sampler_a_sandbox_and_turns_long_enough_for_a_call(
        tmp_path):
    import argparse

    from reinforge.cli.demo import MAX_NEW_TOKENS, TOOL_MAX_NEW_TOKENS, cluster_config, register
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo"])
    config = tmp_path / "demo.toml"
    for domains, sandbox, tokens in ((["math", "code"], False, MAX_NEW_TOKENS),
                                     (["terminal", "python_tool"], True, TOOL_MAX_NEW_TOKENS)):
        config.write_text(cluster_config("t", tmp_path, tmp_path / "sft", domains, args))
        sampler, = [a for a in load_cluster_config(config).actors
                    if a.spec.endswith(":SamplerActor")]
        assert (sampler.config["sandbox"], sampler.config["max_new_tokens"]) == (sandbox, tokens)


def test_the_demo_reports_turns_and_tool_call_errors_of_tool_domains_before_and_after():
    from reinforge.cli.demo import episode_summary

    def res(turns, errors):
        return {"domains": {"math": {"pass_at_1": 0.5},
                            "terminal": {"turns_mean": turns, "tool_call_error_rate": errors}}}

    assert episode_summary(res(1.5, 0.25), res(2.0, 0.1)) == {"terminal": {
        "turns_mean_before": 1.5, "tool_call_error_rate_before": 0.25,
        "turns_mean_after": 2.0, "tool_call_error_rate_after": 0.1}}


def test_the_demo_starts_from_a_given_model_as_it_is_and_refuses_a_folder_without_one(
        tmp_path, tiny_model_dir):
    from reinforge.cli import demo

    base, start = demo.ensure_models(tmp_path, ["math"], 0, model=tiny_model_dir)
    assert base == start == tiny_model_dir
    assert not (tmp_path / "models").exists()  # no SFT, no tiny policy made

    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "reinforge", "demo", "--model",
                          str(tmp_path / "nothing-here"), "--run", "ci-demo-model"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "not a Hugging Face model folder (no config.json) nor a pretrained" in out.stderr
    assert "reinforge model import" in out.stderr and "Traceback" not in out.stderr


def test_the_demo_refuses_eval_tiers_that_are_not_numbers(tmp_path):
    env = dict(os.environ, REINFORGE_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "reinforge", "demo", "--eval-tiers", "0,one",
                          "--run", "ci-demo-tiers"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--eval-tiers '0,one': give tiers as numbers" in out.stderr
    assert not (tmp_path / "home").exists()  # refused before anything was made


def test_the_rm_suite_scores_with_its_reward_model_and_guards_the_gold_on_enough_tasks(
        tmp_path):
    import argparse

    from reinforge.cli import UserError, demo
    from reinforge.core.cluster import load_cluster_config

    parser = argparse.ArgumentParser(prog="reinforge")
    demo.register(parser.add_subparsers(dest="command"))
    args = demo.with_policy_defaults(parser.parse_args(["demo", "--suite", "rm"]))
    assert args.guard_every == demo.RM_GUARD_EVERY
    config = tmp_path / "demo.toml"
    config.write_text(demo.cluster_config("rm", tmp_path, tmp_path / "sft", ["rm-synthetic"],
                                          args, guard={"rm-synthetic": 0.2},
                                          reward_model="/models/rm"))
    actors = {a.spec.rsplit(":", 1)[1]: a.config for a in load_cluster_config(config).actors}
    assert actors["VerifierActor"]["reward_model"] == "/models/rm"
    evaluator = actors["Evaluator"]
    assert (evaluator["reward_model"], evaluator["score_per_tier"], evaluator["samples"]) == (
        "/models/rm", demo.RM_GUARD_TASKS, demo.RM_GUARD_SAMPLES)
    assert actors["Learner"]["keep_every"] == demo.RM_GUARD_EVERY  # rollback targets kept
    plain = demo.with_policy_defaults(parser.parse_args(["demo"]))
    assert plain.guard_every == 25
    config.write_text(demo.cluster_config("m", tmp_path, tmp_path / "sft", ["math"], plain,
                                          guard={"math": 0.2}))
    actors = {a.spec.rsplit(":", 1)[1]: a.config for a in load_cluster_config(config).actors}
    assert "reward_model" not in actors["VerifierActor"]
    assert actors["Evaluator"]["score_per_tier"] == demo.GUARD_TASKS_PER_TIER
    with pytest.raises(UserError, match="--planted-exploit goes with --suite rm"):
        demo.cmd_demo(parser.parse_args(["demo", "--planted-exploit", "--model", "tiny"]))


def test_the_demo_says_how_long_it_trains_and_warns_when_the_budget_leaves_little(capsys):
    from reinforge.cli import demo

    # a pretrained model on 2 cores: warm start and evaluation 500 s of a 10-minute budget
    assert demo.say_training_window(500.0, 600.0, 200.0) == demo.MIN_TRAIN_S
    said = capsys.readouterr().err
    assert "training for 60 s: the warm start and the evaluation took 500 s of the 10-minute" \
        in said
    assert "warning: 60 s of training is too little" in said
    assert "ends about 180 s past its budget" in said and "--minutes 24 or more" in said
    assert demo.say_training_window(300.0, 1800.0, 200.0) == 1280.0
    said = capsys.readouterr().err
    assert "training for 1280 s" in said and "warning" not in said


def test_a_warm_start_that_cannot_run_is_the_users_error_not_a_traceback(tmp_path,
                                                                         tiny_model_dir):
    from reinforge.cli import UserError, demo

    with pytest.raises(UserError, match="the SFT warm start cannot run: sft: unknown domain "
                                        "'no-such-domain'.*--sft-steps 0 starts without it"):
        demo.ensure_models(tmp_path, ["no-such-domain"], 2, model=tiny_model_dir)
