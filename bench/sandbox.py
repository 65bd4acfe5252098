"""Sandbox throughput, one run: unit-test jobs three ways, then code checks three ways.

Jobs (small Python unit-test jobs):
  subprocess  plain `python3 -m unittest` on the host, no isolation (the upper bound)
  naive       a fresh `podman run --rm` per job (files streamed in as a tar on stdin)
  pool        reinforge's SandboxPool (warm containers, exec + reset)

Checks (HumanEval-shaped: the code domain's harness over a prompt, a candidate, hidden tests):
  zygote       the pool's default: a fork of the sandbox's zygote per check (zygote.py)
  two_process  the pool with zygote=False: one exec per check, the harness and the
               candidate's worker each a fresh interpreter
  podman_run   a fresh `podman run --rm` per check, the harness as a script

Terminal episodes (`--episode-turns`, default 5 and 20; one episode at a time, one command
per turn): the wall-clock sandbox seconds per turn, each step a job replaying every command
before it (the replay path) against one session per episode (the session path), and
session_vs_replay at each length.

Every way runs `concurrency` at a time (for a pool: that many sandboxes, given everything at
once, as its users do), in interleaved rounds so that load from other processes falls on all
alike; every way must give the same outcomes. CPU seconds per check are machine-wide (user +
system over all processes: the Podman service, conmon and runtime count), over the check's
rounds. Prints one JSON object as the last line: *_per_s, pool_vs_naive, pool_vs_subprocess,
checks_*_per_s, checks_*_cpu_s, zygote_vs_two_process, zygote_vs_podman_run.

    python bench/sandbox.py --json [--jobs 40] [--checks 60] [--concurrency 2]
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

from reinforge.envs.domains.code import HARNESS_PATH, CodeDomain
from reinforge.envs.sandbox.box import DEFAULT_IMAGE, default_podman_url, make_tar
from reinforge.envs.sandbox.pool import InfraFailure, Job, PoolConfig, SandboxPool
from reinforge.envs.sandbox.zygote import Check

sys.path.insert(0, os.path.dirname(__file__))  # bench/ is not a package
from rl_sync_loop import CpuMeter  # noqa: E402

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


PROMPT = '''def running_max(xs: list[int]) -> list[int]:
    """The largest element seen so far, at each position.
    >>> running_max([1, 3, 2, 5])
    [1, 3, 3, 5]
    """
'''
CHECK_TEST = """
def check(candidate):
    assert candidate([1, 3, 2, 5]) == [1, 3, 3, 5]
    assert candidate([]) == []
    assert candidate([-2, -5, -1]) == [-2, -2, -1]
    assert candidate([4] * 6) == [4] * 6
    assert candidate(list(range(50, 0, -1))) == [50] * 50
