import msgspec
import pytest

from reinforge.core import messages as m


def sample_messages() -> list:
    rollout = m.Rollout(
        rollout_id="t1:0:1", task_id="t1", sample_index=0, domain="math", tier=0,
        prompt="1+1=", completion="2", prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.1],
        policy_version=3,
    )
    return [
        m.Task(task_id="t1", domain="math", tier=0, prompt="1+1=", spec={"answer": "2"}),
        rollout,
        m.ScoredRollout(rollout=rollout, reward=1.0, outcome=m.Outcome.PASS,
                        checks=[m.Check(name="answer", passed=True)]),
        m.GroupDecision(task_id="t1", domain="math", fate=m.Fate.TRAINED, version=4,
                        signal=True, samples=8),
        m.WeightsPublished(version=3, path="/ckpt/3"),
        m.Rollback(to_version=2, path="/ckpt/2", reason="math fell below 0.3"),
        m.RunSettingsPublished(settings={"name": "r", "group_size": 4}, host="h1"),
        m.KeepVersions(versions=[2, 10], reason="the evaluator's rollback targets"),
        m.TrainStats(version=3, step=7, loss=0.5, figures={"kl": 0.01}),
        m.EvalStats(version=3, domain="math", pass_at_1=0.5, pass_at_k=0.75, k=4, n_tasks=8),
        m.ReviewMark(rollout_id="t1:0:1", task_id="t1", domain="math", kind=m.Review.EXPLOIT,
                     recorded_reward=1.0, corrected_reward=0.0, note="prints the answer key",
                     prompt="1+1=", completion="2"),
        m.Echo(seq=1, body="x"),
        m.DeadLetter(subject="a.b", reason="bad", actor_id="x", payload=b"\xff\x00"),
        m.Heartbeat(actor_id="a", actor_type="echo", host="h", pid=1, started_at=0.0),
        m.Announce(actor_id="a", actor_type="echo", host="h", pid=1, capabilities=["x"]),
        m.AttachRequest(spec="pkg.mod:Class", replicas=2),
        m.Stop(reason="done"),
        m.StatusQuery(),
        m.CommandReply(ok=True, text="started 1 x echo"),
        m.StatusReport(run="r", supervisor_pid=1, actors=[m.ActorStatus(
            heartbeat=m.Heartbeat(actor_id="a", actor_type="echo", host="h", pid=1,
                                  started_at=0.0), last_seen=1.0, flags=["late"])]),
    ]


def test_every_message_type_round_trips_through_msgpack():
    msgs = sample_messages()
    assert {type(x) for x in msgs} == set(m.MESSAGE_TYPES)
    for msg in msgs:
        assert m.decode(m.encode(msg)) == msg


def test_every_tag_carries_a_schema_version_and_tags_are_unique():
    tags = [m.tag_of(cls) for cls in m.MESSAGE_TYPES]
    assert len(set(tags)) == len(tags)
    assert all(t.rsplit("/", 1)[1].isdigit() for t in tags)


def test_a_review_mark_of_an_unknown_kind_is_refused_naming_the_field():
    data = msgspec.msgpack.encode({
        "type": "review/1", "rollout_id": "r", "task_id": "t", "domain": "math",
        "kind": "looks_odd", "recorded_reward": 1.0, "corrected_reward": 0.0})
    with pytest.raises(m.MessageError, match=r"\$\.kind"):
        m.decode(data)


def test_a_missing_field_is_named_in_the_error():
    data = msgspec.msgpack.encode({"type": "task/1", "task_id": "x", "domain": "math", "tier": 0})
    with pytest.raises(m.MessageError, match=r"prompt"):
        m.decode(data)


