"""Arithmetic / math: generated problems by difficulty tier, plus users' JSONL sets.

Output format asked of the policy: end with `#### <answer>` (a final
`\\boxed{<answer>}` is accepted too). Extraction and equivalence rules live in
`reinforge.envs.domains.answers` (explicit, tested): equivalent forms (`0.5`, `1/2`,
`\\frac{1}{2}`, `1,000`) pass; near misses and hedged answers fail.

JSONL row schema (`MathRow`), one object per line; GSM8K and MATH rows load as they are:

    {"question": "What is 2+3?", "answer": "5"}            # answer: string or number
    {"question": "...", "answer": "...\\n#### 72"}          # GSM8K: the text after ####
    {"problem": "...", "solution": "... \\boxed{3/4} ..."} # MATH: the boxed answer
    optional: "task_id", "tier" (int), "rel_tol", "abs_tol" (numeric tolerance, default exact)
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.domains.answers import (
    equivalent,
    extract_final_answer,
    extract_math_answer,
)
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier
from reinforge.envs.tasksets import decode_row, load_jsonl

FORMAT_HINT = "End with '#### <answer>'."


class MathSpec(msgspec.Struct, frozen=True, kw_only=True):
    question: str
    answer: str
    """The expected final answer, as a string (`"42"`, `"3/4"`, `"Paris"`)."""
    rel_tol: float = 0.0
    abs_tol: float = 0.0


class MathRow(msgspec.Struct, kw_only=True):
    """One line of a user's math JSONL file (extra keys are ignored)."""

    question: str | None = None
    problem: str | None = None
    answer: str | int | float | None = None
    solution: str | None = None
    task_id: str | None = None
    tier: int = 0
    rel_tol: float = 0.0
    abs_tol: float = 0.0


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _ref(steps: list[str], answer: Fraction) -> str:
    return "\n".join([*steps, f"#### {_fmt(answer)}"])


def generate(rng: random.Random, tier: int) -> tuple[str, Fraction, list[str]]:
    """(expression, value, worked steps) for a tier; pure given the rng state."""
    if tier == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a} + {b}", Fraction(a + b), []
    if tier == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            tens, ones = b - b % 10, b % 10
            return f"{a} + {b}", Fraction(a + b), [f"{a} + {tens} = {a + tens}",
                                                    f"{a + tens} + {ones} = {a + b}"]
        a, b = max(a, b), min(a, b)
        tens, ones = b - b % 10, b % 10
        return f"{a} - {b}", Fraction(a - b), [f"{a} - {tens} = {a - tens}",
                                                f"{a - tens} - {ones} = {a - b}"]
    if tier == 2:
        a, b, c = rng.randint(2, 19), rng.randint(2, 12), rng.randint(1, 50)
        op = rng.choice("+-")
        ab = a * b
        value = ab + c if op == "+" else ab - c
        return f"{a} * {b} {op} {c}", Fraction(value), [f"{a} * {b} = {ab}",
                                                         f"{ab} {op} {c} = {value}"]
    if tier == 3:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        c, d = rng.randint(2, 19), rng.randint(1, 999)
        s = a + b
        p = s * c
        value = p - d
        steps = [f"{a} + {b} = {s}", f"{s} * {c} = {p}", f"{p} - {d} = {value}"]
        return f"({a} + {b}) * {c} - {d}", Fraction(value), steps
    if tier == 4:
        a, b = rng.randint(1, 9), rng.randint(2, 12)
        c, d = rng.randint(1, 9), rng.randint(2, 12)
        op = rng.choice("+-")
        x, y = Fraction(a, b), Fraction(c, d)
        value = x + y if op == "+" else x - y
        steps = [f"{a}/{b} {op} {c}/{d} = {_fmt(value)}"]
        return f"{a}/{b} {op} {c}/{d}", value, steps
    raise ValueError(f"math has tiers 0..4, got {tier}")


