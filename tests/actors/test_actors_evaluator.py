"""The evaluator: scoring, contamination, the regression guard (real nats-server), and
`reinforge eval` on a tiny checkpoint through the embedded rollout server."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
from collections import Counter

import msgspec
import pytest
import trio
from reinforge.cli.eval import register
from reinforge.rl.evalsets import (
    ContaminationError,
    HeldOutConfig,
    build_heldout,
    check_contamination,
    fingerprint,
    modal_references,
    require_clean,
)
from reinforge.actors.evaluator import (
    Baseline,
    Evaluator,
    EvaluatorConfig,
    GoodVersion,
    ServerSource,
    answer_prior,
    evaluate_sets,
    gold_peaks_after,
    guard_picks,
    regression_rollback,
    rotation,
    score_domain,
)
from reinforge.rl.scoring import drop_test, fewer_passes_p, smallest_drop_p
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import RuntimeConfig, run_actor
from reinforge.core.bus import open_bus
from reinforge.envs.domain import DomainRegistry, TaskSpec

HELD = HeldOutConfig(tasks_per_tier=2)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [x for e in exc.exceptions for x in _leaves(e)]
    return [exc]


# ----------------------------------------------------------------------------- scoring


class Scripted:
    """Completions by policy version: the reference when good, a wrong answer when bad."""

    def __init__(self, good: bool) -> None:
        self.good = good
        self.calls = 0

    async def complete(self, task, n, domain):
        self.calls += 1
        return [task.reference if self.good else "#### -987654321"] * n


def test_evaluate_sets_verifies_every_sample_with_its_domain():
    reg = DomainRegistry.default()
    sets = build_heldout(reg, ["math"], HELD)

    async def main():
        good = await evaluate_sets(sets, {"math": reg.get("math")}, Scripted(True),
                                   samples=3, k=2)
        bad = await evaluate_sets(sets, {"math": reg.get("math")}, Scripted(False),
                                  samples=3, k=2)
        return good["math"], bad["math"]

    good, bad = trio.run(main)
    assert good.n_tasks == len(sets["math"]) == 10
    assert (good.pass_at_1, good.pass_at_k) == (1.0, 1.0)
    assert (bad.pass_at_1, bad.pass_at_k) == (0.0, 0.0)


def test_a_domain_given_its_own_sample_count_is_sampled_that_many_times_a_task():
    reg = DomainRegistry.default()
    sets = build_heldout(reg, ["math", "gym-gcd"], HeldOutConfig(tasks_per_tier=2, tiers=[0]))
    doms = {d: reg.get(d) for d in sets}
    scores = trio.run(functools.partial(evaluate_sets, sets, doms, Scripted(True), samples=2,
                                        k=2, samples_by_domain={"gym-gcd": 8}))
    assert {d: {tuple(c) for c in s.task_counts.values()} for d, s in scores.items()} == {
        "math": {(2, 2)}, "gym-gcd": {(8, 8)}}
    assert (scores["math"].samples, scores["gym-gcd"].samples) == (2, 8)


def test_a_policy_giving_one_answer_to_every_task_scores_a_modal_share_of_one():
    reg = DomainRegistry.default()
    sets = build_heldout(reg, ["math"], HELD)
    good, bad = trio.run(lambda: _both(sets, reg))
    assert bad.answer_mode_share == 1.0  # "#### -987654321" every time
    # the references: 10 tasks x 3 samples, most common answer 3 (or a few) times of 30
    assert good.answer_mode_share < 0.5


async def _both(sets, reg):
    doms = {"math": reg.get("math")}
    good = await evaluate_sets(sets, doms, Scripted(True), samples=3, k=2)
    bad = await evaluate_sets(sets, doms, Scripted(False), samples=3, k=2)
    return good["math"], bad["math"]


def test_the_answer_prior_scores_each_held_out_task_with_its_tiers_most_common_reference():
    reg = DomainRegistry.default()
    math, gcd = reg.get("math"), reg.get("gym-gcd")
    sets = build_heldout(reg, ["math", "gym-gcd"], HeldOutConfig(tasks_per_tier=20, tiers=[0]))
    modal = modal_references(math, [0])
    # tier 0 is one-digit sums: the modal reference is one of them, the same on every call
    assert modal == modal_references(math, [0]) and modal[0].startswith("#### ")
    prior = trio.run(answer_prior, sets, {"math": math, "gym-gcd": gcd})
    assert set(prior) == {"math", "gym-gcd"}
    assert prior["math"] == {t.task_id: float(t.reference == modal[0]) for t in sets["math"]}
    # small answers dominate gcds of random pairs: the constant answer is right on some
    gcd_modal = modal_references(gcd, [0])[0]
    assert prior["gym-gcd"] == {t.task_id: float(t.reference == gcd_modal)
                                for t in sets["gym-gcd"]}
    assert 0 < sum(prior["gym-gcd"].values()) < 20


def test_the_answer_prior_leaves_out_domains_verified_in_a_sandbox():
    reg = DomainRegistry.default()
    sets = build_heldout(reg, ["math", "code"], HeldOutConfig(tasks_per_tier=1, tiers=[0]))
    prior = trio.run(answer_prior, sets, {"math": reg.get("math"), "code": reg.get("code")})
    assert set(prior) == {"math"}


# ----------------------------------------------------------------------------- contamination


def test_contamination_is_detected_on_a_planted_overlap():
    reg = DomainRegistry.default()
    held = build_heldout(reg, ["math", "docqa"], HELD)
    evals = [(t.task_id, t.prompt) for ts in held.values() for t in ts]
    rng = random.Random(1)
    train = []
    fps = {fingerprint(p) for _, p in evals}
    for d in ("math", "docqa"):
        for i in range(60):
            t = reg.get(d).sample_task(rng, i % len(reg.get(d).tiers))
            if fingerprint(t.prompt) not in fps:
                train.append((t.task_id, t.prompt))
    clean = check_contamination(train, evals)
    assert clean.clean, clean.summary()
    require_clean(clean)
    # plant: one held-out prompt verbatim (other spacing and case), one docqa document
    # pasted inside a longer training prompt
    math_t = held["math"][3]
    doc_t = held["docqa"][1]
    planted = train + [
        ("leak-1", "  " + math_t.prompt.upper().replace(" ", "   ")),
        ("leak-2", "Read this first.\n" + doc_t.prompt + "\nThen answer something else."),
    ]
    report = check_contamination(planted, evals)
    found = {o.eval_id: o for o in report.overlaps}
    assert set(found) == {math_t.task_id, doc_t.task_id}
    assert found[math_t.task_id].exact and found[math_t.task_id].train_id == "leak-1"
    assert found[doc_t.task_id].overlap > 0.9 and found[doc_t.task_id].train_id == "leak-2"
    with pytest.raises(ContaminationError, match="2 of .* eval prompts overlap"):
        require_clean(report)


def test_shared_template_text_alone_is_not_contamination():
    train = [(f"t{i}", f"Compute {i} + {i + 1}. End with '#### <answer>'.") for i in range(40)]
    evals = [(f"e{i}", f"Compute {i} * {i + 2}. End with '#### <answer>'.") for i in range(10)]
    assert check_contamination(train, evals).clean


def test_a_templated_domain_s_sibling_tasks_are_not_contamination_but_a_copy_is():
    """terminal's prompts differ in a file name or two: across the scheduler's training
    tasks (none of them held out) every n-gram of a held-out prompt turns up, which the
    n-gram test called contamination (an evaluator on a tools demo refused to start). For
    a templated domain only an exact copy counts."""
    from reinforge.envs.domain import templated_prompts

    reg = DomainRegistry.default()
    terminal = reg.get("terminal")
    held = build_heldout(reg, ["terminal"], HeldOutConfig(tasks_per_tier=5))["terminal"]
    evals = [(t.task_id, t.prompt) for t in held]
    fps = {fingerprint(p) for _, p in evals}
    rng = random.Random(7)
    train = [(t.task_id, t.prompt) for t in (terminal.sample_task(rng, i % 4) for i in range(200))
             if fingerprint(t.prompt) not in fps]
    exact_only = [eid for eid, _ in evals] if templated_prompts(terminal) else []
    assert exact_only and not templated_prompts(reg.get("math"))
    assert not check_contamination(train, evals).clean  # the n-gram test: siblings flagged
    assert check_contamination(train, evals, exact_only=exact_only).clean
    leak = [*train, ("copy", "  " + held[7].prompt.upper())]
    report = check_contamination(leak, evals, exact_only=exact_only)
    assert [(o.eval_id, o.train_id, o.exact) for o in report.overlaps] == [
        (held[7].task_id, "copy", True)]


def test_held_out_sets_are_deterministic_and_free_of_duplicates():
    reg = DomainRegistry.default()
    a = build_heldout(reg, ["math", "code"], HELD)
    b = build_heldout(reg, ["math", "code"], HELD)
    assert [t.prompt for t in a["math"]] == [t.prompt for t in b["math"]]
    for ts in a.values():
        assert len({fingerprint(t.prompt) for t in ts}) == len(ts)
        assert all(t.task_id.startswith("heldout-") for t in ts)
    other = build_heldout(reg, ["math"], HeldOutConfig(tasks_per_tier=2, seed=7))
    assert [t.prompt for t in other["math"]] != [t.prompt for t in a["math"]]


# ----------------------------------------------------------------------------- the guard


def _score(p1: float, n_tasks: int = 4):
    return score_domain("x", [[True] * round(p1 * 4) + [False] * (4 - round(p1 * 4))] * n_tasks,
                        k=2)


def test_a_domain_below_its_threshold_rolls_back_to_the_last_good_version():
    scores = {"math": _score(0.25), "docqa": _score(1.0)}
    below, rb = regression_rollback(7, scores, {"math": 0.5, "docqa": 0.5},
                                    GoodVersion(version=5, path="/ckpt/v5"))
    assert below == ["math"]
    assert isinstance(rb, m.Rollback)
    assert (rb.to_version, rb.path) == (5, "/ckpt/v5")
    assert "version 7 regressed" in rb.reason and "math pass@1 0.250 < 0.500" in rb.reason
    assert m.decode(m.encode(rb)) == rb  # well-formed on the wire


def test_no_rollback_without_an_earlier_good_version_or_a_regression():
    scores = {"math": _score(0.25)}
    assert regression_rollback(3, scores, {"math": 0.5}, None) == (["math"], None)
    assert regression_rollback(3, scores, {"math": 0.5}, GoodVersion(version=3, path="p")) == (
        ["math"], None)
    assert regression_rollback(3, scores, {"math": 0.2}, GoodVersion(version=1, path="p")) == (
        [], None)
    empty = {"math": score_domain("math", [[None, None]], k=1)}
    assert regression_rollback(3, empty, {"math": 0.5}, GoodVersion(version=1, path="p")) == (
        [], None)


# ----------------------------------------------------------------------------- the actor


class ScriptedEvaluator(Evaluator):
    """The evaluator with its rollout server replaced: versions in BAD answer wrongly."""

    BAD = {3}

    async def source_for(self, msg):
        return Scripted(msg.version not in self.BAD)


async def _read(bus, run, subject, until, timeout_s=30.0):
    stream = await bus.ensure_run_stream(run)
    got = []
    with trio.fail_after(timeout_s):
        while not until(got):
            got = [d async for d in bus.read_stream(stream, filter_subject=subject)]
            await trio.sleep(0.1)
    return got


def guard_config(tmp_path) -> EvaluatorConfig:
    """The guard of the ScriptedEvaluator tests: math at a 0.5 floor, 2 samples a task."""
    return EvaluatorConfig(domains=["math"], k=2, samples=2, heldout=HELD,
                           thresholds={"math": 0.5}, state_file=str(tmp_path / "ev.json"))


@contextlib.asynccontextmanager
async def evaluator_running(creds, run_name, evaluator, cfg):
    """A bus, with `evaluator` running on `cfg` until the block ends."""
    async with open_bus(creds) as bus:
        await bus.ensure_run_stream(run_name)
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                run_actor, evaluator, creds=creds, run=run_name, config=cfg))
            yield bus
            nursery.cancel_scope.cancel()


async def announce(bus, weights: str, versions) -> None:
    """The learner's announcements of `versions`, as it makes them."""
    for v in versions:
        await bus.publish_durable(
            weights, m.WeightsPublished(version=v, path=f"/ckpt/v{v}", step=v * 10),
            msg_id=f"weights:{v}")


