"""The learner: grouping, advantages, one GRPO step on the tiny policy, checkpoints, and
the actor on a real nats-server (versions published, ledger, resume without double counting)."""

import functools
import math
from pathlib import Path

import msgspec
import pytest
import torch
import trio
from learner_fixtures import GradientRecorder, generate_group, synthetic_group, with_tokens
from reinforge.rl import checkpoint as ckpt
from reinforge.rl.grpo import AdvantageNorm
from reinforge.actors.learner import (
    DecisionJournal,
    GroupBuffer,
    Learner,
    LearnerConfig,
    train_stats,
)
from reinforge.rl.samples import anchor_samples, prepare_samples
from reinforge.rl.trainer import Trainer, sequence_logprobs
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import run_actor
from reinforge.core.bus import open_bus


def test_a_group_completes_at_group_size_and_counts_infra_errors_toward_it():
    buf = GroupBuffer()
    group = synthetic_group("t1", [1.0, 0.0, 0.0], infra=(1,))
    assert [buf.add(s, f"ticket{i}") for i, s in enumerate(group)] == ["added", "added",
                                                                         "completed"]
    assert len(buf.ready) == 1 and not buf.pending
    done = buf.ready.popleft()
    buf.consume(done, "v1")
    assert buf.ledger == {"t1:0:1": 0, "t1:1:1": 0, "t1:2:1": 0}
    assert buf.tasks == {"t1": "v1"}
    buf.settle(done)
    assert buf.add(group[2], "redelivered") == "consumed"
    assert buf.counts["duplicates_skipped"] == 1


def complete_group(task_id: str, rewards: list[float]):
    """A buffer holding one complete group of `task_id` (tickets ticket0, ticket1, ...)."""
    buf = GroupBuffer()
    group = synthetic_group(task_id, rewards)
    for i, s in enumerate(group):
        buf.add(s, f"ticket{i}")
    return buf, group


def test_a_redelivery_to_a_complete_group_joins_it_and_starts_no_second_group_of_its_task():
    # seen under chaos: a sample redelivered while its group waited to be trained made a
    # second group of the task, trained in the next version too
    buf, group = complete_group("t1", [1.0, 0.0])
    assert [buf.add(s, f"again{i}") for i, s in enumerate(group)] == ["duplicate"] * 2
    assert not buf.pending and len(buf.ready) == 1
    assert buf.ready[0].tickets == ["ticket0", "ticket1", "again0", "again1"]


def test_a_redelivery_is_held_until_the_decision_of_its_group_is_durable():
    buf, group = complete_group("t1", [1.0, 0.0])
    trained = buf.ready.popleft()
    buf.consume(trained, "v1")  # trained; its checkpoint is being written
    assert buf.add(group[0], "redelivered") == "duplicate"  # acked with the batch, not now
    assert trained.tickets[-1] == "redelivered"
    buf.settle(trained)  # the checkpoint committed
    assert buf.add(group[0], "late") == "consumed"
    assert trained.tickets[-1] == "redelivered"


def test_an_expired_group_takes_no_more_samples_while_it_is_dropped():
    buf = GroupBuffer()
    a, b = synthetic_group("t1", [1.0, 0.0])
    buf.add(a, "ticket-a")
    [expired] = buf.expire(older_than=float("inf"))
    assert buf.add(b, "ticket-b") == "duplicate"
    assert not buf.ready and not buf.pending and expired.tickets == ["ticket-a", "ticket-b"]


def test_a_later_attempt_of_a_decided_task_is_skipped_not_trained_again():
    import msgspec

    buf, first = complete_group("t3", [1.0, 0.0])
    done = buf.ready.popleft()
    buf.consume(done, "v4")
    buf.settle(done)
    # the scheduler's lease ran out and attempt 2 of the same task finished later
    retry = [msgspec.structs.replace(s, rollout=msgspec.structs.replace(
        s.rollout, rollout_id=s.rollout.rollout_id.replace(":1", ":2")))
        for s in first]
    assert [buf.add(s, f"b{i}") for i, s in enumerate(retry)] == ["consumed", "consumed"]
    assert not buf.ready and not buf.pending
    assert buf.counts["decided_task_samples_skipped"] == 2


def test_a_duplicate_sample_is_held_with_its_group_but_not_counted_twice():
    buf = GroupBuffer()
    a, b = synthetic_group("t2", [1.0, 0.0])
    assert buf.add(a, "t-a") == "added"
    assert buf.add(a, "t-a-again") == "duplicate"
    assert buf.add(b, "t-b") == "completed"
    group = buf.ready[0]
    assert len(group.samples) == 2 and group.tickets == ["t-a", "t-a-again", "t-b"]


def test_prepare_samples_masks_infra_errors_and_reports_rewards_per_domain():
    groups = [synthetic_group("a", [1.0, 0.0, 0.5], infra=(2,)),
              synthetic_group("b", [0.2, 0.6], domain="docqa")]
    samples, fig = prepare_samples(groups, AdvantageNorm.GROUP_STD)
    assert [s.rollout_id for s in samples] == ["a:0:1", "a:1:1", "b:0:1", "b:1:1"]
    assert [round(s.advantage, 4) for s in samples] == [1.0, -1.0, -1.0, 1.0]
    assert fig["masked_samples"] == 1.0
    assert fig["reward_mean/math"] == pytest.approx(0.5)
    assert fig["reward_mean/docqa"] == pytest.approx(0.4)


def make_config(model_dir, tmp_path, **kw):
    # group_size 0: each group is as large as its rollouts say (the tests make several sizes)
    base = {"model": str(model_dir), "checkpoint_dir": str(tmp_path / "ckpt"), "group_size": 0,
            "groups_per_version": 2, "learning_rate": 1e-3, "torch_threads": 1, "ack_wait_s": 30.0}
    base.update(kw)
    return LearnerConfig(**base)


