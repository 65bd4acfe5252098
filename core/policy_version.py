"""Which policy version is current, from the weights subject's messages in any order.

A `Rollback` sends the policy back to `to_version`, and the learner then numbers its new
versions from there again. Announcements it made before it applied the rollback can still
arrive after the rollback (the evaluator judged an older version while the learner moved
on), and their numbers are higher than any new version's for a while: taken at their word,
they would put the policy ahead of what exists, and tasks asking for such a version would
wait for it forever. So `WeightsPublished.epoch` counts the rollbacks the learner had
applied: a newer epoch is taken whatever its number; after a rollback, announcements of the
epoch it ended are ignored; within an epoch, only a higher number moves the version on.
"""

from __future__ import annotations

import msgspec

from reinforge.core.messages import Rollback, WeightsPublished


class PolicyVersion(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 0
    epoch: int = 0
    """The newest `WeightsPublished.epoch` taken."""
    rolled_back: bool = False
    """A Rollback came after the last announcement taken: the epoch it ended is over."""


def outlived(min_version: int, epoch: int, current: PolicyVersion) -> bool:
    """Whether a task asking for `min_version` of `epoch` can never be served: a rollback
    ended its epoch before the policy got there (the scheduler has issued it again)."""
    ended = epoch < current.epoch or (epoch == current.epoch and current.rolled_back)
    return ended and min_version > current.version


def after(current: PolicyVersion, msg: WeightsPublished | Rollback) -> PolicyVersion | None:
    """The current version once `msg` arrived, or None when `msg` changes nothing (an older
    or a repeated announcement)."""
    if isinstance(msg, Rollback):
        if current.rolled_back and current.version == msg.to_version:
            return None  # a repeat: JetStream stores one, but core subscribers get both
        return PolicyVersion(version=msg.to_version, epoch=current.epoch, rolled_back=True)
    newer_epoch = msg.epoch > current.epoch
    if newer_epoch or (msg.epoch == current.epoch and not current.rolled_back
                       and msg.version > current.version):
        return PolicyVersion(version=msg.version, epoch=msg.epoch)
    return None