@pytest.mark.nats
def test_a_planted_regression_publishes_a_rollback_to_the_last_good_version(
    creds, run_name, tmp_path
):
    cfg = guard_config(tmp_path)

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            weights = subjects.weights(run_name)
            async with trio.open_nursery() as nursery, bus.subscribe(weights) as follower:
                await nursery.start(functools.partial(
                    run_actor, ScriptedEvaluator, creds=creds, run=run_name, config=cfg))
                await announce(bus, weights, (1, 2, 3))
                with trio.fail_after(30):  # what a sampler/learner subscribed to weights sees
                    seen = []
                    async for batch in follower:
                        seen += [m.decode(r.data) for r in batch]
                        if any(isinstance(x, m.Rollback) for x in seen):
                            break
                stats = await _read(bus, run_name, subjects.stats(run_name, "eval"),
                                    lambda g: len(g) >= 3)
                stored = await _read(bus, run_name, weights, lambda g: len(g) >= 4)
                kept = await _read(bus, run_name, subjects.keep(run_name),
                                   lambda g: len(g) >= 3)
                nursery.cancel_scope.cancel()
        rollback = [x for x in seen if isinstance(x, m.Rollback)]
        assert len(rollback) == 1
        assert (rollback[0].to_version, rollback[0].path) == (2, "/ckpt/v2")
        assert "version 3 regressed" in rollback[0].reason
        last = stored[-1]
        assert m.decode(last.data) == rollback[0]
        assert last.headers["Nats-Msg-Id"] == "rollback:2:3"
        evals = sorted((e.version, e.domain, e.pass_at_1, e.pass_at_k, e.k, e.n_tasks)
                       for e in (m.decode(d.data) for d in stats))
        assert evals == [(1, "math", 1.0, 1.0, 2, 10), (2, "math", 1.0, 1.0, 2, 10),
                         (3, "math", 0.0, 0.0, 2, 10)]
        # after each version, the learner is told which checkpoints a rollback may need
        assert [m.decode(d.data).versions for d in kept] == [[1], [2], [2]]
        state = json.loads((tmp_path / "ev.json").read_text())
        assert state["last_good"] == {"version": 2, "path": "/ckpt/v2"}
        assert state["rolled_back"] == [3]

    trio.run(main)


class SampleCounting(ScriptedEvaluator):
    """The scripted evaluator, noting how many completions each task was asked for."""

    asked: list[int] = []

    async def source_for(self, msg):
        scripted = await super().source_for(msg)

        class Counted:
            async def complete(self, task, n, domain):
                SampleCounting.asked.append(n)
                return await scripted.complete(task, n, domain)

        return Counted()


