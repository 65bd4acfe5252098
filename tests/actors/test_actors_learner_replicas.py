"""Data-parallel learner replicas (`reinforge.rl.replicas`) on torch.distributed's gloo
backend, real worker processes: two replicas, each training on half of every optimizer
step's samples and summing gradients, make the update one replica makes on the whole batch,
and stay equal to each other."""

from __future__ import annotations

import math

import pytest
import torch
from learner_fixtures import GradientRecorder, synthetic_group
from reinforge.actors.learner import LearnerConfig
from reinforge.rl.grpo import AdvantageNorm
from reinforge.rl.replicas import ReplicaGroup, weights_digest
from reinforge.rl.samples import anchor_samples, prepare_samples
from reinforge.rl.trainer import Trainer

pytestmark = pytest.mark.slow

FIGURES = ("loss", "policy_loss", "kl_behaviour", "clip_frac", "ratio_mean", "grad_norm",
           "tokens", "logp_mismatch_mean_nats", "logp_mismatch_max_nats")


def config(model_dir, tmp_path, **kw):
    return LearnerConfig(**{"model": str(model_dir), "checkpoint_dir": str(tmp_path / "ckpt"),
                            "group_size": 0, "groups_per_version": 3, "learning_rate": 1e-2,
                            "torch_threads": 1, "micro_batch_size": 2, **kw})


def batch():
    groups = [synthetic_group(f"dp{k}", rewards, tokens=4 + k)
              for k, rewards in enumerate(([1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0],
                                           [1.0, 0.0, 1.0, 0.0]))]
    return prepare_samples(groups, AdvantageNorm.GROUP_STD)[0]


def test_two_replicas_sum_to_the_gradient_one_replica_has_on_the_whole_batch(
        tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path, max_grad_norm=0.0)
    samples = batch()
    one = Trainer(cfg, tiny_model_dir)
    alone = GradientRecorder(one)
    one.train_step(samples, version=0)
    group = ReplicaGroup(cfg, tiny_model_dir, replicas=2)
    try:
        together = GradientRecorder(group.trainer)  # rank 0's, after the all-reduce
        group.train_step(samples, version=0)
    finally:
        group.close()
    assert len(alone.grads) == len(together.grads) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
               for a, b in zip(alone.grads, together.grads, strict=True))


def test_two_replicas_sum_the_anchors_gradient_one_replica_has_on_them_all(
        tiny_model_dir, tmp_path):
    """Anchors (KL to a reference, here a policy a step away, so that it pulls) are shared
    out like the batch: the summed gradient is the one a single replica has."""
    reference = tmp_path / "reference"
    moved = Trainer(config(tiny_model_dir, tmp_path), tiny_model_dir)
    moved.train_step(batch(), version=0)
    moved.export_model().save_pretrained(reference)
    cfg = config(tiny_model_dir, tmp_path, max_grad_norm=0.0, anchor_domains=["math"],
                 anchor_kl_coef=1.0)
    samples = batch()
    anchors = anchor_samples([synthetic_group(f"an{k}", [0.0] * 4, tokens=3 + k)
                              for k in range(3)])
    one = Trainer(cfg, tiny_model_dir, reference_dir=reference)
    alone = GradientRecorder(one)
    one.train_step(samples, version=0)
    without = alone.grads
    one.train_step(samples, version=0, anchors=anchors)
    group = ReplicaGroup(cfg, tiny_model_dir, reference_dir=reference, replicas=2)
    try:
        together = GradientRecorder(group.trainer)
        figures = group.train_step(samples, version=0, anchors=anchors)
    finally:
        group.close()
    assert figures["anchor_kl"] > 0.0 and figures["anchor_samples"] == 12.0
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # the anchors pull
                   for a, b in zip(without, alone.grads, strict=True))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
               for a, b in zip(alone.grads, together.grads, strict=True))


# With several steps and TIS, the logprobs before a batch's first step: each replica
# computes those of its half of the 12 samples (once a version) and gathers the rest.
@pytest.mark.parametrize("steps, proximal_rows", [
    ({}, []), ({"ppo_epochs": 2, "minibatches": 2, "tis_cap": 2.0}, [6, 6])])
def test_two_replicas_make_the_update_one_replica_makes_on_the_same_batch(
        tiny_model_dir, tmp_path, steps, proximal_rows):
    """The same policy after two versions' steps (its logprobs; a parameter whose gradient
    is rounding noise, a key bias, moves by Adam's step either way), the same figures, and
    the replicas' weights equal to the bit."""
    cfg = config(tiny_model_dir, tmp_path, **steps)
    samples = batch()
    one = Trainer(cfg, tiny_model_dir)
    alone = [one.train_step(samples, version=v) for v in range(2)]
    group = ReplicaGroup(cfg, tiny_model_dir, replicas=2)
    rows: list[int] = []
    logprobs = group.trainer.logprobs
    group.trainer.logprobs = lambda part: rows.append(len(part)) or logprobs(part)
    try:
        together = [group.train_step(samples, version=v) for v in range(2)]
        group.trainer.logprobs = logprobs
        digests = group.weight_digests()
        policy = group.logprobs(samples)
        moved = weights_digest(group.model) != weights_digest(Trainer(cfg, tiny_model_dir).model)
    finally:
        group.close()
    assert [w.returncode for w in group.workers] == [0]
    assert len(samples) == 12 and rows == proximal_rows
    assert digests[0] == digests[1] and moved
    assert all(torch.allclose(a, b, atol=1e-5)
               for a, b in zip(one.logprobs(samples), policy, strict=True))
    for a, b in zip(alone, together, strict=True):
        for k in FIGURES:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


def test_a_replica_group_restores_a_checkpoint_on_every_replica(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path)
    group = ReplicaGroup(cfg, tiny_model_dir, replicas=3)
    try:
        start = group.state_dict(step=0, ledger={}, counters={})
        first = group.weight_digests()
        group.train_step(batch(), version=0)
        moved = group.weight_digests()
        group.restore(tiny_model_dir, start)
        back = group.weight_digests()
    finally:
        group.close()
    assert len(set(first)) == len(set(moved)) == len(set(back)) == 1  # three equal replicas
    assert moved[0] != first[0] and back == first
