"""`reinforge sft`: supervised fine-tuning from demonstrations into a Hugging Face checkpoint.

Demonstrations are (prompt, response) pairs: from the task domains' reference completions
(`Domain.sample_task(rng, tier).reference`, seeded) or from a JSONL file of
`{"prompt": ..., "response": ...}` rows. The prompt is tokenized on its own, exactly as the
rollout server tokenizes a `/generate` text, and the response tokens plus EOS follow it; the
loss is the mean cross-entropy over response tokens only.

Deterministic: one seed drives task sampling, shuffling and torch. Cacheable: the output
directory's manifest records a hash of every input (model files, demonstrations, settings);
when it matches, the work is skipped and the existing checkpoint is reused.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from reinforge.rl import checkpoint as ckpt
from reinforge.envs.tools import Tool, TranscriptTurn, decode_transcript
from reinforge.rl.episodes import domain_tools
from reinforge.rl.evalsets import HeldOutConfig, build_heldout, fingerprint, heldout_fingerprints
from reinforge.rl.prompts import observation_ids, task_prompt_ids

log = logging.getLogger(__name__)

TIER_GIVES_UP_AFTER = 200
"""Draws in a row without a usable reference after which a (domain, tier) is left out of
the demonstrations: its few distinct tasks are all held out (terminal's tier-1 prompts name
their files, not the files' contents: a handful of prompts, all in a held-out set of 5)."""

SFT_FORMAT = "reinforge-sft/2"  # 2: prompts through the chat template, as RL sees them
# The fields that choose the demonstrations; the demonstrations are hashed instead.
SFT_SOURCES = ("jsonl", "domains", "tiers", "num_examples", "heldout")


class SFTConfig(ckpt.TrainingJob, frozen=True, kw_only=True, forbid_unknown_fields=True):
    domains: tuple[str, ...] = ("math",)
    """Domains whose reference completions are the demonstrations (ignored with `jsonl`)."""
    tiers: tuple[int, ...] = (0,)
    """Difficulty tiers to sample (each domain uses the tiers it has)."""
    jsonl: str = ""
    """A JSONL file of {"prompt", "response"} rows instead of the domains."""
    num_examples: int = 256
    """Demonstrations drawn from the domains."""
    chat_template: bool = True
    """Format prompts with the tokenizer's chat template (as the sampler's `chat_template`)."""
    heldout: HeldOutConfig | None = None
    """The run's held-out sets: a demonstration of one of their tasks is never trained on
    (else the evaluation before RL scores what SFT memorised)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_examples < 1:
            raise ValueError(f"SFTConfig: num_examples must be >= 1, got {self.num_examples}")


class Demo(msgspec.Struct, frozen=True):
    prompt: str
    response: str
    """The answer; for a tool domain, the episode's transcript (`envs.tools`), trained
    turn by turn with the observations as context."""
    tools: list[Tool] = []
    """The tools the prompt presents (a tool domain's)."""


def demos_from_domains(domains: tuple[str, ...], tiers: tuple[int, ...], n: int,
                       seed: int, heldout: HeldOutConfig | None = None) -> list[Demo]:
    """`n` demonstrations cycling over domains and tiers, from each task's reference; none
    of a task in the `heldout` sets. A tier whose tasks are all held out is left out; a
    domain with no tier left is an error."""
    from reinforge.envs.domain import DomainRegistry

    registry = DomainRegistry.default()
    rng = random.Random(seed)
    out: list[Demo] = []
    for name in domains:
        if name not in registry:
            raise ValueError(f"sft: unknown domain {name!r}; known: {', '.join(registry.names())}")
    combos = []
    for name in domains:
        domain = registry.get(name)
        usable = [t for t in tiers if 0 <= t < len(domain.tiers)] or [0]
        combos += [(domain, t) for t in usable]
    held = heldout_fingerprints(build_heldout(registry, domains, heldout)) if heldout else {}
    misses = 0  # draws in a row without a usable reference
    while len(out) < n:
        domain, tier = combos[len(out) % len(combos)]
        task = domain.sample_task(rng, tier)
        if task.reference and fingerprint(task.prompt) not in held.get(domain.name, ()):
            out.append(Demo(task.prompt, task.reference, list(domain_tools(domain))))
            misses = 0
            continue
        misses += 1
        if misses >= TIER_GIVES_UP_AFTER:
            combos.remove((domain, tier))
            misses = 0
            if not any(d is domain for d, _ in combos):
                raise ValueError(f"sft: domain {domain.name!r} gives no reference completions "
                                 "outside its held-out set")
            log.info("sft: %s tier %d left out: none of its tasks outside the held-out set "
                     "has a reference", domain.name, tier)
    return out


def demos_from_jsonl(path: str | Path) -> list[Demo]:
    """Rows {"prompt": str, "response": str}; a bad line raises ValueError with FILE:LINE."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(msgspec.json.decode(line, type=Demo))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise ValueError(f"{path}:{i}: not a {{prompt, response}} row: {exc}") from None
    if not out:
        raise ValueError(f"{path}: no demonstrations")
    return out


def encode_demo(tokenizer: Any, demo: Demo, *,
                chat_template: bool = True) -> tuple[list[int], list[int]]:
    """(ids, mask): the prompt, then the response and EOS (mask 1, trained). A transcript
    response is laid out as a tool episode is (`rl.episodes`): each turn and its EOS
    trained, each observation between turns context only. The prompt is built as the
    sampler and the evaluator build it, so SFT trains the format RL shows."""
    ids = task_prompt_ids(tokenizer, demo.prompt, chat_template=chat_template,
                          tools=demo.tools)
    mask = [0] * len(ids)
    turns = decode_transcript(demo.response) or [TranscriptTurn(text=demo.response)]
    for i, turn in enumerate(turns):
        said = [*tokenizer.encode(turn.text, add_special_tokens=False), tokenizer.eos_token_id]
        ids += said
        mask += [1] * len(said)
        if i < len(turns) - 1:
            env = observation_ids(tokenizer, turn.observation, tools=demo.tools,
                                  chat_template=chat_template, closed_by=tokenizer.eos_token)
            ids += env
            mask += [0] * len(env)
    return ids, mask


def run_sft(cfg: SFTConfig, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Train (or reuse the cached result); returns the summary printed as the final JSON."""
    demos = demos_from_jsonl(cfg.jsonl) if cfg.jsonl else demos_from_domains(
        cfg.domains, cfg.tiers, cfg.num_examples, cfg.seed, cfg.heldout)
    digest = cfg.inputs_digest(SFT_FORMAT, demos, sources=SFT_SOURCES)
    out = Path(cfg.out)
    cached = ckpt.cached_result(out, digest)
    if cached is not None:
        return cached

    from reinforge.engine.tokenizer import load_tokenizer
    from transformers import AutoModelForCausalLM

    torch = ckpt.seeded_torch(cfg.torch_threads, cfg.seed)
    tok = load_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    model.train()
    examples = [encode_demo(tok, d, chat_template=cfg.chat_template) for d in demos]
    dropped = sum(len(ids) > cfg.max_len for ids, _ in examples)
    examples = [e for e in examples if len(e[0]) <= cfg.max_len]
    if not examples:
        raise ValueError(f"sft: every demonstration is longer than max_len={cfg.max_len}")
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    tokens = 0
    for step in range(cfg.steps):
        batch = []
        while len(batch) < min(cfg.batch_size, len(examples)):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        length = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), length), pad, dtype=torch.long)
        labels = torch.full((len(batch), length), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), length), dtype=torch.long)
        for i, (seq, mask) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            labels[i, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
            ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens += int((labels[:, 1:] != -100).sum())
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            progress(f"sft step {step + 1}/{cfg.steps} loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - t0
    summary = {
        "steps": cfg.steps, "examples": len(examples), "dropped_too_long": dropped,
        "loss_first": losses[0], "loss_last": losses[-1],
        "loss_last10_mean": sum(losses[-10:]) / len(losses[-10:]),
        "response_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "train_s": elapsed,
    }
    ckpt.save_model_checkpoint(out, model=model, tokenizer_src=cfg.model, version=0,
                               step=cfg.steps, replace=True,
                               extra={"input_hash": digest, "summary": summary,
                                      "format": SFT_FORMAT})
    return {"out": str(out.absolute()), "cached": False, "input_hash": digest, **summary}
