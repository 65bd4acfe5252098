"""Document QA: generated financial statements (tables over pages) and users' JSONL sets.

Each task asks for one or more named fields. The answer format asked of the policy:

- one field: end with `#### <value>` (or a line `<field>: <value>`);
- several fields: one line per field, `<field>: <value>`.

Each field is scored on its own and the reward is their mean:

- `number`: one number (rules of `reinforge.envs.domains.answers`; `$`, thousands
  separators and a trailing unit word such as `thousand`/`USD` are allowed),
  equal within the field's tolerance;
- `exact`: normalised exact match (case, punctuation, articles, whitespace);
- `f1`: token F1 against the expected text (SQuAD-style normalisation).

Anti-gaming: a field answered twice with different values, or with several
values on one line ("530 or 412"), scores 0; a number field needs exactly one
number; text stuffing lowers F1 precision; pasting the document answers nothing.

JSONL row schema (`DocQARow`):

    {"document": "...", "question": "...", "answer": "530"}               # one field
    {"document": "...", "question": "...", "fields": {"revenue_2023": 530, "top_region": "Europe"}}
    optional: "match": "auto"|"number"|"exact"|"f1" (auto: number if the expected
    value is a number, else exact), "rel_tol", "abs_tol", "task_id", "tier"
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
from reinforge.envs.domains.answers import answers_match, extract_final_answer, normalize_answer
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier
from reinforge.envs.tasksets import decode_row, load_jsonl

Match = Literal["number", "exact", "f1"]

_UNIT_WORDS = ("usd", "dollars", "thousand", "thousands", "percent")
_FIELD_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class FieldSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    answer: str
    match: Match = "number"
    rel_tol: float = 0.0
    abs_tol: float = 0.0


class DocQASpec(msgspec.Struct, frozen=True, kw_only=True):
    document: str
    question: str
    fields: list[FieldSpec]


class DocQARow(msgspec.Struct, kw_only=True):
    """One line of a user's docqa JSONL file (extra keys are ignored)."""

    document: str
    question: str
    answer: str | int | float | None = None
    fields: dict[str, str | int | float] | None = None
    match: Literal["auto", "number", "exact", "f1"] = "auto"
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    task_id: str | None = None
    tier: int = 0


# ---------------------------------------------------------------- scoring (pure)