@pytest.mark.nats
def test_the_evaluator_actor_asks_a_domain_for_its_own_sample_count(creds, run_name, tmp_path):
    cfg = msgspec.structs.replace(guard_config(tmp_path), domains=["math", "gym-gcd"],
                                  domain_samples={"gym-gcd": 5})
    SampleCounting.asked = []

    async def main():
        async with evaluator_running(creds, run_name, SampleCounting, cfg) as bus:
            await announce(bus, subjects.weights(run_name), (1,))
            stats = await _read(bus, run_name, subjects.stats(run_name, "eval"),
                                lambda g: len(g) >= 2)
        return {e.domain: e.n_tasks for e in (m.decode(d.data) for d in stats)}

    n_tasks = trio.run(main)
    assert sorted(SampleCounting.asked) == [2] * n_tasks["math"] + [5] * n_tasks["gym-gcd"]


class FirstVersionBad(ScriptedEvaluator):
    BAD = {1}


class FallsAtThreeOnly(ScriptedEvaluator):
    BAD = {3}


class FallsFromThreeOn(ScriptedEvaluator):
    BAD = {3, 4}


@pytest.mark.parametrize(("evaluator", "rollbacks", "last_good"), [
    (FallsAtThreeOnly, [], 4),  # v3 was never a good version, v4 is
    (FallsFromThreeOn, [(2, "version 4 regressed")], 2),
])
@pytest.mark.nats
def test_a_fall_the_next_check_no_longer_finds_rolls_nothing_back(
    creds, run_name, tmp_path, evaluator, rollbacks, last_good
):
    """Two checks in a row must find a fall: v3 answers wrongly, v4 answers well again (no
    rollback; v3 was never a good version, v4 is) or wrongly too (rolled back to v2)."""
    cfg = msgspec.structs.replace(guard_config(tmp_path), falls_before_rollback=2)

    def judged_v4() -> bool:  # kept as evaluated, or rolled back for
        path = tmp_path / "ev.json"
        state = json.loads(path.read_text()) if path.exists() else {}
        return len(state.get("evaluated", [])) >= 4 or bool(state.get("rolled_back"))

    async def main():
        async with evaluator_running(creds, run_name, evaluator, cfg) as bus:
            await announce(bus, subjects.weights(run_name), (1, 2, 3, 4))
            with trio.fail_after(30):
                while not judged_v4():
                    await trio.sleep(0.05)
            stored = await _read(bus, run_name, subjects.weights(run_name),
                                 lambda g: len(g) >= 4)
        return [x for x in (m.decode(d.data) for d in stored) if isinstance(x, m.Rollback)]

    published = trio.run(main)
    state = json.loads((tmp_path / "ev.json").read_text())
    assert [(r.to_version, r.reason.split(":")[0]) for r in published] == rollbacks
    assert state["rolled_back"] == [4] * len(rollbacks)
    assert state["last_good"] == {"version": last_good, "path": f"/ckpt/v{last_good}"}
    assert state["falls_seen"] == {}


@pytest.mark.parametrize("from_start", [True, False])
@pytest.mark.nats
def test_a_domains_first_evaluation_is_judged_against_the_start_when_the_run_has_it(
    creds, run_name, tmp_path, from_start
):
    """The demo hands the evaluator its evaluation of the start (`reinforge eval --json`):
    version 1 answers every task wrongly. Judged against the start, it is no good version
    (the test on the counts: 10 tasks from 2 of 2 to 0 of 2); with nothing to judge it
    against, it passes (no floor is set) and becomes the version to roll back to."""
    registry = DomainRegistry.default()
    sets = build_heldout(registry, ["math"], HELD)
    start = trio.run(functools.partial(evaluate_sets, sets, {"math": registry.get("math")},
                                       Scripted(True), samples=2, k=2))["math"]
    assert start.pass_at_1 == 1.0
    path = tmp_path / "eval_before.json"
    path.write_text(json.dumps({"domains": {"math": {
        "task_pass_at_1": start.task_pass_at_1, "task_counts": start.task_counts}}}))
    cfg = msgspec.structs.replace(guard_config(tmp_path), thresholds={},
                                  start_scores=str(path) if from_start else "")

    async def main():
        async with evaluator_running(creds, run_name, FirstVersionBad, cfg) as bus:
            await announce(bus, subjects.weights(run_name), (1,))
            with trio.fail_after(30):  # the state is written once v1 is judged
                while not (tmp_path / "ev.json").exists():
                    await trio.sleep(0.05)

    trio.run(main)
    state = json.loads((tmp_path / "ev.json").read_text())
    assert state["evaluated"] == ["1:/ckpt/v1"]
    assert state["last_good"] == (None if from_start else {"version": 1, "path": "/ckpt/v1"})


def test_start_scores_that_are_not_an_evaluation_are_a_clear_error(tmp_path):
    from reinforge.actors.evaluator import start_baselines

    bad = tmp_path / "x.json"
    bad.write_text('{"model": "m"}')
    with pytest.raises(ValueError, match="not a `reinforge eval --json` result"):
        start_baselines(bad, {})
    with pytest.raises(ValueError, match="not a `reinforge eval --json` result"):
        start_baselines(tmp_path / "missing.json", {})


@pytest.mark.nats
def test_a_version_announced_before_the_learner_applied_a_rollback_is_not_judged(
    creds, run_name, tmp_path
):
    cfg = guard_config(tmp_path)

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            weights = subjects.weights(run_name)
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(
                    run_actor, ScriptedEvaluator, creds=creds, run=run_name, config=cfg))
                await announce(bus, weights, (1, 2, 3))  # v3 is bad: rolled back to v2
                await _read(bus, run_name, weights, lambda g: len(g) >= 4)  # the rollback
                # the learner announced v4 before it applied the rollback; then, in its new
                # epoch, v3 again (a new checkpoint)
                for msg in (m.WeightsPublished(version=4, path="/ckpt/v4"),
                            m.WeightsPublished(version=3, path="/ckpt/v3b", epoch=1)):
                    await bus.publish_durable(weights, msg, msg_id=f"w:{msg.path}")
                stats = await _read(bus, run_name, subjects.stats(run_name, "eval"),
                                    lambda g: len(g) >= 4)
                nursery.cancel_scope.cancel()
        return [(e.version, e.pass_at_1) for e in (m.decode(d.data) for d in stats)]

    # v4 was not scored; the new epoch's v3 was (and failed, as every v3 here does)
    assert trio.run(main) == [(1, 1.0), (2, 1.0), (3, 0.0), (3, 0.0)]


@pytest.mark.nats
def test_the_evaluator_refuses_to_start_when_issued_training_tasks_overlap_its_held_out_set(
    creds, run_name, tmp_path
):
    held = build_heldout(DomainRegistry.default(), ["math"], HELD)["math"]
    leaked = held[0]
    cfg = EvaluatorConfig(domains=["math"], k=1, heldout=HELD,
                          state_file=str(tmp_path / "ev.json"))

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            task = m.Task(task_id="math-leak@0", domain="math", tier=leaked.tier,
                          prompt=leaked.prompt, spec=leaked.spec, group_size=2)
            await bus.publish_durable(subjects.task(run_name, "math"), task, "task:leak:1")
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(
                    run_actor, Evaluator, creds=creds, run=run_name, config=cfg))

    with pytest.raises(BaseException) as info:
        trio.run(main)
    errors = [e for e in _leaves(info.value) if isinstance(e, ContaminationError)]
    assert errors, info.value
    assert leaked.task_id in str(errors[0]) and "math-leak@0" in str(errors[0])


def test_the_evaluator_refuses_to_start_on_a_contaminated_training_file(tmp_path):
    """The same check from `reinforge eval --train-file` (no bus needed)."""
    held = build_heldout(DomainRegistry.default(), ["math"], HELD)["math"]
    spec = held[2].spec
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": spec["question"], "answer": spec["answer"]}) + "\n"
                     + json.dumps({"question": "Compute 1234 * 5678.", "answer": "7006652"}))
    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--model", str(tmp_path), "--domains", "math",
                              "--tasks-per-tier", "2", "--train-file", f"math={train}"])
    (tmp_path / "config.json").write_text("{}")
    from reinforge.cli import UserError

    with pytest.raises(UserError, match="contaminated held-out set: 1 of 10 eval prompts"):
        args.func(args)


