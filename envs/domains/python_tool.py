"""Python tool: compute with a sandboxed Python tool, then answer; the final answer is checked.

The policy calls the `python` tool (`envs/tools.py`), each call one program run in the
sandbox (a fresh process: nothing carries over between calls, so a program prints what it
needs), sees its output, and answers with a turn without a call, `#### <number>`. Tasks
are numbers that are tedious by hand and one line of Python: a product, a sum of
squares, a count of primes, a digit sum of a power.

Verification reads the final answer of the transcript (`tools.replay`: the first turn
without a call, within `max_turns`) by the math rules (`answers.extract_final_answer`,
exact). A tool run the sandbox could not make ends the episode with an observation
without an exit status (`[sandbox unavailable: ...]`); a transcript ending so is
`infra_error`, never a 0 (a program's own output always ends with `[exit ...]`, so it
cannot pass for one).

JSONL row schema (`PythonToolRow`):

    {"question": "What is 123 * 457?", "answer": "56211",
     "max_turns": 4}                                    # optional; also "task_id", "tier"
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier, infra_error
from reinforge.envs.domains.answers import answers_match, extract_final_answer
from reinforge.envs.sandbox.runner import CodeRunner, RunnerInfraError
from reinforge.envs.tasksets import decode_row, load_jsonl
from reinforge.envs.tools import (
    Tool,
    ToolCall,
    TranscriptTurn,
    decode_transcript,
    encode_transcript,
    render_call,
    replay,
)

PYTHON = Tool(
    name="python",
    description="Run a Python 3 program in a sandbox and return what it prints (stdout and "
    "stderr) and its exit status. Each call is a fresh process: print what you need.",
    parameters={"type": "object", "properties": {"code": {
        "type": "string", "description": "the program"}}, "required": ["code"]},
)
UNAVAILABLE = "[sandbox unavailable: "
_EXIT_MARK = re.compile(r"\[exit (-?\d+|timeout)\]$")


class PythonToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    question: str
    answer: str
    max_turns: int = 4


class PythonToolRow(msgspec.Struct, kw_only=True):
    """One line of a user's python_tool JSONL file (extra keys are ignored)."""

    question: str
    answer: str
    max_turns: int = 4
    task_id: str | None = None
    tier: int = 0
    reference: str | None = None


class PythonToolConfig(msgspec.Struct, frozen=True, kw_only=True):
    run_timeout_s: float = 5.0
    """Wall-clock limit of one program run."""
    output_chars: int = 2000
    """A run's output shown to the policy is cut to this many characters."""


# ---------------------------------------------------------------- generator


def generate(rng: random.Random, tier: int) -> tuple[str, int, str]:
    """(question, answer, a program that prints it) for a tier; pure given the rng state."""
    if tier == 0:
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        return f"What is {a} * {b}?", a * b, f"print({a} * {b})"
    if tier == 1:
        xs = [rng.randint(-99, 99) for _ in range(rng.randint(5, 8))]
        return (f"What is the sum of the squares of {xs}?", sum(x * x for x in xs),
                f"print(sum(x * x for x in {xs}))")
    if tier == 2:
        n = rng.randint(100, 3000)
        primes = sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))
        return (f"How many prime numbers are smaller than {n}?", primes,
                f"print(sum(all(k % d for d in range(2, int(k**0.5) + 1)) "
                f"for k in range(2, {n})))")
    if tier == 3:
        a, b = rng.randint(2, 9), rng.randint(20, 80)
        return (f"What is the sum of the decimal digits of {a}**{b}?",
                sum(map(int, str(a**b))), f"print(sum(map(int, str({a}**{b}))))")
    raise ValueError(f"python_tool has tiers 0..3, got {tier}")


def build_prompt(question: str) -> str:
    return (f"{question}\nCompute it with the python tool, then reply without a tool call, "
            "giving the final answer as '#### <number>'.")


def reference_transcript(program: str, answer: int) -> str:
    call = render_call(ToolCall(name=PYTHON.name, arguments={"code": program}))
    return encode_transcript([TranscriptTurn(text=call, observation=f"{answer}\n[exit 0]"),
                              TranscriptTurn(text=f"#### {answer}")])


