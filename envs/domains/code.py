"""Code: write a function that passes hidden unit tests, run in the Podman sandbox.

The completion is either the function's body continuing the prompt (HumanEval style)
or a whole program that defines the entry point (a ```python fence is unwrapped).
The hidden tests run in `code_harness.py` (read its docstring): tests and candidate
in separate processes, plain values across, a nonce-bearing verdict written by the
harness, expected values never readable by the candidate. A job the harness gives no
verdict for is an `error` (reward 0); only a sandbox that cannot run it at all is
`infra_error`.

JSONL row schema (`CodeRow`); HumanEval and MBPP rows load as they are:

    {"task_id": "HumanEval/0", "prompt": "def f(x):\\n    \\"\\"\\"...\\"\\"\\"\\n",
     "test": "def check(candidate):\\n    assert candidate(1) == 2\\n", "entry_point": "f",
     "canonical_solution": "    return x + 1\\n"}
    {"task_id": 11, "text": "Write a function ...", "code": "def f(...): ...",
     "test_list": ["assert f(1) == 2"], "test_setup_code": "", "test_imports": []}
    optional: "tier", "timeout_s"; for `reinforge verify`, "completion".
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import random
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.sandbox.runner import CodeRunner, RunnerInfraError
from reinforge.envs.domain import (
    Check,
    TaskSpec,
    Tier,
    Verdict,
    check_tier,
    infra_error,
    output_tail,
)
from reinforge.envs.tasksets import decode_row, load_jsonl

HARNESS_PATH = Path(__file__).with_name("code_harness.py")
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_MBPP_ENTRY_RE = re.compile(r"assert\s+(?:not\s+)?\(?\s*(?:set\s*\(\s*)?([A-Za-z_]\w*)\s*\(")


class CodeSpec(msgspec.Struct, frozen=True, kw_only=True):
    code_prompt: str
    """Trusted code the completion continues (and the tests may call helpers from)."""
    entry_point: str
    test: str = ""
    """HumanEval style: code defining `check(candidate)`."""
    test_list: list[str] = []
    """MBPP style: assertion lines calling the entry point by name."""
    setup: list[str] = []
    timeout_s: float = 6.0


class CodeRow(msgspec.Struct, kw_only=True):
    """One line of a user's code JSONL file (extra keys are ignored)."""

    prompt: str | None = None
    test: str | None = None
    entry_point: str | None = None
    canonical_solution: str | None = None
    task_id: str | int | None = None
    tier: int = 0
    text: str | None = None
    code: str | None = None
    test_list: list[str] | None = None
    test_setup_code: str | None = None
    test_imports: list[str] | None = None
    timeout_s: float | None = None


class CodeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How code is checked."""

    timeout_s: float = 6.0
    """Budget for loading the program and running all its tests (harness side)."""
    overhead_s: float = 4.0
    """Extra wall-clock for the sandbox around the harness (python start-up, set-up)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.overhead_s <= 0:
            raise ValueError("timeout_s and overhead_s must be > 0")


def assemble_program(code_prompt: str, completion: str, entry_point: str) -> str:
    """The program the candidate submits: prompt + body, or its own full definition."""
    fenced = _FENCE_RE.search(completion)
    if fenced:
        completion = fenced.group(1)
    if re.search(rf"^(async\s+)?def\s+{re.escape(entry_point)}\s*\(", completion, re.MULTILINE):
        for program in (code_prompt.rstrip("\n") + "\n\n" + completion, completion):
            try:
                ast.parse(program)
                return program
            except SyntaxError:
                continue
        return completion
    return code_prompt + completion


# ---------------------------------------------------------------- generator


# (name, args, docstring, reference body, input maker) per tier; inputs from the task rng.
def _ints(lo, hi, k):
    return lambda r: tuple(r.randint(lo, hi) for _ in range(k))


def _int_list(lo, hi, n_lo, n_hi):
    return lambda r: ([r.randint(lo, hi) for _ in range(r.randint(n_lo, n_hi))],)


def _word(r, lo=1, hi=8, alphabet="abcdefghij"):
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