@pytest.mark.smoke
def test_learner_logprobs_match_generate_and_the_on_policy_ratio_is_exactly_one(
    tiny_model_dir, tmp_path
):
    group = generate_group(tiny_model_dir, task_id="g", version=0)
    trainer = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    prompts = [s.rollout.prompt_ids for s in group]
    outputs = [s.rollout.output_ids for s in group]
    with torch.no_grad():
        logp, _ = sequence_logprobs(trainer.model, prompts, outputs)
    behaviour = torch.tensor([s.rollout.logprobs for s in group])
    assert torch.allclose(logp, behaviour, atol=1e-4)  # generate's logprobs = the learner's
    # behaviour logprobs from the learner's own forward (its group forward shares the
    # prompt): the ratio must be exactly 1
    own = trainer.logprobs(prepare_samples([group], AdvantageNorm.GROUP_STD)[0])
    on_policy = [m.ScoredRollout(rollout=m.Rollout(**{**_fields(s.rollout),
                                                     "logprobs": lp.tolist()}),
                                 reward=s.reward, outcome=s.outcome)
                 for s, lp in zip(group, own, strict=True)]
    samples, _ = prepare_samples([on_policy], AdvantageNorm.GROUP_STD)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    fig = trainer.train_step(samples, version=0)
    assert fig["ratio_dev_max_on_policy"] == 0.0
    assert fig["clip_frac"] == 0.0 and fig["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert fig["kl_behaviour"] == 0.0
    assert fig["grad_norm"] > 0
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _fields(struct):
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


# ----------------------------------------------------------------------------- loss mask

# A two-turn episode: 2 policy tokens, 2 of environment text, 2 policy tokens, 2 of
# environment text at the end (the sampler records environment tokens with logprob 0.0).
TURNS_MASK = [1, 1, 0, 0, 1, 1, 0, 0]


def learner_logprobs(trainer, group) -> list[list[float]]:
    """The trainer's own logprobs of `group`'s outputs (by the path its steps take)."""
    samples, _ = prepare_samples([group], AdvantageNorm.GROUP_STD)
    return [logp.tolist() for logp in trainer.logprobs(samples)]


def behaviour_at(own: list[list[float]], env_logprob: float) -> list[list[float]]:
    """The learner's own logprobs on policy tokens, `env_logprob` on environment tokens."""
    return [[lp if keep else env_logprob for lp, keep in zip(row, TURNS_MASK, strict=True)]
            for row in own]


def test_prepare_samples_carries_the_loss_mask_and_gives_single_turn_rollouts_all_ones():
    turns = synthetic_group("mt", [1.0, 0.0], tokens=8, loss_mask=TURNS_MASK)
    single = synthetic_group("st", [1.0, 0.0], tokens=3)  # the sampler leaves loss_mask empty
    torn = synthetic_group("torn", [1.0, 0.0, 0.5], tokens=3, loss_mask=[1, 0])  # wrong length
    samples, fig = prepare_samples([turns, single, torn], AdvantageNorm.GROUP_STD)
    masks = {s.rollout_id: s.loss_mask for s in samples}
    assert masks == {"mt:0:1": TURNS_MASK, "mt:1:1": TURNS_MASK,
                     "st:0:1": [1, 1, 1], "st:1:1": [1, 1, 1]}
    assert fig["masked_samples"] == 3.0


@pytest.mark.parametrize("tis_cap", [0.0, 2.0], ids=["tis-off", "tis-on"])
def test_environment_tokens_add_nothing_to_the_gradient_whatever_their_ids_and_logprobs(
    tiny_model_dir, tmp_path, tis_cap
):
    trainer = Trainer(make_config(tiny_model_dir, tmp_path, max_grad_norm=0.0, tis_cap=tis_cap),
                      tiny_model_dir)
    recorder = GradientRecorder(trainer)
    group = synthetic_group("mt", [1.0, 0.0], tokens=8, loss_mask=TURNS_MASK)
    own = learner_logprobs(trainer, group)
    # Environment ids in the middle are context for later policy tokens, so only the
    # trailing ones are free to change without changing what the policy saw.
    other_ids = [s.rollout.output_ids[:6] + [900, 901] for s in group]
    variants = [with_tokens(group, logprobs=behaviour_at(own, 0.0)),
                with_tokens(group, logprobs=behaviour_at(own, -7.5), output_ids=other_ids)]
    losses, grads = [], []
    for variant in variants:
        samples, _ = prepare_samples([variant], AdvantageNorm.GROUP_STD)
        losses.append(trainer.train_step(samples, version=0)["loss"])
        grads.append(recorder.grads)
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert any(bool(g.abs().sum() > 0) for g in grads[0])  # the policy tokens do train


def test_the_token_count_and_the_ratio_figures_cover_only_policy_tokens(tiny_model_dir, tmp_path):
    trainer = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    group = synthetic_group("mt", [1.0, 0.0], tokens=8, loss_mask=TURNS_MASK)
    on_policy = with_tokens(group, logprobs=behaviour_at(learner_logprobs(trainer, group), 0.0))
    samples, _ = prepare_samples([on_policy], AdvantageNorm.GROUP_STD)
    fig = trainer.train_step(samples, version=0)
    assert fig["tokens"] == 8.0  # 2 samples x 4 policy tokens, not 16
    # behaviour = learner on every policy token: exactly on policy, environment tokens aside
    assert fig["ratio_mean"] == 1.0 and fig["ratio_dev_max_on_policy"] == 0.0
    assert fig["clip_frac"] == 0.0 and fig["kl_behaviour"] == 0.0


# ----------------------------------------------------------------------------- TIS


def step_with(trainer, recorder, group, **cfg):
    """One step over `group` under `cfg` changes; (figures, gradient)."""
    trainer.cfg = msgspec.structs.replace(trainer.cfg, **cfg)
    samples, _ = prepare_samples([group], AdvantageNorm.GROUP_STD)
    return trainer.train_step(samples, version=0), recorder.grads


def test_with_tis_a_biased_behaviour_is_reweighted_and_without_it_clipped(tiny_model_dir,
                                                                         tmp_path):
    trainer = Trainer(make_config(tiny_model_dir, tmp_path, max_grad_norm=0.0), tiny_model_dir)
    recorder = GradientRecorder(trainer)
    group = synthetic_group("b", [1.0, 0.0])  # advantages +1, -1; 4 tokens each
    own = learner_logprobs(trainer, group)
    on_policy = with_tokens(group, logprobs=own)
    # as if the engine's KV cache made every token 0.25 nats less likely than the learner does
    biased = with_tokens(group, logprobs=[[lp - 0.25 for lp in row] for row in own])

    _, grad_on = step_with(trainer, recorder, on_policy, tis_cap=2.0)
    fig_tis, grad_tis = step_with(trainer, recorder, biased, tis_cap=2.0)
    fig_plain, grad_plain = step_with(trainer, recorder, biased, tis_cap=0.0)

    # TIS: every token weighted by exp(0.25) < cap, so the gradient is the importance-
    # weighted on-policy one; the clip never binds.
    w = math.exp(0.25)
    assert all(torch.allclose(g, w * g0, rtol=1e-4, atol=1e-5)  # float32 sums
               for g, g0 in zip(grad_tis, grad_on, strict=True))
    assert fig_tis["clip_frac"] == 0.0 and fig_tis["tis_capped_share"] == 0.0
    assert fig_tis["tis_weight_mean"] == pytest.approx(w, rel=1e-5)
    assert fig_tis["logp_mismatch_mean_nats"] == pytest.approx(0.25, abs=1e-5)
    assert fig_tis["logp_mismatch_max_nats"] == pytest.approx(0.25, abs=1e-5)
    assert fig_tis["logp_mismatch_share_over"] == 1.0  # all 8 tokens above 0.1 nats
    # Without TIS, ratio exp(0.25) > 1 + 0.2: the +1 sample's 4 tokens are clipped away
    assert fig_plain["clip_frac"] == 0.5 and "tis_weight_mean" not in fig_plain
    assert not all(torch.allclose(g, g_tis, rtol=1e-3)
                   for g, g_tis in zip(grad_plain, grad_tis, strict=True))


def test_with_behaviour_equal_to_the_learner_tis_changes_nothing(tiny_model_dir, tmp_path):
    trainer = Trainer(make_config(tiny_model_dir, tmp_path, max_grad_norm=0.0), tiny_model_dir)
    recorder = GradientRecorder(trainer)
    group = synthetic_group("e", [1.0, 0.0, 0.0, 1.0])
    on_policy = with_tokens(group, logprobs=learner_logprobs(trainer, group))
    fig_tis, grad_tis = step_with(trainer, recorder, on_policy, tis_cap=2.0)
    fig_plain, grad_plain = step_with(trainer, recorder, on_policy, tis_cap=0.0)
    assert fig_tis["loss"] == fig_plain["loss"]
    assert all(torch.equal(a, b) for a, b in zip(grad_tis, grad_plain, strict=True))
    assert fig_tis["tis_weight_mean"] == 1.0 and fig_tis["tis_capped_share"] == 0.0
    assert fig_tis["logp_mismatch_max_nats"] == 0.0 and fig_tis["logp_mismatch_share_over"] == 0.0


# ----------------------------------------------------------------------------- batching


def test_micro_batches_respect_the_sequence_and_the_padded_token_budgets():
    from reinforge.rl.trainer import micro_batches, split_evenly

    class S:
        def __init__(self, n):
            self.prompt_ids, self.output_ids = [1] * 2, [2] * (n - 2)

    lengths = [4, 4, 10, 3, 3, 3, 30]
    runs = micro_batches([S(n) for n in lengths], size=3, token_budget=12)
    assert [[len(s.prompt_ids) + len(s.output_ids) for s in run] for run in runs] == [
        [4, 4], [10], [3, 3, 3], [30]]  # 3 x 4 = 12 fits, 3 x 10 would not; 30 alone
    assert [len(r) for r in micro_batches([S(4)] * 7, size=3)] == [3, 3, 1]
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([0, 1], 4) == [[0], [1]]


def test_micro_batches_by_prompt_hold_one_prompt_each_in_first_seen_order():
    from reinforge.rl.trainer import micro_batches

    class S:
        def __init__(self, prompt, n):
            self.prompt_ids, self.output_ids = prompt, [2] * n

    samples = [S([1], 3), S([7, 7], 3), S([1], 4), S([7, 7], 2), S([1], 5), S([3], 1)]
    runs = micro_batches(samples, size=2, by_prompt=True)
    assert [[samples.index(s) for s in run] for run in runs] == [[0, 2], [4], [1, 3], [5]]


def test_a_shared_prompt_forward_gives_each_output_the_logprobs_and_gradient_of_its_own(
        tiny_model_dir):
    """The group forward (the prompt once, its keys and values for every output) computes
    the same function as one padded sequence per sample, outputs of unequal length too."""
    from reinforge.rl.trainer import load_policy, prompt_group_logprobs

    torch.manual_seed(0)
    model = load_policy(tiny_model_dir).train()
    prompt = torch.randint(5, 400, (11,)).tolist()
    outputs = [torch.randint(5, 400, (n,)).tolist() for n in (6, 1, 9, 3, 0)]
    weights = torch.arange(1.0, 10.0)  # a loss that weighs every position differently
    results = []
    for forward in (lambda: sequence_logprobs(model, [prompt] * 5, outputs),
                    lambda: prompt_group_logprobs(model, prompt, outputs)):
        model.zero_grad(set_to_none=True)
        logp, mask = forward()
        (logp * weights).sum().backward()
        results.append((logp.detach(), mask, [p.grad.clone() for p in model.parameters()]))
    (each, each_mask, each_grad), (shared, shared_mask, shared_grad) = results
    assert torch.equal(each_mask, shared_mask)
    assert each_mask.sum(dim=1).tolist() == [6, 1, 9, 3, 0]
    assert torch.allclose(each, shared, atol=1e-5)
    # float32 sums in another order: each tensor agrees to 1e-5 of its largest entry
    assert all(float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
               for a, b in zip(each_grad, shared_grad, strict=True))
    assert any(bool(g.abs().sum() > 0) for g in shared_grad)
    with torch.no_grad():  # a group whose every output is empty has nothing to score
        assert prompt_group_logprobs(model, prompt, [[], []])[0].shape == (2, 0)


def test_the_gradient_is_the_same_whatever_the_micro_batches(tiny_model_dir, tmp_path):
    group = synthetic_group("mb", [1.0, 0.0, 0.0, 1.0], tokens=6)
    grads = []
    for cut in ({"micro_batch_size": 8}, {"micro_batch_size": 1},
                {"micro_batch_size": 8, "micro_batch_tokens": 20},
                {"micro_batch_size": 8, "share_prompts": False},
                {"micro_batch_size": 3, "gradient_checkpointing": True}):
        trainer = Trainer(make_config(tiny_model_dir, tmp_path, max_grad_norm=0.0, **cut),
                          tiny_model_dir)
        recorder = GradientRecorder(trainer)
        samples, _ = prepare_samples([group], AdvantageNorm.GROUP_STD)
        trainer.train_step(samples, version=0)
        grads.append(recorder.grads)
    for other in grads[1:]:
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                   for a, b in zip(grads[0], other, strict=True))


