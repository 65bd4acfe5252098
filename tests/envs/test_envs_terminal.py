"""The terminal domain: reference transcripts pass, the final state is what counts, and
hidden checks can't be edited, printed past or outlived — local runner and, marked
`podman`, the real sandbox."""

import contextlib
import json
import random

import pytest
import trio
from reinforge.envs.tasksets import TaskFileError
from reinforge.envs.domains.terminal import TerminalDomain, parse_commands

FIX_ROW = {
    "instruction": "calc.py has a bug: fix it so that test_calc.py passes.",
    "files": {
        "calc.py": "def add(a, b):\n    return a - b\n",
        "test_calc.py": "from calc import add\nassert add(2, 3) == 5\nprint('ok')\n",
    },
    "checks": [
        {
            "kind": "python_tests",
            "path": "calc.py",
            "entry_point": "add",
            "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
            "    assert candidate(10, -4) == 6\n",
        }
    ],
}
FIXED = "$ sed -i 's/a - b/a + b/' calc.py\n$ python3 test_calc.py\n$ exit"


def run(with_runner, fn):
    async def main():
        async with with_runner() as runner:
            return await fn(TerminalDomain().with_runner(runner))

    return trio.run(main)


def test_reference_transcripts_pass_on_every_tier(with_runner):
    """One task of each kind a tier has (the instruction with its names taken out: each
    bug of tier 2, each of tier 3's reductions, ...)."""
    d0 = TerminalDomain()
    kinds = {}
    for tier in range(4):
        for s in range(300):
            task = d0.sample_task(random.Random(s), tier)
            words = task.spec["instruction"].split()
            kinds.setdefault((tier, words[0] if tier == 2 else " ".join(words[:4])), task)
    tasks = list(kinds.values())
    assert len({k for k in kinds if k[0] == 2}) == 6 and len(tasks) == 11

    async def go(d):
        return [await d.verify(t, t.reference) for t in tasks]

    for task, v in zip(tasks, run(with_runner, go)):
        assert (v.reward, v.outcome) == (1.0, "pass"), (task.prompt, task.reference, v)


def test_an_episode_steps_through_commands_and_checks_the_final_state(with_runner):
    task = TerminalDomain().task_from_row(FIX_ROW, where="t:1")

    async def go(d):
        ep = d.start_episode(task)
        first = await ep.step("$ cat calc.py")
        second = await ep.step("$ sed -i 's/a - b/a + b/' calc.py")
        third = await ep.step("$ python3 test_calc.py")
        last = await ep.step("$ exit")
        return first, second, third, last, await ep.finish()

    first, second, third, last, verdict = run(with_runner, go)
    assert first == ("def add(a, b):\n    return a - b\n[exit 0]", False)
    assert second == ("[exit 0]", False)
    assert third == ("ok\n[exit 0]", False)
    assert last == ("", True)
    assert (verdict.reward, verdict.outcome) == (1.0, "pass")


CHEATS = {
    "does nothing": "$ exit",
    "edits the visible tests instead of the code": "$ echo 'print(\"ok\")' > test_calc.py\n"
    "$ python3 test_calc.py",
    "prints a pass": "$ echo PASS; echo 'all checks passed'; echo '{\"status\": \"pass\"}'",
    "makes the module exit 0 on import": "$ printf 'import os\\nos._exit(0)\\n' > calc.py",
    "returns an object equal to everything": (
        "$ printf 'class A:\\n    def __eq__(s, o):\\n        return True\\n"
        "def add(a, b):\\n    return A()\\n' > calc.py"
    ),
    "hunts for the hidden checks": "$ grep -rs 'candidate(' / > found.txt; cat found.txt",
}


@pytest.mark.slow
def test_cheating_transcripts_score_zero(with_runner):
    task = TerminalDomain().task_from_row(FIX_ROW, where="t:1")

    async def go(d):
        return [await d.verify(task, c) for c in CHEATS.values()]

    for name, v in zip(CHEATS, run(with_runner, go)):
        assert v.reward == 0.0 and v.outcome == "fail", (name, v)