def test_a_templated_domain_s_held_out_file_still_gets_the_n_gram_test(tmp_path):
    """People's own held-out prompts are free text: a training row that rewords one of them
    (one word changed) is contamination, templated domain or not."""
    row = {"instruction": "Collect every log line that mentions a timeout from app.log and "
                          "write them, oldest first, into timeouts.txt for the on-call team.",
           "files": {"app.log": "x\n"},
           "checks": [{"kind": "file_exists", "path": "timeouts.txt"}], "tier": 0}
    held, train = tmp_path / "held.jsonl", tmp_path / "train.jsonl"
    held.write_text(json.dumps(row) + "\n")
    train.write_text(json.dumps({**row, "instruction": row["instruction"].replace(
        "on-call team", "night shift")}) + "\n")
    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--model", str(tmp_path), "--domains", "terminal",
                              "--heldout-file", f"terminal={held}",
                              "--train-file", f"terminal={train}"])
    (tmp_path / "config.json").write_text("{}")
    from reinforge.cli import UserError

    with pytest.raises(UserError, match="contaminated held-out set: 1 of 1 eval prompts"):
        args.func(args)


def test_reinforge_eval_rejects_k_larger_than_samples_and_a_missing_model(tmp_path):
    from reinforge.cli import UserError

    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    with pytest.raises(UserError, match="--samples >= k"):
        args = parser.parse_args(["eval", "--model", str(tmp_path), "--k", "4", "--samples", "2"])
        args.func(args)
    with pytest.raises(UserError, match="no config.json"):
        args = parser.parse_args(["eval", "--model", str(tmp_path / "nope")])
        args.func(args)
    (tmp_path / "config.json").write_text("{}")
    for given, error in (("math", "expected DOMAIN=N with N >= k"),
                         ("math=1", "expected DOMAIN=N with N >= k"),
                         ("math=eight", "expected DOMAIN=N with N >= k"),
                         ("code=8", "--domain-samples names code, not among the domains")):
        with pytest.raises(UserError, match=error):
            args = parser.parse_args(["eval", "--model", str(tmp_path), "--k", "2",
                                      "--domains", "math", "--domain-samples", given])
            args.func(args)


def eval_args(*argv: str) -> argparse.Namespace:
    """`reinforge eval ARGV` parsed by the real command's parser."""
    parser = argparse.ArgumentParser(prog="reinforge")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *argv])


@pytest.mark.slow
def test_reinforge_eval_scores_a_hugging_face_checkpoint_offline(tiny_model_dir, capsys):
    args = eval_args("--model", str(tiny_model_dir), "--domains", "math,judge", "--k", "2",
                     "--samples", "3", "--domain-samples", "judge=4", "--tasks-per-tier", "1",
                     "--max-new-tokens", "8", "--json")
    assert args.func(args) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    assert result["k"] == 2 and result["samples"] == 3
    for d, n_tiers, samples in (("math", 5, 3), ("judge", 4, 4)):
        s = result["domains"][d]
        assert s["n_tasks"] == n_tiers  # one held-out task per tier, every one answered
        assert 0.0 <= s["pass_at_1"] <= s["pass_at_k"] <= 1.0
        assert s["samples"] == len(s["run_pass_rates"]) == samples
        assert s["infra_errors"] == 0
        assert 0.0 < s["answer_mode_share"] <= 1.0
    assert set(result["domains"]["math"]["prior_task_pass"]) == \
        set(result["domains"]["math"]["task_pass_at_1"])
    assert "pass@2" in out.err  # the table went to stderr
    msgspec.json.decode(out.out.strip().splitlines()[-1])  # stdout is exactly the JSON


@pytest.mark.podman
def test_reinforge_eval_plays_a_tool_domain_as_episodes_and_reports_turns_and_call_errors(
        tiny_model_dir, capsys):
    args = eval_args("--model", str(tiny_model_dir), "--domains", "python_tool", "--k", "1",
                     "--samples", "2", "--tasks-per-tier", "1", "--max-new-tokens", "12",
                     "--json")
    assert args.func(args) == 0
    out = capsys.readouterr()
    s = json.loads(out.out.strip().splitlines()[-1])["domains"]["python_tool"]
    assert s["n_tasks"] == 4 and s["infra_errors"] == 0
    assert 1.0 <= s["turns_mean"] <= 4.0  # every sample an episode of at least one turn
    assert 0.0 <= s["tool_call_error_rate"] <= 1.0
    assert "turns " in out.err and "tool-call errors" in out.err


def test_a_server_source_answers_a_multi_turn_domain_with_episode_transcripts(
        server_url, tiny_model_dir):
    from transformers import AutoTokenizer
    from reinforge.envs.domains.python_tool import PythonToolDomain
    from reinforge.envs.sandbox.runner import UnsafeLocalRunner
    from reinforge.envs.tools import decode_transcript
    from reinforge.rollout.client import RolloutClient

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    domain = PythonToolDomain().with_runner(UnsafeLocalRunner())
    task = domain.sample_task(random.Random(0), 0)

    async def main():
        async with RolloutClient(server_url) as client:
            source = ServerSource(client, tok, max_new_tokens=12, temperature=1.0)
            return await source.complete(task, 3, domain)

    completions = trio.run(main)
    assert len(completions) == 3
    for text in completions:
        turns = decode_transcript(text)
        assert turns is not None and 1 <= len(turns) <= 4


def test_one_sampling_seed_draws_the_same_samples_whichever_time_a_task_is_evaluated(
        server_url, tiny_model_dir):
    """Two evaluations with one seed meet the same random numbers (common random numbers):
    on one checkpoint they are the same samples, task by task and episode by episode, while
    other tasks, other seeds and unseeded draws differ."""
    from transformers import AutoTokenizer
    from reinforge.envs.domains.python_tool import PythonToolDomain
    from reinforge.envs.sandbox.runner import UnsafeLocalRunner
    from reinforge.envs.domains.math import MathDomain
    from reinforge.rollout.client import RolloutClient

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    math, tool = MathDomain(), PythonToolDomain().with_runner(UnsafeLocalRunner())
    a, b = (math.sample_task(random.Random(i), 0) for i in (0, 1))
    episode_task = tool.sample_task(random.Random(0), 0)

    async def draws(seed, task, domain, n=4):
        async with RolloutClient(server_url) as client:
            source = ServerSource(client, tok, max_new_tokens=12, temperature=1.0, seed=seed)
            return await source.complete(task, n, domain)

    def run(*call):
        return trio.run(draws, *call)

    first = run(7, a, math)
    assert run(7, a, math) == first
    assert len(set(first)) > 1  # sample j has a seed of its own, not sample 0's repeated
    assert run(8, a, math) != first and run(None, a, math) != run(None, a, math)
    assert run(7, b, math) != first  # each task its own seed
    episodes = run(7, episode_task, tool, 2)
    assert run(7, episode_task, tool, 2) == episodes != run(8, episode_task, tool, 2)


def test_reinforge_eval_seeds_its_samples_unless_told_none():
    assert eval_args("--model", "m").sampling_seed == 0
    assert eval_args("--model", "m", "--sampling-seed", "3").sampling_seed == 3
    assert eval_args("--model", "m", "--sampling-seed", "none").sampling_seed is None


def test_reinforge_eval_skips_the_constant_answer_when_asked(tiny_model_dir, capsys):
    args = eval_args("--model", str(tiny_model_dir), "--domains", "math", "--k", "1",
                     "--tasks-per-tier", "1", "--tiers", "0", "--max-new-tokens", "4", "--json",
                     "--no-answer-prior")
    assert args.func(args) == 0
    math = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["domains"]["math"]
    assert math["n_tasks"] == 1 and "answer_mode_share" in math
    assert "prior_pass_at_1" not in math and "prior_task_pass" not in math


