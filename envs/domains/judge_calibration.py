"""How far a judge model can be trusted: its YES/NO on rubric items against labels.

A labelled item is one rubric question the judge domain asks (`judge_prompt`): a task's
instruction, an answer, one criterion, and whether the answer meets it (`label`). The judge
gives two things per item: its greedy reply, parsed as the domain parses it (the decision
a run would use), and P(YES), from the model's log-probabilities of answering YES and NO
(normalised over the two). Agreement figures come from the decisions; calibration figures
(Brier score, expected calibration error, the reliability table, AUROC) from P(YES).

JSONL row schema (`LabelledItem`):

    {"instruction": "Name one fruit.", "answer": "Mars.",
     "criterion": "names exactly one fruit", "label": false}

`synthetic_labels` builds a labelled set from the judge domain's built-in tasks: each
criterion with the answers written for its task (YES), and with answers written to fail it
or for other tasks (NO), each label checked against the criterion's keyword rule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.domains import judge as jd
from reinforge.envs.tasksets import decode_row, load_jsonl

ECE_BINS = 10


class LabelledItem(msgspec.Struct, frozen=True, kw_only=True):
    instruction: str
    answer: str
    criterion: str
    label: bool
    """True: the answer meets the criterion."""


def load_labels(path: str | Path) -> list[LabelledItem]:
    """A labelled set from JSONL; a bad row is a ValueError naming its line."""
    def row(raw: Any, where: str) -> LabelledItem:
        item = decode_row(raw, LabelledItem, where=where)
        if not item.criterion.strip() or not item.answer.strip():
            raise ValueError("`criterion` and `answer` must not be empty")
        return item

    items = load_jsonl(path, row)
    if not items:
        raise ValueError(f"{path}: no labelled items")
    return items


class _Task(msgspec.Struct, frozen=True):
    instruction: str
    rubric: list[jd.RubricItem]
    meets: list[str]
    """Answers written for this task: they meet every criterion (the rule agrees)."""
    fails: list[str] = []
    """Answers written to fail it (one that names several things where one is asked)."""


def _built_in_tasks() -> list[_Task]:
    """Every task the judge domain generates, with answers known to meet or fail it."""
    tasks = []
    for cat, words, ref in jd._NAME_ONE:
        listing = ", ".join(w.capitalize() for w in words[:3]) + "."
        tasks.append(_Task(f"Name one {cat}.",
                           [jd.RubricItem(criterion=f"names exactly one {cat}",
                                          keywords=[words], exclusive=True)],
                           [ref, *(f"{w.capitalize()}." for w in words)], [listing]))
    for topic, kws, word, ref in jd._SENTENCE:
        tasks.append(_Task(f"Write one short sentence about {topic} that uses the word "
                           f"'{word}'.",
                           [jd.RubricItem(criterion=f"is about {topic}", keywords=[kws]),
                            jd.RubricItem(criterion=f"uses the word '{word}'",
                                          keywords=[[word]])], [ref]))
    for question, max_words, crits, ref in (*jd._EXPLAIN, *jd._STEPS):
        tasks.append(_Task(f"{question} Use at most {max_words} words.",
                           [jd.RubricItem(criterion=c, keywords=k) for c, k in crits], [ref]))
    return tasks


async def _rule_says(instruction: str, answer: str, item: jd.RubricItem) -> bool:
    result = await jd.RuleItemJudge().judge_item(instruction=instruction, answer=answer,
                                                 item=item)
    return result.passed


async def _labelled_pool() -> list[LabelledItem]:
    """YES: a task's own answers on its criteria. NO: its failing answers, and other tasks'
    answers that the criterion's rule rejects (one the rule accepts by a stray keyword,
    "water" in an answer on ice for "waters it", is left out: its label is not clear)."""
    tasks = _built_in_tasks()
    pool = []
    for task in tasks:
        others = [a for t in tasks if t is not task for a in (*t.meets, *t.fails)]
        for item in task.rubric:
            for answer, meant in ([(a, True) for a in task.meets]
                                  + [(a, False) for a in (*task.fails, *others)]):
                says = await _rule_says(task.instruction, answer, item)
                if says == meant:
                    pool.append(LabelledItem(instruction=task.instruction, answer=answer,
                                             criterion=item.criterion, label=meant))
                elif meant:
                    raise AssertionError(f"the rule rejects {answer!r} on {item.criterion!r}")
    return pool


def synthetic_labels(n: int, seed: int = 0) -> list[LabelledItem]:
    """`n` labelled items by seed: half labelled YES, or all the YES items there are."""
    import trio

    if n < 2:
        raise ValueError(f"a labelled set needs n >= 2 items, got {n}")
    pool = trio.run(_labelled_pool)
    rng = random.Random(seed)
    yes = [i for i in pool if i.label]
    no = [i for i in pool if not i.label]
    rng.shuffle(yes)
    rng.shuffle(no)
    if n > len(pool):
        raise ValueError(f"the built-in labelled set has {len(pool)} items, asked for {n}")
    take_yes = min(len(yes), n // 2)
    chosen = yes[:take_yes] + no[:n - take_yes]
    rng.shuffle(chosen)
    return chosen


# ---------------------------------------------------------------- figures (pure)


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The chance that a random positive scores above a random negative (ties count half);
    None without both kinds."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def reliability(p_yes: Sequence[float], labels: Sequence[bool],
                bins: int = ECE_BINS) -> list[dict[str, Any]]:
    """Equal-width bins of P(YES): items, mean P(YES) and the share labelled YES in each
    non-empty bin."""
    rows: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for p, y in zip(p_yes, labels):
        rows[min(int(p * bins), bins - 1)].append((p, y))
    return [{"bin": [k / bins, (k + 1) / bins], "n": len(r),
             "p_yes_mean": sum(p for p, _ in r) / len(r),
             "labelled_yes": sum(y for _, y in r) / len(r)}
            for k, r in enumerate(rows) if r]


def calibration_figures(labels: Sequence[bool], decisions: Sequence[bool | None],
                        p_yes: Sequence[float]) -> dict[str, Any]:
    """Agreement of the decisions (None: unparseable, left out of agreement) and
    calibration of P(YES), against the labels."""
    if not (len(labels) == len(decisions) == len(p_yes)) or not labels:
        raise ValueError("labels, decisions and p_yes must be equally long and not empty")
    parsed = [(d, y) for d, y in zip(decisions, labels) if d is not None]
    tp = sum(d and y for d, y in parsed)
    tn = sum((not d) and (not y) for d, y in parsed)
    fp = sum(d and (not y) for d, y in parsed)
    fn = sum((not d) and y for d, y in parsed)
    n_parsed = len(parsed)
    accuracy = (tp + tn) / n_parsed if n_parsed else None
    kappa = None
    if n_parsed:
        chance = ((tp + fp) * (tp + fn) + (tn + fn) * (tn + fp)) / n_parsed ** 2
        kappa = (accuracy - chance) / (1 - chance) if chance < 1 else None
    table = reliability(p_yes, labels)
    n = len(labels)
    return {
        "items": n,
        "labelled_yes": sum(labels) / n,
        "parsed": n_parsed / n,
        "judge_yes": (tp + fp) / n_parsed if n_parsed else None,
        "accuracy": accuracy,
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
        "cohen_kappa": kappa,
        "confusion": {"tp": tp, "fp": fp, "tn": tn, "fn": fn, "unparsed": n - n_parsed},
        "p_yes_mean": sum(p_yes) / n,
        "accuracy_at_p_half": sum((p >= 0.5) == y for p, y in zip(p_yes, labels)) / n,
        "brier": sum((p - y) ** 2 for p, y in zip(p_yes, labels)) / n,
        "ece": sum(r["n"] / n * abs(r["p_yes_mean"] - r["labelled_yes"]) for r in table),
        "auroc": auroc(p_yes, labels),
        "reliability": table,
    }


# ---------------------------------------------------------------- asking the judge


def p_yes_of(logprobs: dict[str, float]) -> float:
    """P(YES) from log P(YES) and log P(NO), normalised over the two."""
    top = max(logprobs["YES"], logprobs["NO"])
    yes, no = math.exp(logprobs["YES"] - top), math.exp(logprobs["NO"] - top)
    return yes / (yes + no)


async def calibrate(client: jd.SGLangJudgeClient, items: Sequence[LabelledItem], *,
                    seed: int = 0, max_new_tokens: int = 4,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Ask the judge every item (its greedy reply and P(YES)); the figures, and per item
    what it said. The markers' nonces come from `seed`, so a rerun asks the same prompts."""
    rng = random.Random(seed)
    decisions: list[bool | None] = []
    p_yes: list[float] = []
    replies = []
    for k, item in enumerate(items):
        prompt = jd.judge_prompt(item.instruction, item.answer,
                                 jd.RubricItem(criterion=item.criterion),
                                 f"{rng.getrandbits(48):012x}")
        reply = await client.generate(prompt, max_new_tokens=max_new_tokens)
        decisions.append(jd.parse_judge_reply(reply))
        p_yes.append(p_yes_of(await client.answer_logprobs(prompt, ("YES", "NO"))))
        replies.append({"label": item.label, "reply": reply.strip()[:40],
                        "p_yes": round(p_yes[-1], 4)})
        if progress is not None:
            progress(k + 1, len(items))
    figures = calibration_figures([i.label for i in items], decisions, p_yes)
    return {**figures, "judge_url": client.url, "items_asked": replies}