_BANK: dict[int, list[tuple[str, str, str, str, Any]]] = {
    0: [
        ("add", "a, b", "Return the sum of a and b.", "return a + b", _ints(-50, 50, 2)),
        ("subtract", "a, b", "Return a minus b.", "return a - b", _ints(-50, 50, 2)),
        ("multiply", "a, b", "Return a times b.", "return a * b", _ints(-20, 20, 2)),
        ("larger", "a, b", "Return the larger of a and b.", "return max(a, b)", _ints(-50, 50, 2)),
        (
            "is_even",
            "n",
            "Return True if n is even, else False.",
            "return n % 2 == 0",
            _ints(-99, 99, 1),
        ),
        ("square", "n", "Return n squared.", "return n * n", _ints(-30, 30, 1)),
        ("negate", "n", "Return -n.", "return -n", _ints(-99, 99, 1)),
    ],
    1: [
        (
            "sum_list",
            "xs",
            "Return the sum of the numbers in xs.",
            "return sum(xs)",
            _int_list(-20, 20, 0, 8),
        ),
        (
            "count_even",
            "xs",
            "Return how many numbers in xs are even.",
            "return sum(1 for x in xs if x % 2 == 0)",
            _int_list(-20, 20, 0, 8),
        ),
        (
            "reverse_string",
            "s",
            "Return s reversed.",
            "return s[::-1]",
            lambda r: (_word(r, 0, 9),),
        ),
        (
            "max_list",
            "xs",
            "Return the largest number in the non-empty list xs.",
            "return max(xs)",
            _int_list(-50, 50, 1, 8),
        ),
        (
            "count_char",
            "s, c",
            "Return how many times the character c occurs in s.",
            "return s.count(c)",
            lambda r: (_word(r, 0, 12, "abc"), r.choice("abc")),
        ),
        (
            "factorial",
            "n",
            "Return n! for n >= 0.",
            "out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out",
            _ints(0, 10, 1),
        ),
    ],
    2: [
        (
            "is_palindrome",
            "s",
            "Return True if s reads the same backwards, ignoring case.",
            "return s.lower() == s.lower()[::-1]",
            lambda r: (
                (lambda w: w + w[::-1][r.randint(0, 1) :] if r.random() < 0.5 else w)(
                    _word(r, 1, 5, "abAB")
                ),
            ),
        ),
        (
            "fibonacci",
            "n",
            "Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1.",
            "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
            _ints(0, 25, 1),
        ),
        (
            "gcd",
            "a, b",
            "Return the greatest common divisor of positive integers a and b.",
            "while b:\n        a, b = b, a % b\n    return a",
            _ints(1, 200, 2),
        ),
        (
            "running_sum",
            "xs",
            "Return the list of running totals of xs.",
            "out, t = [], 0\n    for x in xs:\n        t += x\n"
            "        out.append(t)\n    return out",
            _int_list(-9, 9, 0, 7),
        ),
        (
            "dedupe",
            "xs",
            "Return xs without repeated items, keeping first occurrences in order.",
            "seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
            "            seen.add(x)\n            out.append(x)\n    return out",
            _int_list(0, 5, 0, 10),
        ),
        (
            "vowel_count",
            "s",
            "Return the number of vowels (a, e, i, o, u; any case) in s.",
            "return sum(1 for ch in s.lower() if ch in 'aeiou')",
            lambda r: (_word(r, 0, 12, "aeioubcdXYZE"),),
        ),
    ],
    3: [
        (
            "is_prime",
            "n",
            "Return True if n is a prime number.",
            "if n < 2:\n        return False\n    k = 2\n    while k * k <= n:\n"
            "        if n % k == 0:\n            return False\n        k += 1\n    return True",
            _ints(-5, 200, 1),
        ),
        (
            "merge_sorted",
            "a, b",
            "Merge two sorted lists into one sorted list.",
            "return sorted(a + b)",
            lambda r: (sorted(_int_list(0, 50, 0, 6)(r)[0]), sorted(_int_list(0, 50, 0, 6)(r)[0])),
        ),
        (
            "to_roman",
            "n",
            "Return the Roman numeral for 1 <= n <= 3999.",
            "vals = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),\n"
            "            (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'),\n"
            "            (1, 'I')]\n"
            "    out = ''\n    for v, s in vals:\n        while n >= v:\n            out += s\n"
            "            n -= v\n    return out",
            _ints(1, 3999, 1),
        ),
        (
            "word_freq",
            "s",
            "Return a dict mapping each space-separated word of s to its count.",
            "out = {}\n    for w in s.split():\n        out[w] = out.get(w, 0) + 1\n    return out",
            lambda r: (" ".join(_word(r, 1, 2, "ab") for _ in range(r.randint(0, 6))),),
        ),
        (
            "second_largest",
            "xs",
            "Return the second largest distinct value in xs (which has "
            "at least two distinct values).",
            "return sorted(set(xs))[-2]",
            lambda r: ([1, 2] + _int_list(-9, 9, 0, 6)(r)[0],),
        ),
    ],
}

