"""rm-synthetic: open answers scored by a trained reward model (`reinforge rm train`).

The tasks are the synthetic preference task's prompts (`reinforge.rl.reward_model`: describe
a thing in 8 to 14 words, naming a given colour); the reference is a preferred answer. The
verifier scores a completion with the reward model given in its config (`reward_model =
DIR`), in its own process: the reward is sigmoid(z), z the score standardised by the model's
held-out score mean and std (`standardised`: a model's scores have no scale of their own,
and models trained apart each get theirs), the outcome `pass` from 0.5, the model's typical
answer on its held-out rows. A reward model that is not configured, missing or broken gives
`infra_error`, never a 0.

A model is a folder (scored in this process) or the URL of a server of it (`reinforge serve
--model DIR --is-embedding`, or SGLang's for a reward model on a GPU: `POST /classify`, which
batches the verifications that arrive together).

An ensemble (`reward_model = [DIR, DIR, ...]`) scores with each model and rewards
sigmoid(mean - spread_penalty x std) of their scores: where the models disagree, as they do
off the data they were trained on, where a policy exploiting one of them goes, the reward is
held down.

The hidden rule itself is reported as a check (`gold`, `GOLD_CHECK`) and never enters the
reward: the gold signal against which a policy that learns to please the reward model, not
to follow the rule, shows up (the evaluator rolls back a version whose reward rose while its
gold fell).

Not among "every domain" (one tier, and it needs a model): a family (`rm_domains`) the
registry loads when its name is asked for, whose verdicts without a model are infra_error.
The verifier's and the evaluator's `reward_model = DIR` (and `reinforge eval
--reward-model DIR`) attach it with its model (`attach_reward_model`).

JSONL row schema: {"prompt": "..."} (optional "task_id", "tier", "reference").
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.domain import (
    GOLD_CHECK,
    Check,
    TaskSpec,
    Tier,
    Verdict,
    check_tier,
    infra_error,
)
from reinforge.envs.tasksets import decode_row, load_jsonl


class PromptRow(msgspec.Struct, kw_only=True):
    prompt: str
    task_id: str | None = None
    tier: int = 0
    reference: str | None = None


class RewardModelDomain:
    """Answers scored by a reward model; the synthetic task's rule as the gold check."""

    name = "rm-synthetic"
    description = "open answers scored by a trained reward model (the synthetic preference task)"
    resource = "cpu"
    multi_turn = False
    tiers = (Tier(level=0, name="describe", description="describe a thing, naming its colour"),)

    def __init__(self, *, model_path: str | Sequence[str] = "",
                 spread_penalty: float = 1.0) -> None:
        paths = [model_path] if isinstance(model_path, str) else list(model_path)
        self.model_paths = [p for p in paths if p]
        if spread_penalty < 0:
            raise ValueError(f"spread_penalty must be >= 0, got {spread_penalty}")
        self.spread_penalty = spread_penalty
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[Any, Any, int]] = {}
        self._clients: dict[str, RewardModelClient] = {}
        self._stats: dict[str, tuple[float, float] | None] = {}

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        from reinforge.rl.reward_model import synthetic_pairs

        check_tier(self, tier)
        (pair,) = synthetic_pairs(rng.getrandbits(32), 1)
        return TaskSpec(task_id=f"rm-synthetic-{rng.getrandbits(48):012x}", domain=self.name,
                        tier=tier, prompt=pair.prompt, spec={}, reference=pair.chosen)

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, PromptRow, where=where)
        return TaskSpec(task_id=r.task_id or f"rm-{where.rsplit(':', 1)[-1]}", domain=self.name,
                        tier=r.tier, prompt=r.prompt, spec={}, reference=r.reference,
                        source="jsonl")

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        import trio

        from reinforge.rl.reward_model import follows_rule

        if not self.model_paths:
            return infra_error("no reward model configured (the verifier's `reward_model`)")
        each: list[float] = []
        for path in self.model_paths:
            try:
                if is_url(path):
                    client = self._client(path)
                    raw = await client.score(task.prompt, completion)
                    folder = client.tokenizer.name_or_path  # the served model's, on this host
                else:
                    raw = await trio.to_thread.run_sync(self.score, path, task.prompt,
                                                        completion)
                    folder = path
            except Exception as exc:  # a missing or broken model is ours, not the answer's
                return infra_error(f"reward model {path}: {type(exc).__name__}: {exc}")
            if folder not in self._stats:  # read once per model
                self._stats[folder] = held_out_stats(folder)
            each.append(standardised(raw, self._stats[folder]))
        score = ensemble_score(each, self.spread_penalty)
        reward = 1.0 / (1.0 + math.exp(-score))
        gold = follows_rule(task.prompt, completion)
        detail = f"{score:.4f}" if len(each) == 1 else (
            f"{score:.4f} = mean - {self.spread_penalty:g} x std of "
            f"{', '.join(f'{x:.4f}' for x in each)}")
        return Verdict(
            reward=reward, outcome="pass" if reward >= 0.5 else "fail",
            checks=[Check(name="rm_score", passed=reward >= 0.5, detail=detail),
                    Check(name=GOLD_CHECK, passed=gold, detail="the hidden rule (not rewarded)")],
            reason=f"reward model score {score:.3f}")

    def _client(self, url: str) -> RewardModelClient:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = RewardModelClient(url)
            return self._clients[url]

    def score(self, path: str, prompt: str, completion: str) -> float:
        """The score of `completion` by the reward model at `path` (its forward pass; each
        model loaded once)."""
        import torch

        from reinforge.rl.reward_model import encode, load_scorer, scores

        with self._lock:
            if path not in self._loaded:
                tok, model, pad = load_scorer(path)
                self._loaded[path] = (tok, model.eval(), pad)
            tok, model, pad = self._loaded[path]
            with torch.no_grad():
                return float(scores(model, [encode(tok, prompt, completion)], pad)[0])