class PythonToolEpisode:
    """A live episode: `step_call(call)` runs the program and answers its output."""

    def __init__(self, domain: PythonToolDomain, task: TaskSpec):
        self.domain = domain
        self.spec = msgspec.convert(task.spec, PythonToolSpec)
        self.max_turns = self.spec.max_turns

    async def step_call(self, call: ToolCall) -> tuple[str, bool]:
        cfg = self.domain.config
        try:
            out = await self.domain.require_runner().run(
                files={"main.py": call.arguments["code"]},
                argv=["python3", "-I", "-B", "main.py"], stdin=b"",
                timeout_s=cfg.run_timeout_s)
        except RunnerInfraError as exc:
            return f"{UNAVAILABLE}{exc}]", True
        text = (out.stdout + out.stderr).decode("utf-8", errors="replace")
        if len(text) > cfg.output_chars:
            text = text[: cfg.output_chars] + "\n[output truncated]\n"
        status = "timeout" if out.status == "timeout" else out.exit_code
        return f"{text}[exit {status}]", False

    async def aclose(self) -> None:
        pass


class PythonToolDomain:
    """Numbers computed with a Python tool; the final answer is checked exactly."""

    name = "python_tool"
    description = "multi-turn: compute with a sandboxed Python tool, then answer '#### N'"
    resource = "sandbox"
    multi_turn = True
    tools = (PYTHON,)
    tiers = (
        Tier(level=0, name="product", description="the product of two 3-4 digit numbers"),
        Tier(level=1, name="sum-of-squares", description="the sum of squares of a list"),
        Tier(level=2, name="count-primes", description="how many primes below N"),
        Tier(level=3, name="digit-sum", description="the digit sum of a power"),
    )

    def __init__(self, *, config: PythonToolConfig | None = None,
                 runner: CodeRunner | None = None):
        self.config = config or PythonToolConfig()
        self.runner = runner

    def with_runner(self, runner: CodeRunner) -> PythonToolDomain:
        return PythonToolDomain(config=self.config, runner=runner)

    def require_runner(self) -> CodeRunner:
        if self.runner is None:
            raise RunnerInfraError("no sandbox attached to the python_tool domain: use "
                                   "`async with sandbox_runner() as r: domain.with_runner(r)`")
        return self.runner

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        check_tier(self, tier)
        question, answer, program = generate(rng, tier)
        spec = PythonToolSpec(question=question, answer=str(answer))
        return TaskSpec(task_id=f"python_tool-t{tier}-{rng.getrandbits(48):012x}",
                        domain=self.name, tier=tier, prompt=build_prompt(question),
                        spec=msgspec.to_builtins(spec),
                        reference=reference_transcript(program, answer), source="generated")

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, PythonToolRow, where=where)
        if r.max_turns < 1:
            raise ValueError(f"`max_turns` must be >= 1, got {r.max_turns}")
        spec = PythonToolSpec(question=r.question, answer=r.answer, max_turns=r.max_turns)
        return TaskSpec(task_id=r.task_id or f"python_tool-{where.rsplit(':', 1)[-1]}",
                        domain=self.name, tier=r.tier, prompt=build_prompt(r.question),
                        spec=msgspec.to_builtins(spec), reference=r.reference, source="jsonl")

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    def start_episode(self, task: TaskSpec) -> PythonToolEpisode:
        return PythonToolEpisode(self, task)

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        spec = msgspec.convert(task.spec, PythonToolSpec)
        turns = decode_transcript(completion)
        if turns and turns[-1].observation.startswith(UNAVAILABLE) \
                and not _EXIT_MARK.search(turns[-1].observation):
            return infra_error(turns[-1].observation.strip("[]"))
        calls, final = replay(completion, self.tools, spec.max_turns)
        used = Check(name="tool_calls", passed=bool(calls), detail=f"{len(calls)} made")
        ex = extract_final_answer(final or "")
        ok = ex.answer is not None and answers_match(ex.answer, spec.answer)
        match = Check(name="answer_matches", passed=ok,
                      detail=f"expected {spec.answer!r}, got {ex.answer!r}")
        reason = ("correct final answer" if ok else "no final answer turn" if final is None
                  else f"wrong or missing final answer ({ex.rule})")
        return Verdict(reward=1.0 if ok else 0.0, outcome="pass" if ok else "fail",
                       checks=[used, match], reason=reason)