def test_ppo_epochs_and_minibatches_take_that_many_steps_and_later_ones_clip(
        tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path, learning_rate=0.05, ppo_epochs=3,
                      minibatches=2, clip_low=0.05, clip_high=0.05)
    trainer = Trainer(cfg, tiny_model_dir)
    group = synthetic_group("ppo", [1.0, 0.0, 0.0, 1.0], tokens=6)
    on_policy = with_tokens(group, logprobs=learner_logprobs(trainer, group))
    steps = []
    optimizer_step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (steps.append(1), optimizer_step())[1]
    samples, _ = prepare_samples([on_policy], AdvantageNorm.GROUP_STD)
    fig = trainer.train_step(samples, version=0)
    assert len(steps) == fig["optimizer_steps"] == 6.0
    # the first step is on policy (ratio 1, nothing clipped); as the policy moves, the
    # ratio to the policy before the first step leaves the clip range
    assert fig["ratio_dev_max_on_policy"] == 0.0
    assert fig["clip_frac_epoch_0"] < fig["clip_frac_epoch_2"]
    assert fig["clip_frac_epoch_2"] > 0.0
    one = Trainer(make_config(tiny_model_dir, tmp_path, learning_rate=0.05), tiny_model_dir)
    assert "clip_frac_epoch_0" not in one.train_step(samples, version=0)


# ----------------------------------------------------------------------------- precision


def test_bf16_training_steps_float32_masters_and_serves_their_bf16_rounding(
        tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path, precision="bf16", learning_rate=1e-2)
    trainer = Trainer(cfg, tiny_model_dir)
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {m.dtype for m in trainer.master} == {torch.float32}
    before = [m.detach().clone() for m in trainer.master]
    samples, _ = prepare_samples([synthetic_group("bf", [1.0, 0.0, 0.0, 1.0])],
                                 AdvantageNorm.GROUP_STD)
    fig = trainer.train_step(samples, version=0)
    assert math.isfinite(fig["loss"]) and fig["grad_norm"] > 0
    assert any(not torch.equal(m, b) for m, b in zip(trainer.master, before, strict=True))
    assert all(torch.equal(p, m.to(torch.bfloat16))
               for p, m in zip(params, trainer.master, strict=True))
    # the float32 masters travel in the trainer state: a restart resumes them, not the
    # bf16 rounding of them; a rollback too, with their optimizer state
    state = trainer.state_dict(step=1, ledger={}, counters={})
    resumed = Trainer(cfg, tiny_model_dir, state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.master, trainer.master, strict=True))
    assert any(not torch.equal(m, p.float()) for m, p in zip(trainer.master, params,
                                                             strict=True))
    trainer.restore(tiny_model_dir, state)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert trainer.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()


def trained_once(model_dir, tmp_path, task_id):
    """A trainer of the tiny policy after one step on a two-sample group, and that group."""
    trainer = Trainer(make_config(model_dir, tmp_path), model_dir)
    samples, _ = prepare_samples([synthetic_group(task_id, [1.0, 0.0], tokens=5)],
                                 AdvantageNorm.GROUP_STD)
    trainer.train_step(samples, version=0)
    return trainer, samples


def test_a_checkpoint_keeps_the_optimizers_moments_in_safetensors_and_gives_them_back_exactly(
        tiny_model_dir, tmp_path):
    trainer, samples = trained_once(tiny_model_dir, tmp_path, "ck")
    state = trainer.state_dict(step=1, ledger={"ck:0:1": 1}, counters={"trained_groups": 1})
    path = ckpt.save_model_checkpoint(tmp_path / "v1", model=trainer.model,
                                      tokenizer_src=tiny_model_dir, version=1,
                                      trainer_state=state)
    moments = sum(p.numel() for p in trainer.model.parameters()) * 2 * 4  # float32 x 2
    assert (path / ckpt.OPTIMIZER_TENSORS).stat().st_size >= moments
    assert (path / ckpt.TRAINER_STATE).stat().st_size < moments / 20
    loaded = ckpt.load_trainer_state(path)
    want, got = state["optimizer"], loaded["optimizer"]
    assert got["param_groups"] == want["param_groups"] and loaded["ledger"] == {"ck:0:1": 1}
    assert got["state"].keys() == want["state"].keys()
    for index, slots in want["state"].items():
        assert slots.keys() == got["state"][index].keys()
        assert all(torch.equal(value, got["state"][index][name]) for name, value in slots.items())
    resumed = Trainer(make_config(tiny_model_dir, tmp_path), path, loaded)
    resumed.train_step(samples, version=1)
    trainer.train_step(samples, version=1)  # the step after, from memory and from disk
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(),
                                                 trainer.model.parameters(), strict=True))


