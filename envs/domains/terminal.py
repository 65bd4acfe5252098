"""Terminal: multi-turn tasks in a sandboxed shell; the final state is checked.

The policy calls the `bash` tool, one command per turn (`envs/tools.py`: tool calls in the
model's own chat format), and sees each one's output; when it answers without a call, runs
`exit` or runs out of turns, the final state is checked: files created with
the right content, files moved or deleted, unit tests passing after a fix. The checks
are hidden: they travel to `terminal_driver.py` on its stdin and live only in its
(non-dumpable) memory; test files the agent can see may be edited freely, the
hidden copy is what runs.

On the Podman pool an episode runs in one sandbox session (`envs/sandbox/session.py`): the
driver starts once and each step is one command in the live directory, so n turns cost n
commands, not the 1 + 2 + ... + n of a replay. `verify` of a finished transcript replays its
commands once in a fresh sandbox (the state is a pure function of the command list, so a
crash loses nothing); commands whose output is nondeterministic (dates, random numbers) may
show different output on replay. Runners without sessions replay every step.

Completion formats for `verify`: a tool episode's transcript (the commands are the `bash`
calls of its turns, read by the same parser as the live episode); the policy's tool calls
written in one go; or one command per line, each starting with `$ ` (lines without it are
ignored if any line has it, e.g. echoed observations), `exit` ending.

JSONL row schema (`TerminalRow`):

    {"instruction": "Create hello.txt containing hello.",
     "files": {"notes.txt": "..."},                 # optional, the starting directory
     "checks": [{"kind": "file_equals", "path": "hello.txt", "content": "hello"},
                {"kind": "file_exists" | "file_absent", "path": "..."},
                {"kind": "python_tests", "path": "calc.py", "entry_point": "add",
                 "test": "def check(candidate): ..."}],
     "max_turns": 8}                                # optional; also "task_id", "tier"
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import random
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
from reinforge.envs.sandbox.runner import CodeRunner, RunnerInfraError
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier, infra_error
from reinforge.envs.tasksets import decode_row, load_jsonl
from reinforge.envs.tools import (
    CALL_OPEN,
    Tool,
    ToolCall,
    TranscriptTurn,
    decode_transcript,
    encode_transcript,
    render_call,
    replay,
)

DRIVER_PATH = Path(__file__).with_name("terminal_driver.py")
HARNESS_PATH = Path(__file__).with_name("code_harness.py")
SESSION_ARGV = ["python3", "-I", "-B", "-c", DRIVER_PATH.read_text(encoding="utf-8"), "--session"]
EXIT_WORDS = ("exit", "submit", "done", "logout")
BASH = Tool(
    name="bash",
    description="Run one shell command in the task directory; returns its output and its "
    "exit status.",
    parameters={"type": "object", "properties": {"command": {
        "type": "string", "description": "the shell command"}}, "required": ["command"]},
)


class StateCheck(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    kind: Literal["file_equals", "file_exists", "file_absent", "python_tests"]
    path: str
    content: str | None = None
    entry_point: str | None = None
    test: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.path.startswith("/") or ".." in self.path.split("/") or not self.path:
            raise ValueError(f"check path {self.path!r} must be relative, inside the task dir")
        if self.kind == "file_equals" and self.content is None:
            raise ValueError("a file_equals check needs `content`")
        if self.kind == "python_tests" and (not self.entry_point or not self.test):
            raise ValueError("a python_tests check needs `entry_point` and `test`")


class TerminalSpec(msgspec.Struct, frozen=True, kw_only=True):
    instruction: str
    files: dict[str, str] = {}
    checks: list[StateCheck]
    max_turns: int = 8
    command_timeout_s: float = 5.0


class TerminalRow(msgspec.Struct, kw_only=True):
    """One line of a user's terminal JSONL file (extra keys are ignored)."""

    instruction: str
    checks: list[StateCheck]
    files: dict[str, str] = {}
    max_turns: int = 8
    task_id: str | None = None
    tier: int = 0
    reference: str | None = None


