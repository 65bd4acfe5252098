"""`reinforge replay` runs the replayed actor in a scratch home: the live run's files are
read, never written."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from reinforge.actors.learner import Learner, LearnerConfig
from reinforge.actors.scheduler import Scheduler, SchedulerConfig, load_state
from reinforge.core import messages as m
from reinforge.core import paths, subjects
from reinforge.core.actor import run_actor
from reinforge.core.bus import open_bus
from reinforge.core.msglog import LogRecord, LogWriter, read_log
from reinforge.core.replay import replay

pytestmark = [pytest.mark.nats, pytest.mark.slow]

ROOT = Path(__file__).parent.parent.parent
SCHEDULER = SchedulerConfig(domains={"math": 1.0}, group_size=2, max_in_flight=2, tick_s=0.1,
                            persist_every_s=0.05)


@pytest.fixture
def live_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "live-home"
    monkeypatch.setenv("REINFORGE_HOME", str(home))
    return home


def scored_group(task_id: str, rewards: list[float], *, version: int) -> list[m.ScoredRollout]:
    """What verifiers publish for one group: four tokens per sample, within the tiny vocab."""
    out = []
    for i, reward in enumerate(rewards):
        rollout = m.Rollout(
            rollout_id=f"{task_id}:{i}:1", task_id=task_id, sample_index=i, domain="math",
            tier=0, prompt="p", completion="c", prompt_ids=[5, 6, 7],
            output_ids=[10 + i + k for k in range(4)], logprobs=[-1.0] * 4,
            policy_version=version, group_size=len(rewards),
        )
        out.append(m.ScoredRollout(rollout=rollout, reward=reward, outcome=m.Outcome.FAIL))
    return out


async def publish(bus, run: str, group: list[m.ScoredRollout]) -> None:
    for s in group:
        await bus.publish_durable(subjects.scored(run, "math"), s,
                                  msg_id=f"scored:{s.rollout.rollout_id}")


async def wait_until(condition, timeout_s: float = 120.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.1)


async def record_log(bus, run: str, path: Path) -> list[LogRecord]:
    """What `reinforge log export` writes: every stored message of the run, in order."""
    with LogWriter(path) as writer:
        async for d in bus.read_stream(subjects.stream_name(run)):
            writer.write(LogRecord(subject=d.subject, headers=dict(d.headers or {}),
                                   stream_seq=d.stream_seq, timestamp=d.timestamp,
                                   payload=d.data))
    return list(read_log(path))


async def run_live_scheduler(creds, run: str) -> None:
    """The live scheduler issues as many tasks as it may (saving its state), then stops."""
    async with open_bus(creds) as bus, trio.open_nursery() as nursery:
        ctx = await nursery.start(functools.partial(run_actor, Scheduler, creds=creds, run=run,
                                                    config=SCHEDULER))
        with trio.fail_after(60):
            while await count_stored(bus, run, subjects.task(run, "*")) < SCHEDULER.max_in_flight:
                await trio.sleep(0.1)
        ctx.stop_requested.set()
    state = load_state(paths.run_dir(run) / "scheduler_state.json")
    assert state is not None and state.issued == SCHEDULER.max_in_flight


async def count_stored(bus, run: str, subject: str) -> int:
    return len([d async for d in bus.read_stream(subjects.stream_name(run),
                                                 filter_subject=subject)])


async def run_live_learner(creds, run: str, config: LearnerConfig) -> None:
    """The live learner trains version 1 and journals a group without signal; a third group
    reaches the log after it stopped (recorded, not yet trained)."""
    journal = Path(config.checkpoint_dir) / "decisions.jsonl"
    async with open_bus(creds) as bus, trio.open_nursery() as nursery:
        stream = await bus.ensure_run_stream(run)
        await nursery.start(functools.partial(run_actor, Learner, creds=creds, run=run,
                                              config=config))
        await publish(bus, run, scored_group("a", [1.0, 0.0], version=0))
        with trio.fail_after(120):
            while await bus.last_message(stream, subjects.weights(run)) is None:
                await trio.sleep(0.1)
        await publish(bus, run, scored_group("silent", [0.0, 0.0], version=1))
        await wait_until(journal.exists)
        nursery.cancel_scope.cancel()
    async with open_bus(creds) as bus:
        await publish(bus, run, scored_group("b", [0.0, 1.0], version=1))


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` by its bytes' hash (and every directory), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "directory" for p in sorted(root.rglob("*"))}


def test_replaying_a_learner_and_a_scheduler_leaves_every_file_of_the_live_run_as_it_was(
    creds, run_name, live_home, tiny_model_dir, tmp_path
):
    live_run = live_home / run_name
    # As `reinforge demo` configures it: the checkpoint directory named inside the run's.
    learner = LearnerConfig(model=str(tiny_model_dir), checkpoint_dir=str(live_run / "checkpoints"),
                            groups_per_version=1, group_size=0, learning_rate=1e-3,
                            torch_threads=1,
                            ack_wait_s=30.0)

    async def main():
        await run_live_scheduler(creds, run_name)
        await run_live_learner(creds, run_name, learner)
        async with open_bus(creds) as bus:
            records = await record_log(bus, run_name, tmp_path / "run.log")
        before = snapshot(live_run)
        learned = await replay(records, Learner, learner, idle_s=1.0, timeout_s=120,
                               workdir=tmp_path, keep_home=True)
        scheduled = await replay(records, Scheduler, SCHEDULER, idle_s=1.0, timeout_s=60,
                                 workdir=tmp_path, keep_home=True)
        return before, learned, scheduled

    before, learned, scheduled = trio.run(main)
    assert {"checkpoints/v1", "checkpoints/decisions.jsonl", "scheduler_state.json"} <= set(before)
    assert snapshot(live_run) == before
    # what they wrote went to their scratch homes: the learner resumed from a copy of the
    # live v1, trained the group the live one had not, and cleared the copied journal
    learner_run = Path(learned.scratch_home) / run_name
    assert sorted(p.name for p in (learner_run / "checkpoints").iterdir()) == ["v1", "v2"]
    assert (Path(scheduled.scratch_home) / run_name / "scheduler_state.json").is_file()


def test_replay_says_where_its_scratch_home_is_and_keeps_it_only_when_asked(
    creds, run_name, live_home, tmp_path
):
    async def record():
        await run_live_scheduler(creds, run_name)
        async with open_bus(creds) as bus:
            await record_log(bus, run_name, tmp_path / "run.log")

    trio.run(record)
    env = dict(os.environ, TMPDIR=str(tmp_path))  # REINFORGE_HOME: the live home

    def replay_scheduler(*flags: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = subprocess.run(
            [sys.executable, "-m", "reinforge", "replay", str(tmp_path / "run.log"),
             "--actor", "reinforge.actors.scheduler:Scheduler", "--set", "group_size=2",
             "--set", "max_in_flight=2", "--idle-s", "0.5", *flags],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        said = re.search(r"replay: scheduler runs in scratch home (\S+) ", out.stderr)
        assert said is not None, out.stderr
        return out, Path(said.group(1))

    kept, kept_home = replay_scheduler("--keep")
    removed, removed_home = replay_scheduler()
    # a fresh scheduler (not the live one's state) reissues exactly the recorded tasks
    assert kept.returncode == 0 and "identical" in kept.stdout, kept.stdout + kept.stderr
    assert f"scratch home (kept): {kept_home}" in kept.stdout
    assert (kept_home / run_name / "scheduler_state.json").is_file()
    assert kept_home.parent == tmp_path and removed_home.parent == tmp_path
    assert removed.returncode == 0 and not removed_home.exists()


def test_a_replayed_output_that_differs_only_in_measured_durations_is_no_difference():
    """Two runs of a verifier never time a check alike; the verdict is what is compared."""
    from reinforge.core.replay import diff_text, normalise

    recorded = scored_group("t", [1.0], version=0)[0]
    timed = msgspec.structs.replace(recorded.rollout, timings=m.Timings(verify_s=2.5, queued_s=1))
    replayed = msgspec.structs.replace(recorded, rollout=timed, verifier_id="another")
    assert diff_text(normalise(m.encode(recorded)), normalise(m.encode(replayed))) == []
    rescored = msgspec.structs.replace(replayed, reward=0.0)
    assert diff_text(normalise(m.encode(recorded)), normalise(m.encode(rescored))) == [
        "$.reward: recorded 1.0 != replayed 0.0"]
