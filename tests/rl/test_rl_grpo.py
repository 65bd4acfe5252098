"""GRPO maths against hand computations (CPU, no model unless stated)."""

import math

import pytest
import torch
from reinforge.rl import grpo
from reinforge.rl.grpo import AdvantageNorm
from reinforge.engine.sampling import token_logprobs


def t(xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def test_group_std_advantages_of_a_hand_made_group():
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    adv = grpo.group_advantages(t([1, 0, 0, 1]), torch.tensor([True] * 4), eps=0.0)
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]
    # 3, 1, 2: mean 2, population std sqrt(2/3)
    adv = grpo.group_advantages(t([3, 1, 2]), torch.tensor([True] * 3), eps=0.0)
    s = math.sqrt(2 / 3)
    assert adv.tolist() == pytest.approx([1 / s, -1 / s, 0.0])


def test_dr_grpo_advantages_are_only_centred():
    adv = grpo.group_advantages(t([1, 0, 0, 0]), torch.tensor([True] * 4),
                                norm=AdvantageNorm.NONE)
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25]


def test_domain_std_advantages_divide_by_the_domain_scale():
    scales = grpo.domain_reward_scales([1, 0, 0.5, 0.5], [True] * 4, ["m", "m", "d", "d"])
    assert scales == {"m": 0.5, "d": 0.0}
    adv = grpo.group_advantages(t([1, 0]), torch.tensor([True, True]),
                                norm=AdvantageNorm.DOMAIN_STD, scale=0.25, eps=0.0)
    assert adv.tolist() == [2.0, -2.0]
    with pytest.raises(ValueError, match="needs the domain's `scale`"):
        grpo.group_advantages(t([1, 0]), torch.tensor([True, True]),
                              norm=AdvantageNorm.DOMAIN_STD)


def test_a_scale_floor_keeps_crumbs_of_credit_from_weighing_as_a_pass():
    """reasoning-gym scores some wrong answers 0.06: divided by that group's own std
    (0.026), the wrong answer would be pushed as hard as a pass against a fail."""
    crumbs, passed, ok = t([0, 0, 0.06, 0]), t([1, 0, 0, 0]), torch.tensor([True] * 4)
    assert grpo.group_advantages(crumbs, ok, eps=0.0).max().item() == pytest.approx(3 ** 0.5)
    floored = grpo.group_advantages(crumbs, ok, eps=0.0, scale_floor=0.25)
    assert floored.tolist() == pytest.approx([-0.06, -0.06, 0.18, -0.06])
    assert grpo.group_advantages(passed, ok, eps=0.0, scale_floor=0.25).tolist() == \
        grpo.group_advantages(passed, ok, eps=0.0).tolist()  # one pass in 4: std 0.43
    assert grpo.group_advantages(crumbs[:2], ok[:2], norm=AdvantageNorm.DOMAIN_STD,
                                 scale=0.01, eps=0.0, scale_floor=0.25).tolist() == [0.0, 0.0]
    assert grpo.group_advantages(t([1, 0]), ok[:2], norm=AdvantageNorm.DOMAIN_STD,
                                 scale=0.1, eps=0.0, scale_floor=0.25).tolist() == [2.0, -2.0]


def test_infra_error_samples_are_masked_out_of_mean_std_and_advantage():
    # the masked reward (99) must not move the baseline: valid rewards 1, 0 -> +1, -1
    adv = grpo.group_advantages(t([1, 99, 0]), torch.tensor([True, False, True]), eps=0.0)
    assert adv.tolist() == [1.0, 0.0, -1.0]


def test_clipped_objective_and_gradient_match_a_hand_computation():
    # one sequence of three tokens, advantage +2, clip 0.2
    # token 0: ratio e^0.1 = 1.105 (inside) -> loss -2r, d/dlogp = -2r
    # token 1: ratio e^0.5 = 1.649 > 1.2 with A > 0 -> clipped: loss -2*1.2, grad 0
    # token 2: ratio e^-0.5 = 0.607 < 0.8 with A > 0 -> min picks the unclipped -2r, grad -2r
    old = t([[0.0, 0.0, 0.0]]) - 1.0
    logp = (old + t([[0.1, 0.5, -0.5]])).requires_grad_(True)
    mask = torch.ones(1, 3)
    terms = grpo.clipped_policy_terms(logp, old, t([2.0]), mask, clip_low=0.2, clip_high=0.2)
    r = [math.exp(0.1), math.exp(0.5), math.exp(-0.5)]
    assert terms.loss.detach().tolist()[0] == pytest.approx([-2 * r[0], -2 * 1.2, -2 * r[2]])
    assert terms.clipped.tolist() == [[0.0, 1.0, 0.0]]
    loss = grpo.token_mean(terms.loss, mask)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2 * r[0] / 3, 0.0, -2 * r[2] / 3])