def test_a_snapshot_stays_the_policy_it_was_taken_from_and_writes_the_same_checkpoint(
        tiny_model_dir, tmp_path):
    trainer, samples = trained_once(tiny_model_dir, tmp_path, "sn")
    live = ckpt.save_model_checkpoint(tmp_path / "live", model=trainer.model,
                                      tokenizer_src=None, version=1,
                                      trainer_state=trainer.state_dict(step=1, ledger={},
                                                                       counters={}))
    model, weights, state = trainer.snapshot(step=1, ledger={}, counters={})
    trainer.train_step(samples, version=1)  # changes the live tensors in place
    copy = ckpt.save_model_checkpoint(tmp_path / "copy", model=model, weights=weights,
                                      tokenizer_src=None, version=1, trainer_state=state)
    from safetensors.torch import load_file

    for name in ("model.safetensors", ckpt.OPTIMIZER_TENSORS):
        want, got = load_file(live / name), load_file(copy / name)
        assert want.keys() == got.keys()  # tied weights stay one tensor in the file
        assert all(torch.equal(want[k], got[k]) for k in want)
    moved = load_file(copy / "model.safetensors")
    now = trainer.model.state_dict()
    assert any(not torch.equal(moved[k], now[k]) for k in moved)  # the step after moved it
    assert ckpt.load_trainer_state(copy)["rng"].equal(ckpt.load_trainer_state(live)["rng"])


def test_a_sealed_journal_clears_only_the_lines_its_checkpoint_holds(tmp_path):
    journal = DecisionJournal(tmp_path / DecisionJournal.NAME)
    journal.append("a", "no_signal", {"a:0:1": 0})
    sealed = journal.seal()  # a checkpoint's state is taken here
    journal.append("b", "stale", {"b:0:1": 0})  # decided while that checkpoint is written
    assert [t for t, _, _ in journal.read()] == ["a", "b"]
    journal.clear(sealed)
    assert journal.read() == [("b", "stale", {"b:0:1": 0})]
    # a crash between a seal and its clear: a new learner replays both, and its next
    # checkpoint's seal hands back both files to clear
    left = journal.seal()
    journal.append("c", "no_signal", {"c:0:1": 0})
    again = DecisionJournal(tmp_path / DecisionJournal.NAME)
    assert [t for t, _, _ in again.read()] == ["b", "c"]
    both = again.seal()
    assert set(left) < set(both) and len(both) == 2
    again.clear(both)
    assert again.read() == [] and sorted(p.name for p in tmp_path.iterdir()) == []


def test_bf16_autocast_keeps_float32_weights_and_float32_logprobs_near_fp32(
        tiny_model_dir, tmp_path):
    group = synthetic_group("ac", [1.0, 0.0], tokens=6)
    samples, _ = prepare_samples([group], AdvantageNorm.GROUP_STD)
    fp32 = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    auto = Trainer(make_config(tiny_model_dir, tmp_path, precision="bf16-autocast"),
                   tiny_model_dir)
    a, b = fp32.logprobs(samples), auto.logprobs(samples)
    assert all(x.dtype == torch.float32 for x in b)
    gap = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    assert 0.0 < gap < 0.2  # bf16 matmuls: near, not equal
    auto.train_step(samples, version=0)
    assert {p.dtype for p in auto.model.parameters()} == {torch.float32}


def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_dir, tmp_path):
    group = synthetic_group("gc", [1.0, 0.0, 0.0, 1.0], tokens=6)
    grads = []
    for checkpointing in (False, True):
        trainer = Trainer(make_config(tiny_model_dir, tmp_path, max_grad_norm=0.0,
                                      gradient_checkpointing=checkpointing), tiny_model_dir)
        assert trainer.model.is_activation_checkpointing == checkpointing
        recorder = GradientRecorder(trainer)
        samples, _ = prepare_samples([group], AdvantageNorm.GROUP_STD)
        trainer.train_step(samples, version=0)
        grads.append(recorder.grads)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads, strict=True))


def test_lora_trains_only_adapters_and_publishes_merged_weights_the_engine_serves(
        tiny_model_dir, tmp_path):
    from reinforge.actors.learner import LoraSettings
    from reinforge.engine.loader import load_model

    cfg = make_config(tiny_model_dir, tmp_path, learning_rate=1e-2,
                      lora=LoraSettings(r=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj")))
    trainer = Trainer(cfg, tiny_model_dir)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
            if not p.requires_grad}
    adapters = trainer.state_dict(step=0, ledger={}, counters={})["lora"]
    assert adapters and all("lora_" in n for n in adapters)
    samples, _ = prepare_samples([synthetic_group("lora", [1.0, 0.0, 0.0, 1.0], tokens=6)],
                                 AdvantageNorm.GROUP_STD)
    trainer.train_step(samples, version=0)
    trainer.train_step(samples, version=1)  # a LoRA B starts at zero: the A's move at step 2
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], b) for n, b in base.items())  # the base is frozen
    state = trainer.state_dict(step=2, ledger={}, counters={})
    assert all(not torch.equal(state["lora"][n], adapters[n]) for n in adapters)
    # published merged: a plain checkpoint the engine loads, computing what the learner does
    path = ckpt.save_model_checkpoint(tmp_path / "v2", model=trainer.export_model(),
                                      tokenizer_src=tiny_model_dir, version=2, step=2)
    ids = torch.tensor(samples[0].prompt_ids + samples[0].output_ids)
    with torch.no_grad():
        want = trainer.model(input_ids=ids[None]).logits[0]
    got = load_model(path).prefill(ids, all_logits=True)
    assert (want - got).abs().max().item() < 1e-4
    # a restarted learner resumes the adapters from the trainer state, on the base model
    again = Trainer(cfg, path, state)
    assert all(torch.equal(dict(again.model.named_parameters())[n], v)
               for n, v in state["lora"].items())


@pytest.mark.parametrize("bad, why", [({"precision": "fp16"}, "precision must be one of"),
                                      ({"device": "tpu"}, "device must be cpu, cuda or cuda:N"),
                                      ({"replicas": 0}, "replicas must be >= 1"),
                                      ({"replicas": 2, "device": "cuda"},
                                       "replicas > 1 needs device")])
def test_an_unknown_precision_or_device_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        LearnerConfig(**bad)


def test_a_tis_cap_between_zero_and_one_is_refused():
    with pytest.raises(ValueError, match="tis_cap must be 0 \\(off\\) or >= 1, got 0.5"):
        LearnerConfig(tis_cap=0.5)


def test_the_mismatch_and_tis_figures_reach_train_stats_the_monitor_and_the_report():
    from reinforge.actors.monitor import MonitorState, render_line
    from reinforge.metrics.report import summarise

    typed = {"logp_mismatch_mean_nats": 0.05, "logp_mismatch_max_nats": 0.25,
             "logp_mismatch_share_over": 0.1, "logp_mismatch_threshold_nats": 0.1,
             "tis_weight_mean": 1.01, "tis_capped_share": 0.002}
    stats = train_stats(3, 3, {"loss": 0.5, "kl_behaviour": 0.01, **typed})
    assert stats.figures == {"loss": 0.5, "kl_behaviour": 0.01}  # each figure in one place
    assert (stats.logp_mismatch_max_nats, stats.tis_capped_share) == (0.25, 0.002)
    assert m.decode(m.encode(stats)) == stats
    later = train_stats(4, 4, {"loss": 0.4, **typed, "logp_mismatch_mean_nats": 0.07,
                               "logp_mismatch_max_nats": 0.2, "tis_capped_share": 0.004})

    st = MonitorState("r")
    records = [st.on_stats(stats, 1.0), st.on_stats(later, 2.0)]
    assert records[0]["figures"] == {"loss": 0.5, "kl_behaviour": 0.01, **typed}
    snap = st.snapshot(3.0)
    assert snap.train_figures["logp_mismatch_mean_nats"] == 0.07
    assert "|dlogp| mean 0.070 max 0.200 nats, 10.0% > 0.1; TIS w 1.010 capped 0.4%" in \
        render_line(snap)

    figures, _, _, _ = summarise(records)
    assert figures["logp_mismatch_mean_nats"] == pytest.approx(0.06)  # mean of the steps
    assert figures["logp_mismatch_max_nats"] == 0.25  # max of the steps
    assert figures["tis_capped_share_mean"] == pytest.approx(0.003)
    assert figures["learner_tis_weight_mean"] == 1.01  # the last step's, like every figure