def normalize_text(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.casefold()
    s = "".join(ch for ch in s if ch not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(got: str, expected: str) -> float:
    g, e = normalize_text(got).split(), normalize_text(expected).split()
    if not g or not e:
        return float(g == e)
    common = sum((Counter(g) & Counter(e)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(g), common / len(e)
    return 2 * precision * recall / (precision + recall)


def _strip_units(value: str) -> str:
    v = normalize_answer(value)
    words = v.split()
    while len(words) > 1 and words[-1].casefold().strip(".") in _UNIT_WORDS:
        words.pop()
    return " ".join(words)


def score_field(field: FieldSpec, got: str) -> float:
    if field.match == "number":
        ok = answers_match(
            _strip_units(got), field.answer, rel_tol=field.rel_tol, abs_tol=field.abs_tol
        )
        return 1.0 if ok else 0.0
    if field.match == "exact":
        return 1.0 if normalize_text(got) == normalize_text(field.answer) else 0.0
    return token_f1(got, field.answer)


def parse_field_lines(completion: str, names: list[str]) -> dict[str, list[str]]:
    """All `name: value` (or `name = value`) lines per field name, case-insensitive."""
    found: dict[str, list[str]] = {n: [] for n in names}
    lookup = {n.casefold(): n for n in names}
    for line in completion.splitlines():
        m = re.match(r"^\s*[-*]?\s*\**([A-Za-z][A-Za-z0-9_ ]*?)\**\s*[:=]\s*(.+?)\s*$", line)
        if not m:
            continue
        key = m.group(1).strip().casefold().replace(" ", "_")
        if key in lookup:
            found[lookup[key]].append(m.group(2))
    return found


def score_completion(spec: DocQASpec, completion: str) -> Verdict:
    names = [f.name for f in spec.fields]
    lines = parse_field_lines(completion, names)
    checks: list[Check] = []
    total = 0.0
    for field in spec.fields:
        values = list(lines[field.name])
        if len(spec.fields) == 1 and not values:
            ex = extract_final_answer(completion)
            if ex.rule == "ambiguous":
                values = ex.candidates
            elif ex.answer is not None:
                values = [ex.answer]
        if not values:
            checks.append(Check(name=f"field:{field.name}", passed=False, detail="no answer"))
            continue
        scores = [score_field(field, v) for v in values]
        if len(set(scores)) > 1:  # hedging: a right and a wrong answer together
            checks.append(
                Check(
                    name=f"field:{field.name}",
                    passed=False,
                    detail=f"several different answers {values!r}",
                )
            )
            continue
        s = scores[0]
        total += s
        checks.append(
            Check(
                name=f"field:{field.name}",
                passed=s == 1.0,
                detail=f"expected {field.answer!r}, got {values[0]!r}, score {s:.3f}",
            )
        )
    reward = total / len(spec.fields)
    passed = sum(c.passed for c in checks)
    return Verdict(
        reward=reward,
        outcome="pass" if reward == 1.0 else "fail",
        checks=checks,
        reason=f"{passed}/{len(spec.fields)} fields correct",
    )


# ---------------------------------------------------------------- generator

_COMPANIES = (
    "Northwind Traders",
    "Acme Fasteners",
    "Blue Heron Foods",
    "Copperline Energy",
    "Vantor Logistics",
    "Orchid Pharma",
    "Granite Peak Tools",
    "Lumen Textiles",
)
_REGIONS = ("North America", "Europe", "Asia Pacific", "Latin America")
_FILLER = (
    "Management believes the company is well positioned for the coming year.",
    "The board approved a new code of conduct and renewed the audit committee charter.",
    "Supply chain conditions normalised during the second half of the year.",
    "The company opened {n} new distribution sites and closed {m} older ones.",
    "Average headcount was {h} employees, of whom {p} percent work outside headquarters.",
    "Customer retention remained high and the order backlog grew modestly.",
    "Capital expenditure focused on automation and information security.",
    "Foreign exchange movements had a limited effect on reported figures.",
)


def _table(title: str, years: list[int], rows: list[tuple[str, list[int]]]) -> str:
    head = "| Item | " + " | ".join(str(y) for y in years) + " |"
    lines = [f"Table: {title} (USD thousands)", head]
    lines += [
        "| " + name + " | " + " | ".join(f"{v:,}" for v in vals) + " |" for name, vals in rows
    ]
    return "\n".join(lines)


class _Company:
    """A consistent set of statements for `years` (all integers, USD thousands)."""

    def __init__(self, rng: random.Random, years: list[int]):
        self.name = rng.choice(_COMPANIES)
        self.years = years
        rev = [rng.randint(200, 5000)]
        for _ in years[1:]:
            rev.append(max(50, round(rev[-1] * rng.uniform(0.9, 1.3))))
        cost = [round(r * rng.uniform(0.4, 0.7)) for r in rev]
        gross = [r - c for r, c in zip(rev, cost)]
        opex = [round(r * rng.uniform(0.1, 0.25)) for r in rev]
        op = [g - o for g, o in zip(gross, opex)]
        tax = [max(0, round(o * 0.2)) for o in op]
        net = [o - t for o, t in zip(op, tax)]
        self.income = {
            "Revenue": rev,
            "Cost of revenue": cost,
            "Gross profit": gross,
            "Operating expenses": opex,
            "Operating income": op,
            "Net income": net,
        }
        self.segments: dict[str, list[int]] = {r: [] for r in _REGIONS}
        for total in rev:
            weights = [rng.uniform(0.5, 2.0) for _ in _REGIONS]
            parts = [int(total * w / sum(weights)) for w in weights]
            parts[0] += total - sum(parts)
            for region, part in zip(_REGIONS, parts):
                self.segments[region].append(part)
        cash = [rng.randint(50, 2000) for _ in years]
        recv = [round(r * rng.uniform(0.1, 0.2)) for r in rev]
        inv = [rng.randint(30, 900) for _ in years]
        ppe = [rng.randint(200, 6000) for _ in years]
        assets = [sum(x) for x in zip(cash, recv, inv, ppe)]
        liab = [round(a * rng.uniform(0.3, 0.7)) for a in assets]
        self.balance = {
            "Cash": cash,
            "Receivables": recv,
            "Inventory": inv,
            "Property and equipment": ppe,
            "Total assets": assets,
            "Total liabilities": liab,
            "Equity": [a - b for a, b in zip(assets, liab)],
        }

    def value(self, table: dict[str, list[int]], row: str, year: int) -> int:
        return table[row][self.years.index(year)]


def _slug(row: str, year: int) -> str:
    return re.sub(r"[^a-z0-9]+", "_", row.casefold()).strip("_") + f"_{year}"


def _pct(x: float) -> str:
    return f"{x:.1f}"


def _filler(rng: random.Random, k: int) -> str:
    out = []
    for _ in range(k):
        s = rng.choice(_FILLER)
        out.append(
            s.format(
                n=rng.randint(2, 9),
                m=rng.randint(1, 4),
                h=rng.randint(80, 4000),
                p=rng.randint(10, 60),
            )
        )
    return " ".join(out)


def generate(rng: random.Random, tier: int) -> tuple[str, str, list[FieldSpec]]:
    """(document, question, fields) for a tier; pure given the rng state."""
    if tier == 0:
        years = [2023, 2024]
        c = _Company(rng, years)
        rows = [("Revenue", c.income["Revenue"]), ("Net income", c.income["Net income"])]
        row, year = rng.choice(rows)[0], rng.choice(years)
        doc = _table("Income", years, rows)
        field = FieldSpec(name="answer", answer=str(c.value(c.income, row, year)))
        return doc, f"What was {row} in {year}?", [field]
    years = [2022, 2023, 2024] if tier < 3 else list(range(2020, 2025))
    c = _Company(rng, years)
    seg_rows = list(c.segments.items())
    tables = {
        "income": _table("Income statement", years, list(c.income.items())),
        "balance": _table("Balance sheet", years, list(c.balance.items())),
        "segments": _table("Revenue by region", years, seg_rows),
    }
    if tier == 1:
        doc = "\n\n".join(
            [f"{c.name} annual report", tables["income"], tables["balance"], tables["segments"]]
        )
        table = rng.choice([c.income, c.balance, c.segments])
        row, year = rng.choice(list(table)), rng.choice(years)
        field = FieldSpec(name="answer", answer=str(c.value(table, row, year)))
        return doc, f"What was {row} in {year}?", [field]

    def cross_question(y: int) -> tuple[str, FieldSpec, str]:
        kind = rng.randrange(4)
        if kind == 0:
            r1, r2 = rng.sample(_REGIONS, 2)
            v = c.value(c.segments, r1, y) + c.value(c.segments, r2, y)
            return (
                f"the combined revenue of {r1} and {r2} in {y}",
                FieldSpec(name=f"combined_revenue_{y}", answer=str(v)),
                "",
            )
        if kind == 1:
            region = rng.choice(_REGIONS)
            v = 100 * c.value(c.segments, region, y) / c.value(c.income, "Revenue", y)
            name = re.sub(r"\W+", "_", region.casefold()) + f"_share_{y}"
            return (
                f"{region}'s share of total revenue in {y}, in percent to 1 decimal",
                FieldSpec(name=name, answer=_pct(v), abs_tol=0.051),
                "",
            )
        if kind == 2:
            v = 100 * c.value(c.income, "Net income", y) / c.value(c.balance, "Total assets", y)
            return (
                f"net income as a percentage of total assets in {y}, to 1 decimal",
                FieldSpec(name=f"return_on_assets_{y}", answer=_pct(v), abs_tol=0.051),
                "",
            )
        prev = years[years.index(y) - 1]
        a, b = c.value(c.income, "Revenue", prev), c.value(c.income, "Revenue", y)
        return (
            f"revenue growth from {prev} to {y}, in percent to 1 decimal",
            FieldSpec(name=f"revenue_growth_{y}", answer=_pct(100 * (b - a) / a), abs_tol=0.051),
            "",
        )

    if tier == 2:
        doc = "\n\n".join(
            [f"{c.name} annual report", tables["income"], tables["balance"], tables["segments"]]
        )
        what, field, _ = cross_question(rng.choice(years[1:]))
        field = msgspec.structs.replace(field, name="answer")
        return doc, f"What was {what}?", [field]
    if tier == 3:
        pages = [
            f"{c.name} annual report {years[-1]}\n\n" + _filler(rng, 6),
            "Management discussion\n\n" + _filler(rng, 10),
            tables["income"],
            "Operations review\n\n" + _filler(rng, 10),
            tables["segments"],
            "Governance\n\n" + _filler(rng, 12),
            tables["balance"],
            "Outlook\n\n" + _filler(rng, 8),
        ]
        doc = "\n\n".join(f"--- Page {i + 1} of {len(pages)} ---\n{p}" for i, p in enumerate(pages))
        y = rng.choice(years[1:])
        what, f1, _ = cross_question(y)
        table = rng.choice([c.balance, c.segments])
        row = rng.choice(list(table))
        f2 = FieldSpec(name=_slug(row, years[0]), answer=str(c.value(table, row, years[0])))
        first, last = years[0], years[-1]
        growth = {r: c.segments[r][-1] / c.segments[r][0] for r in _REGIONS}
        top = max(growth, key=lambda r: growth[r])
        f3 = FieldSpec(name="fastest_growing_region", answer=top, match="exact")
        question = (
            f"Give {f1.name} ({what}); {f2.name} ({row} in {first}); and "
            f"fastest_growing_region (the region whose revenue grew most, relative, "
            f"from {first} to {last})."
        )
        return doc, question, [f1, f2, f3]
    raise ValueError(f"docqa has tiers 0..3, got {tier}")


def _format_hint(fields: list[FieldSpec]) -> str:
    if len(fields) == 1:
        return "End with '#### <answer>'."
    return "Answer with one line per field: " + ", ".join(f"'{f.name}: <value>'" for f in fields)


def _reference(fields: list[FieldSpec]) -> str:
    if len(fields) == 1:
        return f"#### {fields[0].answer}"
    return "\n".join(f"{f.name}: {f.answer}" for f in fields)


class DocQADomain:
    """Questions over long generated documents, scored per field."""

    name = "docqa"
    description = "questions over financial statements; per-field exact/F1/numeric scoring"
    resource = "cpu"
    multi_turn = False
    tiers = (
        Tier(level=0, name="one-table-lookup", description="one small table, one direct lookup"),
        Tier(level=1, name="multi-table-lookup", description="three tables, one lookup"),
        Tier(
            level=2,
            name="cross-section-arithmetic",
            description="sum/ratio/growth across two tables, one field",
        ),
        Tier(
            level=3,
            name="long-multi-field",
            description="8 pages with narrative, 3 fields: ratio, lookup, comparison",
        ),
    )

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        check_tier(self, tier)
        document, question, fields = generate(rng, tier)
        spec = DocQASpec(document=document, question=question, fields=fields)
        return TaskSpec(
            task_id=f"docqa-t{tier}-{rng.getrandbits(48):012x}",
            domain=self.name,
            tier=tier,
            prompt=f"{document}\n\nQuestion: {question}\n{_format_hint(fields)}",
            spec=msgspec.to_builtins(spec),
            reference=_reference(fields),
            source="generated",
        )

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, DocQARow, where=where)
        if (r.answer is None) == (r.fields is None):
            raise ValueError("a docqa row needs exactly one of `answer` or `fields`")
        raw = {"answer": r.answer} if r.fields is None else r.fields
        if not raw:
            raise ValueError("`fields` is empty")
        fields = []
        for name, value in raw.items():
            if not _FIELD_NAME_RE.match(name):
                raise ValueError(f"field name {name!r} must be an identifier (letters, digits, _)")
            text = str(value)
            if not text.strip():
                raise ValueError(f"field {name!r} has an empty expected value")
            match = r.match
            if match == "auto":
                match = "number" if extract_final_answer(text).rule == "bare" else "exact"
            fields.append(
                FieldSpec(name=name, answer=text, match=match, rel_tol=r.rel_tol, abs_tol=r.abs_tol)
            )
        spec = DocQASpec(document=r.document, question=r.question, fields=fields)
        return TaskSpec(
            task_id=r.task_id or f"docqa-{where.rsplit(':', 1)[-1]}",
            domain=self.name,
            tier=r.tier,
            prompt=f"{r.document}\n\nQuestion: {r.question}\n{_format_hint(fields)}",
            spec=msgspec.to_builtins(spec),
            reference=_reference(fields),
            source="jsonl",
        )

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    def score(self, task: TaskSpec, completion: str) -> Verdict:
        return score_completion(msgspec.convert(task.spec, DocQASpec), completion)

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        return self.score(task, completion)
