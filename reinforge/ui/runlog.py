"""A run's messages as the UI reads them: scored rollouts, dead letters and review marks, by
id and by problem.

Built from a message log file (`reinforge log export`) or from the run's stream as it grows
(`follow`): every record decoded with the one typed decoder; records that do not decode are
counted, never shown as anything else.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reinforge.core.messages import (
    DeadLetter,
    MessageError,
    ReviewMark,
    Rollback,
    ScoredRollout,
    WeightsPublished,
    decode,
)
from reinforge.core.msglog import read_log
from reinforge.rl.evalsets import fingerprint


@dataclass
class RunLog:
    scored: list[ScoredRollout] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    marks: list[ReviewMark] = field(default_factory=list)
    versions: list[WeightsPublished] = field(default_factory=list)
    rollbacks: list[Rollback] = field(default_factory=list)
    undecodable: int = 0
    unreadable: str = ""
    """Why the run's stream cannot be read now ("" while it can: `follow`)."""
    unreadable_since: float = 0.0
    last_seq: int = 0
    """The last stream sequence read (a live view reads on from the next)."""
    by_id: dict[str, ScoredRollout] = field(default_factory=dict)
    by_problem: dict[str, list[ScoredRollout]] = field(default_factory=lambda: defaultdict(list))
    """Scored rollouts by problem (`problem_of`), so that one problem's groups, drawn again
    as the run went on, line up across versions."""
    problem_of_task: dict[str, str] = field(default_factory=dict)
    marks_of: dict[str, list[ReviewMark]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def from_file(cls, path: str | Path) -> RunLog:
        log = cls()
        for record in read_log(path):
            log.take(record.payload, record.stream_seq)
        return log

    def take(self, payload: bytes, seq: int = 0) -> None:
        """One stored message: kept when the UI shows its type, counted when it does not
        decode, else passed over."""
        self.last_seq = max(self.last_seq, seq)
        try:
            msg = decode(payload)
        except MessageError:
            self.undecodable += 1
            return
        if isinstance(msg, ScoredRollout):
            self.add(msg)
        elif isinstance(msg, DeadLetter):
            self.dead_letters.append(msg)
        elif isinstance(msg, ReviewMark):
            self.marks.append(msg)
            self.marks_of[msg.rollout_id].append(msg)
        elif isinstance(msg, WeightsPublished):
            self.versions.append(msg)
        elif isinstance(msg, Rollback):
            self.rollbacks.append(msg)

    def add(self, s: ScoredRollout) -> None:
        if s.rollout.rollout_id in self.by_id:  # a redelivery stored twice: keep the first
            return
        self.scored.append(s)
        self.by_id[s.rollout.rollout_id] = s
        problem = problem_of(s)
        self.by_problem[problem].append(s)
        self.problem_of_task.setdefault(s.rollout.task_id, problem)

    def scored_per_minute(self) -> float:
        """Rollouts scored per minute, over the span of their send times."""
        if len(self.scored) < 2:
            return 0.0
        times = [s.sent_at for s in self.scored]
        span = max(times) - min(times)
        return 60.0 * (len(times) - 1) / span if span > 0 else 0.0

    def domains(self) -> list[str]:
        return sorted({s.rollout.domain for s in self.scored})

    def select(self, *, domain: str = "", tier: str = "", outcome: str = "",
               version: str = "", min_reward: float | None = None,
               max_reward: float | None = None) -> list[ScoredRollout]:
        """Scored rollouts matching every filter given ("" or None = any; the reward bounds
        are inclusive)."""
        return [s for s in self.scored
                if (not domain or s.rollout.domain == domain)
                and (not tier or str(s.rollout.tier) == tier)
                and (not outcome or s.outcome.value == outcome)
                and (not version or str(s.rollout.policy_version) == version)
                and (min_reward is None or s.reward >= min_reward)
                and (max_reward is None or s.reward <= max_reward)]


def problem_of(s: ScoredRollout) -> str:
    """What makes two groups the same problem: their domain and prompt (the prompt's
    fingerprint, blind to case and spacing). Task ids do not: a generated problem drawn
    twice gets two ids, and the scheduler numbers each issue of one (`...@17`)."""
    return f"{s.rollout.domain}:{fingerprint(s.rollout.prompt)}"


async def catch_up(bus: Any, stream: str, log: RunLog, deadline_s: float = 60.0) -> None:
    """Read into `log` what the run's stream stored after `log.last_seq`."""
    async for d in bus.read_stream(stream, start_seq=log.last_seq + 1, deadline_s=deadline_s):
        log.take(d.data, d.stream_seq)


async def follow(bus: Any, stream: str, log: RunLog, every_s: float = 2.0,
                 deadline_s: float = 10.0) -> None:
    """Keep `log` up to date with the run's stream: `catch_up` every `every_s` seconds
    (runs until cancelled). A read that fails (the run's nats-server gone, say) is said in
    `log.unreadable`, and the next read tries again: what was read stays shown."""
    import nats.errors
    import trio

    from reinforge.core.bus import BusError

    while True:
        await trio.sleep(every_s)
        try:
            await catch_up(bus, stream, log, deadline_s=deadline_s)
        except (BusError, nats.errors.Error) as exc:
            if not log.unreadable:
                log.unreadable_since = time.time()
            log.unreadable = str(exc) or type(exc).__name__
        else:
            log.unreadable = ""


def review_rows(marks: list[ReviewMark], min_score: float | None = None) -> list[dict]:
    """The review set: one row per marked rollout (its latest mark), with the prompt, the
    completion as `response` and the right reward as `score`, the shape that SFT
    (`{prompt, response}`) and the reward-model trainer (`{prompt, response, score}`) read.
    `min_score` keeps the rollouts whose right reward is at least that (answers to imitate).
    `task` is the reviewed task itself, which held-out sets read (`HeldOutConfig.review_sets`).
    """
    latest: dict[str, ReviewMark] = {}
    for mark in marks:
        latest[mark.rollout_id] = mark
    return [{"prompt": m.prompt, "response": m.completion, "score": m.corrected_reward,
             "domain": m.domain, "task_id": m.task_id, "rollout_id": m.rollout_id,
             "kind": m.kind.value, "recorded_reward": m.recorded_reward, "note": m.note,
             "reviewer": m.reviewer,
             "task": {"task_id": m.task_id.split("@", 1)[0], "domain": m.domain,
                      "tier": m.tier, "prompt": m.prompt, "spec": m.spec}}
            for m in latest.values() if min_score is None or m.corrected_reward >= min_score]