def test_a_tier_drawn_from_a_small_bank_holds_out_only_its_cap_so_training_keeps_the_rest():
    from reinforge.envs.domains.code import _BANK

    reg = DomainRegistry.default()
    held = build_heldout(reg, ["code", "math"], HeldOutConfig(tasks_per_tier=20))
    code = reg.get("code")
    for tier, bank in _BANK.items():
        prompts = {t.prompt for t in held["code"] if t.tier == tier}
        assert len(prompts) == code.tiers[tier].max_heldout == 2 < len(bank)
    # math's tiers are large: no cap, 20 per tier
    assert len(held["math"]) == 20 * len(reg.get("math").tiers)


@pytest.mark.nats
def test_a_version_pruned_before_its_turn_is_skipped_and_counted_not_retried(
        creds, run_name, tmp_path):
    cfg = EvaluatorConfig(domains=["math"], k=1, heldout=HELD, every_versions=1,
                          state_file=str(tmp_path / "ev.json"))

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            async with trio.open_nursery() as nursery, \
                    bus.subscribe(subjects.heartbeat(run_name, "*")) as beats:
                await nursery.start(functools.partial(
                    run_actor, Evaluator, creds=creds, run=run_name, config=cfg,
                    runtime=RuntimeConfig(heartbeat_s=0.2)))
                await bus.publish_durable(
                    subjects.weights(run_name),
                    m.WeightsPublished(version=1, path=str(tmp_path / "v1-pruned"), step=1),
                    msg_id="weights:1")
                with trio.fail_after(30):
                    async for batch in beats:
                        figures = [m.decode(r.data).figures for r in batch]
                        if any(f.get("skipped_versions") == 1.0 for f in figures):
                            break
                nursery.cancel_scope.cancel()
        return figures

    figures = trio.run(main)
    skipped = next(f for f in figures if f.get("skipped_versions") == 1.0)
    assert skipped["evaluated_versions"] == 0.0  # no server was started for it


@pytest.mark.nats
def test_an_evaluator_without_the_checkpoint_on_its_disk_scores_the_version_from_the_store(
        creds, run_name, tmp_path, tiny_model_dir, monkeypatch):
    import shutil
    import tempfile

    from reinforge.core.weights import put_version

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model_dir, v1)
    cfg = EvaluatorConfig(domains=["math"], k=1, heldout=HELD, every_versions=1,
                          score_per_tier=1, max_new_tokens=8, model_path=str(tiny_model_dir),
                          state_file=str(tmp_path / "ev.json"))

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            bucket = await put_version(bus, run_name, 1, v1)
            shutil.rmtree(v1)  # the learner's disk is not this host's
            async with trio.open_nursery() as nursery, \
                    bus.subscribe(subjects.heartbeat(run_name, "*")) as beats:
                ctx = await nursery.start(functools.partial(
                    run_actor, Evaluator, creds=creds, run=run_name, config=cfg,
                    runtime=RuntimeConfig(heartbeat_s=0.2)))
                await bus.publish_durable(subjects.weights(run_name), m.WeightsPublished(
                    version=1, path=str(v1), step=1, store=bucket), msg_id="weights:1")
                with trio.fail_after(240):
                    async for batch in beats:
                        beat = m.decode(batch[-1].data)
                        if beat.figures.get("evaluated_versions", 0) + \
                                beat.figures.get("skipped_versions", 0) >= 1:
                            break
                ctx.stop_requested.set()
        return beat

    beat = trio.run(main)
    assert (beat.figures["evaluated_versions"], beat.figures["skipped_versions"]) == (1.0, 0.0)
    assert json.loads((tmp_path / "ev.json").read_text())["evaluated"] == [f"1:{v1}"]
    assert list(scratch.iterdir()) == []  # the fetched version went with the evaluator


def _prune_v1_while_the_eval_server_starts(creds, run_name, tmp_path, model_dir, **config):
    """Publish version 1; delete its checkpoint as soon as the evaluator says it is starting
    its server (what the learner's pruning does on a busy CPU), then publish version 2.
    Returns the evaluator's state file and its last heartbeat, once both are settled."""
    import shutil

    paths = {v: tmp_path / f"v{v}" for v in (1, 2)}
    for path in paths.values():
        shutil.copytree(model_dir, path)
    cfg = EvaluatorConfig(domains=["math"], k=1, heldout=HELD, every_versions=1,
                          score_per_tier=1, max_new_tokens=8,
                          state_file=str(tmp_path / "ev.json"), **config)

    def publish(bus, v):
        return bus.publish_durable(subjects.weights(run_name), m.WeightsPublished(
            version=v, path=str(paths[v]), step=v), msg_id=f"weights:{v}")

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            async with trio.open_nursery() as nursery, \
                    bus.subscribe(subjects.heartbeat(run_name, "*")) as beats:
                ctx = await nursery.start(functools.partial(
                    run_actor, Evaluator, creds=creds, run=run_name, config=cfg,
                    runtime=RuntimeConfig(heartbeat_s=0.2)))
                await publish(bus, 1)
                with trio.fail_after(240):
                    async for batch in beats:
                        beat = m.decode(batch[-1].data)
                        if beat.waiting_on == "eval rollout server start" and paths[1].exists():
                            shutil.rmtree(paths[1])
                            await publish(bus, 2)
                        settled = (beat.figures.get("evaluated_versions", 0)
                                   + beat.figures.get("skipped_versions", 0))
                        if settled == 2:
                            break
                ctx.stop_requested.set()  # a clean stop: its teardown stops the eval server
        return beat

    beat = trio.run(main)
    return json.loads((tmp_path / "ev.json").read_text()), beat, paths


@pytest.mark.nats
def test_an_eval_server_started_from_the_starting_model_outlives_a_version_pruned_meanwhile(
        creds, run_name, tmp_path, tiny_model_dir):
    state, beat, paths = _prune_v1_while_the_eval_server_starts(
        creds, run_name, tmp_path, tiny_model_dir, model_path=str(tiny_model_dir))
    assert state["evaluated"] == [f"2:{paths[2]}"]
    assert beat.figures["skipped_versions"] == 1.0
    assert beat.dead_letters == 0


@pytest.mark.nats
def test_a_version_pruned_while_the_eval_server_starts_from_it_leaves_the_next_one_scored(
        creds, run_name, tmp_path, tiny_model_dir):
    # the server may have read version 1 before it vanished (then it is scored) or not (then
    # it is skipped); either way the evaluator keeps a tokenizer and scores version 2
    state, beat, paths = _prune_v1_while_the_eval_server_starts(
        creds, run_name, tmp_path, tiny_model_dir)
    assert state["evaluated"][-1] == f"2:{paths[2]}"
    assert beat.dead_letters == 0


def test_scoring_the_first_n_per_tier_is_the_held_out_set_of_n_per_tier():
    """The guard scores a subset of the run's held-out sets: exactly the smaller set."""
    from reinforge.actors.evaluator import first_per_tier

    registry = DomainRegistry.default()
    wide = build_heldout(registry, ["math", "code"], HeldOutConfig(tasks_per_tier=20))
    narrow = build_heldout(registry, ["math", "code"], HeldOutConfig(tasks_per_tier=4))
    subset = first_per_tier(wide, 4)
    assert {d: [t.task_id for t in ts] for d, ts in subset.items()} == {
        d: [t.task_id for t in ts] for d, ts in narrow.items()}
    assert first_per_tier(wide, 0) == {d: list(ts) for d, ts in wide.items()}