def held_out_stats(folder: str) -> tuple[float, float] | None:
    """(mean, std) of a reward model's scores on its held-out rows, from its folder's
    manifest (`reinforge rm train` writes them); None for a model without them."""
    from reinforge.rl.checkpoint import read_manifest

    manifest = read_manifest(folder)
    summary = manifest.extra.get("summary", {}) if manifest is not None else {}
    mean, std = summary.get("score_mean"), summary.get("score_std")
    if isinstance(mean, float) and isinstance(std, float) and std > 0:
        return mean, std
    return None


def standardised(score: float, stats: tuple[float, float] | None) -> float:
    """A model's score in its own held-out standard deviations from its held-out mean, so
    the scores of models trained apart share one scale (ensembles average them, and
    sigmoid(0) = 0.5 is the model's typical answer); raw without statistics."""
    if stats is None:
        return score
    mean, std = stats
    return (score - mean) / std


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


class RewardModelUnavailable(RuntimeError):
    """The reward model's server cannot be reached or answered out of contract."""


class RewardModelClient:
    """A reward model served on SGLang's `POST /classify` (`reinforge serve --is-embedding`,
    or `sglang.launch_server --is-embedding`), where concurrent verifications share forward
    passes. It is sent the token ids the model was trained on (`encode`: the prompt in the
    chat template, the answer, end of sequence), so its tokenizer must be on this host."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.tokenizer: Any = None

    async def score(self, prompt: str, completion: str) -> float:
        import httpx

        from reinforge.rl.reward_model import encode
        from reinforge.rollout.client import http_client, served_tokenizer

        try:
            async with http_client(self.timeout_s) as http:
                if self.tokenizer is None:
                    self.tokenizer = await served_tokenizer(http, self.url)
                    if self.tokenizer is None:
                        raise RewardModelUnavailable(
                            f"{self.url} names no tokenizer on this host (/get_model_info)")
                ids = encode(self.tokenizer, prompt, completion)
                resp = await http.post(f"{self.url}/classify", json={"input_ids": ids})
        except httpx.HTTPError as exc:
            raise RewardModelUnavailable(f"{self.url} unreachable: {exc!r}") from None
        if resp.status_code != 200:
            raise RewardModelUnavailable(
                f"{self.url}/classify answered HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return float(resp.json()["embedding"][0])
        except (ValueError, KeyError, TypeError, IndexError):
            raise RewardModelUnavailable(
                f"{self.url}/classify answered without embedding[0]: {resp.text[:200]}") from None


def rm_domains() -> dict[str, Any]:
    """The `rm-` family: the domains scored by a reward model (no model attached yet)."""
    return {RewardModelDomain.name: RewardModelDomain}


def attach_reward_model(registry: Any, model_path: str | Sequence[str],
                        spread_penalty: float = 1.0) -> None:
    """Make `registry`'s rm-synthetic score with the reward model(s) at `model_path`."""
    registry.attach(RewardModelDomain(model_path=model_path, spread_penalty=spread_penalty))


def ensemble_score(scores: Sequence[float], spread_penalty: float) -> float:
    """The ensemble's score: mean minus `spread_penalty` x the population std (one model:
    its score). Worked example: (1, 3), penalty 1 -> 2 - 1 = 1."""
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores))
    return mean - spread_penalty * std
