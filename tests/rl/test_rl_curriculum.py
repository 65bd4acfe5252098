"""The scheduler's pure logic: tiers, signal, mixing, flow control (no bus)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from reinforge.rl.curriculum import (
    CurriculumConfig,
    DomainCurriculum,
    DomainDraw,
    RunningStats,
    TaskRecord,
    draw_domain,
    group_has_signal,
    group_straddles_pass,
    informative_probability,
    issue_budget,
    mix_probabilities,
    new_task_signal_rate,
    pick_recurring_task,
    prior_signal_rate,
    updated_signal_rate,
)

CFG = CurriculumConfig(min_groups=3, window_groups=4, explore=0.0)


def test_informative_probability_matches_the_binomial_by_hand():
    assert informative_probability(0.5, 4) == pytest.approx(1 - 2 / 16)
    assert informative_probability(0.9, 2) == pytest.approx(2 * 0.9 * 0.1)
    assert informative_probability(1.0, 8) == 0.0
    assert informative_probability(0.0, 8) == 0.0
    assert informative_probability(0.5, 1) == 0.0


def test_a_group_has_signal_only_when_its_valid_rewards_differ():
    assert not group_has_signal([1.0, 1.0, 1.0])
    assert not group_has_signal([0.0, 0.0])
    assert not group_has_signal([1.0])
    assert group_has_signal([0.0, 1.0, 1.0])
    assert group_has_signal([0.5, 0.25])
    assert not group_has_signal([1, 0], [True, False])  # one valid sample only
    assert group_has_signal([1, 0, 0, 0], [True] * 4)
    assert not group_has_signal([1, 0, 0], [False, True, True])


def test_rewards_closer_than_the_reward_spread_carry_no_signal():
    """reasoning-gym's crumbs of credit: 0.01 for a well-formed wrong answer, a closeness
    of 1e-3 for a near one. A group of such failures is not worth a full-size advantage."""
    assert not group_has_signal([0.01, 0.0, 0.01, 0.0])
    assert not group_has_signal([0.0012, 0.00018, 0.0])
    assert group_has_signal([0.06, 0.0, 0.0])  # futoshiki's partial grids: credit enough
    assert group_has_signal([1.0, 0.01, 0.0])
    assert group_has_signal([0.01, 0.0], min_spread=0.0)  # 0: any difference at all
    assert not group_has_signal([0.3, 0.3], min_spread=0.0)
    assert not group_has_signal([0.3, 1.0, 0.0], [True, False, True], min_spread=0.5)


def test_the_curriculum_moves_a_domain_up_a_tier_when_its_tasks_are_all_solved():
    cur = DomainCurriculum.new(CFG, n_tiers=3)
    moves = [cur.record(0, 1.0) for _ in range(3)]
    assert moves == [0, 0, 1]
    assert cur.level == 1
    # the next move needs min_groups new groups at the new level
    assert cur.record(1, 1.0) == 0 and cur.record(1, 1.0) == 0
    assert cur.record(1, 1.0) == 1 and cur.level == 2
    for _ in range(5):  # top tier: nowhere to go
        cur.record(2, 1.0)
    assert cur.level == 2


def test_the_curriculum_moves_a_domain_down_a_tier_when_none_are_solved():
    cur = DomainCurriculum.new(CurriculumConfig(start_tier=2, min_groups=3, explore=0.0), 4)
    assert cur.level == 2
    assert [cur.record(2, 0.0) for _ in range(3)] == [0, 0, -1]
    assert cur.level == 1
    for _ in range(3):
        cur.record(1, 0.0)
    assert cur.level == 0
    for _ in range(4):
        cur.record(0, 0.0)
    assert cur.level == 0


def test_a_curriculum_given_measured_rates_starts_at_the_easiest_tier_not_yet_solved():
    # the starting policy solves tier 0 (0.94 > promote_above 0.8): it starts at tier 1
    cur = DomainCurriculum.new(CurriculumConfig(explore=0.0), 5, [0.94, 0.54, 0.44, 0.0])
    assert cur.level == 1
    assert cur.window(0) == [0.94] and cur.window(3) == [0.0] and cur.window(4) == []
    # every measured tier solved: the next one; nothing left: the top
    assert DomainCurriculum.new(CurriculumConfig(), 3, [0.9, 0.85]).level == 2
    assert DomainCurriculum.new(CurriculumConfig(), 2, [0.9, 0.85]).level == 1
    assert DomainCurriculum.new(CurriculumConfig(start_tier=2), 3, []).level == 2
    with pytest.raises(ValueError, match=r"in \[0, 1\], one per tier"):
        DomainCurriculum.new(CurriculumConfig(), 2, [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"in \[0, 1\], one per tier"):
        DomainCurriculum.new(CurriculumConfig(), 2, [54.0])


def test_mixed_results_keep_the_domain_at_its_tier():
    cur = DomainCurriculum.new(CFG, n_tiers=3)
    for r in [0.5, 0.25, 0.75, 0.5, 0.5, 0.625]:
        assert cur.record(0, r) == 0
    assert cur.level == 0


def test_groups_at_other_tiers_do_not_move_the_level():
    cur = DomainCurriculum.new(CFG, n_tiers=3)
    for _ in range(6):
        assert cur.record(1, 1.0) == 0  # exploration results inform predictions only
    assert cur.level == 0
    assert cur.predicted(1) > 0.8


def test_exploration_goes_to_the_neighbour_tier_predicted_to_carry_more_signal():
    cur = DomainCurriculum.new(CurriculumConfig(explore=1.0, prior_groups=1.0), 3)
    cur.state.level = 1
    cur.state.windows = {0: [1.0] * 8, 1: [0.9] * 8, 2: [0.5] * 8}
    rng = random.Random(0)
    seen = Counter(cur.choose_tier(rng, 8) for _ in range(1000))
    assert set(seen) == {0, 2}
    for tier, n in seen.items():
        for _ in range(n):
            cur.issued(tier)
    p0 = informative_probability(cur.predicted(0), 8) + 0.05
    p2 = informative_probability(cur.predicted(2), 8) + 0.05
    share = p2 / (p0 + p2)
    assert share > 0.8
    assert abs(seen[2] / 1000 - share) < 4 * math.sqrt(share * (1 - share) / 1000)
    assert cur.tier_mix() == {0: seen[0] / 1000, 2: seen[2] / 1000}


def test_moves_and_exploration_step_over_a_closed_tier():
    cur = DomainCurriculum.new(CurriculumConfig(min_groups=2, window_groups=2, explore=1.0), 4)
    assert cur.close(1)
    assert cur.band() == [0, 2]
    assert [cur.record(0, 1.0) for _ in range(2)] == [0, 1]
    assert cur.level == 2 and cur.band() == [0, 2, 3]
    rng = random.Random(3)
    assert {cur.choose_tier(rng, 8) for _ in range(200)} == {0, 3}
    assert [cur.record(2, 0.0) for _ in range(2)] == [0, -1]
    assert cur.level == 0


def test_a_level_on_a_closed_tier_moves_to_the_open_neighbour_nearer_half_passing():
    up = DomainCurriculum.new(CFG, 4, measured=[1.0, 0.5])  # tier 2 predicted 0.2
    assert up.level == 1 and up.close(1) and up.level == 2
    down = DomainCurriculum.new(CFG, 4, measured=[0.7, 0.1])  # tier 2 predicted 0.02
    assert down.level == 0 and down.close(0) and down.level == 1
    assert down.close(1) and down.level == 2 and down.band() == [2, 3]
    assert down.close(2) and down.close(3) is False


def test_the_tier_mix_counts_the_tiers_tasks_were_issued_at():
    cur = DomainCurriculum.new(CFG, 3)
    for tier in (0, 0, 2):
        cur.issued(tier)
    assert cur.tier_mix() == {0: 2 / 3, 2: 1 / 3}


def test_without_exploration_every_task_is_at_the_level():
    cur = DomainCurriculum.new(CurriculumConfig(explore=0.0, start_tier=2), 5)
    rng = random.Random(1)
    assert {cur.choose_tier(rng, 4) for _ in range(50)} == {2}


def test_an_unseen_tier_is_predicted_from_its_nearest_observed_neighbour():
    cur = DomainCurriculum.new(CurriculumConfig(tier_step=0.3, prior_groups=1.0), 4)
    assert cur.predicted(2) == pytest.approx(0.5)  # nothing known: the prior
    cur.state.windows = {1: [0.9, 0.9]}
    assert cur.predicted(2) == pytest.approx(0.6)
    assert cur.predicted(0) == pytest.approx(0.98)  # clipped
    # an observed tier is its window mean shrunk by one pseudo-group of its prior
    assert cur.predicted(1) == pytest.approx((1.8 + 0.5) / 3)


def test_bad_curriculum_configs_are_refused_with_the_constraint_named():
    with pytest.raises(ValueError, match="demote_below < promote_above"):
        CurriculumConfig(promote_above=0.3, demote_below=0.6)
    with pytest.raises(ValueError, match="min_groups <= window_groups"):
        CurriculumConfig(min_groups=9, window_groups=4)


def test_mixing_weights_are_honoured_within_sampling_error():
    weights = {"math": 3.0, "code": 1.0, "docqa": 1.0}
    probs = mix_probabilities(weights)
    assert probs == pytest.approx({"math": 0.6, "code": 0.2, "docqa": 0.2})
    rng = random.Random(11)
    n = 5000
    counts = Counter(draw_domain(probs, rng) for _ in range(n))
    for d, p in probs.items():
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[d] - n * p) < 4 * sd, (d, counts[d], n * p)


def test_replay_floors_raise_a_critical_domain_and_shrink_the_others():
    probs = mix_probabilities({"math": 9.0, "code": 1.0, "judge": 0.0}, floors={"judge": 0.2})
    assert probs["judge"] == pytest.approx(0.2)
    assert probs["math"] == pytest.approx(0.8 * 0.9)
    assert probs["code"] == pytest.approx(0.8 * 0.1)
    # a floor already met changes nothing
    probs = mix_probabilities({"math": 1.0, "code": 1.0}, floors={"code": 0.1})
    assert probs == pytest.approx({"math": 0.5, "code": 0.5})
    with pytest.raises(ValueError, match="more than 1"):
        mix_probabilities({"a": 1.0, "b": 1.0}, floors={"a": 0.7, "b": 0.6})


def test_ineligible_domains_get_nothing_and_boosts_multiply_weights():
    probs = mix_probabilities({"math": 1.0, "code": 1.0}, eligible={"code"}, floors={"math": 0.5})
    assert probs == {"code": 1.0}
    probs = mix_probabilities({"math": 1.0, "code": 1.0}, boosts={"code": 3.0})
    assert probs == pytest.approx({"math": 0.25, "code": 0.75})
    assert mix_probabilities({"math": 1.0}, eligible=set()) == {}


def test_recurring_tasks_are_picked_where_their_posterior_pass_rate_is_informative():
    records = {
        "solved": TaskRecord(passes=40, fails=0),
        "hopeless": TaskRecord(passes=0, fails=40),
        "edge": TaskRecord(passes=10, fails=10),
    }
    rng = random.Random(5)
    counts = Counter(
        pick_recurring_task(["solved", "hopeless", "edge"], records, rng, 8) for _ in range(2000)
    )
    # weights: informative_probability of the Beta posterior mean, plus the 0.05 floor
    w = {k: informative_probability((1 + r.passes) / (2 + r.passes + r.fails), 8) + 0.05
         for k, r in records.items()}
    share = w["edge"] / sum(w.values())
    assert share > 0.65
    assert abs(counts["edge"] / 2000 - share) < 4 * math.sqrt(share * (1 - share) / 2000)
    assert counts["solved"] > 0 and counts["hopeless"] > 0  # still revisited (floor)


def test_the_issue_budget_follows_learner_demand_and_staleness():
    # 4 groups per version, staleness 1 -> at most 8 groups ahead of the learner
    assert issue_budget(in_flight=0, max_in_flight=100, groups_per_version=4, max_staleness=1,
                        queued=0) == 8
    assert issue_budget(in_flight=5, max_in_flight=100, groups_per_version=4, max_staleness=1,
                        queued=2) == 1
    assert issue_budget(in_flight=5, max_in_flight=100, groups_per_version=4, max_staleness=1,
                        queued=6) == 0
    assert issue_budget(in_flight=3, max_in_flight=4, groups_per_version=100, max_staleness=3,
                        queued=0) == 1


def test_the_issue_budget_counts_a_task_by_its_chance_of_carrying_signal():
    # 2 groups per version, staleness 0: 2 groups of signal ahead. At 10 % signal per task,
    # 20 tasks are expected to give them; 5 in flight already count 0.5.
    assert issue_budget(in_flight=0, max_in_flight=100, groups_per_version=2, max_staleness=0,
                        queued=0, expected_in_flight=0.0, signal_rate=0.1) == 20
    assert issue_budget(in_flight=5, max_in_flight=100, groups_per_version=2, max_staleness=0,
                        queued=0, expected_in_flight=0.5, signal_rate=0.1) == 15
    assert issue_budget(in_flight=5, max_in_flight=100, groups_per_version=2, max_staleness=0,
                        queued=1, expected_in_flight=0.5, signal_rate=0.1) == 5
    # the hard cap still holds, and nothing is issued once the demand is met
    assert issue_budget(in_flight=5, max_in_flight=8, groups_per_version=2, max_staleness=0,
                        queued=0, expected_in_flight=0.5, signal_rate=0.1) == 3
    assert issue_budget(in_flight=30, max_in_flight=100, groups_per_version=2, max_staleness=0,
                        queued=0, expected_in_flight=2.0, signal_rate=0.1) == 0
    with pytest.raises(ValueError, match="signal_rate"):
        issue_budget(in_flight=0, max_in_flight=8, groups_per_version=2, max_staleness=0,
                     queued=0, signal_rate=0.0)


def test_a_new_task_counts_by_the_mix_of_floored_domain_rates():
    # a domain never seen with signal still counts at the floor
    assert new_task_signal_rate({"a": 0.5, "b": 0.5}, {"a": 0.0, "b": 0.4},
                                floor=0.05) == pytest.approx(0.225)
    assert new_task_signal_rate({"a": 1.0}, {"a": 3.0}, floor=0.05) == 1.0
    assert new_task_signal_rate({}, {}, floor=0.05) == 1.0  # no mix: every task counts 1


def test_the_signal_rate_follows_recent_groups():
    rate = 0.5
    for _ in range(100):
        rate = updated_signal_rate(rate, False)
    assert rate < 0.01
    for _ in range(100):
        rate = updated_signal_rate(rate, True)
    assert rate > 0.99


def test_a_domains_signal_rate_is_its_posterior_mean_then_a_moving_average():
    rate, verdicts, rates = 0.5, [False] * 8 + [True] * 2 + [False] * 30, []
    for judged, informative in enumerate(verdicts):
        before, rate = rate, updated_signal_rate(rate, informative, judged=judged,
                                                 prior_groups=2.0)
        rates.append(rate)
        if judged < 17:  # 2 pseudo-groups at 0.5 and the verdicts so far, by hand
            seen = verdicts[:judged + 1]
            assert rate == pytest.approx((2 * 0.5 + sum(seen)) / (2 + len(seen)))
        else:  # a verdict weighs 1 / 20 from the 18th on, as the moving average does
            assert rate == pytest.approx(updated_signal_rate(before, informative))
    # eight hopeless groups bring the prior of 0.5 to 0.1; the moving average alone, 0.33
    moving = 0.5
    for _ in range(8):
        moving = updated_signal_rate(moving, False)
    assert rates[7] == pytest.approx(0.1) and moving == pytest.approx(0.5 * 0.95**8)


def test_the_prior_signal_rate_is_the_starts_pass_rate_at_the_level_or_a_half():
    assert prior_signal_rate([0.0], 0, 4) == 0.0  # never passed: probed at the floor
    assert prior_signal_rate([0.9, 0.5], 1, 4) == pytest.approx(1 - 2 / 16)
    assert prior_signal_rate([0.9], 1, 4) == 0.5  # the level's tier was not measured
    assert prior_signal_rate([], 0, 4) == 0.5


def test_a_group_straddles_pass_only_with_a_pass_and_a_non_pass():
    assert group_straddles_pass(1, 4) and group_straddles_pass(3, 4)
    assert not group_straddles_pass(0, 4)  # all failed, however their partial credit differs
    assert not group_straddles_pass(4, 4) and not group_straddles_pass(0, 0)


def test_a_start_pass_rate_measured_on_few_samples_is_read_as_uncertain():
    # no pass in 4 samples: a pass rate of 0.5 / 5 = 0.1 (Jeffreys), not 0
    assert prior_signal_rate([0.0], 0, 4, samples=[4]) == pytest.approx(1 - 0.9**4 - 0.1**4)
    # in 32 samples: 0.5 / 33, a domain probed barely above a 0.02 floor
    assert prior_signal_rate([0.0], 0, 4, samples=[32]) == pytest.approx(
        1 - (32.5 / 33) ** 4 - (0.5 / 33) ** 4)
    # all 4 passed: 4.5 / 5, symmetric; the level's own count is the one read
    assert prior_signal_rate([0.2, 1.0], 1, 4, samples=[100, 4]) == pytest.approx(
        1 - 0.9**4 - 0.1**4)
    # a rate without a count (or a count of 0) is exact
    assert prior_signal_rate([0.0, 0.0], 1, 4, samples=[4]) == 0.0
    assert prior_signal_rate([0.0], 0, 4, samples=[0]) == 0.0


def test_running_stats_match_numpy_mean_and_population_std():
    xs = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0]
    rs = RunningStats()
    for x in xs:
        rs.add(x)
    mean = sum(xs) / len(xs)
    assert rs.mean == pytest.approx(mean)
    assert rs.std == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)))


def simulate_wasted_fraction(choose, true_rates, *, groups=2000, group_size=8, seed=0):
    """Fraction of groups with no signal when tiers are chosen by `choose(rng)` and each
    sample of a tier-t task passes with probability true_rates[t]."""
    rng = random.Random(seed)
    wasted = 0
    for _ in range(groups):
        tier = choose(rng)
        rewards = [1.0 if rng.random() < true_rates[tier] else 0.0 for _ in range(group_size)]
        wasted += not group_has_signal(rewards)
        record = getattr(choose, "record", None)
        if record is not None:  # a curriculum learns from what it chose
            record(tier, sum(rewards) / group_size)
    return wasted / groups


def test_in_simulation_the_curriculum_wastes_fewer_groups_than_fixed_or_uniform_tiers():
    true_rates = [0.99, 0.97, 0.6, 0.1, 0.01]  # only tier 2 is in the informative band
    cur = DomainCurriculum.new(CurriculumConfig(), len(true_rates))

    def by_curriculum(rng):
        return cur.choose_tier(rng, 8)

    by_curriculum.record = cur.record
    curriculum = simulate_wasted_fraction(by_curriculum, true_rates)
    uniform = simulate_wasted_fraction(lambda rng: rng.randrange(5), true_rates)
    easiest = simulate_wasted_fraction(lambda rng: 0, true_rates)
    assert cur.level == 2
    assert curriculum < 0.5 * uniform and curriculum < 0.5 * easiest, (curriculum, uniform,
                                                                         easiest)


def test_a_draw_built_once_picks_what_a_fresh_weighted_choice_would():
    """The planner draws a batch from one DomainDraw; each pick must be the one
    rng.choices over the sorted names would make with the same rng state."""
    probs = {f"d{i}": (i % 7 + 1) / 100 for i in range(50)}
    draw = DomainDraw(probs)
    names = sorted(probs)
    for seed in range(200):
        expected = random.Random(seed).choices(names, weights=[probs[d] for d in names])[0]
        assert draw(random.Random(seed)) == expected
    with pytest.raises(ValueError, match="no eligible domain"):
        DomainDraw({})
