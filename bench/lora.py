"""Benchmark: a learner step with LoRA adapters against full fine-tuning, same policy and batch.

The wide policy (about 26 M parameters, `reinforge demo`'s `wide` size), one GRPO step over a
batch of 16 samples (prompt 64 + output 64 tokens each), fp32 on the CPU. Each variant runs
in its own process (peak RSS is a process's high-water mark), full fine-tuning first, then
LoRA r=16 on every projection; step time is the median of `--steps` steps after a warm-up
step. Reported: step seconds and peak RSS of each, their ratios, trainable parameters.

    python bench/lora.py --json        # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_variant(model_dir: str, lora: bool, steps: int) -> dict:
    import torch

    from reinforge.actors.learner import LearnerConfig, LoraSettings
    from reinforge.rl.samples import TrainSample
    from reinforge.rl.trainer import Trainer

    cfg = LearnerConfig(model=model_dir, torch_threads=1, micro_batch_size=16,
                        lora=LoraSettings() if lora else None)
    trainer = Trainer(cfg, model_dir)
    gen = torch.Generator().manual_seed(0)
    def ids() -> list[int]:
        return torch.randint(5, 3000, (64,), generator=gen).tolist()

    samples = [TrainSample(
        rollout_id=f"b:{i}:1", domain="bench", prompt_ids=ids(), output_ids=ids(),
        logprobs=[-1.0] * 64, advantage=1.0 if i % 2 else -1.0, reward=float(i % 2),
        policy_version=0, loss_mask=[1] * 64) for i in range(16)]
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        trainer.train_step(samples, version=step)
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"step_s": statistics.median(times[1:]), "step_s_all": [round(t, 3) for t in times],
            "trainable_params": trainable,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variant", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:  # a child: one variant, one JSON line
        print(json.dumps(one_variant(args.model, args.variant == "lora", args.steps)))
        return 0
    from reinforge.cli.demo import policy_spec
    from reinforge.engine.tiny import init_tiny_model

    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_tiny_model(Path(tmp) / "wide", policy_spec("wide")))
        out = {}
        for variant in ("full", "lora"):
            run = subprocess.run([sys.executable, __file__, "--variant", variant, "--model",
                                  model_dir, "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            out[variant] = json.loads(run.stdout.strip().splitlines()[-1])
            v = out[variant]
            say(f"{variant}: step {v['step_s']:.3f} s, peak RSS {v['peak_rss_mb']:.0f} MB, "
                f"trainable {v['trainable_params']}")
    result = {
        "bench": "lora",
        "policy": "wide",
        "batch": "16 x (64 prompt + 64 output) tokens, fp32, 1 torch thread",
        "lora": {"r": 16, "alpha": 32, "targets": "every projection"},
        "full": out["full"],
        "lora_run": out["lora"],
        "step_time_ratio_lora_vs_full": round(out["lora"]["step_s"] / out["full"]["step_s"], 3),
        "peak_rss_ratio_lora_vs_full": round(
            out["lora"]["peak_rss_mb"] / out["full"]["peak_rss_mb"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
