"""Final-answer extraction and equivalence for math-style answers (pure functions).

The rules, in order (each is tested in tests/envs/test_envs_answers.py):

1. Marked answers. Every `\\boxed{...}` (or `\\fbox{...}`, braces balanced) and
   every `#### ...` (the rest of that line) in the completion is a candidate.
   If the marked answers do not all normalise to the same value, the
   completion hedges and has NO answer (listing several guesses never wins).
2. Unmarked. With no marker, a completion that is, as a whole, a single
   number (e.g. `42`, `-3/4`, `0.5`) is its own answer. Anything else has no
   answer: we never guess "the last number in the text".
3. Normalisation of an answer string: surrounding `$...$`, `\\(...\\)`,
   `\\text{}`/`\\mathrm{}` wrappers, LaTeX spacing (`\\,` `\\!` `\\;` `\\ `),
   `\\left`/`\\right`, a currency sign, a trailing full stop and a leading
   `x =` are removed; thousands separators (`1,234,567`) are dropped.
4. Numbers: integers, decimals, scientific notation (`1.5e3`), fractions `a/b`,
   `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, `\\frac12`), a leading sign, and a
   trailing `%` (`50%` reads as 50: percent questions ask for the number).
   They are compared EXACTLY as rationals (`0.5 == 1/2 == \\frac{1}{2}`),
   unless the task gives a relative tolerance. Near misses (`42.01` for 42,
   `0.33` for 1/3) are wrong.
5. Non-numeric answers compare as normalised text (case-folded, whitespace
   collapsed, the wrappers of rule 3 removed).

How graders judge math (`judge_math`, what the math domain uses), on top of 1-5:

6. Unmarked, a completion that is one arithmetic formula (`2^{10}`) answers with
   it; one with one math span (`$...$`, `$$...$$`, `\\(...\\)`,
   `\\[...\\]`; several that all denote one value count as one) answers with it
   (`Answer \\[ 9 \\]`); without any span, a completion with exactly one number
   answers with it (`The answer is 9.`). Several different spans or numbers are a
   hedge: no answer.
7. Where 4 and 5 do not decide (either side is not a plain number: roots,
   pi, symbolic forms, intervals, sets, matrices, equations, units in `\\text{}`),
   equivalence is math-verify's (sympy, with its own time limit in the main
   thread; answers over `SYMBOLIC_MAX_CHARS` are not tried). Two plain numbers
   are never handed to it: they stay exact (`0.33` is not 1/3).
8. Also read as numbers: thousands separated by spaces (`1 000`, `1\\,000`) and a
   decimal comma (`1,22`; a comma before exactly three digits is a thousands
   separator: `1,220`).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####[ \t]*((?:(?!####)[^\n])*)")
_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")
_SPACED_THOUSANDS_RE = re.compile(r"(?<![\d.,])\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+(?![\d,.])")
_DECIMAL_COMMA_RE = re.compile(r"^([+-]?\d+),(\d{1,2}|\d{4,})$")
_MATH_SPAN_RE = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_BARE_EXPRESSION_RE = re.compile(r"[\d\s+\-*/^(){}.]+")
_TEXT_NUMBER_RE = re.compile(r"(?<![\w.])[+-]?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?%?(?![\w])")
_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_FRAC_RE = re.compile(
    r"^([+-]?)\\[dt]?frac\s*(?:\{\s*([^{}]+?)\s*\}|(\d))\s*(?:\{\s*([^{}]+?)\s*\}|(\d))$"
)
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_ASSIGN_RE = re.compile(r"^[A-Za-z]\s*=\s*(?=\S)")


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` / `\\fbox{...}` with balanced braces."""
    out = []
    for m in _BOX_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1])
    return out


def marked_answers(text: str) -> list[str]:
    """All marked final answers, raw: boxed contents first, then `####` lines."""
    return boxed_contents(text) + [m.group(1).strip() for m in _HASH_RE.finditer(text)]