def test_checkpoints_are_atomic_complete_and_pruned(tiny_model_dir, tmp_path):
    trainer = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    root = tmp_path / "ck"
    for v in (1, 2, 3):
        ckpt.save_model_checkpoint(ckpt.version_dir(root, v), model=trainer.model,
                                   tokenizer_src=tiny_model_dir, version=v, step=v,
                                   trainer_state={"step": v, "ledger": {"x": v}})
    (root / "v4").mkdir()  # a half-written directory without a manifest is not a checkpoint
    (root / ".tmp-v5-dead").mkdir()
    assert ckpt.latest_checkpoint(root) == (3, (root / "v3").absolute())
    assert ckpt.remove_temp_dirs(root) == [".tmp-v5-dead"]
    assert ckpt.prune_checkpoints(root, keep_last=2, protect=(3,)) == [1]
    assert ckpt.load_trainer_state(root / "v3")["ledger"] == {"x": 3}
    with pytest.raises(ckpt.CheckpointError, match="never rewritten"):
        ckpt.save_model_checkpoint(root / "v3", model=trainer.model, tokenizer_src=None,
                                   version=3)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(root / "v3"), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(root / "v3")).encode("12") == \
        AutoTokenizer.from_pretrained(str(tiny_model_dir)).encode("12")
    for a, b in zip(loaded.state_dict().values(), trainer.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_pruning_keeps_the_two_newest_multiples_of_keep_every_for_the_evaluator(tmp_path):
    root = tmp_path / "ck"
    for v in range(1, 13):  # manifests only: pruning looks at nothing else
        (root / f"v{v}").mkdir(parents=True)
        (root / f"v{v}" / ckpt.MANIFEST).write_text(f'{{"version": {v}}}')
    assert [v for v, _ in ckpt.list_checkpoints(root)] == list(range(1, 13))
    deleted = ckpt.prune_checkpoints(root, keep_last=2, protect=(12,), keep_every=4)
    assert deleted == [1, 2, 3, 4, 5, 6, 7, 9, 10]
    assert [v for v, _ in ckpt.list_checkpoints(root)] == [8, 11, 12]  # 12 is a multiple too


# ----------------------------------------------------------------------------- on the bus


async def publish(bus, run, scored, prefix="scored"):
    for s in scored:
        await bus.publish_durable(subjects.scored(run, s.rollout.domain), s,
                                  msg_id=f"{prefix}:{s.rollout.rollout_id}")


async def learner_until(bus, creds, run, cfg, version):
    """Run a learner until it has published `version`, then stop it; that WeightsPublished."""
    stream = await bus.ensure_run_stream(run)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_actor, Learner, creds=creds, run=run,
                                              config=cfg))
        w = await wait_for_version(bus, stream, run, version)
        nursery.cancel_scope.cancel()
    return w


async def wait_for_version(bus, stream, run, version, timeout_s=120.0):
    with trio.fail_after(timeout_s):
        while True:
            last = await bus.last_message(stream, subjects.weights(run))
            if last is not None:
                w = m.decode(last.data)
                if w.version >= version:
                    return w
            await trio.sleep(0.2)


async def all_acked(bus, stream, run, timeout_s):
    """Wait until the learner holds no scored rollout unacked."""
    durable = subjects.durable_name(run, "learner", subjects.scored(run, "*"))
    with trio.fail_after(timeout_s):
        while (await bus.consumer_info(stream, durable)).num_ack_pending:
            await trio.sleep(0.2)


async def collect_stats(bus, run, out, task_status=trio.TASK_STATUS_IGNORED):
    async with bus.subscribe(subjects.stats(run, "learner")) as sub:
        task_status.started()
        async for batch in sub:
            out.extend(m.decode(r.data) for r in batch)


@pytest.mark.nats
@pytest.mark.slow
@pytest.mark.parametrize("overlap, replicas", [(True, 1), (False, 1), (True, 2)],
                         ids=["overlapped", "in-turn", "two-replicas"])
def test_the_learner_publishes_three_versions_from_rollouts_tagged_with_their_version(
    creds, run_name, tiny_model_dir, tmp_path, overlap, replicas
):
    cfg = make_config(tiny_model_dir, tmp_path, max_staleness=0, keep_last=2,
                      overlap_checkpoints=overlap, replicas=replicas)
    generated: dict[str, int] = {}
    stats: list = []
    weights: list = []

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            await nursery.start(collect_stats, bus, run_name, stats)
            await nursery.start(functools.partial(run_actor, Learner, creds=creds, run=run_name,
                                                  config=cfg))
            path, version = tiny_model_dir, 0
            for _ in range(3):
                for k in range(cfg.groups_per_version):  # sample from the policy the learner has
                    group = await trio.to_thread.run_sync(functools.partial(
                        generate_group, path, task_id=f"v{version}-t{k}", version=version,
                        seed=version * 10 + k))
                    generated.update({s.rollout.rollout_id: version for s in group})
                    await publish(bus, run_name, group)
                w = await wait_for_version(bus, stream, run_name, version + 1)
                assert w.version == version + 1 and Path(w.path).is_dir()
                weights.append(w)
                path, version = w.path, w.version
            with trio.fail_after(10):
                while len(stats) < 3:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [w.version for w in weights] == [1, 2, 3]
    state = ckpt.load_trainer_state(weights[-1].path)
    assert state["step"] == 3
    assert state["ledger"] == generated  # every rollout consumed once, with its own version
    assert [s.version for s in stats] == [1, 2, 3]
    for s in stats:
        assert s.figures["staleness_max"] == 0.0
        # behaviour logprobs came from the published checkpoint of the version they claim
        assert s.figures["ratio_dev_max_on_policy"] < 1e-3
        assert s.logp_mismatch_max_nats < 1e-3 and s.logp_mismatch_share_over == 0.0
        assert s.tis_weight_mean == pytest.approx(1.0, abs=1e-3)
        assert s.figures["samples"] == 8.0 and s.figures["tokens"] == 64.0
        assert "reward_mean/math" in s.figures and "tokens_per_s" in s.figures
    assert sorted(p.name for p in Path(cfg.checkpoint_dir).iterdir()) == ["v2", "v3"]


@pytest.mark.nats
@pytest.mark.slow
def test_a_restarted_learner_resumes_and_skips_what_its_checkpoint_consumed(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, max_staleness=0)
    group_a = synthetic_group("a", [1.0, 0.0, 0.0, 1.0], version=0)
    group_b = synthetic_group("b", [0.0, 1.0, 1.0, 1.0], version=1)
    group_c = synthetic_group("c", [0.0, 1.0, 0.0, 0.0], version=0)  # stale at version 1
    stats: list = []

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            async with trio.open_nursery() as nursery:
                await nursery.start(collect_stats, bus, run_name, stats)
                await publish(bus, run_name, group_a)
                w1 = await learner_until(bus, creds, run_name, cfg, 1)
                # as if the server redelivered group a after the crash, plus new work
                await publish(bus, run_name, group_a, prefix="redelivered")
                await publish(bus, run_name, group_c)
                await publish(bus, run_name, group_b)
                w2 = await learner_until(bus, creds, run_name, cfg, 2)
                with trio.fail_after(10):
                    while len(stats) < 2:
                        await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
            decisions = [m.decode(d.data) async for d in bus.read_stream(
                stream, filter_subject=subjects.decision(run_name))]
            return w1, w2, decisions

    w1, w2, decisions = trio.run(main)
    assert (w1.version, w2.version) == (1, 2)
    # Each group's fate, told once; a's redelivery sends "trained in v1" again, which the
    # server's duplicate window stores once.
    assert [(d.task_id, d.fate.value, d.version) for d in decisions] == [
        ("a", "accepted", 0), ("a", "trained", 1),
        ("c", "stale", 1), ("b", "accepted", 1), ("b", "trained", 2)]
    assert (decisions[0].signal, decisions[0].samples, decisions[0].tokens) == (True, 4, 16)
    state = ckpt.load_trainer_state(w2.path)
    assert state["step"] == 2
    assert all(s["step"] == 2 for s in state["optimizer"]["state"].values())  # Adam resumed
    ids = lambda g, v: {s.rollout.rollout_id: v for s in g}
    assert state["ledger"] == {**ids(group_a, 0), **ids(group_b, 1), **ids(group_c, 0)}
    last = stats[-1].figures
    assert last["duplicates_skipped"] == 4.0
    assert last["dropped_stale_groups"] == 1.0 and last["samples"] == 4.0


