"""`reinforge eval`: held-out pass@1 / pass@k per domain of any Hugging Face-format checkpoint,
offline (no bus).

    reinforge eval --model DIR --domains math,docqa --k 4 [--samples 8] [--json]

Starts the embedded rollout server on the checkpoint (a free port; or uses `--url`),
generates `samples` completions per held-out task in one request (`--domain-samples D=N`: a
domain's own count), verifies them locally with the domains, and prints one line per domain;
with `--json` the table goes to stderr and stdout is one JSON object (the last line). The
held-out sets are the evaluator actor's (`--seed`, `--tasks-per-tier`, `--heldout-file`,
`--review-set`), and `--train-file` runs the same contamination check first (exit 2 when it
finds overlap). Code and terminal domains run their checks in the Podman sandbox pool. Each
task's samples are drawn with a seed made from `--sampling-seed` and the task: two
checkpoints evaluated with one seed are compared on the same random numbers (a checkpoint
evaluated twice reads the same; two close ones mostly do).

Two figures tell a skill from the answer prior: `answer_mode_share`, how often the policy's
most common final answer was given (near 1.0: one answer whatever the task), and, for the
domains verified in-process, `prior_pass_at_1`, the pass@1 of answering every task with
its tier's most common reference (a gain up to there needs no skill).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any


def register(subparsers: Any) -> None:
    """Add `reinforge eval` to the `reinforge` parser."""
    p = subparsers.add_parser(
        "eval", help="pass@1 / pass@k of a checkpoint on the held-out sets (offline)"
    )
    p.add_argument("--model", help="Hugging Face-format model directory (and its tokenizer)")
    p.add_argument("--url", help="use this running rollout server instead of starting one")
    p.add_argument("--domains", default="math",
                   help="comma-separated domains or globs, e.g. 'gym-*,math' (default: math)")
    p.add_argument("--k", type=int, default=4, help="pass@k's k (default 4)")
    p.add_argument("--no-answer-prior", dest="answer_prior", action="store_false",
                   help="skip the constant answer's scores (prior_pass_at_1): they do not "
                        "depend on the model, and cost a task draw and a check per task")
    p.add_argument("--samples", type=int, default=0, help="completions per task (default: k)")
    p.add_argument("--domain-samples", action="append", default=[], metavar="DOMAIN=N",
                   help="completions per task of one domain instead of --samples "
                        "(repeatable): more where a change must be measured finely")
    p.add_argument("--tasks-per-tier", type=int, default=4, help="held-out tasks per tier")
    p.add_argument("--skip-per-tier", type=int, default=0, metavar="N",
                   help="leave each tier's first N held-out tasks unscored (the held-out set "
                        "is still the run's --tasks-per-tier): a run's guard scores tasks "
                        "apart from those its final evaluation reports")
    p.add_argument("--score-per-tier", type=int, default=0, metavar="N",
                   help="score at most N held-out tasks a tier, after the skipped ones "
                        "(default 0: all of them); a tier holding fewer than --tasks-per-tier "
                        "(a small bank) scales both counts to what it holds")
    p.add_argument("--tiers", default="", help="comma-separated tiers (default: all)")
    p.add_argument("--seed", type=int, default=None, help="held-out seed (default: the run's)")
    p.add_argument("--heldout-file", action="append", default=[], metavar="DOMAIN=JSONL",
                   help="held-out tasks of a domain from a file (repeatable)")
    p.add_argument("--review-set", action="append", default=[], metavar="JSONL",
                   help="a review set (`reinforge log reviews`): its reviewed problems join "
                        "the held-out sets (repeatable)")
    p.add_argument("--reward-model", action="append", default=[], metavar="DIR",
                   help="score rm-synthetic with this reward model (`reinforge rm train`; "
                        "repeat for an ensemble)")
    p.add_argument("--train-file", action="append", default=[], metavar="DOMAIN=JSONL",
                   help="training tasks to check the held-out sets against (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=seed_arg, default=0, metavar="N|none",
                   help="draw each task's samples with a seed of its own made from N and the "
                        "task, so two checkpoints evaluated with one N meet the same random "
                        "numbers (default 0; 'none': fresh draws)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the bare prompt (default: the tokenizer's chat template)")
    p.add_argument("--concurrency", type=int, default=4, help="tasks in flight at once")
    p.add_argument("--sandbox-pool-size", type=int, default=2)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for `reinforge serve` (repeatable)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="server start-up limit")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_eval)


def seed_arg(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    from reinforge.cli import UserError

    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"{flag} {item!r}: expected DOMAIN=PATH")
        if not Path(path).is_file():
            raise UserError(f"{flag} {item!r}: no such file {path}")
        out[name] = path
    return out


def _domain_samples(items: list[str], k: int) -> dict[str, int]:
    from reinforge.cli import UserError

    out = {}
    for item in items:
        name, sep, count = item.partition("=")
        try:
            n = int(count) if sep and name else 0
        except ValueError:
            n = 0
        if n < max(1, k):
            raise UserError(f"--domain-samples {item!r}: expected DOMAIN=N with N >= k ({k})")
        out[name] = n
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    import trio
    from reinforge.rl.evalsets import HeldOutConfig

    from reinforge.cli import UserError

    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    samples = args.samples or args.k
    if not domains:
        raise UserError("--domains: give at least one domain")
    if args.skip_per_tier < 0 or args.score_per_tier < 0:
        raise UserError("--skip-per-tier and --score-per-tier must be >= 0")
    if args.k < 1 or samples < args.k:
        raise UserError(f"--k {args.k} needs --samples >= k (got {samples})")
    samples_by_domain = _domain_samples(args.domain_samples, args.k)
    if not args.model and not args.url:
        raise UserError("give --model DIR (a Hugging Face-format checkpoint) or --url")
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise UserError(f"--model {args.model}: no config.json there")
    try:
        tiers = [int(t) for t in args.tiers.split(",") if t.strip()]
        heldout = HeldOutConfig(
            tasks_per_tier=args.tasks_per_tier, tiers=tiers,
            files=_pairs(args.heldout_file, "--heldout-file"), review_sets=args.review_set,
            **({} if args.seed is None else {"seed": args.seed}),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return trio.run(_eval, args, domains, samples, heldout, samples_by_domain)


async def _eval(args: argparse.Namespace, domains: list[str], samples: int, heldout: Any,
                samples_by_domain: dict[str, int]) -> int:
    import trio
    from reinforge.rl.evalsets import build_heldout, check_contamination, exact_only_ids
    from reinforge.actors.evaluator import (
        ServerSource,
        answer_prior,
        evaluate_sets,
        first_per_tier,
    )
    from reinforge.engine.tokenizer import load_tokenizer
    from reinforge.rollout.client import RolloutClient, RolloutServerUnavailable
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.episodes import domain_tools

    from reinforge.cli import UserError

    out = sys.stderr if args.json else sys.stdout
    registry = DomainRegistry.default()
    if args.reward_model:
        from reinforge.envs.domains.reward_model import attach_reward_model

        attach_reward_model(registry, args.reward_model)
    try:
        domains = registry.resolve(domains, where="--domains")
        if unknown := sorted(set(samples_by_domain) - set(domains)):
            raise ValueError(f"--domain-samples names {', '.join(unknown)}, not among the "
                             f"domains evaluated")
        doms = {d: registry.get(d) for d in domains}
        sets = first_per_tier(build_heldout(registry, domains, heldout), args.score_per_tier,
                              args.skip_per_tier, heldout.tasks_per_tier)
    except (KeyError, ValueError) as exc:
        raise UserError(str(exc).strip("'\"")) from None
    train = _pairs(args.train_file, "--train-file")
    if train:
        prompts = [(f"{path}:{t.task_id}", t.prompt)
                   for d, path in train.items() for t in registry.get(d).load_tasks(path)]
        report = check_contamination(
            prompts, [(t.task_id, t.prompt) for ts in sets.values() for t in ts],
            exact_only=exact_only_ids(sets, doms, heldout))
        if not report.clean:
            raise UserError("contaminated held-out set: " + report.summary())
        print(report.summary(), file=out)
    server = None
    try:
        url = args.url
        if not url:
            server = _start_server(args)
            url = await server.wait_url(args.timeout_s)
        tok_path = args.model
        async with RolloutClient(url, timeout_s=600) as client:
            if not tok_path:
                tok_path = str((await client.model_info()).get("tokenizer_path") or "")
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, tok_path)
            source = ServerSource(client, tokenizer, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p,
                                  chat_template=not args.no_chat_template,
                                  seed=args.sampling_seed)
            t0 = time.monotonic()
            scores = await _with_sandbox(args, doms, lambda ds: evaluate_sets(
                sets, ds, source, samples=samples, k=args.k, concurrency=args.concurrency,
                samples_by_domain=samples_by_domain))
            took_s = time.monotonic() - t0
    except RolloutServerUnavailable as exc:
        raise UserError(f"rollout server: {exc}") from None
    except RuntimeError as exc:  # the server did not start
        raise UserError(str(exc)) from None
    finally:
        if server is not None:
            await trio.to_thread.run_sync(server.stop)
    # After the server is gone: the constant answer needs no model, and an error of a
    # domain's own here is not the server's ("did not start").
    prior = await answer_prior(sets, doms) if args.answer_prior else {}
    prior_p1 = {d: fmean(tasks.values()) for d, tasks in prior.items()}
    for d, s in scores.items():
        print(f"{d:10s} pass@1 {s.pass_at_1:.3f}  pass@{s.k} {s.pass_at_k:.3f}  "
              f"tasks {s.n_tasks}  samples {s.samples}  run std {s.run_std:.3f}  "
              f"infra errors {s.infra_errors}  refused {s.rejected_tasks}  "
              f"modal answer {s.answer_mode_share:.2f}"
              + (f"  turns {s.turns_mean:.2f}  tool-call errors {s.tool_call_error_rate:.2f}"
                 if domain_tools(doms[d]) else "")
              + (f"  constant answer's pass@1 {prior_p1[d]:.3f}" if d in prior else "")
              + (f"  reward {s.reward_mean:.3f}  gold {s.gold_pass_rate:.3f}"
                 if s.gold_pass_rate is not None else ""),
              file=out)
    result = {
        "model": args.model or url, "k": args.k, "samples": samples, "eval_s": round(took_s, 3),
        "sampling_seed": args.sampling_seed,
        "domains": {d: {"pass_at_1": s.pass_at_1, "pass_at_k": s.pass_at_k, "k": s.k,
                        "n_tasks": s.n_tasks, "samples": s.samples,
                        "run_pass_rates": s.run_pass_rates, "run_std": s.run_std,
                        "infra_errors": s.infra_errors, "rejected_tasks": s.rejected_tasks,
                        "task_pass_at_1": s.task_pass_at_1,
                        "task_counts": s.task_counts,
                        "answer_mode_share": s.answer_mode_share,
                        "reward_mean": s.reward_mean,
                        **({"gold_pass_rate": s.gold_pass_rate, "task_gold": s.task_gold}
                           if s.gold_pass_rate is not None else {}),
                        **({"turns_mean": s.turns_mean,
                            "tool_call_error_rate": s.tool_call_error_rate}
                           if domain_tools(doms[d]) else {}),
                        **({"prior_pass_at_1": prior_p1[d], "prior_task_pass": prior[d]}
                           if d in prior else {})}
                    for d, s in scores.items()},
    }
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def _start_server(args: argparse.Namespace) -> Any:
    from reinforge.rollout.server import ServerProcess, ServerSpec

    cfg = ServerSpec(model_path=args.model, server_args=list(args.server_arg))
    server = ServerProcess(cfg)
    server.start()
    return server


async def _with_sandbox(args: argparse.Namespace, doms: dict[str, Any], run: Any) -> Any:
    """Run `run(domains)`, inside a sandbox pool when a domain verifies in one."""
    from reinforge.cli import UserError

    needs = [d for d, dom in doms.items() if dom.resource == "sandbox"]
    if not needs:
        return await run(doms)
    from reinforge.envs.sandbox.runner import RunnerInfraError, sandbox_runner
    from reinforge.envs.sandbox.pool import PoolConfig

    try:
        async with sandbox_runner(PoolConfig(size=args.sandbox_pool_size)) as runner:
            return await run({d: (dom.with_runner(runner) if d in needs else dom)
                              for d, dom in doms.items()})
    except RunnerInfraError as exc:
        raise UserError(f"domains {', '.join(needs)} need the Podman sandbox: {exc} "
                        "(see `reinforge sandbox doctor`)") from None