@pytest.mark.podman
def test_leftover_processes_are_gone_before_the_checks_in_the_sandbox(sandbox_runner_only):
    # A detached helper creates late.txt 1 s after the commands end; the first check takes
    # 1.5 s, so the second would see late.txt if the helper had survived.
    row = {
        "instruction": "leave nothing running",
        "files": {"m.py": "def f():\n    return 1\n"},
        "checks": [
            {
                "kind": "python_tests",
                "path": "m.py",
                "entry_point": "f",
                "test": "def check(candidate):\n    import time\n    time.sleep(1.5)\n"
                "    assert candidate() == 1\n",
            },
            {"kind": "file_absent", "path": "late.txt"},
        ],
    }
    task = TerminalDomain().task_from_row(row, where="t:1")
    helper = "$ setsid sh -c 'sleep 1; echo x > late.txt' > /dev/null 2>&1 < /dev/null &"

    async def go(d):
        return await d.verify(task, helper + "\n$ sleep 0.1")

    v = run(sandbox_runner_only, go)
    assert (v.reward, v.outcome) == (1.0, "pass"), v


def test_parse_commands_reads_dollar_lines_and_stops_at_exit():
    transcript = "$ ls\nfile.txt\n$ cat file.txt\nhello\n$ exit\n$ rm -rf x"
    assert parse_commands(transcript, 8) == ["ls", "cat file.txt"]
    assert parse_commands("ls\npwd\n", 8) == ["ls", "pwd"]
    assert parse_commands("$ a\n$ b\n$ c", 2) == ["a", "b"]


def test_no_runner_is_an_infra_error():
    task = TerminalDomain().task_from_row(FIX_ROW, where="t:1")
    assert trio.run(TerminalDomain().verify, task, FIXED).outcome == "infra_error"