def test_checkpoints_after_a_restart_keep_the_tokenizer_once_the_resumed_one_is_pruned(
    creds, run_name, tiny_model_dir, tmp_path
):
    """A restarted learner resumes from its newest checkpoint; when pruning removes that one,
    the checkpoints it writes next still carry the tokenizer (a sampler or `reinforge eval`
    loads them on their own)."""
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, keep_last=2,
                      max_staleness=5)
    groups = [synthetic_group(t, [1.0, 0.0, 0.0, 1.0], version=0) for t in "abcd"]

    async def main():
        async with open_bus(creds) as bus:
            await bus.ensure_run_stream(run_name)
            await publish(bus, run_name, groups[0])
            await learner_until(bus, creds, run_name, cfg, 1)
            for g in groups[1:]:
                await publish(bus, run_name, g)
            return await learner_until(bus, creds, run_name, cfg, 4)  # resumes from v1

    last = trio.run(main)
    kept = ckpt.list_checkpoints(tmp_path / "ckpt")
    assert [v for v, _ in kept] == [3, 4] and last.version == 4
    for _, path in kept:
        assert (path / "tokenizer.json").read_bytes() == \
            (tiny_model_dir / "tokenizer.json").read_bytes()


def test_the_kl_term_to_the_reference_starts_at_zero_and_enters_the_loss(tiny_model_dir, tmp_path):
    group = synthetic_group("k", [1.0, 0.0, 0.0, 1.0])
    samples, _ = prepare_samples([group], AdvantageNorm.NONE)
    trainer = Trainer(make_config(tiny_model_dir, tmp_path, kl_coef=0.5), tiny_model_dir,
                      reference_dir=tiny_model_dir)
    first = trainer.train_step(samples, version=0)
    assert first["kl_ref"] == 0.0 and first["loss"] == pytest.approx(first["policy_loss"])
    second = trainer.train_step(samples, version=0)
    assert second["kl_ref"] > 0.0
    assert second["loss"] == pytest.approx(second["policy_loss"] + 0.5 * second["kl_ref"])


def test_anchors_add_only_their_kl_to_the_reference_and_pull_the_policy_back(tiny_model_dir,
                                                                             tmp_path):
    """An anchor group (no signal) trains nothing by itself; once the policy has moved, its
    KL to the reference is > 0, and a step with it moves the policy back on its prompt."""
    trained, _ = prepare_samples([synthetic_group("t", [1.0, 0.0, 0.0, 1.0])], AdvantageNorm.NONE)
    anchors = anchor_samples([synthetic_group("a", [0.0, 0.0, 0.0, 0.0])])
    cfg = make_config(tiny_model_dir, tmp_path, anchor_domains=["d"], anchor_kl_coef=5.0)
    trainer = Trainer(cfg, tiny_model_dir, reference_dir=tiny_model_dir)
    reference = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    first = trainer.train_step(trained, version=0, anchors=anchors)
    assert first["anchor_kl"] == 0.0 and first["anchor_samples"] == 4.0
    assert "kl_ref" not in first  # the trained tokens carry no KL term
    for _ in range(3):  # the policy moves away from its start
        trainer.train_step(trained, version=0)

    def drift():  # mean |logp - logp_reference| over the anchors' tokens
        now, ref = trainer.logprobs(anchors), reference.logprobs(anchors)
        return float(sum((a - b).abs().sum() for a, b in zip(now, ref, strict=True)))

    moved = drift()
    pulled = trainer.train_step(trained[:1], version=0, anchors=anchors)
    assert pulled["anchor_kl"] > 0.0 and moved > 0.0
    alone = Trainer(make_config(tiny_model_dir, tmp_path), tiny_model_dir)
    for _ in range(4):
        alone.train_step(trained, version=0)
    alone.train_step(trained[:1], version=0)
    without = float(sum((a - b).abs().sum() for a, b in zip(
        alone.logprobs(anchors), reference.logprobs(anchors), strict=True)))
    assert drift() < without  # the same steps without anchors end farther from the start


def test_anchors_need_their_domains_and_weight_together(tiny_model_dir, tmp_path):
    for kw in ({"anchor_domains": ["d"]}, {"anchor_kl_coef": 1.0},
               {"anchor_domains": ["d"], "anchor_kl_coef": 1.0, "anchor_groups": 0}):
        with pytest.raises(ValueError, match="anchor_domains goes with"):
            make_config(tiny_model_dir, tmp_path, **kw)
    with pytest.raises(ValueError, match="anchor_kl_coef must be >= 0"):
        make_config(tiny_model_dir, tmp_path, anchor_domains=["d"], anchor_kl_coef=-1.0)


def learner_process(run_name, creds_file, model_dir, checkpoint_dir, *settings):
    """`reinforge actor run` arguments of a learner training a version per group."""
    extra = [arg for setting in settings for arg in ("--set", setting)]
    return ("actor", "run", "reinforge.actors.learner:Learner", "--run", run_name, "--creds",
            str(creds_file), "--set", f"model={model_dir}", "--set",
            f"checkpoint_dir={checkpoint_dir}", "--set", "groups_per_version=1", "--set",
            "group_size=0", "--set", "ack_wait_s=3", "--set", "torch_threads=1", *extra)


def assert_each_rollout_trained_once(weights, *groups):
    """The checkpoint of `weights` took a step per group, each rollout in its version's."""
    state = ckpt.load_trainer_state(weights.path)
    assert state["step"] == len(groups)
    assert state["ledger"] == {s.rollout.rollout_id: s.rollout.policy_version
                               for group in groups for s in group}


def two_versions_of_groups():
    return (synthetic_group("a", [1.0, 0.0, 0.0, 1.0], version=0),
            synthetic_group("b", [0.0, 1.0, 1.0, 1.0], version=1))


@pytest.mark.nats
@pytest.mark.slow
def test_a_learner_killed_with_a_partial_group_loses_nothing_and_counts_nothing_twice(
    creds, creds_file, run_name, tiny_model_dir, tmp_path, spawn
):
    args = learner_process(run_name, creds_file, tiny_model_dir, tmp_path / "ckpt")
    group_a, group_b = two_versions_of_groups()

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            first = spawn(*args, log_name="learner1.log")
            await publish(bus, run_name, group_a)
            await wait_for_version(bus, stream, run_name, 1, timeout_s=120)
            await publish(bus, run_name, group_b[:2])
            async with bus.subscribe(subjects.heartbeat(run_name)) as beats:
                with trio.fail_after(30):  # until the learner holds the half group
                    async for batch in beats:
                        hb = [m.decode(r.data) for r in batch]
                        if any(h.figures.get("pending_groups") == 1.0 for h in hb):
                            break
            first.kill()
            first.wait()
            await publish(bus, run_name, group_b[2:])
            spawn(*args, log_name="learner2.log")
            return await wait_for_version(bus, stream, run_name, 2, timeout_s=120)

    w2 = trio.run(main)
    assert_each_rollout_trained_once(w2, group_a, group_b)


@pytest.mark.nats
@pytest.mark.slow
def test_a_replica_killed_mid_run_stops_its_learner_and_the_next_one_loses_nothing(
    creds, creds_file, run_name, tiny_model_dir, tmp_path, spawn
):
    """kill -9 of a worker replica: the learner's next collective fails and the learner
    exits (its supervisor would start it again); the next learner, with new replicas,
    resumes from the checkpoint, and every rollout is trained once."""
    import psutil

    args = learner_process(run_name, creds_file, tiny_model_dir, tmp_path / "ckpt",
                           "replicas=2")
    group_a, group_b = two_versions_of_groups()

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            first = spawn(*args, log_name="learner1.log")
            await publish(bus, run_name, group_a)
            await wait_for_version(bus, stream, run_name, 1, timeout_s=120)
            (replica,) = [c for c in psutil.Process(first.pid).children(recursive=True)
                          if "reinforge.rl.replicas" in " ".join(c.cmdline())]
            replica.kill()
            await publish(bus, run_name, group_b)
            with trio.fail_after(120):
                while first.poll() is None:
                    await trio.sleep(0.2)
            spawn(*args, log_name="learner2.log")
            return first.returncode, await wait_for_version(bus, stream, run_name, 2,
                                                            timeout_s=120)

    code, w2 = trio.run(main)
    assert code != 0
    assert "ReplicaLost: a learner replica is gone: rank 1 (pid " in \
        (tmp_path / "learner1.log").read_text()
    assert_each_rollout_trained_once(w2, group_a, group_b)


