"""The current policy version from weights messages in any order: a rollback is taken at
once, an announcement made before the learner applied it never undoes it, and the learner's
new epoch is taken whatever its numbers."""

from reinforge.core.messages import Rollback, WeightsPublished
from reinforge.core.policy_version import PolicyVersion, after


def w(version: int, epoch: int = 0) -> WeightsPublished:
    return WeightsPublished(version=version, path=f"/v{version}", epoch=epoch)


def follow(*msgs) -> list[int]:
    """The version after each message."""
    current, seen = PolicyVersion(), []
    for msg in msgs:
        current = after(current, msg) or current
        seen.append(current.version)
    return seen


def test_a_stale_announcement_after_a_rollback_is_ignored_until_the_new_epoch():
    # the learner announced v39 and v40 before it applied the rollback to v10 that the
    # evaluator sent after judging v30; its new versions (epoch 1) restart at 11
    assert follow(w(39), Rollback(to_version=10, path="/v10", reason="r"), w(40), w(11, 1),
                  w(40), w(12, 1)) == [39, 10, 10, 11, 11, 12]


def test_a_repeated_rollback_changes_nothing():
    """The same Rollback published twice (a sender's retry): the stream keeps one, but a
    core subscription delivers both; the second must not count as another rollback."""
    back = Rollback(to_version=8, path="/v8", reason="r")
    rolled = after(PolicyVersion(version=12), back)
    assert rolled == PolicyVersion(version=8, rolled_back=True)
    assert after(rolled, back) is None
    assert after(rolled, Rollback(to_version=5, path="/v5", reason="r")).version == 5


def test_within_an_epoch_only_a_higher_version_moves_on():
    assert follow(w(3), w(2), w(3), w(5)) == [3, 3, 3, 5]
    assert after(PolicyVersion(version=5), w(5)) is None  # nothing changes: no reload


def test_a_rollback_the_learner_never_applied_keeps_the_version_low_not_stuck_high():
    # a rejected rollback (its checkpoint pruned): the learner goes on in epoch 0; tasks
    # asking for v10 or later stay servable by any newer policy
    assert follow(w(40), Rollback(to_version=10, path="/v10", reason="r"), w(41), w(42)) == [
        40, 10, 10, 10]


def test_a_task_asking_past_a_rollback_in_the_epoch_it_ended_is_outlived():
    """v12 at epoch 0, two versions of staleness: tasks ask for v10. A rollback to v8 ends
    epoch 0: such a task can never be served (the scheduler issues it again); one asking
    for v8 or less still can, and so can one issued in the new epoch."""
    from reinforge.core.policy_version import outlived

    before = PolicyVersion(version=12)
    rolled = after(before, Rollback(to_version=8, path="/v8", reason="r"))
    new_epoch = after(rolled, w(9, 1))
    assert not outlived(10, 0, before)
    assert outlived(10, 0, rolled) and not outlived(8, 0, rolled)
    assert outlived(10, 0, new_epoch) and not outlived(9, 1, new_epoch)
    assert not outlived(10, 1, new_epoch)  # waits for epoch 1's v10, which will come