class TerminalConfig(msgspec.Struct, frozen=True, kw_only=True):
    command_timeout_s: float = 5.0
    """Wall-clock limit of one agent command."""
    overhead_s: float = 10.0
    """Extra wall-clock per job for python start-up and the checks."""
    episode_time_s: float = 120.0
    """An episode's steps together may take this long in the sandbox (the model's time
    between them not counted); the step that crosses it ends the episode."""
    episode_output_chars: int = 20_000
    """... and show this many characters of output in all."""


def parse_commands(completion: str, max_turns: int) -> list[str]:
    """The commands of a completion (see the module docstring), at most `max_turns`."""
    if CALL_OPEN in completion or decode_transcript(completion) is not None:
        commands = [c.arguments["command"] for c in replay(completion, (BASH,), max_turns).calls]
    else:
        lines = completion.splitlines()
        marked = [ln[2:] for ln in lines if ln.startswith("$ ")]
        commands = marked if marked else [ln for ln in lines if ln.strip()]
    out = []
    for cmd in commands:
        if cmd.strip().lower() in EXIT_WORDS:
            break
        out.append(cmd)
    return out[:max_turns]


# ---------------------------------------------------------------- generator
# Names vary in every tier: the held-out set is chosen by prompt, and a tier with a handful
# of distinct prompts would be held out whole and leave training nothing at that tier.

_NAMES = ("hello", "notes", "todo", "greeting", "result", "data", "report")
_WORDS = ("hello", "apple", "ready", "blue", "seven", "done", "river")
_DIRS = ("archive", "backup", "docs", "old", "saved", "done")
_LOGS = ("log", "events", "access", "errors", "lines")
_OUTS = ("count", "total", "result", "answer")
_INPUTS = ("numbers", "values", "amounts", "scores", "readings", "prices", "data")
_MODULES = ("calc", "mathutil", "ops", "helpers", "numbers")
_BUGS = (  # (entry, buggy body, sed fix, tests)
    ("add", "return a - b", "s/return a - b/return a + b/",
     [((2, 3), 5), ((10, -4), 6), ((0, 0), 0), ((7, 8), 15)]),
    ("multiply", "return a + b", "s/return a + b/return a * b/",
     [((2, 3), 6), ((4, 5), 20), ((0, 9), 0), ((-2, 3), -6)]),
    ("subtract", "return a + b", "s/return a + b/return a - b/",
     [((5, 3), 2), ((0, 4), -4), ((9, 9), 0), ((-1, 1), -2)]),
    ("is_even", "return n % 2 == 1", "s/== 1/== 0/",
     [((2,), True), ((3,), False), ((0,), True), ((-7,), False)]),
    ("is_positive", "return n < 0", "s/n < 0/n > 0/",
     [((3,), True), ((-2,), False), ((0,), False), ((10,), True)]),
    ("square", "return n + n", "s/n + n/n * n/",
     [((3,), 9), ((0,), 0), ((-2,), 4), ((1,), 1)]),
)
_REDUCE = {  # what tier 3 asks for: (words, the reference's command on SRC into DST)
    "sum": ("the sum of", "awk '{s += $1} END {print s}' SRC > DST"),
    "max": ("the largest of", "sort -n SRC | tail -n 1 > DST"),
}


def _sig(entry: str, n: int) -> str:
    return ", ".join(["a", "b"][:n]) if n == 2 else "n"