def test_negative_advantages_clip_on_the_low_side():
    # A = -1: ratio 0.5 < 0.8 -> clipped at 0.8 (grad 0); ratio 1.5 -> unclipped (grad +r)
    old = t([[0.0, 0.0]])
    logp = t([[math.log(0.5), math.log(1.5)]]).requires_grad_(True)
    terms = grpo.clipped_policy_terms(logp, old, t([-1.0]), torch.ones(1, 2),
                                      clip_low=0.2, clip_high=0.28)
    assert terms.loss.detach().tolist()[0] == pytest.approx([0.8, 1.5])
    grpo.token_mean(terms.loss, torch.ones(1, 2)).backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 1.5 / 2])


def test_the_ratio_is_exactly_one_on_policy_and_the_gradient_is_reinforce():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float32)
    targets = torch.randint(0, 11, (2, 5))
    behaviour = grpo.target_logprobs(logits, targets, temperature=0.7)
    logp = grpo.target_logprobs(logits.clone().requires_grad_(True), targets, temperature=0.7)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    adv = t([0.5, -1.5], torch.float32)
    terms = grpo.clipped_policy_terms(logp, behaviour, adv, mask)
    assert torch.equal(terms.ratio, torch.ones_like(terms.ratio))
    assert float(terms.clipped.sum()) == 0.0
    # on-policy the loss gradient w.r.t. logp is -A / num_tokens on each valid token
    lp = logp.detach().requires_grad_(True)
    grpo.token_mean(grpo.clipped_policy_terms(lp, behaviour, adv, mask).loss, mask).backward()
    want = -adv.unsqueeze(1) * mask / 8
    assert torch.allclose(lp.grad, want)


def test_target_logprobs_are_log_softmax_of_tempered_logits():
    logits = t([[2.0, 0.0, -1.0]])
    got = grpo.target_logprobs(logits, torch.tensor([0]), temperature=2.0)
    z = [1.0, 0.0, -0.5]
    want = z[0] - math.log(sum(math.exp(v) for v in z))
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_target_logprobs_match_what_the_rollout_server_reports_greedy_included():
    """The learner reads logprobs by the server's one definition: greedy (T = 0) is T = 1."""
    logits = torch.randn(3, 4, 11)
    targets = torch.randint(0, 11, (3, 4))
    for temperature in (0.0, 0.7, 1.0):
        served = token_logprobs(logits.reshape(12, 11), torch.full((12,), temperature))
        want = served.gather(1, targets.reshape(12, 1)).reshape(3, 4)
        assert torch.equal(grpo.target_logprobs(logits, targets, temperature), want)
    assert torch.equal(grpo.target_logprobs(logits, targets, 0.0),
                       grpo.target_logprobs(logits, targets, 1.0))


def test_token_mean_over_micro_batches_equals_the_whole_batch_mean():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    whole = grpo.token_mean(values, mask)
    parts = grpo.token_mean(values[:1], mask[:1], 5) + grpo.token_mean(values[1:], mask[1:], 5)
    assert float(whole) == pytest.approx(3.0) and float(parts) == pytest.approx(3.0)


def test_k3_kl_is_zero_at_equality_and_positive_elsewhere():
    mask = torch.ones(1, 2)
    assert grpo.k3_kl(t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), mask).tolist() == [[0.0, 0.0]]
    kl = grpo.k3_kl(t([[-1.0]]), t([[-1.5]]), torch.ones(1, 1))
    assert float(kl) == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_staleness_filtering_drops_groups_older_than_the_cap_and_future_versions():
    assert grpo.staleness(7, 5) == 2
    assert not grpo.is_too_stale(7, [5, 6, 7], max_staleness=2)
    assert grpo.is_too_stale(7, [4, 7], max_staleness=2)  # one sample 3 versions old
    assert not grpo.is_too_stale(3, [3, 3], max_staleness=0)
    assert grpo.is_too_stale(3, [2], max_staleness=0)
    assert grpo.is_too_stale(3, [4], max_staleness=10)  # claims a version not yet published