@pytest.mark.parametrize(
    "row, message",
    [
        ({"instruction": "x", "checks": []}, "at least one check"),
        (
            {"instruction": "x", "checks": [{"kind": "file_exists", "path": "/etc/passwd"}]},
            "must be relative",
        ),
        ({"instruction": "x", "checks": [{"kind": "file_equals", "path": "a"}]}, "needs `content`"),
        ({"instruction": "x", "checks": [{"kind": "teleport", "path": "a"}]}, "kind"),
        ({"checks": [{"kind": "file_exists", "path": "a"}]}, "instruction"),
    ],
)
def test_malformed_rows_are_refused_with_their_line_number(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(FIX_ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=f"bad.jsonl:2: .*{message}"):
        TerminalDomain().load_tasks(path)


# ----------------------------------------------------------------- episodes in one session

COUNT_ROW = {
    "instruction": "append the numbers 1 to 10 to log.txt, one per command",
    "checks": [{"kind": "file_equals", "path": "log.txt",
                "content": "\n".join(str(i) for i in range(1, 11))}],
    "max_turns": 12,
}


def _episode(make_runner, row, steps, *, config=None, during=None, replay=False):
    from reinforge.envs.domains.terminal import TerminalConfig
    from reinforge.envs.sandbox.runner import WithoutSessions

    async def main():
        async with make_runner() as runner:
            d = TerminalDomain(config=config or TerminalConfig()).with_runner(
                WithoutSessions(runner) if replay else runner)
            ep = d.start_episode(d.task_from_row(row, where="t:1"))
            obs = []
            for i, cmd in enumerate(steps):
                if during is not None and i == during[0]:
                    during[1](ep)
                obs.append(await ep.step(cmd))
                if obs[-1][1]:
                    break
            verdict = await ep.finish()
            return obs, verdict, getattr(runner, "statistics", lambda: None)()

    return trio.run(main)


@pytest.mark.podman
def test_a_ten_turn_episode_runs_ten_commands_in_one_session_not_a_replay_of_each_prefix(
        sandbox_runner_only):
    steps = [f"$ echo {i} >> log.txt" for i in range(1, 11)]
    obs, verdict, stats = _episode(sandbox_runner_only, COUNT_ROW, steps)
    assert [o for o, _ in obs] == ["[exit 0]"] * 10
    assert (verdict.reward, verdict.outcome) == (1.0, "pass"), verdict
    # one session, ten steps and the final check; no job, no replay
    assert (stats.sessions, stats.session_requests, stats.jobs) == (1, 11, 0)
    obs, verdict, stats = _episode(sandbox_runner_only, COUNT_ROW, steps, replay=True)
    assert (verdict.reward, stats.sessions) == (1.0, 0)
    assert stats.jobs == 11  # a job per step, each replaying every command before it


@pytest.mark.podman
def test_a_hanging_and_a_flooding_command_each_end_their_step_and_the_episode_goes_on(
        sandbox_runner_only):
    from reinforge.envs.domains.terminal import TerminalConfig

    steps = ["$ sleep 60", "$ yes | head -c 5000000", "$ echo 1 > log.txt"]
    row = {**COUNT_ROW, "checks": [{"kind": "file_equals", "path": "log.txt", "content": "1"}]}
    obs, verdict, stats = _episode(sandbox_runner_only, row, steps,
                                   config=TerminalConfig(command_timeout_s=1.0))
    assert obs[0] == ("[exit timeout]", False)
    assert obs[1][0].endswith("[output truncated][exit 0]") and len(obs[1][0]) < 2100
    assert obs[2] == ("[exit 0]", False)
    assert (verdict.reward, verdict.outcome) == (1.0, "pass")
    assert (stats.sessions, stats.sandboxes_replaced) == (1, 0)


@pytest.mark.podman
def test_an_episode_that_kills_its_own_session_ends_there_and_scores_zero(
        sandbox_runner_only):
    steps = ["$ echo 1 > log.txt", "$ kill -9 -1", "$ echo never"]
    obs, verdict, stats = _episode(sandbox_runner_only, COUNT_ROW, steps)
    assert obs[0] == ("[exit 0]", False)
    assert obs[1][1] and obs[1][0].startswith("[the shell session ended: ")
    assert len(obs) == 2  # the episode ended there
    assert (verdict.reward, verdict.outcome) == (0.0, "error"), verdict


@pytest.mark.podman
def test_a_sandbox_lost_mid_episode_is_an_infrastructure_error_not_a_zero(sandbox_runner_only):
    steps = ["$ echo 1 > log.txt", "$ echo 2 >> log.txt"]
    kill_container = (1, lambda ep: ep._session.raw.box.kill())
    obs, verdict, stats = _episode(sandbox_runner_only, COUNT_ROW, steps, during=kill_container)
    assert obs[1][1] and "died" in obs[1][0]
    assert verdict.outcome == "infra_error", verdict


class SlowToStart:
    """The real sandbox runner, its sessions slow to start (a loaded machine): wraps it
    to test the episode's time accounting above it."""

    def __init__(self, runner, delay_s: float) -> None:
        self.runner, self.delay_s = runner, delay_s
        self.name, self.run, self.check = runner.name, runner.run, runner.check

    @contextlib.asynccontextmanager
    async def session(self, argv, config):
        await trio.sleep(self.delay_s)
        async with self.runner.session(argv, config) as session:
            yield session


@pytest.mark.podman
def test_a_sessions_start_up_is_not_counted_against_the_episodes_time(sandbox_runner_only):
    """CI once ended an episode at its first step (`sleep 1` under a 1.5 s limit): the
    session's start-up on a loaded machine was counted as the episode's time."""
    from reinforge.envs.domains.terminal import TerminalConfig

    @contextlib.asynccontextmanager
    async def slow_runner():
        async with sandbox_runner_only() as runner:
            yield SlowToStart(runner, delay_s=2.0)

    obs, verdict, _ = _episode(slow_runner, COUNT_ROW, ["$ echo 1 > log.txt", "$ sleep 2",
                                                        "$ echo never"],
                               config=TerminalConfig(episode_time_s=1.5))
    assert [done for _, done in obs] == [False, True]
    assert obs[1][0].endswith("\n[episode time limit of 1.5 s reached]")


@pytest.mark.parametrize("limit, steps, crossed", [
    ({"episode_output_chars": 2500}, ["$ seq 1 400", "$ seq 1 400", "$ echo never"],
     "[episode output limit of 2500 characters reached]"),
    ({"episode_time_s": 1.5}, ["$ sleep 1", "$ sleep 1", "$ echo never"],
     "[episode time limit of 1.5 s reached]"),
])
def test_the_step_that_crosses_an_episode_limit_ends_the_episode_and_says_so(
        with_runner, limit, steps, crossed):
    from reinforge.envs.domains.terminal import TerminalConfig

    obs, verdict, _ = _episode(with_runner, COUNT_ROW, steps, config=TerminalConfig(**limit))
    assert [done for _, done in obs] == [False, True]  # the third command never runs
    assert obs[1][0].endswith("\n" + crossed)
    assert verdict.outcome == "fail"
