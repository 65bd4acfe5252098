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
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH_RE = re.compile(r"####[ \t]*((?:(?!####)[^\n])*)")
_THOUSANDS_RE = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")
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