async def train_one_version_per_group(bus, creds, run_name, cfg, groups, after_version=None):
    """A learner trains `groups`, one version each (`after_version(bus, v)` once v is out),
    until every step's stats are out (they follow its pruning); the last WeightsPublished."""
    stats: list = []
    async with trio.open_nursery() as nursery:
        stream = await bus.ensure_run_stream(run_name)
        await nursery.start(collect_stats, bus, run_name, stats)
        await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                              run=run_name, config=cfg))
        for i, g in enumerate(groups, 1):
            await publish(bus, run_name, g)
            w = await wait_for_version(bus, stream, run_name, i)
            if after_version is not None:
                await after_version(bus, i)
        with trio.fail_after(30):
            while len(stats) < len(groups):
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return w


@pytest.mark.nats
def test_a_learner_publishing_to_the_store_makes_each_version_fetchable_elsewhere_and_prunes_it(
    creds, run_name, tiny_model_dir, tmp_path
):
    from reinforge.core.weights import fetch_version

    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, keep_last=2,
                      max_staleness=5, publish_weights="store")
    groups = [synthetic_group(t, [1.0, 0.0, 0.0, 1.0], version=0) for t in "abc"]

    async def main():
        async with open_bus(creds) as bus:
            w = await train_one_version_per_group(bus, creds, run_name, cfg, groups)
            fetched = (await fetch_version(bus, w.store, 3, tmp_path / "elsewhere" / "v3")).path
            store = await bus.object_store(w.store)
            names = {o.name for o in await bus.js_call(store.list, what="list") if not o.deleted}
            return w, fetched, names

    w, fetched, names = trio.run(main)
    assert (w.version, w.store) == (3, subjects.weights_bucket(run_name))
    disk = Path(w.path)
    assert {p.name for p in fetched.iterdir()} == {p.name for p in disk.iterdir() if p.is_file()}
    assert (fetched / "model.safetensors").read_bytes() == \
        (disk / "model.safetensors").read_bytes()
    assert {n.split("/")[0] for n in names} == {"v2", "v3"}  # v1 was pruned with keep_last 2


@pytest.mark.nats
def test_a_version_the_evaluator_keeps_for_a_rollback_outlives_the_learners_pruning(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, keep_last=1,
                      max_staleness=5)
    groups = [synthetic_group(t, [1.0, 0.0, 0.0, 1.0], version=0) for t in "abcd"]

    async def keep_v1(bus, version):
        if version == 1:  # the evaluator's gold peak, say
            await bus.publish_durable(subjects.keep(run_name), m.KeepVersions(versions=[1]),
                                      msg_id="keep:1")

    async def main():
        async with open_bus(creds) as bus:
            await train_one_version_per_group(bus, creds, run_name, cfg, groups, keep_v1)

    trio.run(main)
    kept = sorted(v for v, _ in ckpt.list_checkpoints(tmp_path / "ckpt"))
    assert kept == [1, 4]  # keep_last 1, and the version kept for a rollback


def partial_group(task_id: str, rewards: list[float], versions: tuple[int, int]):
    """A group of two-turn rollouts (policy, environment, policy tokens) whose turns come
    from `versions`: partial rollouts that spanned a weights update."""
    group = synthetic_group(task_id, rewards, version=min(versions), loss_mask=[1, 1, 0, 1])
    turns = [m.Turn(start=0, end=2, policy_version=versions[0]),
             m.Turn(start=3, end=4, policy_version=versions[1])]
    return [msgspec.structs.replace(s, rollout=msgspec.structs.replace(s.rollout, turns=turns))
            for s in group]


@pytest.mark.nats
def test_a_partial_rollout_is_judged_by_every_segment_and_its_staleness_counted_per_segment(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, max_staleness=1)
    group_a = synthetic_group("a", [1.0, 0.0, 0.0, 1.0], version=0)
    # labelled v0 (its oldest turn), but its second turn claims v2, which the learner (at v1)
    # never published: dropped like any rollout of a policy it does not have
    foreign = partial_group("foreign", [1.0, 0.0, 1.0, 0.0], versions=(0, 2))
    partial = partial_group("p", [0.0, 1.0, 1.0, 0.0], versions=(0, 1))
    stats: list = []

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            await nursery.start(collect_stats, bus, run_name, stats)
            await nursery.start(functools.partial(run_actor, Learner, creds=creds, run=run_name,
                                                  config=cfg))
            await publish(bus, run_name, group_a)
            await wait_for_version(bus, stream, run_name, 1)
            await publish(bus, run_name, foreign)
            await publish(bus, run_name, partial)
            await wait_for_version(bus, stream, run_name, 2)
            with trio.fail_after(10):
                while len(stats) < 2:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()

    trio.run(main)
    figures = stats[-1].figures
    assert figures["dropped_rolled_back_groups"] == 1.0
    assert figures["partial_rollouts"] == 4.0
    assert figures["staleness_max"] == 1.0  # the oldest turn, v0, at learner v1
    # per segment: 2 tokens 1 version old, 1 token 0 versions old
    assert figures["staleness_token_mean"] == pytest.approx(2 / 3)
    assert stats[0].figures["partial_rollouts"] == 0.0


@pytest.mark.nats
@pytest.mark.slow
def test_the_learner_follows_a_rollback_and_drops_groups_of_the_rolled_back_policy(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, keep_last=5)
    group_a = synthetic_group("a", [1.0, 0.0, 0.0, 1.0], version=0)
    group_b = synthetic_group("b", [0.0, 1.0, 1.0, 1.0], version=1)
    from_bad = synthetic_group("bad", [0.0, 1.0, 0.0, 0.0], version=2)  # made by rolled-back v2
    group_c = synthetic_group("c", [1.0, 1.0, 0.0, 0.0], version=1)
    stats: list = []
    root = Path(cfg.checkpoint_dir)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            await nursery.start(collect_stats, bus, run_name, stats)
            await nursery.start(functools.partial(run_actor, Learner, creds=creds, run=run_name,
                                                  config=cfg))
            await publish(bus, run_name, group_a)
            w1 = await wait_for_version(bus, stream, run_name, 1)
            await publish(bus, run_name, group_b)
            bad_v2 = await wait_for_version(bus, stream, run_name, 2)
            bad_weights = {k: v.clone() for k, v in
                           Trainer(cfg, bad_v2.path).model.state_dict().items()}
            await bus.publish_durable(
                subjects.weights(run_name),
                m.Rollback(to_version=1, path=w1.path, reason="planted regression"),
                msg_id="rollback:test")
            with trio.fail_after(60):
                while (root / "v2").exists():
                    await trio.sleep(0.1)
            await publish(bus, run_name, from_bad)
            await publish(bus, run_name, group_c)
            with trio.fail_after(120):
                while len(stats) < 3:
                    await trio.sleep(0.1)
            last = await bus.last_message(stream, subjects.weights(run_name))
            nursery.cancel_scope.cancel()
            return w1, bad_weights, m.decode(last.data)

    w1, bad_weights, w2 = trio.run(main)
    assert [s.version for s in stats] == [1, 2, 2]
    assert isinstance(w2, m.WeightsPublished) and w2.version == 2
    figures = stats[-1].figures
    assert figures["rollbacks"] == 1.0
    assert figures["dropped_rolled_back_groups"] == 1.0
    state = ckpt.load_trainer_state(w2.path)
    assert state["step"] == 2  # one step past v1, not past the rolled-back v2
    assert all(s["step"] == 2 for s in state["optimizer"]["state"].values())
    ids = lambda g, v: {s.rollout.rollout_id: v for s in g}
    # everything consumed stays consumed, the rolled-back lineage's work included
    assert state["ledger"] == {**ids(group_a, 0), **ids(group_b, 1), **ids(from_bad, 2),
                               **ids(group_c, 1)}
    assert state["tasks"] == {"a": "v1", "b": "v2", "bad": "rolled_back", "c": "v2"}
    assert DecisionJournal(root / DecisionJournal.NAME).read() == []  # absorbed by the new v2
    assert len(state["rollbacks_applied"]) == 1
    new_weights = Trainer(cfg, w2.path).model.state_dict()
    assert any(not torch.equal(new_weights[k], bad_weights[k]) for k in bad_weights)
    assert [v for v, _ in ckpt.list_checkpoints(root)] == [1, 2]