class MathDomain:
    """Arithmetic with exact, equivalence-aware answer checking."""

    name = "math"
    description = "generated arithmetic and users' math sets (GSM8K/MATH rows); exact answers"
    resource = "cpu"
    multi_turn = False
    tiers = (
        Tier(level=0, name="add-1digit", description="one addition of two 1-digit numbers"),
        Tier(level=1, name="addsub-2digit", description="one addition/subtraction, 2 digits"),
        Tier(level=2, name="mul-then-add", description="a product then a sum/difference"),
        Tier(level=3, name="three-steps", description="(a + b) * c - d with up to 3 digits"),
        Tier(level=4, name="fractions", description="sum/difference of two fractions, exact"),
    )

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        check_tier(self, tier)
        expr, value, steps = generate(rng, tier)
        question = f"Compute {expr}."
        spec = MathSpec(question=question, answer=_fmt(value))
        return TaskSpec(
            task_id=f"math-t{tier}-{rng.getrandbits(48):012x}",
            domain=self.name,
            tier=tier,
            prompt=f"{question} {FORMAT_HINT}",
            spec=msgspec.to_builtins(spec),
            reference=_ref(steps, value),
            source="generated",
        )

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, MathRow, where=where)
        question = r.question if r.question is not None else r.problem
        if not question:
            raise ValueError("a math row needs a non-empty `question` (or `problem`)")
        if r.answer is not None:
            answer = str(r.answer)
            if "####" in answer:  # GSM8K: worked solution, then #### final
                ex = extract_final_answer(answer)
                if ex.answer is None:
                    raise ValueError("`answer` has a #### marker but no single final answer")
                answer = ex.answer
        elif r.solution is not None:
            ex = extract_final_answer(r.solution)
            if ex.answer is None:
                raise ValueError(f"`solution` has no single marked final answer ({ex.rule})")
            answer = ex.answer
        else:
            raise ValueError("a math row needs `answer` (or a `solution` with \\boxed{})")
        if not answer.strip():
            raise ValueError("`answer` is empty")
        if r.rel_tol < 0 or r.abs_tol < 0:
            raise ValueError("`rel_tol` and `abs_tol` must be >= 0")
        spec = MathSpec(question=question, answer=answer, rel_tol=r.rel_tol, abs_tol=r.abs_tol)
        return TaskSpec(
            task_id=r.task_id or f"math-{where.rsplit(':', 1)[-1]}",
            domain=self.name,
            tier=r.tier,
            prompt=f"{question}\n{FORMAT_HINT}",
            spec=msgspec.to_builtins(spec),
            reference=f"#### {answer}",
            source="jsonl",
        )

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    def score(self, task: TaskSpec, completion: str) -> Verdict:
        """The synchronous check behind `verify` (pure)."""
        spec = msgspec.convert(task.spec, MathSpec)
        ex = extract_math_answer(completion)
        found = Check(
            name="answer_found",
            passed=ex.answer is not None,
            detail=f"rule={ex.rule}" + (f" candidates={ex.candidates!r}" if ex.candidates else ""),
        )
        if ex.answer is None:
            reason = (
                "several different final answers (hedging)"
                if ex.rule == "ambiguous"
                else "no final answer (expected '#### <answer>' or \\boxed{})"
            )
            return Verdict(reward=0.0, outcome="fail", checks=[found], reason=reason)
        ok = equivalent(ex.answer, spec.answer, rel_tol=spec.rel_tol, abs_tol=spec.abs_tol)
        match = Check(
            name="answer_matches", passed=ok, detail=f"expected {spec.answer!r}, got {ex.answer!r}"
        )
        return Verdict(
            reward=1.0 if ok else 0.0,
            outcome="pass" if ok else "fail",
            checks=[found, match],
            reason="correct final answer" if ok else f"wrong final answer {ex.answer!r}",
        )

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        return self.score(task, completion)
