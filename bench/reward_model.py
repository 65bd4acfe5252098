"""Reward-model scoring: the rm domain's verifications one at a time in the verifier's own
process (the baseline: a torch forward pass of batch 1 each) against the same verifications
through `reinforge serve --is-embedding` (SGLang's `/classify`), `--concurrency` in flight,
which the server scores together in its passes. One run, medians of `--repeats`.

    python bench/reward_model.py --json [--model RM_DIR] [--n 96] [--concurrency 16]

Without `--model`, the reward model is an untrained scalar head on `--base` (default: the
tiny policy `reinforge model init` writes; scoring costs the same whatever the head
learned). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

from reinforge.envs.domains.reward_model import RewardModelDomain
from reinforge.rl.reward_model import synthetic_pairs


def make_reward_model(where: Path, base: str) -> Path:
    """An untrained scalar head on `base` (a policy folder), or on the tiny policy."""
    import torch

    from reinforge.engine.tiny import init_tiny_model
    from reinforge.rl import checkpoint as ckpt
    from reinforge.rl.reward_model import load_reward_model

    policy = Path(base) if base else init_tiny_model(where / "policy")
    torch.manual_seed(0)
    return ckpt.save_model_checkpoint(where / "rm", model=load_reward_model(policy),
                                      tokenizer_src=policy, version=0)


async def verify_all(domain: RewardModelDomain, work: list[tuple[str, str]],
                     concurrency: int) -> float:
    """Seconds to verify every (prompt, answer), `concurrency` at a time."""
    from reinforge.envs.domain import TaskSpec

    limit = trio.Semaphore(concurrency)
    failed = []

    async def one(k: int, prompt: str, answer: str) -> None:
        async with limit:
            task = TaskSpec(task_id=f"b{k}", domain="rm-synthetic", tier=0, prompt=prompt,
                            spec={})
            v = await domain.verify(task, answer)
            if v.outcome == "infra_error":
                failed.append(v.reason)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k, (prompt, answer) in enumerate(work):
            nursery.start_soon(one, k, prompt, answer)
    took = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"a verification failed: {failed[0]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a reward model folder (default: tiny, untrained)")
    ap.add_argument("--base", default="",
                    help="without --model: the policy folder to put an untrained head on, "
                         "e.g. .reinforge/models/smollm2-135m (default: the tiny policy)")
    ap.add_argument("--n", type=int, default=96, help="verifications per measurement")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="rf-bench-rm-"))
    model = Path(args.model) if args.model else make_reward_model(scratch, args.base)
    work = [(p.prompt, p.chosen if k % 2 else p.rejected)
            for k, p in enumerate(synthetic_pairs(7, args.n))]
    port_file = scratch / "port"
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "reinforge", "serve", "--model", str(model),
         "--is-embedding", "--port", "0", "--port-file", str(port_file),
         "--max-batch", str(args.max_batch)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("reinforge serve --is-embedding did not start")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        local = RewardModelDomain(model_path=str(model))
        served = RewardModelDomain(model_path=url)
        trio.run(verify_all, local, work[:4], 1)  # load the model, warm both paths
        trio.run(verify_all, served, work[:4], 1)
        in_process, one_by_one, concurrent = [], [], []
        for _ in range(args.repeats):
            in_process.append(trio.run(verify_all, local, work, 1))
            one_by_one.append(trio.run(verify_all, served, work, 1))
            before = httpx.get(f"{url}/get_server_info").json()
            concurrent.append(trio.run(verify_all, served, work, args.concurrency))
            after = httpx.get(f"{url}/get_server_info").json()
    finally:
        server.terminate()
        server.wait(timeout=20)
    n = len(work)
    result = {
        "bench": "reward_model",
        "baseline": "rm domain in the verifier's process: torch forward, batch 1, one at a time",
        "measured": f"rm domain through reinforge serve --is-embedding (/classify), "
                    f"{args.concurrency} in flight, batches of up to {args.max_batch}",
        "model": str(args.model) if args.model else
                 f"untrained head on {args.base or 'the tiny policy'}",
        "n": n, "repeats": args.repeats, "cpus": os.cpu_count(),
        "in_process_per_s": round(n / statistics.median(in_process), 1),
        "served_one_at_a_time_per_s": round(n / statistics.median(one_by_one), 1),
        "served_concurrent_per_s": round(n / statistics.median(concurrent), 1),
        "speedup_served_concurrent_vs_in_process": round(
            statistics.median(in_process) / statistics.median(concurrent), 2),
        "last_run_sequences_per_pass": round(
            (after["sequences_scored"] - before["sequences_scored"])
            / max(1, after["forward_passes"] - before["forward_passes"]), 2),
        "largest_batch": after["largest_batch"],
    }
    for k, v in result.items():
        print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
