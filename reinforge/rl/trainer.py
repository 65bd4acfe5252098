"""The learner's torch side: the policy, its optimizer, and one GRPO step over a batch.

Synchronous and free of I/O except loading the model: the learner actor runs `train_step`
in a worker thread and owns everything about the bus and checkpoints. The maths come from
`reinforge.rl.grpo`; this module only batches sequences and accumulates gradients.
Every per-token term (loss, ratio and clip figures, KL, token count) is over the policy's
own tokens: inside the sequence and with loss mask 1 (environment text in multi-turn
episodes has 0).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import torch
from reinforge.rl.replicas import Replica
from reinforge.rl.grpo import (
    abs_logprob_gaps,
    clipped_policy_terms,
    k3_kl,
    summarise_gaps,
    tis_policy_terms,
    target_logprobs,
    token_mean,
)


def load_policy(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> Any:
    """A Hugging Face causal LM in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)


def sequence_logprobs(
    model: Any,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each output token given its prompt and the earlier output tokens.

    Returns (logp [B, T_out], mask [B, T_out]) with T_out the longest output; sequences are
    right-padded, so padding never influences the positions that are read.
    """
    if len(prompt_ids) != len(output_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(output_ids)} outputs")
    seqs = [list(p) + list(o) for p, o in zip(prompt_ids, output_ids, strict=True)]
    b, length = len(seqs), max(len(s) for s in seqs)
    t_out = max(len(o) for o in output_ids)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    # output token j of sample i is predicted at position len(prompt_i) - 1 + j
    starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=device).unsqueeze(1)
    pos = (starts + torch.arange(t_out, device=device).unsqueeze(0)).clamp(max=length - 1)
    lengths = torch.tensor([len(o) for o in output_ids], device=device).unsqueeze(1)
    mask = torch.arange(t_out, device=device).unsqueeze(0) < lengths
    rows = torch.arange(b, device=device).unsqueeze(1).expand(b, t_out)
    picked = logits[rows, pos]  # [B, T_out, V]
    targets = ids[rows, (pos + 1).clamp(max=length - 1)]
    logp = target_logprobs(picked, targets, temperature) * mask
    return logp, mask


def prompt_group_logprobs(
    model: Any,
    prompt_ids: list[int],
    output_ids: list[list[int]],
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` of outputs that share one prompt (a GRPO group's samples differ
    only after it): the prompt passes through the model once and its keys and values serve
    every output, so a group of G costs P + G x T tokens of compute instead of G x (P + T).
    Gradients flow through the shared keys and values as through G copies of them."""
    if not prompt_ids or not output_ids:
        raise ValueError("prompt_group_logprobs needs a prompt and at least one output")
    device = next(model.parameters()).device
    g, t_out = len(output_ids), max(len(o) for o in output_ids)
    head = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True,
                 logits_to_keep=1)
    targets = padded(output_ids, t_out, torch.long).to(device)
    # predicts every output's first token (none when every output is empty)
    logits = head.logits[:, -1:].expand(g, 1, -1)[:, :t_out]
    if t_out > 1:
        name = cache_argument(model)
        cache = getattr(head, name)
        cache.batch_repeat_interleave(g)
        # right padding: a padded position comes after every position that is read
        rest = model(input_ids=targets[:, :-1], use_cache=True, **{name: cache}).logits
        logits = torch.cat([logits, rest], dim=1)
    lengths = torch.tensor([len(o) for o in output_ids], device=device).unsqueeze(1)
    mask = torch.arange(t_out, device=device).unsqueeze(0) < lengths
    return target_logprobs(logits, targets, temperature) * mask, mask


def cache_argument(model: Any) -> str:
    """The name a causal LM's forward takes its KV cache by (and returns it as): `cache`
    since transformers 5.25, `past_key_values` before (5.25 still takes it, with a warning)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def padded(rows: list[list[float]] | list[list[int]], width: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Rows right-padded with zeros to `width` columns, as one [len(rows), width] tensor."""
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