def test_the_guard_can_score_a_slice_apart_from_the_tasks_a_final_evaluation_reports():
    """A run holding out 8 a tier: the report scores the first 4, the guard the next 4."""
    from reinforge.actors.evaluator import first_per_tier

    held = build_heldout(DomainRegistry.default(), ["math", "code"],
                         HeldOutConfig(tasks_per_tier=8))
    report, guard = first_per_tier(held, 4), first_per_tier(held, 4, skip=4)
    for d, tasks in held.items():
        held_of = Counter(t.tier for t in tasks)  # a tier with a small bank holds fewer
        assert Counter(t.tier for t in report[d]) == {t: min(4, n) for t, n in held_of.items()}
        assert Counter(t.tier for t in guard[d]) == {t: n - 4 for t, n in held_of.items()
                                                     if n > 4}
        assert not {t.task_id for t in report[d]} & {t.task_id for t in guard[d]}
        assert {t.task_id for t in report[d] + guard[d]} == {t.task_id for t in tasks}
    assert set(Counter(t.tier for t in held["math"]).values()) == {8}  # both slices full
    assert first_per_tier(held, 0, skip=8) == {d: [] for d in held}


def test_a_small_bank_gives_the_report_and_the_guard_each_its_share_of_what_it_holds():
    """The run holds out 32 a tier, 16 reported and 16 for the guard. A tier whose bank gave
    only 10 used to give all 10 to the report and none to the guard, which could then never
    flag n_queens; now each slice keeps its half."""
    from reinforge.actors.evaluator import first_per_tier

    def task(tier, i):
        return TaskSpec(task_id=f"t{tier}-{i}", domain="d", tier=tier, prompt=f"p{tier}-{i}",
                        spec={})

    held = {"d": [task(0, i) for i in range(10)] + [task(1, i) for i in range(32)]
            + [task(2, i) for i in range(3)]}
    report, guard = first_per_tier(held, 16, 0, 32)["d"], first_per_tier(held, 16, 16, 32)["d"]
    assert [t.task_id for t in report] == [f"t0-{i}" for i in range(5)] + [
        f"t1-{i}" for i in range(16)] + ["t2-0", "t2-1"]  # the report keeps 2 of 3
    assert [t.task_id for t in guard] == [f"t0-{i}" for i in range(5, 10)] + [
        f"t1-{i}" for i in range(16, 32)] + ["t2-2"]
    assert first_per_tier(held, 0, 0, 32) == held  # everything, as without `held`


# ----------------------------------------------------------------------------- many domains


def _tasks(passes: list[float]) -> dict[str, float]:
    return {f"t{i}": p for i, p in enumerate(passes)}


def _scored(passes: list[float]):
    """A DomainScore whose per-task pass@1 are `passes` (2 samples a task)."""
    rows = [[p >= 0.5, p >= 1.0] for p in passes]
    return score_domain("x", rows, k=1, task_ids=list(_tasks(passes)))


def test_the_sign_test_counts_tasks_that_fell_against_those_that_rose():
    t = drop_test(_tasks([1.0] * 10), _tasks([0.0] * 9 + [1.0]))
    assert (t.worse, t.better, t.n_tasks) == (9, 0, 10)
    assert t.p_value == pytest.approx(1 / 2**9)
    mixed = drop_test(_tasks([0.5] * 10), _tasks([0.0] * 9 + [1.0]))
    assert (mixed.worse, mixed.better) == (9, 1)
    assert mixed.p_value == pytest.approx((10 + 1) / 2**10)  # the docstring's example
    assert drop_test({}, {}).p_value == 1.0


def test_a_real_fall_rolls_back_and_noise_of_the_same_mean_does_not():
    base = {"math": Baseline(version=4, task_pass_at_1=_tasks([1.0] * 20))}
    good = GoodVersion(version=4, path="/v4")
    # 16 of 20 tasks fell from 1.0 to 0.5: p = 2**-16
    real = {"math": _scored([0.5] * 16 + [1.0] * 4)}
    flagged, rb = regression_rollback(6, real, {}, good, baselines=base, drop_alpha=0.01,
                                      drop_margin=0.05)
    assert flagged == ["math"] and rb.to_version == 4
    assert "math pass@1 fell 0.400 since v4 on 20 tasks (16 worse, 0 better" in rb.reason
    # the same fall of the mean on a baseline where half the tasks rise: not significant
    noisy_base = {"math": Baseline(version=4, task_pass_at_1=_tasks([1.0] * 12 + [0.0] * 8))}
    noisy = {"math": _scored([0.0] * 12 + [0.5] * 8)}
    assert regression_rollback(6, noisy, {}, good, baselines=noisy_base, drop_alpha=0.01,
                               drop_margin=0.05) == ([], None)
    # without the drop guard (drop_alpha 0) the real fall passes: thresholds only
    assert regression_rollback(6, real, {}, good, baselines=base) == ([], None)


def test_the_test_on_counts_sees_a_fall_on_four_tasks_that_the_sign_test_cannot():
    before, after = _scored([1.0] * 4), _scored([0.0] * 4)  # 2 of 2 samples -> 0 of 2
    sign = drop_test(before.task_pass_at_1, after.task_pass_at_1)
    counts = drop_test(before.task_pass_at_1, after.task_pass_at_1, before.task_counts,
                       after.task_counts)
    assert sign.p_value == pytest.approx(1 / 2**4)  # never below 0.01 on 4 tasks
    assert counts.p_value == pytest.approx((1 / 6) ** 4) == smallest_drop_p(4, 2)
    assert (counts.worse, counts.better, counts.delta) == (4, 0, -1.0)
    base = {"gym-a": Baseline.of(4, before)}
    good = GoodVersion(version=4, path="/v4")
    flagged, rb = regression_rollback(6, {"gym-a": after}, {}, good, baselines=base,
                                      drop_alpha=0.01, drop_margin=0.05)
    assert flagged == ["gym-a"] and rb.to_version == 4
    assert "test on the counts p=0.00077" in rb.reason
    # a baseline kept before the counts were (an older state file): the sign test, blind
    old = {"gym-a": Baseline(version=4, task_pass_at_1=before.task_pass_at_1)}
    assert regression_rollback(6, {"gym-a": after}, {}, good, baselines=old,
                               drop_alpha=0.01, drop_margin=0.05) == ([], None)


def test_a_slow_slide_no_step_of_which_is_significant_is_a_fall_from_the_start():
    start = {"gym-a": Baseline.of(0, _scored([1.0] * 6 + [0.5] * 2))}
    steps = [_scored([1.0] * 4 + [0.5] * 4), _scored([1.0] * 2 + [0.5] * 4 + [0.0] * 2),
             _scored([0.5] * 4 + [0.0] * 4)]
    last, good = dict(start), GoodVersion(version=0, path="/v0")
    for version, score in zip((5, 10, 15), steps):  # each step against the last: no fall
        assert regression_rollback(version, {"gym-a": score}, {}, good, baselines=last,
                                   drop_alpha=0.01, drop_margin=0.05) == ([], None)
        last, good = {"gym-a": Baseline.of(version, score)}, GoodVersion(version=version,
                                                                          path=f"/v{version}")
    slid = _scored([0.5] * 2 + [0.0] * 6)
    assert regression_rollback(20, {"gym-a": slid}, {}, good, baselines=last,
                               drop_alpha=0.01, drop_margin=0.05) == ([], None)
    flagged, rb = regression_rollback(20, {"gym-a": slid}, {}, good, baselines=last,
                                      starts=start, drop_alpha=0.01, drop_margin=0.05)
    assert flagged == ["gym-a"] and rb.to_version == 15
    assert "gym-a pass@1 fell 0.750 since v0 on 8 tasks (8 worse, 0 better" in rb.reason


