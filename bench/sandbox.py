"""Sandbox throughput: the same batch of small Python unit-test jobs, three ways, one run.

  subprocess  plain `python3 -m unittest` on the host, no isolation (the upper bound)
  naive       a fresh `podman run --rm` per job (files streamed in as a tar on stdin)
  pool        reinforge's SandboxPool (warm containers, exec + reset)

All three run `concurrency` jobs at a time (for the pool: a pool of that many sandboxes, given
every job at once, as its users do; it may run several small waiting jobs in one exec), in
interleaved rounds so that load from other processes falls on all three alike. Prints one JSON object as the last line:
subprocess_per_s, naive_podman_per_s, pool_per_s, pool_vs_naive, pool_vs_subprocess.

    python bench/sandbox.py --json [--jobs 40] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import trio

from reinforge.envs.sandbox.box import DEFAULT_IMAGE, default_podman_url, make_tar
from reinforge.envs.sandbox.pool import InfraFailure, Job, PoolConfig, SandboxPool

TESTS = """import unittest
from sol import solve

class TestSolve(unittest.TestCase):
    def test_small(self):
        self.assertEqual(solve([3, 1, 2]), [1, 2, 3])

    def test_empty(self):
        self.assertEqual(solve([]), [])

    def test_dupes(self):
        self.assertEqual(solve([2, 2, 1]), [1, 2, 2])
"""
ARGV = ["python3", "-m", "unittest", "-q"]


def make_jobs(n: int) -> list[Job]:
    """n distinct candidates (distinct code, so no cache hits), about 1 in 4 wrong."""
    jobs = []
    for i in range(n):
        body = "return sorted(xs)" if i % 4 else "return list(xs)"
        code = f"# candidate {i}\ndef solve(xs):\n    {body}\n"
        jobs.append(Job(files={"sol.py": code, "test_sol.py": TESTS}, argv=ARGV, timeout_s=20.0))
    return jobs


async def run_all(fn, jobs, concurrency: int) -> list:
    results: list = [None] * len(jobs)
    limiter = trio.Semaphore(concurrency)

    async def one(i, job):
        async with limiter:
            results[i] = await fn(job)

    async with trio.open_nursery() as n:
        for i, job in enumerate(jobs):
            n.start_soon(one, i, job)
    return results


async def via_subprocess(job: Job) -> int:
    def go() -> int:
        d = tempfile.mkdtemp(prefix="rf-bench-")
        try:
            for name, content in job.files.items():
                with open(os.path.join(d, name), "w") as f:
                    f.write(content)
            return subprocess.run(
                ["python3", *job.argv[1:]], cwd=d, capture_output=True, timeout=job.timeout_s
            ).returncode
        finally:
            shutil.rmtree(d, ignore_errors=True)

    return await trio.to_thread.run_sync(go)


def naive_cmd(url: str, image: str) -> list[str]:
    script = "cd /work && tar -x -f - && exec " + " ".join(ARGV)
    return [
        "podman",
        "--remote",
        "--url",
        url,
        "run",
        "--rm",
        "-i",
        "--network=none",
        "--read-only",
        "--tmpfs",
        "/work:rw,size=64m,mode=1777",
        "--cap-drop=ALL",
        "--security-opt",
        "no-new-privileges",
        "--user",
        "20000:20000",
        "--ulimit",
        "core=0:0",
        image,
        "sh",
        "-c",
        script,
    ]


async def via_naive(job: Job, *, url: str, image: str) -> int:
    data = make_tar(job.files)

    def go() -> int:
        return subprocess.run(
            naive_cmd(url, image), input=data, capture_output=True, timeout=60
        ).returncode

    return await trio.to_thread.run_sync(go)


async def bench(n_jobs: int, concurrency: int, rounds: int, max_batch: int = 4) -> dict:
    """The three ways in `rounds` interleaved rounds (a share of the jobs each), so that load
    from other processes on the machine falls on all three alike."""
    jobs = make_jobs(n_jobs)
    url = default_podman_url()
    image = DEFAULT_IMAGE
    expected = [0 if i % 4 else 1 for i in range(n_jobs)]
    out: dict = {
        "jobs": n_jobs,
        "concurrency": concurrency,
        "rounds": rounds,
        "max_batch": max_batch,
    }
    spent = {"subprocess": 0.0, "naive": 0.0, "pool": 0.0}
    got: dict[str, list] = {"subprocess": [], "naive": [], "pool": []}

    async def naive(job):
        return await via_naive(job, url=url, image=image)

    config = PoolConfig(size=concurrency, cache_entries=0, max_batch=max_batch)
    async with SandboxPool(config) as pool:
        assert await pool.wait_ready(120), "pool did not warm up"
        await naive(jobs[0])  # warm-up of the CLI path (binary and image in the page cache)

        async def pooled(job):
            r = await pool.run(job)
            assert not isinstance(r, InfraFailure), f"infrastructure failure: {r}"
            return r.exit_code

        share = -(-n_jobs // rounds)
        for start in range(0, n_jobs, share):
            part = jobs[start : start + share]
            for name, fn in (("subprocess", via_subprocess), ("naive", naive), ("pool", pooled)):
                # the pool gets every job at once and bounds itself (size = concurrency
                # sandboxes, as its users do); the other two get `concurrency` at a time
                limit = len(part) if name == "pool" else concurrency
                t0 = time.perf_counter()
                got[name] += await run_all(fn, part, limit)
                spent[name] += time.perf_counter() - t0
        stats = pool.statistics()
    for name, codes in got.items():
        assert codes == expected, f"{name} results wrong: {codes}"

    out["subprocess_s"] = spent["subprocess"]
    out["naive_podman_s"] = spent["naive"]
    out["pool_s"] = spent["pool"]
    out["subprocess_per_s"] = n_jobs / spent["subprocess"]
    out["naive_podman_per_s"] = n_jobs / spent["naive"]
    out["pool_per_s"] = n_jobs / spent["pool"]
    out["pool_vs_naive"] = out["pool_per_s"] / out["naive_podman_per_s"]
    out["pool_vs_subprocess"] = out["pool_per_s"] / out["subprocess_per_s"]
    out["pool_latency_p50_s"] = stats.latency_p50_s
    out["pool_latency_p95_s"] = stats.latency_p95_s
    out["pool_sandboxes_replaced"] = stats.sandboxes_replaced
    out["pool_jobs_per_exec"] = stats.batched_jobs / max(1, stats.batches)
    out["limits"] = pool._limits.value if pool._limits else "?"
    out["load_avg_1m"] = os.getloadavg()[0]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4, help="PoolConfig.max_batch (1: off)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (fairness under load)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    result = trio.run(bench, args.jobs, args.concurrency, args.rounds, args.max_batch)
    if not args.json:
        for k, v in result.items():
            print(f"{k:>24}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
