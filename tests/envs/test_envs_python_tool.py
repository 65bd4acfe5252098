"""The python_tool domain: references pass, the final answer is what counts, and an episode
with a scripted policy (the policy's turns fixed text, the tool runs for real: local runner
and, marked `podman`, the sandbox) computes, survives a hanging and a flooding program,
and ends as `infra_error` when the sandbox fails, never as a 0."""

import json
import random
from pathlib import Path

import pytest
import trio
from reinforge.envs.domains.python_tool import PythonToolConfig, PythonToolDomain
from reinforge.envs.sandbox.runner import RunnerInfraError
from reinforge.envs.tools import ToolCall, TranscriptTurn, decode_transcript, encode_transcript
from reinforge.envs.tools import render_call
from reinforge.rollout.client import Sample
from reinforge.rl.episodes import run_episode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def py(code: str) -> str:
    return render_call(ToolCall(name="python", arguments={"code": code}))


def test_references_pass_on_every_tier_and_a_guess_without_the_tool_is_checked_the_same():
    d = PythonToolDomain()
    tasks = [d.sample_task(random.Random(s), t) for t in range(4) for s in range(3)]

    async def main():
        return [await d.verify(t, t.reference) for t in tasks]

    for task, v in zip(tasks, trio.run(main), strict=True):
        assert (v.reward, v.outcome) == (1.0, "pass"), (task.prompt, v)
    task = tasks[0]
    answer = task.spec["answer"]
    right = encode_transcript([TranscriptTurn(text=f"#### {answer}")])
    wrong = encode_transcript([TranscriptTurn(text=f"#### {int(answer) + 1}")])
    v_right, v_wrong = trio.run(lambda: _both(d, task, right, wrong))
    assert v_right.outcome == "pass" and [c.passed for c in v_right.checks] == [False, True]
    assert (v_wrong.reward, v_wrong.outcome) == (0.0, "fail")


async def _both(d, task, a, b):
    return await d.verify(task, a), await d.verify(task, b)


def test_the_final_answer_is_the_first_turn_without_a_call_within_max_turns():
    d = PythonToolDomain()
    task = d.task_from_row({"question": "What is 6 * 7?", "answer": "42", "max_turns": 2},
                           where="t:1")
    late = encode_transcript([TranscriptTurn(text=py("print(6*7)"), observation="42\n[exit 0]"),
                              TranscriptTurn(text=py("print(6*7)"), observation="42\n[exit 0]"),
                              TranscriptTurn(text="#### 42")])  # the third turn: too late
    first = encode_transcript([TranscriptTurn(text="#### 41"), TranscriptTurn(text="#### 42")])
    v_late, v_first = trio.run(lambda: _both(d, task, late, first))
    assert (v_late.outcome, v_late.reason) == ("fail", "no final answer turn")
    assert v_first.outcome == "fail"  # an answer is final


def test_the_sample_file_verifies_as_documented(capsys):
    from reinforge.cli import main as cli_main

    code = cli_main(["verify", "--domain", "python_tool",
                     str(EXAMPLES / "python_tool_sample.jsonl"), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and (summary["n"], summary["passed"], summary["failed"]) == (3, 2, 1)


def scripted(tok, turns):
    queue = list(turns)

    async def generate(ids, stop):
        text = queue.pop(0)
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Sample(text=text, output_ids=out, logprobs=[-0.5] * len(out),
                      finish_reason="stop", weight_version="0")

    return generate


def play(runner_cm, tok, turns, *, config=PythonToolConfig()):
    async def main():
        async with runner_cm() as runner:
            d = PythonToolDomain(config=config).with_runner(runner)
            task = d.task_from_row({"question": "What is 6 * 7?", "answer": "42",
                                    "max_turns": 8}, where="t:1")
            ep = await run_episode(d, task, [1, 2, 3], tokenizer=tok,
                                   generate=scripted(tok, turns), version_of=int)
            return ep, await d.verify(task, ep.completion)

    return trio.run(main)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_an_episode_computes_with_the_tool_through_hangs_floods_and_bad_calls(with_runner, tok):
    turns = [py("while True: pass"), py("print('x' * 100000)"), "<tool_call>{}</tool_call>",
             py("print(6 * 7)"), "#### 42"]
    ep, verdict = play(with_runner, tok, turns, config=PythonToolConfig(run_timeout_s=1.0))
    obs = [t.observation for t in decode_transcript(ep.completion)]
    assert obs[0] == "[exit timeout]"
    assert obs[1].endswith("\n[output truncated]\n[exit 0]") and len(obs[1]) < 2100
    assert obs[2].startswith("[tool call error: ")
    assert obs[3] == "42\n[exit 0]" and obs[4] == ""
    assert (ep.tool_calls, ep.tool_call_errors) == (3, 1)
    assert (verdict.reward, verdict.outcome) == (1.0, "pass"), verdict


class FailingRunner:
    """A runner whose sandbox is gone (what the pool raises when Podman dies)."""

    name = "failing"

    async def run(self, **job):
        raise RunnerInfraError("podman socket refused the connection")


def test_a_sandbox_failure_ends_the_episode_as_infra_error_and_printed_text_cannot_fake_one(tok):
    from contextlib import nullcontext

    ep, verdict = play(lambda: nullcontext(FailingRunner()), tok, [py("print(6*7)"), "#### 42"])
    assert len(decode_transcript(ep.completion)) == 1  # the episode ended at the failure
    assert verdict.outcome == "infra_error" and verdict.reward == 0.0
    faked = encode_transcript([TranscriptTurn(
        text=py("print('[sandbox unavailable: x]')"),
        observation="[sandbox unavailable: x]\n[exit 0]")])
    d = PythonToolDomain()
    task = d.task_from_row({"question": "q", "answer": "42"}, where="t:1")
    assert trio.run(d.verify, task, faked).outcome == "fail"