@pytest.mark.nats
@pytest.mark.slow
def test_a_dropped_group_is_journaled_before_its_ack_and_reaches_the_next_checkpoint(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1)
    silent = synthetic_group("silent", [0.0, 0.0, 0.0, 0.0], version=0)  # no signal
    useful = synthetic_group("useful", [1.0, 0.0, 1.0, 0.0], version=0)
    journal = DecisionJournal(Path(cfg.checkpoint_dir) / DecisionJournal.NAME)

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            async with trio.open_nursery() as nursery:  # the first learner: drops, then dies
                await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                                      run=run_name, config=cfg))
                await publish(bus, run_name, silent)
                with trio.fail_after(60):
                    while not journal.read():
                        await trio.sleep(0.1)
                nursery.cancel_scope.cancel()
            assert ckpt.latest_checkpoint(cfg.checkpoint_dir) is None  # only the journal has it
            async with trio.open_nursery() as nursery:  # a new learner, then a useful group
                await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                                      run=run_name, config=cfg))
                await publish(bus, run_name, useful)
                w = await wait_for_version(bus, stream, run_name, 1)
                nursery.cancel_scope.cancel()
            return w

    w = trio.run(main)
    state = ckpt.load_trainer_state(w.path)
    assert state["tasks"] == {"silent": "no_signal", "useful": "v1"}
    assert set(state["ledger"]) == {s.rollout.rollout_id for s in silent + useful}
    assert journal.read() == []  # cleared once the checkpoint holds it


@pytest.mark.nats
@pytest.mark.slow
def test_the_next_step_is_anchored_by_idle_anchor_domains_groups_that_pass_nothing(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1,
                      anchor_domains=["gym-*"], anchor_kl_coef=1.0)
    anchored = synthetic_group("anchored", [0.0] * 4, domain="gym-gcd")  # no signal, no pass
    passing = [msgspec.structs.replace(s, outcome=m.Outcome.PASS)  # every sample passes
               for s in synthetic_group("passing", [1.0] * 4, domain="gym-gcd")]
    other = synthetic_group("other", [0.0] * 4, domain="math")  # not an anchor domain
    learning = synthetic_group("learning", [1.0, 0.0, 1.0, 0.0], domain="gym-gcd")
    forgot = synthetic_group("forgot", [0.0] * 4, domain="gym-gcd")  # trained a version ago
    idle = synthetic_group("idle", [0.0] * 4, domain="gym-aiw")  # never trained
    useful = [synthetic_group(f"useful{i}", [1.0, 0.0, 1.0, 0.0]) for i in range(2)]
    journal = DecisionJournal(Path(cfg.checkpoint_dir) / DecisionJournal.NAME)
    stats: list = []

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            await nursery.start(collect_stats, bus, run_name, stats)
            await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                                  run=run_name, config=cfg))

            async def dropped(*groups, then):
                await publish(bus, run_name, [s for g in groups for s in g])
                with trio.fail_after(60):
                    while len(journal.read()) < len(groups):
                        await trio.sleep(0.1)
                await publish(bus, run_name, then)
                return await wait_for_version(bus, stream, run_name, len(stats) + 1)

            await dropped(anchored, passing, other, then=learning)  # v1
            await dropped(forgot, then=useful[0])  # v2
            w = await dropped(idle, then=useful[1])  # v3
            with trio.fail_after(10):
                while len(stats) < 3:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
            return w

    w = trio.run(main)
    first, second, third = stats
    assert first.figures["anchor_samples"] == 4.0 and first.figures["samples"] == 4.0
    assert "anchor_kl" in first.figures
    assert "anchor_samples" not in second.figures  # gym-gcd is learning; an anchor serves once
    assert third.figures["anchor_samples"] == 4.0  # gym-aiw is idle
    assert third.figures["skipped_no_signal_groups"] == 5.0
    state = ckpt.load_trainer_state(w.path)  # dropped as ever: never trained on
    assert state["tasks"] == {"anchored": "no_signal", "passing": "no_signal",
                              "other": "no_signal", "learning": "v1", "forgot": "no_signal",
                              "useful0": "v2", "idle": "no_signal", "useful1": "v3"}


@pytest.mark.nats
@pytest.mark.slow
def test_each_checkpoint_holds_what_was_decided_before_its_step_while_the_next_step_runs(
    creds, run_name, tiny_model_dir, tmp_path
):
    # Everything is there at once, so step N+1 gathers (and drops) while N is written.
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1, max_staleness=10,
                      keep_last=10)
    order = [synthetic_group("u1", [1.0, 0.0, 1.0, 0.0], version=0),
             synthetic_group("s1", [0.0, 0.0, 0.0, 0.0], version=0),
             synthetic_group("u2", [0.0, 1.0, 1.0, 0.0], version=0),
             synthetic_group("s2", [1.0, 1.0, 1.0, 1.0], version=0),
             synthetic_group("u3", [1.0, 0.0, 0.0, 0.0], version=0)]
    journal = DecisionJournal(Path(cfg.checkpoint_dir) / DecisionJournal.NAME)
    stats: list = []

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            await nursery.start(collect_stats, bus, run_name, stats)
            for group in order:
                await publish(bus, run_name, group)
            await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                                  run=run_name, config=cfg))
            await wait_for_version(bus, stream, run_name, 3)
            with trio.fail_after(10):
                while len(stats) < 3:
                    await trio.sleep(0.1)
            await all_acked(bus, stream, run_name, timeout_s=30)
            nursery.cancel_scope.cancel()

    trio.run(main)
    tasks = {v: ckpt.load_trainer_state(path)["tasks"]
             for v, path in ckpt.list_checkpoints(cfg.checkpoint_dir)}
    assert sorted(tasks) == [1, 2, 3]
    for v in (1, 2, 3):  # a checkpoint's state is of its own step, not of a later one
        assert sorted(o for o in tasks[v].values() if o.startswith("v")) == [
            f"v{k}" for k in range(1, v + 1)]
    assert tasks[1].items() <= tasks[2].items() <= tasks[3].items()
    # a step's figures are of that step, though they go out after the next one trained
    assert [(s.version, s.figures["trained_groups"]) for s in stats] == [(1, 1), (2, 2), (3, 3)]
    # A drop is in the newest checkpoint or in the journal, never in both, never in neither
    # (groups complete in delivery order, so which one is not fixed).
    journaled = {task for task, _, _ in journal.read()}
    assert not journaled & set(tasks[3])
    assert journaled | set(tasks[3]) == {"u1", "s1", "u2", "s2", "u3"}


@pytest.mark.nats
def test_a_group_that_never_completes_is_dropped_as_incomplete_and_its_deliveries_acked(
    creds, run_name, tiny_model_dir, tmp_path
):
    cfg = make_config(tiny_model_dir, tmp_path, groups_per_version=1,
                      incomplete_group_timeout_s=1.0)
    half = synthetic_group("half", [1.0, 0.0, 1.0, 0.0], version=0)[:2]  # 2 of 4 ever come
    journal = DecisionJournal(Path(cfg.checkpoint_dir) / DecisionJournal.NAME)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run_name)
            ctx = await nursery.start(functools.partial(run_actor, Learner, creds=creds,
                                                        run=run_name, config=cfg))
            await publish(bus, run_name, half)
            with trio.fail_after(30):
                while not journal.read():
                    await trio.sleep(0.2)
            await all_acked(bus, stream, run_name, timeout_s=10)
            nursery.cancel_scope.cancel()
            return ctx

    trio.run(main)
    [(task_id, outcome, ids)] = journal.read()
    assert (task_id, outcome) == ("half", "incomplete")
    assert set(ids) == {s.rollout.rollout_id for s in half}