def test_staleness_is_counted_per_segment_weighted_by_its_tokens():
    single, partial = [(5, 10)], [(4, 2), (6, 6)]  # a partial rollout: turns at v4 and v6
    figures = grpo.segment_staleness(7, [single, partial])
    # (2*10 + 3*2 + 1*6) / 18 tokens
    assert figures == {"staleness_token_mean": pytest.approx(32 / 18), "partial_rollouts": 1.0}
    assert grpo.segment_staleness(7, []) == {"staleness_token_mean": 0.0, "partial_rollouts": 0.0}


# ----------------------------------------------------------------------------- TIS, gaps


def test_tis_weights_are_truncated_above_the_cap_and_one_off_the_mask():
    # logp_old - logp_behaviour = 0.1, 1.0, -0.5, 3.0; cap 2; the last token is masked
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = old - t([[0.1, 1.0, -0.5, 3.0]])
    w = grpo.truncated_is_weights(old, behaviour, t([[1, 1, 1, 0]]), cap=2.0)
    assert w.weight.tolist()[0] == pytest.approx([math.exp(0.1), 2.0, math.exp(-0.5), 1.0])
    assert w.capped.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="TIS cap must be >= 1, got 0.5"):
        grpo.truncated_is_weights(old, behaviour, t([[1, 1, 1, 0]]), cap=0.5)


def test_tis_weights_the_gradient_where_the_plain_clip_would_zero_it():
    # A = +2, gaps logp - behaviour = 0.1, 0.5, 1.0, clip 0.2, cap 2:
    # plain PPO: ratios e^0.1 (inside), e^0.5 and e^1 (> 1.2: clipped, gradient 0)
    # TIS: ratio to the learner's own logprobs is 1 (never clipped), weights e^0.1, e^0.5,
    # min(e^1, 2) = 2 -> loss -2w per token, gradient -2w / 3
    behaviour = t([[-1.0, -1.0, -1.0]])
    gaps = [0.1, 0.5, 1.0]
    mask = torch.ones(1, 3)
    logp = (behaviour + t([gaps])).requires_grad_(True)
    terms, tis = grpo.tis_policy_terms(logp, behaviour, t([2.0]), mask, cap=2.0)
    w = [math.exp(0.1), math.exp(0.5), 2.0]
    assert terms.loss.detach().tolist()[0] == pytest.approx([-2 * x for x in w])
    assert terms.ratio.tolist() == [[1.0, 1.0, 1.0]] and terms.clipped.tolist() == [[0, 0, 0]]
    assert tis.capped.tolist() == [[0.0, 0.0, 1.0]]
    grpo.token_mean(terms.loss, mask).backward()
    assert logp.grad.tolist()[0] == pytest.approx([-2 * x / 3 for x in w])

    plain_logp = logp.detach().requires_grad_(True)
    plain = grpo.clipped_policy_terms(plain_logp, behaviour, t([2.0]), mask)
    grpo.token_mean(plain.loss, mask).backward()
    assert plain_logp.grad.tolist()[0] == pytest.approx([-2 * math.exp(0.1) / 3, 0.0, 0.0])


def test_tis_changes_neither_loss_nor_gradient_on_policy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5))
    behaviour = grpo.target_logprobs(logits, targets)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]])
    adv = t([0.5, -1.5])
    grads, losses = [], []
    for tis in (False, True):
        logp = grpo.target_logprobs(logits.clone().requires_grad_(True), targets)
        logp.retain_grad()
        if tis:
            terms, w = grpo.tis_policy_terms(logp, behaviour, adv, mask, cap=2.0)
            assert torch.equal(w.weight, torch.ones_like(w.weight))
        else:
            terms = grpo.clipped_policy_terms(logp, behaviour, adv, mask)
        loss = grpo.token_mean(terms.loss, mask)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad)
    assert losses[0] == losses[1]
    assert torch.equal(grads[0], grads[1])


def test_logprob_gaps_count_only_masked_in_tokens_and_summarise_by_hand():
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
    behaviour = t([[-1.25, -1.5, -3.0], [-0.625, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    gaps = grpo.abs_logprob_gaps(logp, behaviour, mask)
    assert gaps.tolist() == [0.25, 0.5, 0.0, 0.125]  # the masked 8-nat gap is left out
    assert grpo.summarise_gaps(gaps, 0.1) == (0.21875, 0.5, 0.75)
    assert grpo.summarise_gaps(gaps, 0.25) == (0.21875, 0.5, 0.25)  # strictly above
    assert grpo.summarise_gaps(gaps[:0], 0.1) == (0.0, 0.0, 0.0)