class Trainer:
    """The policy, an optional frozen reference, AdamW, and the GRPO step.

    `cfg.precision`: fp32 (float32 parameters and compute), bf16-autocast (float32
    parameters, forward passes under bf16 autocast) or bf16 (bf16 parameters, which forward
    passes and checkpoints use, with float32 master weights that the optimizer steps).
    Logprobs are float32 in every case."""

    def __init__(
        self,
        cfg: Any,
        model_dir: str | Path,
        state: dict[str, Any] | None = None,
        *,
        reference_dir: str | Path | None = None,
        replica: Replica | None = None,
    ) -> None:
        """`replica`: this process's place among data-parallel replicas
        (`reinforge.rl.replicas`, torch.distributed initialised): each optimizer step trains
        on its share of the samples and the replicas sum their gradients."""
        self.replica = replica
        torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        keep_freed_memory()
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        # LoRA adapts the frozen base model: a resumed run loads it, not a merged checkpoint
        base = cfg.model if cfg.lora is not None and cfg.model else model_dir
        self.model = load_policy(base, dtype=self.dtype, device=cfg.device)
        if cfg.lora is not None:
            self.model = with_lora(self.model, cfg.lora)
            if state is not None and "lora" in state:
                self._load_adapters(state["lora"])
        if cfg.gradient_checkpointing:  # transformers 5 renamed it (the old name warns)
            enable = (getattr(self.model, "activation_checkpointing_enable", None)
                      or self.model.gradient_checkpointing_enable)
            enable()
        self.model.train()
        # transformers keeps no cache under activation checkpointing: nothing to share then
        self.share_prompts = cfg.share_prompts and not cfg.gradient_checkpointing
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self._new_optimizer(state)
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
        self.reference = None
        if cfg.kl_coef > 0 or cfg.anchor_kl_coef > 0:
            if not reference_dir:
                raise ValueError("kl_coef > 0 or anchor_kl_coef > 0 needs a reference model "
                                 "directory")
            self.reference = load_policy(reference_dir, dtype=self.dtype,
                                         device=cfg.device).eval()
            self.reference.requires_grad_(False)

    def _new_optimizer(self, state: dict[str, Any] | None = None) -> None:
        """AdamW over the trained parameters (all, or LoRA's adapters), or (bf16) float32
        masters of them: those a checkpoint's trainer state kept, else the weights widened."""
        params = self._trained()
        self.master = None
        if self.dtype != torch.float32:
            kept = (state or {}).get("master")
            self.master = [(kept[i] if kept else p.detach()).float().clone().requires_grad_(True)
                           for i, p in enumerate(params)]
        # the fused kernel: one pass over each tensor (bench/learner_step.py times both)
        self.optimizer = torch.optim.AdamW(self.master or params, lr=self.cfg.learning_rate,
                                           weight_decay=self.cfg.weight_decay, fused=True)

    def _trained(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _adapters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()
                if p.requires_grad}

    def _load_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in adapters.items():
                params[name].copy_(value)

    def export_model(self) -> Any:
        """The policy to publish: the model, or with LoRA a copy with the adapters merged
        into plain weights (what a rollout server loads)."""
        if self.cfg.lora is None:
            return self.model
        import copy

        return copy.deepcopy(self.model).merge_and_unload()

    def _forward(self):
        """The context of a forward pass: bf16 autocast for `precision = "bf16-autocast"`."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.precision == "bf16-autocast")

    def restore(self, model_dir: str | Path, state: dict[str, Any]) -> None:
        """Return the policy and optimizer to a checkpoint (a rollback); the reference stays.
        With LoRA only the adapters move (the base is frozen)."""
        if self.cfg.lora is not None:
            self._load_adapters(state["lora"])
        else:
            loaded = load_policy(model_dir, dtype=self.dtype, device=self.cfg.device)
            self.model.load_state_dict(loaded.state_dict())
        self._new_optimizer(state)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])

    def state_dict(self, *, step: int, ledger: dict[str, int], counters: dict[str, int],
                   tasks: dict[str, str] | None = None,
                   rollbacks_applied: list[str] | None = None) -> dict[str, Any]:
        state = {
            "step": step,
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "ledger": dict(ledger),
            "tasks": dict(tasks or {}),
            "counters": dict(counters),
            "rollbacks_applied": list(rollbacks_applied or []),
        }
        if self.cfg.lora is not None:
            state["lora"] = self._adapters()
        if self.master is not None:  # the float32 weights the bf16 ones are rounded from
            state["master"] = [m.detach().cpu().clone() for m in self.master]
        return state

    def snapshot(self, **state_args: Any) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
        """What a checkpoint of now writes, as copies in host memory: (the model to publish,
        its weights, `state_dict(**state_args)`). The next `train_step` changes the live
        tensors in place, so a checkpoint written while it runs must come from copies."""
        model = self.export_model()
        return (model, detached_copy(model.state_dict()),
                detached_copy(self.state_dict(**state_args)))

    def train_step(self, samples: list[Any], version: int,
                   anchors: list[Any] | None = None) -> dict[str, float]:
        """Train on one batch of `samples` (TrainSample-like); returns its figures.

        `anchors` (TrainSample-like, their advantages unused): samples whose tokens add
        `anchor_kl_coef` x their token-mean k3 KL to the reference to every optimizer step's
        loss, and nothing else (`anchor_kl`, `anchor_samples` in the figures): the learner
        holds the policy near its start on prompts it is not learning from.

        `ppo_epochs` passes over the batch, each split into `minibatches` optimizer steps
        (default 1 x 1: one step). With more than one step and TIS on, the PPO ratio of every
        step is taken to the learner's logprobs before the first one (computed once), so later
        steps clip as PPO does; TIS weights stay those of that first policy.

        Figures are over policy tokens (loss mask 1), the mean over the optimizer steps
        (`clip_frac_epoch_<e>` per epoch when there are several). `ratio_mean`,
        `kl_behaviour` and the `logp_mismatch_*` figures compare the learner's logprobs with
        the behaviour logprobs the rollouts carry: for samples of the learner's own version
        (staleness 0) that gap is purely inference vs training (e.g. the engine's quantized KV
        cache), for older ones it includes the policy's drift. With one step `clip_frac` is 0
        while TIS is on (see `grpo.tis_policy_terms`).
        """
        cfg = self.cfg
        if not samples:
            raise ValueError("train_step needs at least one sample")
        t0 = time.perf_counter()
        steps = cfg.ppo_epochs * cfg.minibatches
        proximal = self._proximal_logprobs(samples) if steps > 1 and cfg.tis_cap > 0 else None
        shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + version)
        per_step: list[dict[str, float]] = []
        gaps: list[torch.Tensor] = []
        for epoch in range(cfg.ppo_epochs):
            order = (torch.randperm(len(samples), generator=shuffle).tolist() if epoch
                     else list(range(len(samples))))
            for part in split_evenly(order, cfg.minibatches):
                step = self._optimizer_step(
                    [samples[i] for i in part], None if proximal is None else
                    [proximal[i] for i in part], version, gaps if not per_step else None,
                    anchors or [])
                per_step.append({**step, "epoch": float(epoch)})
        compute_s = time.perf_counter() - t0
        num_tokens = sum(sum(s.loss_mask) for s in samples)
        mismatch = summarise_gaps(torch.cat(gaps), cfg.logp_mismatch_threshold_nats)
        keys = ["loss", "policy_loss", "kl_behaviour", "clip_frac", "ratio_mean", "grad_norm"]
        keys += ["tis_weight_mean", "tis_capped_share"] if cfg.tis_cap > 0 else []
        keys += ["kl_ref"] if cfg.kl_coef > 0 else []
        keys += ["anchor_kl"] if anchors else []
        figures = {k: sum(st[k] for st in per_step) / len(per_step) for k in keys}
        if anchors:
            figures["anchor_samples"] = float(len(anchors))
        figures.update({
            "ratio_dev_max_on_policy": per_step[0]["ratio_dev_max_on_policy"],
            "optimizer_steps": float(steps),
            "tokens": float(num_tokens),
            "samples": float(len(samples)),
            "compute_s": compute_s,
            "tokens_per_s": steps * num_tokens / compute_s if compute_s > 0 else 0.0,
            "logp_mismatch_mean_nats": mismatch.mean_nats,
            "logp_mismatch_max_nats": mismatch.max_nats,
            "logp_mismatch_share_over": mismatch.share_over,
            "logp_mismatch_threshold_nats": cfg.logp_mismatch_threshold_nats,
        })
        if cfg.ppo_epochs > 1:
            for e in range(cfg.ppo_epochs):
                mine = [st["clip_frac"] for st in per_step if st["epoch"] == e]
                figures[f"clip_frac_epoch_{e}"] = sum(mine) / len(mine)
        return figures

    def _batches(self, samples: list[Any]) -> list[list[Any]]:
        """The micro-batches of `samples`: with shared prompts, each holds one prompt's."""
        return micro_batches(samples, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens,
                             by_prompt=self.share_prompts)

    def _sequence_logprobs(self, model: Any, mb: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """`mb`'s output logprobs under `model` (the policy or the reference) and their mask."""
        outputs, temperature = [s.output_ids for s in mb], self.cfg.temperature
        if self.share_prompts and len(mb) > 1:
            return prompt_group_logprobs(model, mb[0].prompt_ids, outputs, temperature=temperature)
        return sequence_logprobs(model, [s.prompt_ids for s in mb], outputs,
                                 temperature=temperature, pad_id=self.pad_id)

    def logprobs(self, samples: list[Any]) -> list[torch.Tensor]:
        """The policy's logprobs of each sample's output tokens now (no gradient)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        index = {id(s): i for i, s in enumerate(samples)}  # micro-batches may regroup them
        with torch.no_grad(), self._forward():
            for mb in self._batches(samples):
                logp, _ = self._sequence_logprobs(self.model, mb)
                for i, s in enumerate(mb):
                    out[index[id(s)]] = logp[i, : len(s.output_ids)].cpu()
        return out

    def _proximal_logprobs(self, samples: list[Any]) -> list[torch.Tensor]:
        """`logprobs(samples)` before a batch's first step. Replicas each compute their share
        and gather the rest: every one needs them all, as later steps reshuffle the batch."""
        if self.replica is None:
            return self.logprobs(samples)
        return self.replica.gather(self.logprobs(self.replica.share(samples)))

    def _optimizer_step(self, samples: list[Any], proximal: list[torch.Tensor] | None,
                        version: int, gaps: list[torch.Tensor] | None,
                        anchors: list[Any]) -> dict[str, float]:
        """Accumulate the gradient of `samples` (and `anchors`' KL) over micro-batches, then
        one optimizer step; the step's figures. `gaps` (the first step's) collects
        |logp - logp_behaviour|."""
        cfg = self.cfg
        num_tokens = sum(sum(s.loss_mask) for s in samples)
        per_token = max(num_tokens, 1)  # a batch of environment text only: figures are 0
        sums = dict.fromkeys(("loss", "policy_loss", "kl_ref", "kl_behaviour", "clip", "ratio",
                              "tis_weight", "tis_capped"), 0.0)
        on_policy_dev = 0.0
        index = {id(s): i for i, s in enumerate(samples)}
        self.optimizer.zero_grad(set_to_none=True)
        mine = samples if self.replica is None else self.replica.share(samples)
        for mb in self._batches(mine) if mine else []:
            with self._forward():
                logp, in_seq = self._sequence_logprobs(self.model, mb)
            width, dev = logp.shape[1], logp.device
            mask = padded([s.loss_mask for s in mb], width, logp.dtype).to(dev) * in_seq
            old = padded([s.logprobs for s in mb], width, logp.dtype).to(dev)
            adv = torch.tensor([s.advantage for s in mb], dtype=logp.dtype, device=dev)
            if cfg.tis_cap > 0:
                first = None if proximal is None else padded(
                    [proximal[index[id(s)]].tolist() for s in mb], width, logp.dtype).to(dev)
                terms, tis = tis_policy_terms(logp, old, adv, mask, cap=cfg.tis_cap,
                                              clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                              logp_old=first)
                sums["tis_weight"] += float((tis.weight * mask).sum())
                sums["tis_capped"] += float(tis.capped.sum())
            else:
                terms = clipped_policy_terms(
                    logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high
                )
            policy_loss = token_mean(terms.loss, mask, num_tokens)
            loss = policy_loss
            if cfg.kl_coef > 0:
                kl = token_mean(k3_kl(logp, self._reference_logprobs(mb), mask), mask,
                                num_tokens)
                loss = loss + cfg.kl_coef * kl
                sums["kl_ref"] += kl.item()
            loss.backward()
            with torch.no_grad():
                sums["loss"] += loss.item()
                sums["policy_loss"] += policy_loss.item()
                sums["kl_behaviour"] += float(token_mean(k3_kl(logp, old, mask), mask, num_tokens))
                sums["clip"] += float(terms.clipped.sum()) / per_token
                ratio = torch.exp((logp - old) * mask)  # to the behaviour policy, 1 off-mask
                sums["ratio"] += float((ratio * mask).sum()) / per_token
                fresh = torch.tensor([s.policy_version == version for s in mb],
                                     device=dev).unsqueeze(1)
                on_policy = ((ratio - 1.0).abs() * mask * fresh).max()
                on_policy_dev = max(on_policy_dev, float(on_policy))
                if gaps is not None:
                    gaps.append(abs_logprob_gaps(logp, old, mask).cpu())
        if anchors:
            sums["anchor_kl"] = self._anchor_gradient(anchors)
        if self.replica is not None:  # every figure over the whole step, as one replica's
            sums = self.replica.sum_figures(sums)
            on_policy_dev = self.replica.max_figure(on_policy_dev)
            if gaps is not None:
                gaps[:] = self.replica.gather(gaps)
        grad_norm = self._step(cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        step = {
            "loss": sums["loss"],
            "policy_loss": sums["policy_loss"],
            "kl_behaviour": sums["kl_behaviour"],
            "clip_frac": sums["clip"],
            "ratio_mean": sums["ratio"],
            "ratio_dev_max_on_policy": on_policy_dev,
            "grad_norm": float(grad_norm),
            "tis_weight_mean": sums["tis_weight"] / per_token,
            "tis_capped_share": sums["tis_capped"] / per_token,
        }
        if cfg.kl_coef > 0:
            step["kl_ref"] = sums["kl_ref"]
        if anchors:
            step["anchor_kl"] = sums["anchor_kl"]
        return step

    def _reference_logprobs(self, mb: list[Any]) -> torch.Tensor:
        with torch.no_grad(), self._forward():
            return self._sequence_logprobs(self.reference, mb)[0]

    def _anchor_gradient(self, anchors: list[Any]) -> float:
        """Accumulate the gradient of `anchor_kl_coef` x the anchors' token-mean k3 KL to
        the reference (over all their policy tokens, this replica's share); their KL."""
        num_tokens = sum(sum(s.loss_mask) for s in anchors)
        mine = anchors if self.replica is None else self.replica.share(anchors)
        total = 0.0
        for mb in self._batches(mine) if mine else []:
            with self._forward():
                logp, in_seq = self._sequence_logprobs(self.model, mb)
            mask = padded([s.loss_mask for s in mb], logp.shape[1], logp.dtype).to(
                logp.device) * in_seq
            kl = token_mean(k3_kl(logp, self._reference_logprobs(mb), mask), mask, num_tokens)
            (self.cfg.anchor_kl_coef * kl).backward()
            total += kl.item()
        return total

    def _step(self, max_norm: float) -> torch.Tensor:
        """Clip the accumulated gradient and step; bf16 parameters take the stepped float32
        masters. Returns the gradient's norm before clipping."""
        params = self._trained()
        if self.master is not None:
            for m, p in zip(self.master, params, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
        if self.replica is not None:  # the whole batch's gradient, on every replica
            self.replica.sum_gradients(self.master or params)
        norm = torch.nn.utils.clip_grad_norm_(self.master or params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, params, strict=True):
                    p.copy_(m)
                    p.grad = None
        return norm


def detached_copy(obj: Any) -> Any:
    """`obj` (nested dicts, lists and tuples of tensors and plain values) with every tensor
    copied to host memory. Tensors that share memory (tied embeddings) share their copy, so
    a model saved from it keeps its tied weights tied."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = (x.device, x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
            if key not in copies:
                copies[key] = x.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse in this process. By default it hands
    blocks over 32 MB back to the kernel and page-faults them in again on the next use; a
    training step allocates the same large buffers every time (a 135 M model's tied
    embedding gradient alone is 113 MB), which made a fifth of a CPU step system time.
    Not glibc (another libc, macOS): nothing to do."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    mallopt(m_mmap_max, 0)  # large blocks come from the heap, which keeps them ...
    mallopt(m_trim_threshold, 1 << 30)  # ... unless over 1 GB lies free at its top


def with_lora(model: Any, lora: Any) -> Any:
    """`model` with peft's LoRA adapters on `lora.targets`, only they trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise RuntimeError(f"learner: lora needs peft ({exc})") from None
    import warnings

    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                        lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' renamed checkpointing flag
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)


def split_evenly(items: list[int], parts: int) -> list[list[int]]:
    """`items` in `parts` consecutive runs of sizes differing by at most one (no empty run)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (p < extra)
        out.append(items[start:end])
        start = end
    return out


def micro_batches(samples: list[Any], size: int, token_budget: int = 0, *,
                  by_prompt: bool = False) -> list[list[Any]]:
    """Consecutive runs of at most `size` samples and, with a `token_budget`, at most that
    many padded tokens (run length x its longest prompt + output); a sample longer than the
    budget gets a run of its own. `by_prompt`: the samples are first put together by prompt
    (in the order prompts first appear) and each run holds one prompt's samples."""
    if by_prompt:
        by: dict[tuple[int, ...], list[Any]] = {}
        for s in samples:
            by.setdefault(tuple(s.prompt_ids), []).append(s)
        return [run for same in by.values() for run in micro_batches(same, size, token_budget)]
    out: list[list[Any]] = []
    run: list[Any] = []
    longest = 0
    for s in samples:
        length = len(s.prompt_ids) + len(s.output_ids)
        grown = max(longest, length) * (len(run) + 1)
        if run and (len(run) == size or (token_budget and grown > token_budget)):
            out.append(run)
            run, longest = [], 0
        run.append(s)
        longest = max(longest, length)
    if run:
        out.append(run)
    return out