def test_the_guard_spends_its_slots_on_the_domains_that_can_fall():
    names = [f"d{i:02d}" for i in range(20)]
    zero = {d: Baseline.of(0, _scored([0.0] * 4)) for d in names[:15]}
    some = {d: Baseline.of(0, _scored([0.0] * 3 + [0.5])) for d in names[15:18]}
    baselines = {**zero, **some}  # d18, d19: not scored yet, so they can fall
    stake_seen, zero_seen, positions = [], [], (0, 0)
    for _ in range(3):  # ceil(15 zero domains / 1 slot) versions would see them all
        stake, at_zero = guard_picks(names, baselines, positions, 5, 0.2)
        assert (len(stake), len(at_zero)) == (4, 1)
        stake_seen += stake
        zero_seen += at_zero
        positions = (positions[0] + len(stake), positions[1] + len(at_zero))
    assert set(stake_seen) == set(names[15:])  # each of the 5 seen within 2 versions
    assert stake_seen.count("d15") == 3 and zero_seen == ["d00", "d01", "d02"]
    # the slots a group cannot fill go to the other; without a share, zero domains only so
    all_zero = {d: zero["d00"] for d in names[:18]}
    assert guard_picks(names, all_zero, (0, 0), 5, 0.2) == (names[18:], names[:3])
    assert guard_picks(names, baselines, (0, 0), 5, 0.0) == (names[15:], [])
    assert guard_picks(names, baselines, (0, 0), 0, 0.2) == (names[15:], names[:15])
    assert guard_picks(names, baselines, (0, 0), 2, 1.0) == (["d15"], ["d00"])
    # a domain that passed something at the start and nothing since can still fall from it
    starts = {"d00": some["d15"]}
    assert guard_picks(names, baselines, (0, 0), 0, 0.2, starts) == (
        ["d00"] + names[15:], names[1:15])


def test_a_second_fall_of_one_version_number_is_a_second_rollback_not_a_redelivery():
    """In suite s23i version 50 fell, was rolled back to 25, and the new version 50 fell the
    same way: the two Rollbacks read word for word alike, the learner took the second for
    a redelivery and kept its v56 while the samplers went back to v25, and every group
    after was stale. The bad version's epoch tells them apart."""
    from reinforge.actors.learner import rollback_key

    start = {"gym-a": Baseline.of(0, _scored([1.0] * 4))}
    fell = {"gym-a": _scored([0.0] * 4)}
    good = GoodVersion(version=25, path="/v25")
    (_, first), (_, second) = (regression_rollback(
        50, fell, {}, good, starts=start, drop_alpha=0.05, drop_margin=0.05, epoch=e)
        for e in (0, 1))
    assert first.reason == second.reason and (first.from_epoch, second.from_epoch) == (0, 1)
    assert rollback_key(first) != rollback_key(second)
    assert rollback_key(first) == f"25:/v25:{first.reason}"  # as checkpoints recorded it


def test_a_domain_rolled_back_for_twice_falls_without_a_third_rollback():
    """In suite s24e gym-self_reference fell at v100, was rolled back to v75, and the
    retrained v100 fell the same way, six times over: the run made nothing after v113. A
    spent domain's fall is still named, but only another domain's fall rolls back."""
    from reinforge.actors.evaluator import spent_domains

    start = {d: Baseline.of(0, _scored([1.0] * 4)) for d in ("gym-a", "gym-b")}
    good = GoodVersion(version=75, path="/v75")

    def judge(fallen, spent):
        scores = {d: _scored([0.0 if d in fallen else 1.0] * 4) for d in start}
        return regression_rollback(100, scores, {}, good, starts=start, drop_alpha=0.05,
                                   drop_margin=0.05, spent=spent)

    assert judge({"gym-a"}, set())[1] is not None
    assert judge({"gym-a"}, {"gym-a"}) == (["gym-a"], None)
    both, rollback = judge({"gym-a", "gym-b"}, {"gym-a"})
    assert both == ["gym-a", "gym-b"] and rollback.to_version == 75
    assert spent_domains({"gym-a": 2, "gym-b": 1}, 2) == {"gym-a"}
    assert spent_domains({"gym-a": 9}, 0) == set()  # no limit


def test_a_fall_waits_for_the_checks_in_a_row_that_must_find_it():
    """In suite s25a count_bits fell at v50 (4 tasks worse, p = 0.04), caused two rollbacks,
    and was a gain of 0.156 by the end. With two checks in a row needed, a fall the next
    check no longer finds causes none; one it finds again does."""
    from reinforge.actors.evaluator import falls_waiting

    def checks(*names):  # scores of these domains, on verified tasks
        return {d: _scored([1.0, 0.0]) for d in names}

    # needed 1: every fall acts at once, as before
    assert falls_waiting({}, checks("a", "b"), ["a"], set(), 1) == ([], {})
    # needed 2: the first check that finds it waits ...
    waiting, seen = falls_waiting({}, checks("a", "b"), ["a"], set(), 2)
    assert (waiting, seen) == (["a"], {"a": 1})
    # ... a check of other domains keeps the count; one that finds it again acts
    assert falls_waiting(seen, checks("b"), [], set(), 2) == ([], {"a": 1})
    assert falls_waiting(seen, checks("a"), ["a"], set(), 2) == ([], {"a": 1})
    # a check without the fall starts the count again; one without verified tasks does not
    assert falls_waiting(seen, checks("a"), [], set(), 2) == ([], {})
    assert falls_waiting(seen, {"a": _scored([])}, [], set(), 2) == ([], {"a": 1})
    # a spent domain never waits (it causes no rollback)
    assert falls_waiting({}, checks("a"), ["a"], {"a"}, 2) == ([], {})
    # three in a row
    w1, s1 = falls_waiting({}, checks("a"), ["a"], set(), 3)
    w2, s2 = falls_waiting(s1, checks("a"), ["a"], set(), 3)
    assert (w1, w2, s2) == (["a"], ["a"], {"a": 2})
    assert falls_waiting(s2, checks("a"), ["a"], set(), 3)[0] == []
    with pytest.raises(ValueError, match="falls_before_rollback must be >= 1"):
        EvaluatorConfig(domains=["math"], falls_before_rollback=0)


def test_a_domain_a_rollback_was_for_is_evaluated_at_every_version_after():
    """In one suite run gym-syllogism fell 0.625 -> 0.22, was rolled back, then fell to 0
    before the rotation came back to it: it is watched from its rollback on."""
    from reinforge.actors.evaluator import with_watched

    names = [f"d{i:02d}" for i in range(12)]
    some = {d: Baseline.of(0, _scored([0.0] * 3 + [0.5])) for d in names}
    watched = with_watched([], ["d07"])
    assert with_watched(watched, ["d07", "d02"]) == ["d07", "d02"]  # each domain once
    positions = (0, 0)
    for _ in range(6):
        stake, zero = guard_picks(names, some, positions, 3, 0.2)
        picks = with_watched(stake + zero, watched)
        assert "d07" in picks and len(picks) == 3 + ("d07" not in stake)
        positions = (positions[0] + len(stake), positions[1] + len(zero))


def test_the_test_on_counts_is_the_exact_law_of_passes_shuffled_within_each_task():
    """Brute force: with no change, a task's passes fall on any of its samples alike, so the
    p-value is the share of those placements with as few passes after as seen."""
    import itertools

    tasks = [((3, 4), (1, 3)), ((1, 2), (0, 3)), ((2, 3), (2, 2))]
    per_task = []
    for (cb, nb), (ca, na) in tasks:
        n = nb + na
        placements = list(itertools.combinations(range(n), cb + ca))
        per_task.append([sum(i >= nb for i in p) for p in placements])
    seen = sum(ca for _, (ca, _) in tasks)
    combos = list(itertools.product(*per_task))
    exact = sum(sum(c) <= seen for c in combos) / len(combos)
    assert fewer_passes_p(tasks) == pytest.approx(exact)
    assert fewer_passes_p([((2, 2), (0, 2))] * 2) == pytest.approx(1 / 36)  # the docstring's
    assert fewer_passes_p([((1, 2), (2, 2))]) == 1.0  # it rose: no evidence of a fall
    with pytest.raises(ValueError, match="passed <= verified"):
        fewer_passes_p([((3, 2), (0, 2))])