def test_a_wrongly_typed_nested_field_is_located():
    bad = msgspec.msgpack.encode({
        "type": "scored/1", "reward": 1.0, "outcome": "pass",
        "rollout": {"rollout_id": "r", "task_id": "t", "sample_index": "zero", "domain": "d",
                    "tier": 0, "prompt": "", "completion": ""},
    })
    with pytest.raises(m.MessageError, match=r"\$\.rollout\.sample_index"):
        m.decode(bad)


def test_unknown_tags_and_garbage_are_refused_with_a_reason():
    with pytest.raises(m.MessageError, match="Invalid value 'nope/1'"):
        m.decode(msgspec.msgpack.encode({"type": "nope/1"}))
    with pytest.raises(m.MessageError, match="undecodable"):
        m.decode(b"\xc1\xc1\xc1")


def test_an_unknown_outcome_is_refused():
    rollout = sample_messages()[1]
    raw = msgspec.to_builtins(m.ScoredRollout(rollout=rollout, reward=0.0, outcome=m.Outcome.FAIL))
    raw["outcome"] = "sort-of"
    with pytest.raises(m.MessageError, match="outcome"):
        m.decode(msgspec.msgpack.encode(raw))


def test_a_newer_writer_with_an_extra_trailing_field_is_still_readable():
    class TaskV1Plus(msgspec.Struct, frozen=True, kw_only=True, tag="task/1", tag_field="type"):
        task_id: str
        domain: str
        tier: int
        prompt: str
        a_future_field: int = 7

    data = msgspec.msgpack.encode(TaskV1Plus(task_id="t", domain="d", tier=1, prompt="p"))
    got = m.decode(data)
    assert isinstance(got, m.Task)
    assert (got.task_id, got.domain, got.tier, got.prompt) == ("t", "d", 1, "p")


def _episode_rollout(**kw) -> dict:
    """A multi-turn rollout as builtins: 2 policy tokens, 2 of the environment, 1 policy."""
    r = m.Rollout(rollout_id="e:0:1", task_id="e", sample_index=0, domain="terminal", tier=0,
                  prompt="p", completion="c", prompt_ids=[1], output_ids=[5, 6, 7, 8, 9],
                  logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], loss_mask=[1, 1, 0, 0, 1],
                  policy_version=3, turns=[m.Turn(start=0, end=2, policy_version=3),
                         m.Turn(start=4, end=5, policy_version=4)])
    return {**msgspec.to_builtins(r), **kw}


def test_a_multi_turn_rollout_carries_its_turns_and_their_versions():
    r = m.decode(msgspec.msgpack.encode(_episode_rollout()))
    assert [(t.start, t.end, t.policy_version) for t in r.turns] == [(0, 2, 3), (4, 5, 4)]
    assert r.versions() == [3, 4] and r.policy_version == 3


def test_a_partial_rollout_is_labelled_with_its_oldest_turn_and_a_single_turn_with_its_own():
    with pytest.raises(m.MessageError, match=r"oldest turn's \(v3\), got v4"):
        m.decode(msgspec.msgpack.encode(_episode_rollout(policy_version=4)))
    single = m.Rollout(rollout_id="s:0:1", task_id="s", sample_index=0, domain="math", tier=0,
                       prompt="p", completion="c", policy_version=7)
    assert single.versions() == [7]


@pytest.mark.parametrize("turns, why", [
    ([{"start": 0, "end": 2, "policy_version": 3}], "cover exactly"),  # misses token 4
    ([{"start": 0, "end": 3, "policy_version": 3}, {"start": 4, "end": 5, "policy_version": 3}],
     "cover exactly"),  # claims an environment token
    ([{"start": 4, "end": 5, "policy_version": 3}, {"start": 0, "end": 2, "policy_version": 3}],
     "out of order"),
    ([{"start": 4, "end": 9, "policy_version": 3}], "outside"),
])
def test_turns_that_disagree_with_the_loss_mask_are_refused_with_the_reason(turns, why):
    with pytest.raises(m.MessageError, match=why):
        m.decode(msgspec.msgpack.encode(_episode_rollout(turns=turns)))
