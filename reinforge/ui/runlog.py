"""A run's messages as the UI reads them: scored rollouts, dead letters, by id and task.

Built from a message log file (`reinforge log export`): every record decoded with the one
typed decoder; records that do not decode are counted, never shown as anything else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from reinforge.core.messages import DeadLetter, MessageError, ScoredRollout, decode
from reinforge.core.msglog import read_log


@dataclass
class RunLog:
    scored: list[ScoredRollout] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    undecodable: int = 0
    by_id: dict[str, ScoredRollout] = field(default_factory=dict)
    by_task: dict[str, list[ScoredRollout]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def from_file(cls, path: str | Path) -> RunLog:
        log = cls()
        for record in read_log(path):
            try:
                msg = decode(record.payload)
            except MessageError:
                log.undecodable += 1
                continue
            if isinstance(msg, ScoredRollout):
                log.add(msg)
            elif isinstance(msg, DeadLetter):
                log.dead_letters.append(msg)
        return log

    def add(self, s: ScoredRollout) -> None:
        if s.rollout.rollout_id in self.by_id:  # a redelivery stored twice: keep the first
            return
        self.scored.append(s)
        self.by_id[s.rollout.rollout_id] = s
        self.by_task[s.rollout.task_id].append(s)

    def domains(self) -> list[str]:
        return sorted({s.rollout.domain for s in self.scored})

    def select(self, *, domain: str = "", tier: str = "", outcome: str = "",
               version: str = "") -> list[ScoredRollout]:
        """Scored rollouts matching every filter given ("" = any)."""
        return [s for s in self.scored
                if (not domain or s.rollout.domain == domain)
                and (not tier or str(s.rollout.tier) == tier)
                and (not outcome or s.outcome.value == outcome)
                and (not version or str(s.rollout.policy_version) == version)]