def test_the_evaluator_says_when_its_drop_guard_cannot_flag_a_domain():
    from reinforge.actors.evaluator import drop_guard_blind

    one = TaskSpec(task_id="a", domain="math", tier=0, prompt="1+1?", spec={})
    sets = {"math": [one], "gym-a": [one] * 4}
    said = drop_guard_blind(sets, EvaluatorConfig(k=2, drop_alpha=0.01))
    assert said.startswith("the drop guard cannot flag math: on 1 task(s) of 2 sample(s)")
    assert "p >= 0.17" in said
    assert drop_guard_blind({"gym-a": [one] * 4}, EvaluatorConfig(k=2, drop_alpha=0.01)) == ""
    assert drop_guard_blind(sets, EvaluatorConfig(k=2, drop_alpha=0.0)) == ""
    assert drop_guard_blind(sets, EvaluatorConfig(k=2, samples=8, drop_alpha=0.01)) == ""
    # a domain scored with more samples than the rest is judged by its own count
    assert drop_guard_blind(sets, EvaluatorConfig(k=2, drop_alpha=0.01,
                                                  domain_samples={"math": 8})) == ""


def test_the_evaluator_scores_a_domain_given_its_own_sample_count_that_many_times():
    with pytest.raises(ValueError, match=r"domain_samples: need each >= k=2, got \{'math': 1\}"):
        EvaluatorConfig(k=2, domain_samples={"math": 1})


class PlantedProxy:
    """A test domain (not a reward model: the guard's logic above one) whose reward has a
    known exploit: it pays the answer's length, while its gold check is the rule the reward
    was meant to stand for (the answer names the task's colour)."""

    name = "planted"
    resource = "cpu"
    multi_turn = False

    async def verify(self, task, completion):
        from reinforge.envs.domain import Check, Verdict

        reward = min(len(completion.split()) / 20, 1.0)
        gold = task.spec["colour"] in completion
        return Verdict(reward=reward, outcome="pass" if reward >= 0.5 else "fail",
                       checks=[Check(name="gold", passed=gold)])


class Answers:
    """Completions of each task from a fixed function of the task (a scripted policy)."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def complete(self, task, n, domain):
        return [self.answer(task)] * n


def test_a_reward_that_rose_while_the_gold_fell_rolls_back_to_the_gold_peak():
    colours = ["red", "green", "blue", "amber", "teal", "plum"]
    sets = {"planted": [TaskSpec(task_id=f"p{i}", domain="planted", tier=0, prompt="describe",
                                 spec={"colour": colours[i % 6]}) for i in range(12)]}

    def policy(words: int, named: int):
        """Answers of `words` words, naming the colour in the first `named` tasks."""
        return Answers(lambda t: " ".join(
            ([t.spec["colour"]] if int(t.task_id[1:]) < named else ["grey"]) + ["kite"] *
            (words - 1)))

    async def scores(p):
        return (await evaluate_sets(sets, {"planted": PlantedProxy()}, p,
                                    samples=2, k=1))["planted"]

    peak, slid, hacked, better = (trio.run(scores, p) for p in (
        policy(8, 12), policy(12, 9), policy(24, 0), policy(15, 12)))
    assert (peak.reward_mean, peak.gold_pass_rate) == (pytest.approx(0.4), 1.0)
    assert (hacked.reward_mean, hacked.gold_pass_rate) == (1.0, 0.0)
    assert peak.figures()["gold_pass_rate"] == 1.0 and hacked.figures()["reward_mean"] == 1.0
    # v4 is the gold peak; v8 slid a little (not significant: 3 of 12 tasks worse) and,
    # passing the guard, became the last good version, but not the peak
    peaks = gold_peaks_after({}, m.WeightsPublished(version=4, path="/v4"), {"planted": peak})
    assert regression_rollback(8, {"planted": slid}, {}, GoodVersion(version=4, path="/v4"),
                               gold_peaks=peaks, gold_alpha=0.01, drop_margin=0.05) == ([], None)
    peaks = gold_peaks_after(peaks, m.WeightsPublished(version=8, path="/v8"), {"planted": slid})
    assert peaks["planted"].version == 4
    last_good = GoodVersion(version=8, path="/v8")
    # v12 pleases the reward with no colour at all: against the peak, significant
    flagged, rb = regression_rollback(12, {"planted": hacked}, {}, last_good, gold_peaks=peaks,
                                      gold_alpha=0.01, drop_margin=0.05)
    assert flagged == ["planted"] and (rb.to_version, rb.path) == (4, "/v4")
    assert ("planted over-optimised: its reward rose +0.600 while its gold pass rate fell "
            "1.000 since its gold peak v4 on 12 tasks (12 worse, 0 better; sign test "
            "p=0.00024)") in rb.reason
    # the reward up with the gold kept is learning, not over-optimising; the guard off
    assert regression_rollback(12, {"planted": better}, {}, last_good, gold_peaks=peaks,
                               gold_alpha=0.01, drop_margin=0.05) == ([], None)
    assert regression_rollback(12, {"planted": hacked}, {}, last_good,
                               gold_peaks=peaks) == ([], None)
    # a better gold moves the peak; a domain without a gold check has none
    plain = score_domain("math", [[True]], k=1, task_ids=["t"])
    moved = gold_peaks_after(peaks, m.WeightsPublished(version=16, path="/v16"),
                             {"planted": better, "math": plain})
    assert (moved["planted"].version, moved["planted"].path, sorted(moved)) == (
        16, "/v16", ["planted"])


def test_the_rotation_sees_every_domain_within_its_bound():
    names = [f"d{i}" for i in range(10)]
    seen, start = [], 0
    for _ in range(4):  # ceil(10 / 3) versions
        picked = rotation(names, start, 3)
        assert len(picked) == 3
        seen += picked
        start += len(picked)
    assert set(seen) == set(names)
    assert rotation(names, 7, 0) == names  # 0: every domain every version


def test_a_tier_with_a_small_bank_of_prompts_keeps_half_of_them_for_training():
    """gym-coin_flip's easiest level has 8 distinct prompts: asking 20 held-out tasks of it,
    or 8, used to hold out all 8, and the scheduler could never train on that tier."""
    import random

    from reinforge.rl.evalsets import fingerprint

    reg = DomainRegistry.default()
    coin = reg.get("gym-coin_flip")
    rng = random.Random(7)
    draws = [fingerprint(coin.sample_task(rng, 0).prompt) for _ in range(400)]
    bank = set(draws)
    for asked in (20, len(bank)):  # more than the bank, and all of it (the draws reach it)
        held = build_heldout(reg, ["gym-coin_flip"],
                             HeldOutConfig(tasks_per_tier=asked, tiers=[0]))
        held_fps = {fingerprint(t.prompt) for t in held["gym-coin_flip"]}
        assert 0 < len(held_fps) <= len(bank) // 2
        assert len(bank - held_fps) >= len(bank) // 2  # what the scheduler may still issue
        assert sum(fp not in held_fps for fp in draws) > len(draws) / 4


def test_a_large_tier_gets_its_full_held_out_count():
    sets = build_heldout(DomainRegistry.default(), ["math"], HeldOutConfig(tasks_per_tier=20,
                                                                             tiers=[0, 2]))
    assert [sum(t.tier == k for t in sets["math"]) for k in (0, 2)] == [20, 20]