CASES_PER_TASK = 6


def generate(rng: random.Random, tier: int) -> tuple[CodeSpec, str]:
    """(spec, reference body) for a tier; pure given the rng state."""
    if tier not in _BANK:
        raise ValueError(f"code has tiers 0..{len(_BANK) - 1}, got {tier}")
    name, args, doc, body, make = rng.choice(_BANK[tier])
    prompt = f'def {name}({args}):\n    """{doc}"""\n'
    reference = f"    {body}\n"
    ns: dict[str, Any] = {}
    exec(prompt + reference, ns)  # our own reference implementation, trusted
    lines = ["def check(candidate):"]
    for _ in range(CASES_PER_TASK):
        inputs = make(rng)
        expected = ns[name](*[list(x) if isinstance(x, list) else x for x in inputs])
        lines.append(f"    assert candidate({', '.join(map(repr, inputs))}) == {expected!r}")
    spec = CodeSpec(code_prompt=prompt, entry_point=name, test="\n".join(lines) + "\n")
    return spec, reference


class CodeDomain:
    """Functions checked by hidden unit tests in the sandbox."""

    name = "code"
    description = "write a Python function; hidden unit tests in the Podman sandbox"
    resource = "sandbox"
    multi_turn = False
    # A prompt is a function's signature and docstring, from a bank of 5-7 per tier (the
    # tests vary, the prompt does not): hold out 2 functions per tier, train on the rest.
    tiers = (
        Tier(level=0, name="one-liner", description="a one-line arithmetic function (add(a, b))",
             max_heldout=2),
        Tier(level=1, name="loop-or-builtin", description="a list/string function, one loop",
             max_heldout=2),
        Tier(level=2, name="small-algorithm", description="fibonacci, gcd, running sums, ...",
             max_heldout=2),
        Tier(level=3, name="algorithm", description="primes, merging, roman numerals, counts",
             max_heldout=2),
    )

    def __init__(self, *, config: CodeConfig | None = None, runner: CodeRunner | None = None):
        self.config = config or CodeConfig()
        self.runner = runner
        self._nonce_key = secrets.token_bytes(32)

    def with_runner(self, runner: CodeRunner) -> CodeDomain:
        """The same domain, running its jobs on `runner` (e.g. from `sandbox_runner()`)."""
        other = CodeDomain(config=self.config, runner=runner)
        other._nonce_key = self._nonce_key
        return other

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        check_tier(self, tier)
        spec, reference = generate(rng, tier)
        spec = msgspec.structs.replace(spec, timeout_s=self.config.timeout_s)
        return TaskSpec(
            task_id=f"code-t{tier}-{rng.getrandbits(48):012x}",
            domain=self.name,
            tier=tier,
            prompt=spec.code_prompt,
            spec=msgspec.to_builtins(spec),
            reference=reference,
            source="generated",
        )

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, CodeRow, where=where)
        setup = []
        if r.test_list is not None:  # MBPP
            if not r.test_list:
                raise ValueError("`test_list` is empty")
            entry = r.entry_point
            if entry is None:
                m = _MBPP_ENTRY_RE.search(r.test_list[0])
                if not m:
                    raise ValueError("cannot infer `entry_point` from test_list[0]; give it")
                entry = m.group(1)
            prompt = r.prompt
            if prompt is None:
                if not r.text:
                    raise ValueError("an MBPP row needs `text` (or `prompt`)")
                prompt = f'"""\n{r.text}\n{r.test_list[0]}\n"""\n'
            setup = [*(r.test_imports or []), r.test_setup_code or ""]
            reference = r.code if r.code is not None else r.canonical_solution
        else:
            if r.prompt is None or r.test is None or r.entry_point is None:
                missing = [k for k in ("prompt", "test", "entry_point") if getattr(r, k) is None]
                raise ValueError(
                    f"a code row needs `prompt`, `test` and `entry_point` "
                    f"(or MBPP's `test_list`); missing {', '.join(missing)}"
                )
            entry, prompt, reference = r.entry_point, r.prompt, r.canonical_solution
        if not entry.isidentifier():
            raise ValueError(f"`entry_point` {entry!r} is not a Python identifier")
        for k, code in enumerate([r.test or "", *(r.test_list or []), *setup]):
            try:
                ast.parse(code)
            except SyntaxError as exc:
                raise ValueError(
                    f"test code #{k} does not parse: {exc.msg} (line {exc.lineno})"
                ) from None
        timeout_s = r.timeout_s if r.timeout_s is not None else self.config.timeout_s
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be > 0, got {timeout_s}")
        spec = CodeSpec(
            code_prompt=prompt,
            entry_point=entry,
            test=r.test or "",
            test_list=list(r.test_list or []),
            setup=[s for s in setup if s],
            timeout_s=timeout_s,
        )
        return TaskSpec(
            task_id=str(r.task_id) if r.task_id is not None else f"code-{where.rsplit(':', 1)[-1]}",
            domain=self.name,
            tier=r.tier,
            prompt=prompt,
            spec=msgspec.to_builtins(spec),
            reference=reference,
            source="jsonl",
        )

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    def job_for(self, task: TaskSpec, completion: str) -> tuple[str, bytes]:
        """(nonce, stdin for the harness): deterministic per domain instance, so identical
        candidates hit the pool's result cache; the nonce is an HMAC under a secret key."""
        spec = msgspec.convert(task.spec, CodeSpec)
        program = assemble_program(spec.code_prompt, completion, spec.entry_point)
        body = {
            "program": program,
            "prompt": spec.code_prompt,
            "test": spec.test,
            "test_list": spec.test_list,
            "setup": spec.setup,
            "entry_point": spec.entry_point,
            "timeout_s": spec.timeout_s,
        }
        payload = json.dumps(body, sort_keys=True)
        nonce = hmac.new(self._nonce_key, payload.encode(), hashlib.sha256).hexdigest()[:32]
        return nonce, json.dumps({**body, "nonce": nonce}).encode()

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        if self.runner is None:
            return infra_error(
                "no sandbox attached to the code domain: use "
                "`async with sandbox_runner() as r: domain.with_runner(r)`"
            )
        spec = msgspec.convert(task.spec, CodeSpec)
        nonce, stdin = self.job_for(task, completion)
        try:
            out = await self.runner.check(
                harness=HARNESS_PATH.read_bytes(),
                payload=stdin,
                timeout_s=spec.timeout_s + self.config.overhead_s,
            )
        except RunnerInfraError as exc:
            return infra_error(str(exc))
        return verdict_from_output(nonce, out)


