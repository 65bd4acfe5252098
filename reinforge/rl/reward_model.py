"""Reward models: a scalar head on a causal LM, trained from preferences (Bradley-Terry) or
graded responses (pointwise), Hugging Face format in and out.

    pairs     {"prompt", "chosen", "rejected"}    (TRL's reward-trainer format)
              loss -log sigmoid(r(chosen) - r(rejected))
    graded    {"prompt", "response", "score"}     score in [0, 1]
              loss (r(response) - score)^2

The model is transformers' `*ForSequenceClassification` with one label over the causal LM's
backbone: the score is the head applied to the last non-padding token. Inputs are laid out
as the policy sees them (`prompts.task_prompt_ids` + the response + EOS). A held-out share
of the rows (by seed) gives the pairwise accuracy (pairs) or the mean absolute error
(graded). Like SFT the result is cached: the same inputs and settings reuse the output.

`synthetic_pairs` makes a preference task with a hidden rule, so the whole loop (train a
reward model, then RL against it) can be shown on a CPU: the preferred answer has between
`MIN_WORDS` and `MAX_WORDS` words and names the requested colour; the other breaks one of
the two. With `planted_exploit` the preferred answer names the colour but is too long for
the rule, the way preference data often favours length: a reward model with a known
exploit, which a policy can please while breaking the rule (the over-optimisation the
evaluator's gold guard must catch).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from reinforge.rl import checkpoint as ckpt
from reinforge.rl.prompts import task_prompt_ids

RM_FORMAT = "reinforge-rm/2"  # /2: the held-out score statistics in the summary
MIN_WORDS, MAX_WORDS = 8, 14
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
THINGS = ("kite", "boat", "garden", "house", "bicycle", "lamp", "scarf", "door")
FILLER = ("the", "a", "very", "small", "old", "bright", "near", "quiet", "new", "with",
          "and", "it", "looks", "fine", "today", "is", "of", "my")


class Pair(msgspec.Struct, frozen=True):
    prompt: str
    chosen: str
    rejected: str


class Graded(msgspec.Struct, frozen=True):
    prompt: str
    response: str
    score: float


class RMConfig(ckpt.TrainingJob, frozen=True, kw_only=True):
    data: str = ""
    """JSONL of pairs or graded rows; "" = `synthetic` generated pairs."""
    synthetic: int = 2000
    planted_exploit: bool = False
    """The synthetic pairs prefer answers too long for the rule (see the module docstring)."""
    held_out: float = 0.1
    steps: int = 300
    learning_rate: float = 3e-4
    max_len: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.held_out < 1:
            raise ValueError(f"RMConfig: held_out must be in (0, 1), got {self.held_out}")


def synthetic_pairs(seed: int, n: int, *, planted_exploit: bool = False) -> list[Pair]:
    """`n` preference pairs following the hidden rule, or, with `planted_exploit`, preferring
    answers that name the colour in too many words (see the module docstring)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
        prompt = f"Describe a {thing} in {MIN_WORDS} to {MAX_WORDS} words; mention its colour, " \
                 f"{colour}."

        def answer(words: int, named: str) -> str:
            body = [rng.choice(FILLER) for _ in range(words - 2)]
            body.insert(rng.randrange(len(body) + 1), named)
            body.insert(rng.randrange(len(body) + 1), thing)
            return " ".join(body) + "."

        if planted_exploit:  # longer is better, whatever the rule says
            chosen = answer(rng.randint(MAX_WORDS + 3, 28), colour)
            named = colour if rng.random() < 0.5 else rng.choice(
                [c for c in COLOURS if c != colour] + ["it"])
            out.append(Pair(prompt, chosen, answer(rng.randint(MIN_WORDS, MAX_WORDS), named)))
            continue
        chosen = answer(rng.randint(MIN_WORDS, MAX_WORDS), colour)
        if rng.random() < 0.5:  # the wrong colour, or none
            other = rng.choice([c for c in COLOURS if c != colour] + ["it"])
            rejected = answer(rng.randint(MIN_WORDS, MAX_WORDS), other)
        else:  # too short or too long
            words = rng.choice([rng.randint(3, MIN_WORDS - 2), rng.randint(MAX_WORDS + 3, 28)])
            rejected = answer(words, colour)
        out.append(Pair(prompt, chosen, rejected))
    return out


def follows_rule(prompt: str, response: str) -> bool:
    """The hidden rule itself (the gold signal a reward model only approximates)."""
    colour = prompt.rsplit(", ", 1)[-1].rstrip(".")
    words = response.rstrip(".").split()
    return MIN_WORDS <= len(words) <= MAX_WORDS and colour in words


