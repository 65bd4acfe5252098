"""`reinforge envs list|sample` and `reinforge verify --domain D FILE.jsonl`.

`verify` reads rows of task fields + `completion` (the domain's JSONL schema), refuses
the whole file if a line is malformed (naming the line), verifies every row with
bounded concurrency, reports progress on stderr, and prints a summary; with `--json`
one JSON object per row and, as the LAST stdout line, the summary
{n, passed, failed, errors, per_s, ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(subparsers) -> None:
    """Add `envs` and `verify` to the `reinforge` parser."""
    envs = subparsers.add_parser("envs", help="task domains: list them, sample tasks")
    envs_sub = envs.add_subparsers(dest="envs_command", metavar="ACTION")
    envs.set_defaults(func=lambda args: (envs.print_help(), 2)[1])

    p = envs_sub.add_parser("list", help="list the task domains and their difficulty tiers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_domain_spec(p)
    p.set_defaults(func=cmd_list)

    p = envs_sub.add_parser("sample", help="print generated tasks (with reference completions)")
    p.add_argument("--domain", required=True)
    p.add_argument("--tier", type=int, default=0)
    p.add_argument("-n", type=int, default=5, help="how many tasks")
    p.add_argument("--seed", type=int, default=0)
    _add_domain_spec(p)
    p.set_defaults(func=cmd_sample)

    p = subparsers.add_parser("verify", help="score completions in a JSONL file with a domain")
    p.add_argument("file", help="JSONL: the domain's task fields + `completion` per line")
    p.add_argument("--domain", required=True, help="domain name (see `reinforge envs list`)")
    p.add_argument("--json", action="store_true", help="JSON per row, summary as last line")
    p.add_argument("--jobs", type=int, default=4, help="concurrent verifications (pool size)")
    p.add_argument(
        "--sandbox",
        choices=("podman", "unsafe-local"),
        default="podman",
        help="where code runs; unsafe-local has NO isolation (trusted inputs only)",
    )
    p.add_argument(
        "--judge-url",
        default=None,
        help="SGLang-compatible judge server for the judge domain (default: rules)",
    )
    _add_domain_spec(p)
    p.set_defaults(func=cmd_verify)


def _add_domain_spec(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--domain-spec",
        action="append",
        default=[],
        metavar="[NAME=]MODULE:CLASS",
        help="attach an extra domain at runtime (repeatable)",
    )


def _registry(args):
    from reinforge.envs.domain import DomainRegistry

    from reinforge.cli import UserError

    try:
        return DomainRegistry.default(args.domain_spec)
    except (ValueError, TypeError, ImportError) as exc:
        raise UserError(f"--domain-spec: {exc}") from None


def _get(registry, name: str):
    from reinforge.cli import UserError

    if name not in registry:
        raise UserError(f"--domain {name!r}: unknown; known domains: {', '.join(registry.names())}")
    return registry.get(name)


def cmd_list(args) -> int:
    from reinforge.envs.domain import describe

    registry = _registry(args)
    rows: list[dict[str, Any]] = []
    for name in registry.names(families=True):
        try:
            rows.append({**describe(registry.get(name)), "name": name})
        except Exception as exc:  # a broken plug-in must not hide the others
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        print(json.dumps({"domains": rows}))
        return 0
    for row in rows:
        if "error" in row:
            print(f"{row['name']:10s} ERROR {row['error']}")
            continue
        print(f"{row['name']:10s} [{row['resource']}] {row['description']}")
        for t in row["tiers"]:
            print(f"    tier {t['level']}: {t['name']:26s} {t['description']}")
    return 0


def cmd_sample(args) -> int:
    import random

    import msgspec

    from reinforge.cli import UserError

    domain = _get(_registry(args), args.domain)
    rng = random.Random(args.seed)
    try:
        for _ in range(args.n):
            task = domain.sample_task(rng, args.tier)
            print(msgspec.json.encode(task).decode())
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return 0


def _load_rows(domain, path: str):
    from reinforge.envs.tasksets import TaskFileError, iter_jsonl

    from reinforge.cli import UserError

    items = []
    try:
        for where, row in iter_jsonl(path):
            completion = row.get("completion")
            if not isinstance(completion, str):
                raise TaskFileError(f"{where}: needs a string `completion` field")
            try:
                task = domain.task_from_row(row, where=where)
            except TaskFileError:
                raise
            except (ValueError, TypeError) as exc:
                raise TaskFileError(f"{where}: {exc}") from None
            items.append((where, task, completion))
    except TaskFileError as exc:
        raise UserError(str(exc)) from None
    return items


def cmd_verify(args) -> int:
    import trio

    from reinforge.cli import UserError

    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    registry = _registry(args)
    domain = _get(registry, args.domain)
    if args.domain == "judge" and args.judge_url:
        from reinforge.envs.domains.judge import JudgeConfig, JudgeDomain

        domain = JudgeDomain(config=JudgeConfig(judge_url=args.judge_url))
    items = _load_rows(domain, args.file)
    summary = trio.run(_verify_all, domain, items, args)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{summary['n']} verified: {summary['passed']} passed, {summary['failed']} failed, "
            f"{summary['errors']} errors; mean reward {summary['mean_reward']:.3f}; "
            f"{summary['per_s']:.1f}/s"
        )
    return 0


async def _verify_all(domain, items, args) -> dict[str, Any]:
    import trio

    from reinforge.cli import UserError

    if hasattr(domain, "with_runner"):
        from reinforge.envs.sandbox.runner import RunnerInfraError, UnsafeLocalRunner, sandbox_runner

        if args.sandbox == "unsafe-local":
            return await _run(domain.with_runner(UnsafeLocalRunner()), items, args)
        from reinforge.envs.sandbox.box import SandboxConfig
        from reinforge.envs.sandbox.pool import PoolConfig

        cfg = PoolConfig(size=args.jobs, sandbox=SandboxConfig(timeout_s=30.0))
        try:
            async with sandbox_runner(cfg) as runner:
                with trio.move_on_after(120):
                    await runner.pool.wait_ready(timeout_s=120)
                return await _run(domain.with_runner(runner), items, args)
        except RunnerInfraError as exc:
            raise UserError(f"sandbox unavailable: {exc}") from None
    return await _run(domain, items, args)


async def _run(domain, items, args) -> dict[str, Any]:
    import trio

    results: list[Any] = [None] * len(items)
    limiter = trio.CapacityLimiter(args.jobs)
    done = 0
    t0 = time.monotonic()
    last_report = t0

    async def one(i: int) -> None:
        nonlocal done, last_report
        where, task, completion = items[i]
        async with limiter:
            results[i] = await domain.verify(task, completion)
        done += 1
        now = time.monotonic()
        if now - last_report >= 1.0 or done == len(items):
            last_report = now
            print(f"verify: {done}/{len(items)}", file=sys.stderr, flush=True)

    async with trio.open_nursery() as nursery:
        for i in range(len(items)):
            nursery.start_soon(one, i)
    seconds = time.monotonic() - t0
    counts = {o: 0 for o in ("pass", "fail", "timeout", "error", "infra_error")}
    for (where, task, _), v in zip(items, results):
        counts[v.outcome] += 1
        row = {
            "where": where,
            "task_id": task.task_id,
            "outcome": v.outcome,
            "reward": v.reward,
            "reason": v.reason,
        }
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{where}  {task.task_id}  {v.outcome:11s} {v.reward:.3f}  {v.reason}")
    n = len(items)
    return {
        "domain": args.domain,
        "n": n,
        "passed": counts["pass"],
        "failed": counts["fail"],
        "errors": counts["error"] + counts["timeout"] + counts["infra_error"],
        "by_outcome": counts,
        "mean_reward": sum(v.reward for v in results) / n if n else 0.0,
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds, 3) if seconds > 0 else 0.0,
    }