def generate(rng: random.Random, tier: int) -> tuple[TerminalSpec, list[str]]:
    """(spec, the reference's commands) for a tier; pure given the rng state."""
    if tier == 0:
        name, word = rng.choice(_NAMES), rng.choice(_WORDS)
        spec = TerminalSpec(
            instruction=f"Create a file named {name}.txt containing the word {word}.",
            checks=[StateCheck(kind="file_equals", path=f"{name}.txt", content=word)],
            max_turns=4,
        )
        return spec, [f"echo {word} > {name}.txt"]
    if tier == 1:
        if rng.random() < 0.5:
            d, name = rng.choice(_DIRS), f"{rng.choice(_NAMES)}.txt"
            content = " ".join(rng.choice(_WORDS) for _ in range(4))
            spec = TerminalSpec(
                instruction=f"Make a directory named {d} and move {name} into it.",
                files={name: content + "\n"},
                checks=[
                    StateCheck(kind="file_equals", path=f"{d}/{name}", content=content),
                    StateCheck(kind="file_absent", path=name),
                ],
                max_turns=6,
            )
            return spec, [f"mkdir {d}", f"mv {name} {d}/"]
        k = rng.randint(2, 9)
        src, dst = f"{rng.choice(_LOGS)}.txt", f"{rng.choice(_OUTS)}.txt"
        log = "".join(f"event {rng.randint(100, 999)}\n" for _ in range(k))
        spec = TerminalSpec(
            instruction=f"Write the number of lines in {src} into {dst}.",
            files={src: log},
            checks=[StateCheck(kind="file_equals", path=dst, content=str(k))],
            max_turns=6,
        )
        return spec, [f"wc -l < {src} > {dst}"]
    if tier == 2:
        entry, buggy, sed, cases = rng.choice(_BUGS)
        stem = rng.choice(_MODULES)
        module, test = f"{stem}.py", f"test_{stem}.py"
        args = _sig(entry, len(cases[0][0]))
        src = f"def {entry}({args}):\n    {buggy}\n"
        visible = (
            f"import unittest\nfrom {stem} import {entry}\n\n\n"
            f"class Test(unittest.TestCase):\n    def test_it(self):\n"
            f"        self.assertEqual({entry}(*{cases[0][0]!r}), {cases[0][1]!r})\n\n\n"
            "if __name__ == '__main__':\n    unittest.main()\n"
        )
        hidden = "def check(candidate):\n" + "".join(
            f"    assert candidate(*{a!r}) == {r!r}\n" for a, r in cases
        )
        spec = TerminalSpec(
            instruction=f"{entry} in {module} has a bug: fix it so that {test} passes.",
            files={module: src, test: visible},
            checks=[StateCheck(kind="python_tests", path=module, entry_point=entry, test=hidden)],
            max_turns=8,
        )
        return spec, [f"sed -i '{sed}' {module}"]
    if tier == 3:
        op = rng.choice(sorted(_REDUCE))
        words, command = _REDUCE[op]
        src, dst = f"{rng.choice(_INPUTS)}.txt", f"{rng.choice(_OUTS)}.txt"
        nums = [rng.randint(-50, 200) for _ in range(rng.randint(3, 8))]
        spec = TerminalSpec(
            instruction=f"Write {words} the numbers in {src} (one per line) into {dst}, then "
            f"delete {src}.",
            files={src: "".join(f"{x}\n" for x in nums)},
            checks=[
                StateCheck(kind="file_equals", path=dst,
                           content=str(sum(nums) if op == "sum" else max(nums))),
                StateCheck(kind="file_absent", path=src),
            ],
            max_turns=8,
        )
        return spec, [command.replace("SRC", src).replace("DST", dst), f"rm {src}"]
    raise ValueError(f"terminal has tiers 0..3, got {tier}")


def reference_transcript(commands: list[str]) -> str:
    """A known-good tool episode: one `bash` call per command (each silent, exit 0), then
    the final answer."""
    turns = [TranscriptTurn(text=render_call(ToolCall(name=BASH.name, arguments={"command": c})),
                            observation="[exit 0]") for c in commands]
    return encode_transcript([*turns, TranscriptTurn(text="Done.")])


