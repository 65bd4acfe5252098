"""Benchmark: a learner step by data-parallel replicas (`learner.replicas`, worker processes
on torch.distributed's gloo, each with its share of the batch and `--threads / replicas`
torch threads) against one `Trainer` with all `--threads`, on `bench/learner_step.py`'s
batch (4 groups of 4, 48-token prompts, outputs of 8 to 96 tokens). Same policy, same batch;
the two alternate step by step so machine noise falls on both; medians after a warm-up step.
Also reported: the largest gap between the two policies' logprobs of the batch afterwards
(the same update, so float rounding only).

    python bench/learner_replicas.py --json [--replicas 2] [--threads 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from learner_step import GROUPS, GROUP_SIZE, PROMPT_TOKENS, demo_batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all")
    ap.add_argument("--model", default="", help="a Hugging Face model folder (default: the "
                                                "wide policy, made in a temp folder)")
    args = ap.parse_args()
    if args.threads % args.replicas:
        raise SystemExit("--threads must be a multiple of --replicas")

    import torch

    from reinforge.actors.learner import LearnerConfig
    from reinforge.cli.demo import policy_spec
    from reinforge.engine.tiny import init_tiny_model
    from reinforge.rl.replicas import ReplicaGroup
    from reinforge.rl.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="rf-bench-replicas-") as tmp:
        model = args.model
        if not model:
            model = str(Path(tmp) / "wide")
            init_tiny_model(Path(model), policy_spec("wide"))

        def config(threads: int) -> LearnerConfig:
            return LearnerConfig(model=model, torch_threads=threads, learning_rate=1e-6)

        one = Trainer(config(args.threads), model)
        group = ReplicaGroup(config(args.threads // args.replicas), model,
                             replicas=args.replicas)
        try:
            samples = demo_batch(one.model.config.vocab_size)
            runs = {"one_trainer": one, "replicas": group}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for step in range(args.steps + 1):
                for name, trainer in runs.items():
                    torch.set_num_threads(args.threads if name == "one_trainer"
                                          else args.threads // args.replicas)
                    t0 = time.perf_counter()
                    trainer.train_step(samples, version=step)
                    times[name].append(time.perf_counter() - t0)
                if not args.json:
                    print(f"step {step}: " + ", ".join(f"{n} {t[-1]:.2f} s"
                                                        for n, t in times.items()),
                          file=sys.stderr)
            gap = max((a - b).abs().max().item() for a, b in zip(
                one.logprobs(samples), group.logprobs(samples), strict=True))
        finally:
            group.close()
    step_s = {name: statistics.median(t[1:]) for name, t in times.items()}
    result = {
        "bench": "learner_replicas",
        "code_path": f"reinforge.rl.replicas.ReplicaGroup.train_step, {args.replicas} "
                     f"replicas x {args.threads // args.replicas} torch threads (gloo), "
                     f"against Trainer.train_step with {args.threads}; fp32, CPU",
        "model": args.model or "wide (made here)",
        "cpus": os.cpu_count(),
        "batch": {"groups": GROUPS, "group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS,
                  "output_tokens": sum(len(s.output_ids) for s in samples)},
        "step_s": {n: round(v, 3) for n, v in step_s.items()},
        "speedup_replicas": round(step_s["one_trainer"] / step_s["replicas"], 3),
        "logprob_max_gap_after": gap,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
