"""Helpers of the learner tests: rollouts made by the tiny policy's own `generate`."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from reinforge.core import messages as m


def generate_group(model_dir: Path | str, *, task_id: str, version: int, group_size: int = 4,
                   max_new_tokens: int = 8, seed: int = 0, domain: str = "math",
                   prompt: str = "Compute 6 + 6. End with '#### <answer>'.") -> list[m.ScoredRollout]:
    """G samples of one prompt from the model at `model_dir` (version `version`), with their
    behaviour logprobs, scored by a made-up reward with signal in every group: 1 for the sample with the
    highest total logprob, 0 for the others."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = tok.encode(prompt)
    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids] * group_size)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             top_k=0, top_p=1.0, temperature=1.0, output_logits=True,
                             return_dict_in_generate=True)
    new = out.sequences[:, len(prompt_ids):]
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
    logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    best = int(logp.sum(1).argmax())
    group = []
    for i in range(group_size):
        output_ids = new[i].tolist()
        reward = 1.0 if i == best else 0.0
        rollout = m.Rollout(
            rollout_id=f"{task_id}:{i}:1", task_id=task_id, sample_index=i, domain=domain,
            tier=0, prompt=prompt, completion=tok.decode(output_ids), prompt_ids=prompt_ids,
            output_ids=output_ids, logprobs=logp[i].tolist(), policy_version=version,
            group_size=group_size,
        )
        group.append(m.ScoredRollout(rollout=rollout, reward=reward, outcome=m.Outcome.FAIL))
    return group


def synthetic_group(task_id: str, rewards: list[float], *, version: int = 0,
                    domain: str = "math", infra: tuple[int, ...] = (),
                    tokens: int = 4, loss_mask: list[int] | None = None) -> list[m.ScoredRollout]:
    """One group of made-up rollouts; `loss_mask` (one per output token, the same for every
    sample) makes them multi-turn-style, with environment text where it is 0."""
    out = []
    for i, reward in enumerate(rewards):
        rollout = m.Rollout(
            rollout_id=f"{task_id}:{i}:1", task_id=task_id, sample_index=i, domain=domain,
            tier=0, prompt="p", completion="c", prompt_ids=[5, 6, 7],
            output_ids=[10 + i + k for k in range(tokens)], logprobs=[-1.0] * tokens,
            policy_version=version, group_size=len(rewards), loss_mask=list(loss_mask or []),
        )
        bad = i in infra
        out.append(m.ScoredRollout(
            rollout=rollout, reward=0.0 if bad else reward,
            outcome=m.Outcome.INFRA_ERROR if bad else m.Outcome.FAIL))
    return out


def with_tokens(group: list[m.ScoredRollout], *, logprobs: list[list[float]],
                output_ids: list[list[int]] | None = None) -> list[m.ScoredRollout]:
    """The group with other behaviour logprobs (and output ids), one row per sample."""
    out = []
    for i, s in enumerate(group):
        ids = list(output_ids[i]) if output_ids is not None else list(s.rollout.output_ids)
        rollout = msgspec.structs.replace(s.rollout, logprobs=list(logprobs[i]), output_ids=ids)
        out.append(msgspec.structs.replace(s, rollout=rollout))
    return out


class GradientRecorder:
    """Stands in for a Trainer's optimizer: keeps each step's accumulated gradient and moves
    no weight, so every step of a test sees the same policy."""

    def __init__(self, trainer) -> None:
        self.params = list(trainer.model.parameters())
        self.grads: list[torch.Tensor] = []
        trainer.optimizer = self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [p.grad.detach().clone() for p in self.params]