def build_prompt(spec: TerminalSpec) -> str:
    files = ", ".join(sorted(spec.files)) or "no files"
    return (
        f"Shell task. The directory has: {files}. {spec.instruction}\n"
        "Run shell commands with the bash tool, one call per turn; when the task is done, "
        "reply without a tool call."
    )


class TerminalEpisode:
    """A live episode: `step(command)` -> (observation, done); `finish()` -> Verdict.

    On a runner with sessions (the Podman pool) the episode holds one sandbox session from
    its first step to `finish`/`aclose`: each step is one command in the live shell
    directory, and `finish` checks the live state. Elsewhere each step replays the commands
    so far (see the module docstring)."""

    def __init__(self, domain: TerminalDomain, task: TaskSpec):
        self.domain = domain
        self.task = task
        self.spec = msgspec.convert(task.spec, TerminalSpec)
        self.commands: list[str] = []
        self.done = False
        self.verdict: Verdict | None = None
        self._held = contextlib.AsyncExitStack()
        self._session: Any = None
        self._ended: Exception | None = None  # why the session is gone (SessionEnded or infra)
        self.spent_s = 0.0  # the steps' time, against TerminalConfig.episode_time_s
        self.output_chars = 0  # against TerminalConfig.episode_output_chars

    @property
    def max_turns(self) -> int:
        return self.spec.max_turns

    async def step_call(self, call: ToolCall) -> tuple[str, bool]:
        """One `bash` call (the tool protocol); see `step`."""
        return await self.step(call.arguments["command"])

    @property
    def uses_session(self) -> bool:
        return hasattr(self.domain.runner, "session")

    async def step(self, action: str) -> tuple[str, bool]:
        if self.done:
            raise RuntimeError("episode already done: call finish()")
        cmd = action[2:] if action.startswith("$ ") else action
        if cmd.strip().lower() in EXIT_WORDS:
            self.done = True
            return "", True
        self.commands.append(cmd)
        self.done = len(self.commands) >= self.spec.max_turns
        if self.uses_session:
            await self._open_session()  # its start-up is ours: not counted as the episode's
        t0 = time.monotonic()
        obs = await self._run(cmd)
        return self._within_limits(obs, time.monotonic() - t0), self.done

    async def _run(self, cmd: str) -> str:
        if not self.uses_session:
            return await self.domain.run_steps(self.task, self.commands)
        reply = await self._request({"op": "run", "cmd": cmd,
                                     "timeout_s": self.spec.command_timeout_s},
                                    self.spec.command_timeout_s)
        if reply is None:
            self.done = True
            return f"[the shell session ended: {self._ended}]"
        code = "timeout" if reply["exit"] is None else reply["exit"]
        return f"{reply['output']}[exit {code}]"

    def _within_limits(self, obs: str, took_s: float) -> str:
        """Count the step against the episode's limits; the step that crosses one ends the
        episode, and its observation says so."""
        cfg = self.domain.config
        self.spent_s += took_s
        self.output_chars += len(obs)
        if self.output_chars > cfg.episode_output_chars:
            self.done = True
            limit = cfg.episode_output_chars
            return obs + f"\n[episode output limit of {limit} characters reached]"
        if self.spent_s > cfg.episode_time_s:
            self.done = True
            return obs + f"\n[episode time limit of {cfg.episode_time_s:g} s reached]"
        return obs

    async def finish(self) -> Verdict:
        if self.verdict is None:
            self.done = True
            if not self.uses_session:
                self.verdict = await self.domain.check(self.task, self.commands)
            else:
                self.verdict = await self._finish_in_session()
            await self.aclose()
        return self.verdict

    async def _finish_in_session(self) -> Verdict:
        checks = [msgspec.to_builtins(c) for c in self.spec.checks]
        budget = sum(c.timeout_s for c in self.spec.checks) + self.domain.config.overhead_s
        result = await self._request({"op": "final", "checks": checks}, budget)
        if result is not None:
            return verdict_of(result, self.commands)
        if isinstance(self._ended, RunnerInfraError) or getattr(self._ended, "infra", False):
            return infra_error(str(self._ended))
        return Verdict(reward=0.0, outcome="error", reason=f"the shell session ended: "
                       f"{self._ended}", checks=[Check(name="session", passed=False,
                                                       detail=str(self._ended))])

    async def _request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The session's answer, or None once it has ended (`self._ended` says why)."""
        from reinforge.envs.sandbox.session import SessionEnded

        await self._open_session()
        if self._ended is not None:
            return None
        try:
            return await self._session.request(body, timeout_s)
        except (SessionEnded, RunnerInfraError) as exc:
            self._ended = exc
            await self.aclose()
            return None

    async def _open_session(self) -> None:
        """Start the episode's session if it has none yet (`self._ended` says why not)."""
        from reinforge.envs.sandbox.session import SessionEnded

        if self._session is not None or self._ended is not None:
            return
        try:
            self._session = await self._held.enter_async_context(
                self.domain.runner.session(SESSION_ARGV, self.domain.session_config(self.spec)))
        except (SessionEnded, RunnerInfraError) as exc:
            self._ended = exc
            await self.aclose()

    async def aclose(self) -> None:
        self.done = True
        await self._held.aclose()