"""


def make_checks(n: int) -> tuple[list[Check], list[str], list[str]]:
    """n distinct HumanEval-shaped checks, about 1 in 4 wrong: (checks, nonces, expected)."""
    domain = CodeDomain()
    task = domain.task_from_row(
        {"prompt": PROMPT, "test": CHECK_TEST, "entry_point": "running_max", "timeout_s": 6.0},
        where="bench:1",
    )
    harness = HARNESS_PATH.read_bytes()
    checks, nonces, expected = [], [], []
    for i in range(n):
        right = i % 4 != 0
        body = (
            f"    # candidate {i}\n    out, top = [], None\n    for x in xs:\n"
            "        top = x if top is None or x > top else top\n        out.append(top)\n"
            + ("    return out\n" if right else "    return out[:-1]\n")
        )
        nonce, payload = domain.job_for(task, body)
        checks.append(Check(harness=harness, payload=payload, timeout_s=10.0))
        nonces.append(nonce)
        expected.append("pass" if right else "fail")
    return checks, nonces, expected


def verdict(stdout: bytes, nonce: str) -> str:
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith(nonce + " "):
            return json.loads(line[len(nonce) + 1 :])["status"]
    return "no verdict"


async def via_podman_run(check: Check, *, url: str, image: str) -> bytes:
    files = {"harness.py": check.harness, "payload.json": check.payload}
    cmd = naive_cmd(url, image)
    cmd[-1] = "cd /work && tar -x -f - && exec python3 -I -B harness.py < payload.json"

    def go() -> bytes:
        return subprocess.run(cmd, input=make_tar(files), capture_output=True, timeout=60).stdout

    return await trio.to_thread.run_sync(go)


async def bench_checks(n_checks: int, concurrency: int, rounds: int) -> dict:
    """The three ways of running a code check, in interleaved rounds."""
    checks, nonces, expected = make_checks(n_checks)
    url, image = default_podman_url(), DEFAULT_IMAGE
    ways = ("zygote", "two_process", "podman_run")
    spent = dict.fromkeys(ways, 0.0)
    cpu = dict.fromkeys(ways, 0.0)
    got: dict[str, list] = {w: [] for w in ways}
    configs = {
        w: PoolConfig(size=concurrency, cache_entries=0, zygote=w == "zygote")
        for w in ("zygote", "two_process")
    }
    async with SandboxPool(configs["zygote"]) as zyg, SandboxPool(configs["two_process"]) as two:
        assert await zyg.wait_ready(120) and await two.wait_ready(120), "pools did not warm up"

        def pooled(pool):
            async def run(check: Check) -> bytes:
                r = await pool.run(check)
                assert not isinstance(r, InfraFailure), f"infrastructure failure: {r}"
                return r.stdout

            return run

        async def podman_run(check: Check) -> bytes:
            return await via_podman_run(check, url=url, image=image)

        fns = {"zygote": pooled(zyg), "two_process": pooled(two), "podman_run": podman_run}
        for fn in fns.values():  # warm-up: the zygotes start, the CLI path is paged in
            await run_all(fn, checks[:concurrency], concurrency)
        share = -(-n_checks // rounds)
        for start in range(0, n_checks, share):
            part = checks[start : start + share]
            for way in ways:
                limit = concurrency if way == "podman_run" else len(part)
                meter, t0 = CpuMeter(), time.perf_counter()
                got[way] += await run_all(fns[way], part, limit)
                spent[way] += time.perf_counter() - t0
                cpu[way] += meter.busy_s()
    want = list(expected)
    for way in ways:
        seen = [verdict(out, nonce) for out, nonce in zip(got[way], nonces, strict=True)]
        assert seen == want, f"{way} verdicts wrong: {seen}"
    out: dict = {"checks": n_checks}
    for way in ways:
        out[f"checks_{way}_per_s"] = n_checks / spent[way]
        out[f"checks_{way}_cpu_s"] = cpu[way] / n_checks
    out["zygote_vs_two_process"] = out["checks_zygote_per_s"] / out["checks_two_process_per_s"]
    out["zygote_vs_podman_run"] = out["checks_zygote_per_s"] / out["checks_podman_run_per_s"]
    out["zygote_cpu_vs_two_process"] = out["checks_two_process_cpu_s"] / out["checks_zygote_cpu_s"]
    return out


async def bench_episodes(turn_counts: list[int], rounds: int) -> dict:
    """Sandbox seconds per turn of a terminal episode, replay path vs session path."""
    from reinforge.envs.domains.terminal import TerminalDomain
    from reinforge.envs.sandbox.runner import PoolRunner, WithoutSessions

    out: dict = {}
    async with SandboxPool(PoolConfig(size=1, cache_entries=0)) as pool:
        assert await pool.wait_ready(120), "the pool did not warm up"
        session_runner = PoolRunner(pool)
        runners = {"replay": WithoutSessions(session_runner), "session": session_runner}
        for turns in turn_counts:
            row = {"instruction": "count", "max_turns": turns,
                   "checks": [{"kind": "file_exists", "path": "log.txt"}]}
            spent = dict.fromkeys(runners, 0.0)
            for _ in range(rounds):
                for way, runner in runners.items():
                    domain = TerminalDomain().with_runner(runner)
                    ep = domain.start_episode(domain.task_from_row(row, where="bench:1"))
                    t0 = time.perf_counter()
                    for i in range(turns):
                        obs, _ = await ep.step(f"$ echo {i} >> log.txt")
                        assert obs == "[exit 0]", f"{way}: {obs}"
                    spent[way] += time.perf_counter() - t0
                    await ep.aclose()
            for way in runners:
                out[f"episode_{turns}_turns_{way}_s_per_turn"] = spent[way] / (rounds * turns)
            out[f"episode_{turns}_turns_session_vs_replay"] = spent["replay"] / spent["session"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--checks", type=int, default=60, help="code checks per way (0: skip)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4, help="PoolConfig.max_batch (1: off)")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds (fairness under load)")
    p.add_argument("--episode-turns", type=int, nargs="*", default=[5, 20],
                   help="terminal episode lengths to time (none: skip)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    result = trio.run(bench, args.jobs, args.concurrency, args.rounds, args.max_batch)
    if args.checks:
        checks = trio.run(bench_checks, args.checks, args.concurrency, args.rounds)
        result.update({k: round(v, 4) if isinstance(v, float) else v for k, v in checks.items()})
    if args.episode_turns:
        episodes = trio.run(bench_episodes, args.episode_turns, 2)
        result.update({k: round(v, 4) for k, v in episodes.items()})
    result["load_avg_1m"] = round(os.getloadavg()[0], 4)
    if not args.json:
        for k, v in result.items():
            print(f"{k:>24}: {v}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
