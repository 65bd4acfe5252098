"""reinforge.rl.scoring: pass@k, domain scores, paired changes (worked by hand)."""

from math import comb

import pytest
from reinforge.rl.scoring import (
    Change,
    answer_signature,
    change_beyond_prior,
    mean_change,
    mode_share,
    paired_change,
    pass_at_k,
    score_domain,
)


def test_pass_at_k_equals_the_combinatorial_formula():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (4, 0, 4), (4, 4, 1), (20, 7, 4), (5, 1, 5)]:
        want = 1 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(want)
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 is the mean
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_scores_are_pass_at_1_means_and_unbiased_pass_at_k_by_hand():
    T, F = True, False
    s = score_domain("math", [[T, F, T, F], [F, F, F, F], [T, T, T, T]], k=2)
    assert s.n_tasks == 3 and s.samples == 4
    assert s.pass_at_1 == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert s.pass_at_k == pytest.approx(((1 - comb(2, 2) / comb(4, 2)) + 0.0 + 1.0) / 3)
    assert s.run_pass_rates == pytest.approx([2 / 3, 1 / 3, 2 / 3, 1 / 3])
    assert s.run_std == pytest.approx(1 / 6)


def test_infrastructure_faults_are_masked_not_counted_as_failures():
    s = score_domain("code", [[None, True], [None, None]], k=2)
    assert s.infra_errors == 3
    assert s.n_tasks == 1  # a task with no verified sample is not scored
    assert s.pass_at_1 == 1.0 and s.pass_at_k == 1.0  # k falls to the one verified sample


def test_scores_keep_each_tasks_pass_at_1_by_id_when_given_ids():
    T, F = True, False
    s = score_domain("math", [[T, F, T, F], [None, None], [T, T, T, T]], k=2,
                     task_ids=["a", "b", "c"])
    assert s.task_pass_at_1 == {"a": 0.5, "c": 1.0}  # b has no verified sample
    with pytest.raises(ValueError, match="2 task ids for 3 tasks"):
        score_domain("math", [[T], [F], [T]], k=1, task_ids=["a", "b"])


def test_a_paired_change_of_pass_at_1_has_its_interval_computed_by_hand():
    c = paired_change({"a": 0.0, "b": 0.5, "c": 1.0, "gone": 1.0},
                      {"a": 0.5, "b": 0.5, "c": 1.0, "new": 0.0})
    # differences (.5, 0, 0): mean 1/6, sample std sqrt(1/12) = .2887, se .2887/sqrt(3)
    half = 1.96 * (1 / 12) ** 0.5 / 3 ** 0.5
    assert c.n_tasks == 3 and c.delta == pytest.approx(1 / 6)
    assert c.ci95 == pytest.approx((1 / 6 - half, 1 / 6 + half))
    assert paired_change({"a": 0.0}, {"b": 1.0}).n_tasks == 0


def test_a_change_on_one_task_takes_the_largest_sd_a_change_can_have_and_stays_finite():
    # one difference of a pass rate cannot give a sample sd: the sd of a value in [-1, 1]
    # is at most 1, so the interval is delta +- 1.96, and a mean over domains stays finite
    one = paired_change({"a": 0.0}, {"a": 1.0})
    assert one.ci95 == pytest.approx((1 - 1.96, 1 + 1.96))
    m = mean_change([one, Change(delta=0.0, ci95=(-0.392, 0.392), n_tasks=20)])
    half = 1.96 * (1.0 + 0.04) ** 0.5 / 2
    assert m.ci95 == pytest.approx((0.5 - half, 0.5 + half))


def test_the_mean_of_per_domain_changes_adds_their_variances():
    # se 0.1 and 0.2 (half-widths 0.196, 0.392): mean se = sqrt(.01 + .04) / 2
    m = mean_change([Change(delta=0.2, ci95=(0.2 - 0.196, 0.2 + 0.196), n_tasks=10),
                     Change(delta=0.0, ci95=(-0.392, 0.392), n_tasks=20)])
    half = 1.96 * 0.05 ** 0.5 / 2
    assert m.delta == pytest.approx(0.1) and m.n_tasks == 30
    assert m.ci95 == pytest.approx((0.1 - half, 0.1 + half))


def test_a_weighted_mean_of_changes_weights_their_deltas_and_their_variances():
    # weights 3:1 -> .75 and .25: delta .75 x .2 = .15, se sqrt((.75 x .1)^2 + (.25 x .2)^2)
    changes = [Change(delta=0.2, ci95=(0.2 - 0.196, 0.2 + 0.196), n_tasks=10),
               Change(delta=0.0, ci95=(-0.392, 0.392), n_tasks=20)]
    m = mean_change(changes, weights=[3, 1])
    half = 1.96 * ((0.75 * 0.1) ** 2 + (0.25 * 0.2) ** 2) ** 0.5
    assert m.delta == pytest.approx(0.15) and m.n_tasks == 30
    assert m.ci95 == pytest.approx((0.15 - half, 0.15 + half))
    with pytest.raises(ValueError, match="one weight >= 0 per change"):
        mean_change(changes, weights=[1])


def test_an_answer_signature_is_the_last_non_empty_line_with_its_spaces_collapsed():
    assert answer_signature("7 * 3 = 21\n####   26 \n\n") == "#### 26"
    assert answer_signature("think\n<answer>2</answer>") == "<answer>2</answer>"
    assert answer_signature("  \n") == ""


def test_scores_give_the_share_of_the_most_common_answer():
    T, F = True, False
    s = score_domain("gcd", [[T, F], [F, T]], k=1,
                     answers=["<answer>2</answer>"] * 3 + ["<answer>5</answer>"])
    assert s.answer_mode_share == 0.75
    assert s.figures()["answer_mode_share"] == 0.75
    assert mode_share(["a", "a", "b"]) == pytest.approx(2 / 3) and mode_share([]) == 0.0


def test_a_change_beyond_the_prior_is_measured_against_the_better_baseline_policy():
    # the constant answer (right on a only: .5) beats the start (.25): it is the baseline
    collapsed = change_beyond_prior({"a": 0.25, "b": 0.25}, {"a": 1.0, "b": 0.0},
                                    {"a": 1.0, "b": 0.0})
    assert paired_change({"a": 0.25, "b": 0.25}, {"a": 1.0, "b": 0.0}).delta == 0.25
    assert collapsed.delta == 0.0 and collapsed.n_tasks == 2
    skilled = change_beyond_prior({"a": 0.25, "b": 0.25}, {"a": 1.0, "b": 1.0},
                                  {"a": 1.0, "b": 0.0})
    assert skilled.delta == pytest.approx(0.5)
    # the start (.75) beats the constant answer (.5): the plain paired change
    kept = change_beyond_prior({"a": 0.75, "b": 0.75}, {"a": 1.0, "b": 0.5},
                               {"a": 1.0, "b": 0.0})
    assert kept == paired_change({"a": 0.75, "b": 0.75}, {"a": 1.0, "b": 0.5})
    # no constant answer known (a sandboxed domain): the plain paired change
    assert change_beyond_prior({"a": 0.5}, {"a": 1.0}, {}).delta == 0.5