class TerminalDomain:
    """Shell tasks checked on the final state of the sandbox."""

    name = "terminal"
    description = "multi-turn shell tasks in the sandbox; the final file state is checked"
    resource = "sandbox"
    multi_turn = True
    tools = (BASH,)
    templated_prompts = True  # tasks of a tier differ in a name or two (envs/domain.py)
    tiers = (
        Tier(level=0, name="create-file", description="create one file with given content"),
        Tier(level=1, name="move-or-count", description="mkdir + mv, or count lines into a file"),
        Tier(level=2, name="fix-the-bug", description="fix a one-line bug so the tests pass"),
        Tier(level=3, name="compute-and-clean",
             description="sum or max of numbers into a file, delete the input"),
    )

    def __init__(self, *, config: TerminalConfig | None = None, runner: CodeRunner | None = None):
        self.config = config or TerminalConfig()
        self.runner = runner
        self._nonce_key = secrets.token_bytes(32)

    def with_runner(self, runner: CodeRunner) -> TerminalDomain:
        other = TerminalDomain(config=self.config, runner=runner)
        other._nonce_key = self._nonce_key
        return other

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        check_tier(self, tier)
        spec, commands = generate(rng, tier)
        spec = msgspec.structs.replace(spec, command_timeout_s=self.config.command_timeout_s)
        return TaskSpec(
            task_id=f"terminal-t{tier}-{rng.getrandbits(48):012x}",
            domain=self.name,
            tier=tier,
            prompt=build_prompt(spec),
            spec=msgspec.to_builtins(spec),
            reference=reference_transcript(commands),
            source="generated",
        )

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, TerminalRow, where=where)
        if not r.checks:
            raise ValueError("`checks` must list at least one check")
        if r.max_turns < 1:
            raise ValueError(f"`max_turns` must be >= 1, got {r.max_turns}")
        for name in r.files:
            if name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"file name {name!r} must be relative, inside the task dir")
        spec = TerminalSpec(
            instruction=r.instruction,
            files=r.files,
            checks=r.checks,
            max_turns=r.max_turns,
            command_timeout_s=self.config.command_timeout_s,
        )
        return TaskSpec(
            task_id=r.task_id or f"terminal-{where.rsplit(':', 1)[-1]}",
            domain=self.name,
            tier=r.tier,
            prompt=build_prompt(spec),
            spec=msgspec.to_builtins(spec),
            reference=r.reference,
            source="jsonl",
        )

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    def start_episode(self, task: TaskSpec) -> TerminalEpisode:
        return TerminalEpisode(self, task)

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        spec = msgspec.convert(task.spec, TerminalSpec)
        return await self.check(task, parse_commands(completion, spec.max_turns))

    # -- jobs --------------------------------------------------------------------------

    def _job(self, spec: TerminalSpec, commands: list[str], mode: str) -> tuple[str, bytes]:
        body = {
            "files": spec.files,
            "commands": commands,
            "mode": mode,
            "command_timeout_s": spec.command_timeout_s,
            "checks": [msgspec.to_builtins(c) for c in spec.checks] if mode == "final" else [],
            "sandboxed": getattr(self.runner, "name", "") == "podman",
        }
        payload = json.dumps(body, sort_keys=True)
        nonce = hmac.new(self._nonce_key, payload.encode(), hashlib.sha256).hexdigest()[:32]
        return nonce, json.dumps({**body, "nonce": nonce}).encode()

    async def _run(self, spec: TerminalSpec, commands: list[str], mode: str):
        if self.runner is None:
            raise RunnerInfraError(
                "no sandbox attached to the terminal domain: use "
                "`async with sandbox_runner() as r: domain.with_runner(r)`"
            )
        nonce, stdin = self._job(spec, commands, mode)
        budget = spec.command_timeout_s * max(1, len(commands)) + self.config.overhead_s
        budget += sum(c.timeout_s for c in spec.checks) if mode == "final" else 0.0
        out = await self.runner.run(
            files={
                "terminal_driver.py": DRIVER_PATH.read_bytes(),
                "code_harness.py": HARNESS_PATH.read_bytes(),
            },
            argv=["python3", "-I", "-B", "terminal_driver.py"],
            stdin=stdin,
            timeout_s=budget,
        )
        for line in out.stdout.decode("utf-8", errors="replace").splitlines():
            if line.startswith(nonce + " "):
                try:
                    return json.loads(line[len(nonce) + 1 :]), out
                except ValueError:
                    break
        return None, out

    async def run_steps(self, task: TaskSpec, commands: list[str]) -> str:
        """Replay `commands`; the last one's observation (exit status and output)."""
        spec = msgspec.convert(task.spec, TerminalSpec)
        try:
            result, out = await self._run(spec, commands, "steps")
        except RunnerInfraError as exc:
            return f"[sandbox unavailable: {exc}]"
        if result is None:
            return f"[the shell session ended ({out.status})]"
        last = result["observations"][-1]
        code = "timeout" if last["exit"] is None else last["exit"]
        return f"{last['output']}[exit {code}]"

    async def check(self, task: TaskSpec, commands: list[str]) -> Verdict:
        spec = msgspec.convert(task.spec, TerminalSpec)
        try:
            result, out = await self._run(spec, commands, "final")
        except RunnerInfraError as exc:
            return infra_error(str(exc))
        if result is None:
            outcome = "timeout" if out.status == "timeout" else "error"
            return Verdict(
                reward=0.0,
                outcome=outcome,
                reason=f"the driver gave no verdict (status {out.status})",
                checks=[Check(name="verdict", passed=False, detail=out.detail)],
            )
        return verdict_of(result, commands)

    def session_config(self, spec: TerminalSpec) -> dict[str, Any]:
        """The session driver's first frame: the task's files, and code_harness's source
        (for the python_tests checks)."""
        return {"files": spec.files, "harness": HARNESS_PATH.read_text(encoding="utf-8"),
                "sandboxed": True}


def verdict_of(result: dict[str, Any], commands: list[str]) -> Verdict:
    """The driver's final answer as a Verdict."""
    checks = [Check(name=str(n), passed=bool(p), detail=str(d)) for n, p, d in result["checks"]]
    ok = result["status"] == "pass"
    return Verdict(
        reward=1.0 if ok else 0.0,
        outcome="pass" if ok else "fail",
        checks=[Check(name="commands", passed=True, detail=f"{len(commands)} run"), *checks],
        reason=result["reason"],
    )
