"""Every message that crosses the bus: a closed, tagged union of frozen msgspec Structs.

Wire format: msgpack. Each Struct carries a tag of the form ``"<kind>/<schema>"``
(e.g. ``"rollout/1"``) in the field ``type``; one reusable typed decoder turns bytes
back into exactly one of these classes or raises `MessageError` naming the field.

Schema evolution (msgspec's rules, docs/schema-evolution.rst):
  * A new field is added at the END of a Struct and has a default; old readers
    ignore it, new readers fill the default when it is absent.
  * A field is never removed, renamed, re-typed or re-ordered within one schema;
    nor does a default change meaning.
  * Anything else is a new schema: a new class with tag ``"<kind>/<n+1>"``. Both
    classes stay in `Message` until no log that holds the old tag is replayed.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Union

import msgspec


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every bus message. `sent_at` is the sender's wall clock (s since epoch)."""

    sent_at: float = msgspec.field(default_factory=time.time)


class Outcome(str, enum.Enum):
    """How a verification ended. Only the candidate's own results carry a reward;
    `infra_error` means our infrastructure failed and the sample is masked, never 0."""

    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    ERROR = "error"
    INFRA_ERROR = "infra_error"


# ----------------------------------------------------------------------------- data plane


class Task(_Msg, frozen=True, tag="task/1"):
    """One prompt to be sampled `group_size` times (one GRPO group)."""

    task_id: str
    domain: str
    tier: int
    prompt: str
    spec: dict[str, Any] = {}  # domain-owned, msgpack-safe; validated by the domain
    group_size: int = 1
    attempt: int = 1  # lease attempt, for retries after a dead sampler
    min_version: int = 0  # oldest policy version allowed to answer it
    purpose: str = "train"  # "train" | "eval"
    epoch: int = 0
    """The learner's epoch (`WeightsPublished.epoch`) `min_version` is numbered in: after a
    rollback past it, the task can never be served (`core/policy_version.py`, `outlived`)."""


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    queued_s: float = 0.0
    generate_s: float = 0.0
    verify_s: float = 0.0


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One of the policy's turns in a multi-turn rollout: output tokens [start, end)."""

    start: int
    end: int
    policy_version: int
    """The version that generated this turn (a later turn may come from a later one)."""


class Rollout(_Msg, frozen=True, tag="rollout/1"):
    """One sample of one task, with what the learner needs to compute the PPO ratio."""

    rollout_id: str  # deterministic: f"{task_id}:{sample_index}:{attempt}"
    task_id: str
    sample_index: int
    domain: str
    tier: int
    prompt: str
    completion: str
    prompt_ids: list[int] = []
    output_ids: list[int] = []
    logprobs: list[float] = []  # behaviour logprobs of output_ids, same length
    policy_version: int = 0
    """The version that generated it; for a multi-turn rollout whose turns span a weights
    update (a partial rollout), the oldest of its turns' versions."""
    finish_reason: str = ""
    spec: dict[str, Any] = {}
    group_size: int = 1
    timings: Timings = Timings()
    purpose: str = "train"
    loss_mask: list[int] = []  # per output token: 1 = the policy's, 0 = environment text
    turns: list[Turn] = []
    """Multi-turn only: the policy's turns in order; exactly the tokens whose loss_mask is 1."""
    tool_calls: int = 0
    """Tool episodes: the tool calls made, and those malformed (answered with the error)."""
    tool_call_errors: int = 0

    def __post_init__(self) -> None:
        if self.turns:
            check_turns(self.turns, self.loss_mask, len(self.output_ids))
            oldest = min(t.policy_version for t in self.turns)
            if self.policy_version != oldest:
                raise ValueError(f"a multi-turn rollout's policy_version is its oldest turn's "
                                 f"(v{oldest}), got v{self.policy_version}")

    def segments(self) -> list[tuple[int, int]]:
        """(policy_version, policy tokens) per segment, in order: one per turn, or one for a
        single-turn rollout."""
        return ([(t.policy_version, t.end - t.start) for t in self.turns]
                or [(self.policy_version, len(self.output_ids))])

    def versions(self) -> list[int]:
        """The versions that generated it, segment by segment, in order."""
        return [v for v, _ in self.segments()]