def normalize_answer(s: str) -> str:
    """Rule 3: strip formatting that does not change the value."""
    s = s.strip()
    for _ in range(3):  # nested wrappers, e.g. $\text{42}$
        before = s
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$").strip()
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2].strip()
        if s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2].strip()
        s = _WRAPPER_RE.sub(r"\1", s)
        if s == before:
            break
    for token in ("\\left", "\\right", "\\,", "\\!", "\\;", "\\:", "\\ ", "\\displaystyle"):
        s = s.replace(token, "")
    s = s.replace("\\%", "%").replace("\\$", "$").replace("\\cdot", "*").replace("\\times", "*")
    s = s.strip()
    if s.startswith("$") and len(s) > 1:  # currency
        s = s[1:].strip()
    s = s.rstrip(".").strip()
    s = _ASSIGN_RE.sub("", s)
    s = _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), s)
    s = _SPACED_THOUSANDS_RE.sub(lambda m: re.sub(r"\s", "", m.group(0)), s)
    s = _DECIMAL_COMMA_RE.sub(r"\1.\2", s.strip())
    return " ".join(s.split())


def parse_number(s: str) -> Fraction | None:
    """Rule 4 on an already-normalised string; None if it is not exactly one number."""
    s = re.sub(r"\s*/\s*", "/", s.strip())
    s = re.sub(r"^([+-])\s+", r"\1", s)
    if not s:
        return None
    if s.endswith("%"):
        s = s[:-1].rstrip()
    m = _FRAC_RE.match(s)
    if m:
        sign, num_b, num_d, den_b, den_d = m.groups()
        num, den = parse_number(num_b or num_d), parse_number(den_b or den_d)
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if sign == "-" else value
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = parse_number(a), parse_number(b)
        if num is None or den is None or den == 0 or "/" in a + b:
            return None
        return num / den
    if s.startswith("(") and s.endswith(")"):
        return parse_number(s[1:-1])
    if _NUMBER_RE.fullmatch(s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _text_key(s: str) -> str:
    return " ".join(normalize_answer(s).casefold().split())


def same_value(a: str, b: str) -> bool:
    """True if two answer strings denote the same value (exact for numbers)."""
    na, nb = parse_number(normalize_answer(a)), parse_number(normalize_answer(b))
    if na is not None or nb is not None:
        return na is not None and nb is not None and na == nb
    return _text_key(a) == _text_key(b)


class Extraction:
    """What rule 1/2 found: the answer (or None) and how."""

    __slots__ = ("answer", "rule", "candidates")

    def __init__(self, answer: str | None, rule: str, candidates: list[str]):
        self.answer = answer
        self.rule = rule
        self.candidates = candidates

    def __repr__(self) -> str:
        return f"Extraction(answer={self.answer!r}, rule={self.rule!r})"


def extract_final_answer(completion: str) -> Extraction:
    """Apply rules 1 and 2. `rule` is "marked", "bare", "ambiguous" or "missing"."""
    marked = [m for m in marked_answers(completion) if m.strip()]
    if marked:
        first = marked[0]
        if all(same_value(first, other) for other in marked[1:]):
            return Extraction(first, "marked", marked)
        return Extraction(None, "ambiguous", marked)
    whole = normalize_answer(completion)
    if parse_number(whole) is not None:
        return Extraction(whole, "bare", [whole])
    return Extraction(None, "missing", [])


def answers_match(got: str, expected: str, *, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Compare an extracted answer with the expected one (rules 4 and 5)."""
    g, e = parse_number(normalize_answer(got)), parse_number(normalize_answer(expected))
    if e is not None:
        if g is None:
            return False
        if g == e:
            return True
        if rel_tol or abs_tol:
            return abs(g - e) <= max(Fraction(rel_tol) * abs(e), Fraction(abs_tol))
        return False
    return _text_key(got) == _text_key(expected)


# ----------------------------------------------------------------------------- graders' rules

SYMBOLIC_MAX_CHARS = 400
SYMBOLIC_TIMEOUT_S = 3


class Judgement(NamedTuple):
    ok: bool
    answer: str | None
    rule: str
    """How the answer was found: marked, bare, span, single_number; or why none was:
    ambiguous, missing."""


def judge_math(completion: str, expected: str, *, rel_tol: float = 0.0,
               abs_tol: float = 0.0) -> Judgement:
    """Rules 1-8: find the completion's one answer, then compare it with `expected`."""
    ex = extract_math_answer(completion)
    if ex.answer is None:
        return Judgement(False, None, ex.rule)
    return Judgement(equivalent(ex.answer, expected, rel_tol=rel_tol, abs_tol=abs_tol),
                     ex.answer, ex.rule)


def extract_math_answer(completion: str) -> Extraction:
    """Rules 1, 2 and 6: marked answers (all one value, symbolic forms included), a bare
    number, one math span, or the one number of an unmarked text."""
    marked = [m for m in marked_answers(completion) if m.strip()]
    if marked:
        if all(equivalent(other, marked[0]) for other in marked[1:]):
            return Extraction(marked[0], "marked", marked)
        return Extraction(None, "ambiguous", marked)
    whole = normalize_answer(completion)
    if parse_number(whole) is not None:
        return Extraction(whole, "bare", [whole])
    if _BARE_EXPRESSION_RE.fullmatch(whole):  # `10^2`: a formula, not several numbers
        return Extraction(whole, "bare", [whole])
    spans = [next(g for g in m.groups() if g is not None).strip()
             for m in _MATH_SPAN_RE.finditer(completion)]
    spans = [x for x in spans if x]
    if spans:
        if all(equivalent(other, spans[0]) for other in spans[1:]):
            return Extraction(spans[0], "span", spans)
        return Extraction(None, "ambiguous", spans)
    numbers = _TEXT_NUMBER_RE.findall(normalize_answer(completion))
    if len({parse_number(n) for n in numbers}) == 1:
        return Extraction(numbers[0], "single_number", numbers)
    return Extraction(None, "ambiguous" if numbers else "missing", numbers)


def equivalent(got: str, expected: str, *, rel_tol: float = 0.0, abs_tol: float = 0.0) -> bool:
    """Rules 4, 5 and 7: exact for two plain numbers, else text, else math-verify."""
    if answers_match(got, expected, rel_tol=rel_tol, abs_tol=abs_tol):
        return True
    if parse_number(normalize_answer(got)) is not None and \
            parse_number(normalize_answer(expected)) is not None:
        return False
    return symbolically_equal(got, expected)


def symbolically_equal(got: str, expected: str) -> bool:
    """math-verify's verdict on two answer strings (LaTeX or plain); False when either
    does not parse, is too long, or the comparison runs out of time."""
    if len(got) > SYMBOLIC_MAX_CHARS or len(expected) > SYMBOLIC_MAX_CHARS:
        return False
    import threading

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify's time limit is signal.alarm: only in the main thread; elsewhere the
    # length bound above is the only guard.
    limit = SYMBOLIC_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def parsed(text: str) -> list:
        latex = text if any(d in text for d in ("$", "\\(", "\\[")) else f"${text}$"
        return parse(latex, extraction_config=configs, parsing_timeout=limit)

    try:
        gold, answer = parsed(expected), parsed(got)
        return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=limit))
    except Exception:  # noqa: BLE001 - an answer math-verify cannot read is not equal
        return False


def agreement(cases_path: str) -> dict[str, object]:
    """`judge_math` against labelled cases (JSONL: gold, output, equal): the figures."""
    import json

    with open(cases_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    verdicts = [(judge_math(r["output"], r["gold"]).ok, bool(r["equal"])) for r in rows]
    agree = sum(ok == label for ok, label in verdicts)
    return {"cases": len(rows), "positives": sum(label for _, label in verdicts),
            "agreement": round(agree / max(1, len(rows)), 4),
            "false_positives": sum(ok and not label for ok, label in verdicts),
            "false_negatives": sum(label and not ok for ok, label in verdicts)}


if __name__ == "__main__":  # python -m reinforge.envs.domains.answers CASES.jsonl
    import json
    import sys

    print(json.dumps(agreement(sys.argv[1])))
