"""Benchmark: how far the rollout engine's sampling distribution is from the learner's, and
how much of that bias each policy-gradient weighting leaves.

The engine samples from mu (its int8 KV cache, the default); the learner's gradient wants
samples from pi (the same weights in float32, transformers). At every context an engine
rollout visited, both full next-token distributions are taken (the engine's from its own
sampling step, the learner's from one forward pass), and for a statistic f in [0, 1] of
the next token the largest bias of its estimate from one mu sample is, exactly:

  uncorrected   weight 1 (the sample treated as pi's):      TV(mu, pi) = sum max(0, mu - pi)
  ppo_clip      weight clip(pi/mu, 1-e, 1+e) (the learner's  sum |mu * clip(pi/mu) - pi| / 2
                ratio to the behaviour logprobs, TIS off)
  tis           weight min(pi/mu, C) (TIS on, `tis_cap` C):  sum max(0, pi - C mu)

(the last two are bounds of the same kind: half the L1 distance between the weighted mu and
pi). Reported as means over the visited contexts. Baseline in the same run: the same
prompts through the engine with a float32 KV cache, whose bias should be ~0.

Also reported: the per-token |logp_learner - logp_engine| on the sampled tokens (what the
learner's `logp_mismatch_*` figures measure) for both caches.

Prints ONE JSON object as its last line (`--json` prints only that).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def rollouts_with_distributions(engine, prompts, params) -> dict:
    """Run the engine and keep, per (sequence, step), its full log-distribution."""
    import torch
    from reinforge.engine.sampling import token_logprobs

    from engine import run_engine  # bench/engine.py: this folder is sys.path[0]

    seen: dict = {}
    sample_and_advance = engine._sample_and_advance

    def recording(seqs, logits):
        temps = [s.params.temperature for s in seqs]
        for s, row in zip(seqs, token_logprobs(logits, torch.tensor(temps))):
            if s.params.max_new_tokens > 0:
                seen[(s.index, len(s.output_ids))] = row.clone()
        sample_and_advance(seqs, logits)

    engine._sample_and_advance = recording
    try:
        _, results = run_engine(engine, prompts, params)
    finally:
        engine._sample_and_advance = sample_and_advance
    return {"results": results, "dists": seen}


def learner_distributions(hf, prompt_ids, output_ids, temperature: float):
    """The learner's log-distribution at every output position: [T, V] per sequence."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.inference_mode():
        logits = hf(input_ids=ids, use_cache=False).logits[0].float()
    p = len(prompt_ids)
    return torch.log_softmax(logits[p - 1 : p - 1 + len(output_ids)] / temperature, dim=-1)


def bias_figures(pairs, *, clip: float, cap: float) -> dict:
    """Mean residual biases over (log mu, log pi) context pairs; see the module doc."""
    import torch

    mu = torch.stack([a for a, _ in pairs]).exp()
    pi = torch.stack([b for _, b in pairs]).exp()
    ratio = pi / mu.clamp_min(1e-30)
    tv = (mu - pi).clamp_min(0).sum(-1)
    ppo = (mu * ratio.clamp(1 - clip, 1 + clip) - pi).abs().sum(-1) / 2
    tis = (pi - cap * mu).clamp_min(0).sum(-1)
    return {"uncorrected": tv.mean().item(), "ppo_clip": ppo.mean().item(),
            "tis": tis.mean().item(), "uncorrected_max": tv.max().item()}


def measure(engine, hf, prompts, params, *, clip: float, cap: float) -> dict:
    import torch

    run = rollouts_with_distributions(engine, prompts, params)
    pairs, gaps = [], []
    for seq_index, res in run["results"].items():
        prompt = prompts[seq_index // params.n]
        learner = learner_distributions(hf, prompt, res.output_ids, params.temperature)
        for step, tok in enumerate(res.output_ids):
            mu = run["dists"][(seq_index, step)]
            pairs.append((mu, learner[step]))
            gaps.append(abs(learner[step][tok].item() - res.output_logprobs[step]))
    figures = bias_figures(pairs, clip=clip, cap=cap)
    gaps_t = torch.tensor(gaps)
    figures.update(contexts=len(pairs), logp_gap_mean_nats=gaps_t.mean().item(),
                   logp_gap_max_nats=gaps_t.max().item())
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--model", help="HF model dir (default: a fresh `reinforge model init`)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--clip", type=float, default=0.2, help="the learner's PPO clip (clip_low)")
    ap.add_argument("--tis-cap", type=float, default=2.0, help="the learner's tis_cap")
    ap.add_argument("--kernel-backend", default="auto")
    args = ap.parse_args()

    import torch
    from reinforge.engine.engine import Engine, EngineConfig, default_torch_threads
    from reinforge.engine.loader import load_model
    from reinforge.engine.sampling import SamplingParams
    from reinforge.engine.tiny import init_tiny_model
    from reinforge.engine.tokenizer import load_tokenizer
    from transformers import AutoModelForCausalLM

    from engine import task_prompts  # bench/engine.py

    torch.set_num_threads(default_torch_threads())
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(args.model) if args.model else init_tiny_model(Path(tmp.name) / "tiny")
    prompts = task_prompts(load_tokenizer(model_dir), args.prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = load_model(model_dir)
    capacity = 2 * len(prompts) * args.n * (max(map(len, prompts)) + args.max_new_tokens + 16)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            n=args.n, ignore_eos=True, sampling_seed=1234)
    out: dict = {"bench": "rollout_mismatch", "model": str(args.model or "tiny (fresh init)"),
                 "temperature": args.temperature, "clip": args.clip, "tis_cap": args.tis_cap}
    for dtype in ("int8", "float32"):
        engine = Engine(model, EngineConfig(kv_cache_dtype=dtype, max_total_tokens=capacity,
                                            kernel_backend=args.kernel_backend))
        figures = measure(engine, hf, prompts, params, clip=args.clip, cap=args.tis_cap)
        figures["kv_backend"] = engine.pool.ops.name
        out[f"kv_{dtype}"] = {k: (float(f"{v:.4g}") if isinstance(v, float) else v)
                              for k, v in figures.items()}
        say(f"kv {dtype} ({figures['kv_backend']}): bias uncorrected {figures['uncorrected']:.5f}"
            f", ppo_clip {figures['ppo_clip']:.5f}, tis {figures['tis']:.5f} over "
            f"{figures['contexts']} contexts; |dlogp| mean {figures['logp_gap_mean_nats']:.4f}"
            f" max {figures['logp_gap_max_nats']:.4f}")
    i8 = out["kv_int8"]
    out["tis_removes_share_of_bias"] = (round(1 - i8["tis"] / i8["uncorrected"], 4)
                                        if i8["uncorrected"] else None)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