def verdict_from_output(nonce: str, out) -> Verdict:
    """Only the harness's nonce line counts; anything else is the candidate's error."""
    result = None
    for line in out.stdout.decode("utf-8", errors="replace").splitlines():
        if line.startswith(nonce + " "):
            try:
                result = json.loads(line[len(nonce) + 1 :])
            except ValueError:
                result = None
            break
    if result is None:
        if out.status == "timeout":
            return Verdict(
                reward=0.0,
                outcome="timeout",
                reason="the sandbox run timed out",
                checks=[Check(name="finished", passed=False, detail=out.detail)],
            )
        why = {
            "memory_limit": "the program ran out of memory",
            "output_limit": "the program flooded its output",
            "input_too_large": "the program is too large to run",
        }.get(out.status, "the harness gave no verdict (killed by the program?)")
        tail = out.stderr.decode("utf-8", errors="replace")[-300:]
        return Verdict(
            reward=0.0,
            outcome="error",
            reason=why,
            checks=[
                Check(name="verdict", passed=False, detail=f"status={out.status} stderr={tail!r}")
            ],
        )
    checks = [Check(name=str(n), passed=bool(p), detail=str(d)) for n, p, d in result["checks"]]
    status = result["status"]
    outcome = status if status in ("pass", "fail", "timeout", "error") else "error"
    return Verdict(
        reward=1.0 if outcome == "pass" else 0.0,
        outcome=outcome,
        checks=checks,
        reason=str(result["reason"]),
        output=output_tail(str(result.get("output", ""))),
    )