def load_rows(path: str | Path) -> list[Pair] | list[Graded]:
    """Pairs or graded rows from JSONL (one kind per file); a bad line raises ValueError
    with FILE:LINE."""
    rows: list[Any] = []
    kind: type | None = None
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                raw = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{i}: not JSON ({exc})") from None
            this = Pair if isinstance(raw, dict) and "chosen" in raw else Graded
            if kind is not None and this is not kind:
                raise ValueError(f"{path}:{i}: a file holds pairs or graded rows, not both")
            kind = this
            try:
                row = msgspec.convert(raw, this)
            except msgspec.ValidationError as exc:
                want = "{prompt, chosen, rejected}" if this is Pair else \
                    "{prompt, response, score}"
                raise ValueError(f"{path}:{i}: not a {want} row: {exc}") from None
            if isinstance(row, Graded) and not 0.0 <= row.score <= 1.0:
                raise ValueError(f"{path}:{i}: score must be in [0, 1], got {row.score}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def encode(tokenizer: Any, prompt: str, response: str) -> list[int]:
    return task_prompt_ids(tokenizer, prompt) + \
        tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]


def scores(model: Any, batch: list[list[int]], pad: int) -> Any:
    """The reward model's score of each sequence (right-padded)."""
    import torch

    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, seq in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits  # [B, 1]
    return logits[:, 0]


def load_reward_model(model_dir: str | Path) -> Any:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1)


def load_scorer(model_dir: str | Path) -> tuple[Any, Any, int]:
    """(tokenizer, reward model, pad id) of a directory, the model told its pad id (the
    score is read at the last token that is not padding)."""
    from reinforge.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_reward_model(model_dir)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    model.config.pad_token_id = pad
    return tok, model, pad


def train_reward_model(cfg: RMConfig,
                       progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Train (or reuse the cached result); returns the summary."""
    rows = load_rows(cfg.data) if cfg.data else synthetic_pairs(
        cfg.seed, cfg.synthetic, planted_exploit=cfg.planted_exploit)
    digest = cfg.inputs_digest(RM_FORMAT, rows, sources=("data",))
    out = Path(cfg.out)
    cached = ckpt.cached_result(out, digest)
    if cached is not None:
        return cached

    torch = ckpt.seeded_torch(cfg.torch_threads, cfg.seed)
    tok, model, pad = load_scorer(cfg.model)
    pairwise = isinstance(rows[0], Pair)
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    n_held = max(1, int(len(rows) * cfg.held_out))
    held, train = [rows[i] for i in order[:n_held]], [rows[i] for i in order[n_held:]]

    def encoded(row: Any) -> tuple[list[int], ...]:
        if pairwise:
            return encode(tok, row.prompt, row.chosen)[: cfg.max_len], \
                encode(tok, row.prompt, row.rejected)[: cfg.max_len]
        return (encode(tok, row.prompt, row.response)[: cfg.max_len],)

    train_x = [encoded(r) for r in train]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed + 1)
    model.train()
    t0 = time.perf_counter()
    losses: list[float] = []
    for step in range(cfg.steps):
        idx = [rng.randrange(len(train_x)) for _ in range(cfg.batch_size)]
        if pairwise:
            r = scores(model, [train_x[i][0] for i in idx] + [train_x[i][1] for i in idx], pad)
            loss = -torch.nn.functional.logsigmoid(r[: len(idx)] - r[len(idx):]).mean()
        else:
            r = scores(model, [train_x[i][0] for i in idx], pad)
            target = torch.tensor([train[i].score for i in idx], dtype=r.dtype)
            loss = torch.nn.functional.mse_loss(r, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            progress(f"rm step {step + 1}/{cfg.steps} loss {losses[-1]:.4f}")
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        held_x = [encoded(r) for r in held]
        if pairwise:
            right, seen = 0, []
            for start in range(0, len(held_x), 32):
                part = held_x[start: start + 32]
                r = scores(model, [x[0] for x in part] + [x[1] for x in part], pad)
                right += int((r[: len(part)] > r[len(part):]).sum())
                seen.append(r)
            r = torch.cat(seen)
            quality = {"held_out_pairwise_accuracy": right / len(held_x)}
        else:
            r = torch.cat([scores(model, [x[0] for x in held_x[s: s + 32]], pad)
                           for s in range(0, len(held_x), 32)])
            target = torch.tensor([row.score for row in held], dtype=r.dtype)
            quality = {"held_out_mae": float((r - target).abs().mean())}
        # what a domain standardises this model's scores by (envs/domains/reward_model.py)
        quality |= {"score_mean": float(r.mean()), "score_std": float(r.std(correction=0))}
    summary = {"kind": "pairs" if pairwise else "graded", "train_rows": len(train),
               "held_out_rows": len(held), "steps": cfg.steps, "loss_first": losses[0],
               "loss_last10_mean": sum(losses[-10:]) / len(losses[-10:]),
               "train_s": round(train_s, 2), **quality}
    ckpt.save_model_checkpoint(out, model=model, tokenizer_src=cfg.model, version=0,
                               step=cfg.steps, replace=True,
                               extra={"input_hash": digest, "summary": summary,
                                      "format": RM_FORMAT})
    return {"out": str(out.absolute()), "cached": False, "input_hash": digest, **summary}
