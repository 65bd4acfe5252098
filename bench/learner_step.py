"""Benchmark: a learner step with each group's prompt run once (`share_prompts`, the
default) against every sample run as its own padded sequence, same policy and batch.

The batch has `reinforge demo`'s shape: 4 groups of 4 samples, a 48-token prompt per group
(the math domain's prompts under a chat template are 45 to 60), outputs of 8 to 96 tokens
with a median near 28 (the demo's policy writes about 27 on average; how widely they spread,
which sets how much the padded path pads, was not measured). Each variant is one `Trainer`
(fp32, one torch thread, on the CPU) stepping the same batch; the two alternate step by step, so
machine noise falls on both, and each's step time is the median after a warm-up step. Also
reported: the largest gap between the two variants' logprobs of the batch (they compute the
same function; float32 rounding only), and one AdamW step over the policy's parameters with
torch's fused kernel (the trainer's) against its default multi-tensor one.

    python bench/learner_step.py --json                      # the wide policy, made here
    python bench/learner_step.py --model DIR --json          # a Hugging Face folder
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

GROUPS, GROUP_SIZE, PROMPT_TOKENS = 4, 4, 48


def demo_batch(vocab: int, seed: int = 0) -> list:
    import torch

    from reinforge.rl.samples import TrainSample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(GROUPS):
        prompt = torch.randint(5, vocab, (PROMPT_TOKENS,), generator=gen).tolist()
        for i in range(GROUP_SIZE):
            # log-uniform lengths between 8 and 96: median about 28
            n = int(8 * 12 ** torch.rand((), generator=gen).item())
            samples.append(TrainSample(
                rollout_id=f"g{g}:{i}:1", domain="bench", prompt_ids=prompt,
                output_ids=torch.randint(5, vocab, (n,), generator=gen).tolist(),
                logprobs=[-2.0] * n, advantage=1.0 if i % 2 else -1.0, reward=float(i % 2),
                policy_version=0, loss_mask=[1] * n))
    return samples


def adamw_step_s(model, fused: bool, steps: int) -> float:
    """Median seconds of one AdamW step (after a warm-up step) over `model`'s parameters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.full_like(p, 1e-3) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-9, fused=fused)
    times = []
    for _ in range(steps + 1):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    for p in params:
        p.grad = None
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--model", default="", help="a Hugging Face model folder (default: the "
                                                "wide policy, made in a temp folder)")
    args = ap.parse_args()

    import torch

    from reinforge.actors.learner import LearnerConfig
    from reinforge.cli.demo import policy_spec
    from reinforge.engine.tiny import init_tiny_model
    from reinforge.rl.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="rf-bench-learner-") as tmp:
        model = args.model
        if not model:
            model = str(Path(tmp) / "wide")
            init_tiny_model(Path(model), policy_spec("wide"))
        trainers = {
            name: Trainer(LearnerConfig(model=model, torch_threads=1, share_prompts=share,
                                        learning_rate=1e-6), model)
            for name, share in (("padded", False), ("shared_prompt", True))}
        samples = demo_batch(trainers["padded"].model.config.vocab_size)
        gap = max((a - b).abs().max().item() for a, b in zip(
            trainers["padded"].logprobs(samples), trainers["shared_prompt"].logprobs(samples),
            strict=True))
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for step in range(args.steps + 1):
            for name, trainer in trainers.items():
                t0 = time.perf_counter()
                trainer.train_step(samples, version=step)
                times[name].append(time.perf_counter() - t0)
            if not args.json:
                print(f"step {step}: " + ", ".join(f"{n} {t[-1]:.2f} s"
                                                    for n, t in times.items()), file=sys.stderr)
        policy = trainers["padded"].model
        adamw = {"foreach": adamw_step_s(policy, False, args.steps),
                 "fused": adamw_step_s(policy, True, args.steps)}
    step_s = {name: statistics.median(t[1:]) for name, t in times.items()}
    tokens = sum(len(s.output_ids) for s in samples)
    result = {
        "bench": "learner_step",
        "code_path": "reinforge.rl.trainer.Trainer.train_step, fp32, CPU, torch threads 1",
        "model": args.model or "wide (made here)",
        "batch": {"groups": GROUPS, "group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS,
                  "output_tokens": tokens},
        "step_s": {n: round(v, 3) for n, v in step_s.items()},
        "step_s_all": {n: [round(x, 3) for x in t] for n, t in times.items()},
        "speedup_shared_prompt": round(step_s["padded"] / step_s["shared_prompt"], 3),
        "logprob_max_gap": gap,
        "adamw_step_s": {n: round(v, 3) for n, v in adamw.items()},
        "speedup_fused_adamw": round(adamw["foreach"] / adamw["fused"], 3),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