def check_turns(turns: list[Turn], loss_mask: list[int], n_tokens: int) -> None:
    """Raise ValueError unless `turns` are ordered, disjoint, inside the output, and cover
    exactly its policy tokens (loss_mask 1)."""
    if len(loss_mask) != n_tokens:
        raise ValueError(f"turns need a loss_mask per output token ({len(loss_mask)} for "
                         f"{n_tokens} tokens)")
    policy = [0] * n_tokens
    last = 0
    for t in turns:
        if not last <= t.start < t.end <= n_tokens:
            raise ValueError(f"turn [{t.start}, {t.end}) is out of order or outside the "
                             f"{n_tokens} output tokens")
        policy[t.start : t.end] = [1] * (t.end - t.start)
        last = t.end
    if policy != list(loss_mask):
        raise ValueError("turns must cover exactly the tokens whose loss_mask is 1")


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One named check inside a verification (a domain's `Verdict` carries them)."""

    name: str
    """What was checked, e.g. `answer_matches` or `field:revenue_2023`."""
    passed: bool
    detail: str = ""
    """Human-readable evidence: expected vs got, the failing assertion, ..."""


class ScoredRollout(_Msg, frozen=True, tag="scored/1"):
    rollout: Rollout
    reward: float
    outcome: Outcome
    checks: list[Check] = []
    reason: str = ""
    verifier_id: str = ""
    output: str = ""
    """What the candidate printed where it ran (a sandboxed program's output, its end),
    for a person reading the rollout; never part of the reward."""


class Fate(str, enum.Enum):
    """What the learner did with a task's group. ACCEPTED is provisional (the group is in
    the batch of the next update; TRAINED or a drop follows); the others are final."""

    ACCEPTED = "accepted"
    TRAINED = "trained"
    STALE = "stale"
    NO_SIGNAL = "no_signal"
    ROLLED_BACK = "rolled_back"
    INCOMPLETE = "incomplete"


class GroupDecision(_Msg, frozen=True, tag="group-decision/1"):
    """The learner's word on one task's group: the one source of its fate, which the
    scheduler's issue budget follows (it never re-derives signal or staleness itself)."""

    task_id: str
    domain: str
    fate: Fate
    version: int
    """TRAINED: the version its update made; otherwise the learner's version then."""
    signal: bool | None = None
    """Whether two of its valid rewards differ; None when not known (a decision sent again
    for a task decided before a restart)."""
    samples: int = 0
    tokens: int = 0
    """Output tokens of its samples (wasted when it has no signal)."""


class WeightsPublished(_Msg, frozen=True, tag="weights/1"):
    version: int
    path: str
    step: int = 0
    epoch: int = 0
    """The rollbacks the learner had applied: its numbers restart after each, so a version
    of a newer epoch supersedes any of an older one (`core/policy_version.py`)."""
    store: str = ""
    """The object store (`core/weights.py`) that also holds the version's files, for hosts
    where `path` is not on disk; "" = the path only (a shared disk)."""


class Rollback(_Msg, frozen=True, tag="rollback/1"):
    """Go back to a known good version (from the evaluator's regression guard)."""

    to_version: int
    path: str
    reason: str
    store: str = ""
    """As WeightsPublished.store."""
    from_epoch: int = 0
    """The epoch (WeightsPublished.epoch) of the version judged bad: past a rollback the
    learner reuses version numbers, and a second fall of "version 50", found the same way
    (seeded evaluations read alike), is a second rollback, not a redelivery of the first."""


class RunSettingsPublished(_Msg, frozen=True, tag="run-settings/1"):
    """The run's `[run]` settings, stored by `reinforge up` when it starts the run: an
    actor attached on another machine (`reinforge attach`) joins with them. The newest one
    stands."""

    settings: dict[str, Any]
    """`RunSettings` (`core/cluster.py`) as plain data."""
    host: str = ""


class KeepVersions(_Msg, frozen=True, tag="keep-versions/1"):
    """The versions the evaluator may roll back to (its last good version, each domain's
    gold peak): the learner never prunes their checkpoints. The newest one stands."""

    versions: list[int]
    reason: str = ""


class TrainStats(_Msg, frozen=True, tag="train-stats/1"):
    version: int
    step: int
    loss: float
    epoch: int = 0
    """The learner's epoch (see `WeightsPublished.epoch`): version and step restart after a
    rollback, so (epoch, version, step) names a step once."""
    figures: dict[str, float] = {}
    # Over the step's policy tokens (loss mask 1): |learner logprob - behaviour logprob|.
    # None: not reported (a learner from before these fields).
    logp_mismatch_mean_nats: float | None = None
    logp_mismatch_max_nats: float | None = None
    logp_mismatch_share_over: float | None = None
    """Share of policy tokens whose gap exceeds `logp_mismatch_threshold_nats`."""
    logp_mismatch_threshold_nats: float | None = None
    # Truncated importance sampling; None: TIS off (or not reported).
    tis_weight_mean: float | None = None
    """Mean TIS weight min(exp(logp_learner - logp_behaviour), cap) over policy tokens."""
    tis_capped_share: float | None = None
    """Share of policy tokens whose TIS weight was truncated at the cap."""


TRAIN_FIGURE_FIELDS = tuple(
    f for f in TrainStats.__struct_fields__
    if f not in ("sent_at", "version", "step", "loss", "figures", "epoch")
)
"""The figures of a step that have a TrainStats field of their own (the rest go in
`figures`)."""


class EvalStats(_Msg, frozen=True, tag="eval-stats/1"):
    version: int
    domain: str
    pass_at_1: float
    pass_at_k: float
    k: int
    n_tasks: int
    figures: dict[str, float] = {}
    epoch: int = 0
    """The epoch of the evaluated weights (`WeightsPublished.epoch`): a version number
    comes back after a rollback, so (epoch, version, domain) names an evaluation once."""


class Review(str, enum.Enum):
    """What a person found wrong with a scored rollout."""

    WRONG_REWARD = "wrong_reward"  # the verifier's reward is wrong: `corrected_reward` is right
    EXPLOIT = "exploit"  # the rollout games its verifier (its reward is not earned)


class ReviewMark(_Msg, frozen=True, tag="review/1"):
    """A person's mark on one scored rollout (`reinforge ui --review`). It carries the
    prompt and the completion, so the review set exported from a log
    (`reinforge log reviews`) needs nothing else, even once the rollout is trimmed."""

    rollout_id: str
    task_id: str
    domain: str
    kind: Review
    recorded_reward: float
    corrected_reward: float
    """The reward the rollout should have had (for an exploit, what it really earns)."""
    tier: int = 0
    policy_version: int = 0
    note: str = ""
    reviewer: str = ""
    prompt: str = ""
    completion: str = ""
    spec: dict[str, Any] = {}
    """The task's spec (as the rollout carried it): with the prompt, the task itself, so a
    reviewed problem can join a held-out set."""


class Echo(_Msg, frozen=True, tag="echo/1"):
    """Payload of the trivial echo actors (smoke tests, benchmarks)."""

    seq: int
    body: str = ""


class DeadLetter(_Msg, frozen=True, tag="dead-letter/1"):
    """A message that could not be handled, with why. `payload` is the raw bytes."""

    subject: str
    reason: str
    actor_id: str
    payload: bytes = b""
    stream_seq: int = 0
    deliveries: int = 0


# ----------------------------------------------------------------------------- control plane


class ProcessFigures(msgspec.Struct, frozen=True, kw_only=True):
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    num_threads: int = 0


class Heartbeat(_Msg, frozen=True, tag="heartbeat/1"):
    actor_id: str
    actor_type: str
    host: str
    pid: int
    started_at: float
    msgs_in: int = 0
    msgs_out: int = 0
    dead_letters: int = 0
    process: ProcessFigures = ProcessFigures()
    waiting_on: str = ""  # what the actor is blocked on right now ("" = busy or idle)
    waiting_since: float = 0.0
    wait_deadline_s: float = 0.0  # 0 = no deadline
    state: str = "running"  # "starting" | "running" | "draining"
    capabilities: list[str] = []
    figures: dict[str, float] = {}


class Announce(_Msg, frozen=True, tag="announce/1"):
    """An actor joined the run (`joined`) or left it (`left`)."""

    actor_id: str
    actor_type: str
    host: str
    pid: int
    capabilities: list[str] = []
    event: str = "joined"


class AttachRequest(_Msg, frozen=True, tag="attach/1"):
    """Ask the run's supervisor to start replicas of an actor class."""

    spec: str  # "pkg.module:Class", "path/file.py:Class" or an entry-point name
    replicas: int = 1
    overrides: dict[str, str] = {}


class Stop(_Msg, frozen=True, tag="stop/1"):
    reason: str = ""
    actor_id: str = ""  # "" = every actor of the run


class StatusQuery(_Msg, frozen=True, tag="status-query/1"):
    """Ask a run's supervisor for its table of actors."""


class ActorStatus(msgspec.Struct, frozen=True, kw_only=True):
    heartbeat: Heartbeat
    last_seen: float  # wall clock of the newest heartbeat
    supervised: bool = False  # started by this run's supervisor (else joined from elsewhere)
    restarts: int = 0
    flags: list[str] = []  # watchdog findings, e.g. "no heartbeat for 9 s"


class StatusReport(_Msg, frozen=True, tag="status/1"):
    run: str
    supervisor_pid: int
    actors: list[ActorStatus] = []
    alerts: list[str] = []


class CommandReply(_Msg, frozen=True, tag="reply/1"):
    """The answer to a control request (e.g. attach): did it work, and what happened."""

    ok: bool
    text: str = ""


Message = Union[
    Task,
    Rollout,
    ScoredRollout,
    GroupDecision,
    WeightsPublished,
    Rollback,
    RunSettingsPublished,
    KeepVersions,
    TrainStats,
    EvalStats,
    ReviewMark,
    Echo,
    DeadLetter,
    Heartbeat,
    Announce,
    AttachRequest,
    Stop,
    StatusQuery,
    StatusReport,
    CommandReply,
]

MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]


class MessageError(ValueError):
    """A payload that is not a well-formed message; the text names the field."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raise `MessageError` saying what is wrong and where."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise MessageError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"undecodable payload ({len(data)} bytes): {exc}") from None


def rollout_id(task_id: str, sample_index: int, attempt: int) -> str:
    """A rollout's deterministic id: a retried publish of the same sample is deduplicated."""
    return f"{task_id}:{sample_index}:{attempt}"


def split_rollout_id(rollout_id: str) -> tuple[str, int, int]:
    """f"{task_id}:{sample_index}:{attempt}" -> (task_id, sample_index, attempt)."""
    task_id, i, attempt = rollout_id.rsplit(":", 2)
    return task_id, int(i), int(attempt)


def tag_of(cls: type) -> str:
    return cls.__struct_config__.tag  # type: ignore[attr-defined]


def to_builtins(msg: _Msg) -> dict[str, Any]:
    """A JSON-friendly dict (bytes become base64), for `log show --json` and reports."""
    return msgspec.to_builtins(msg)
