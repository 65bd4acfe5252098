"""Tool episodes through `rl.episodes.run_episode` on the terminal domain in the real
sandbox, with a scripted policy (a unit test of the episode logic above generation: the
policy's turns are fixed text, everything else is real): malformed calls, a hanging tool, a
flooding tool and a session killed mid-episode each end as the right outcome, and every
turn is in the transcript and the token accounting."""

from contextlib import nullcontext

import pytest
import trio
from transformers import AutoTokenizer
from reinforge.core import messages as m
from reinforge.envs.domains.terminal import TerminalConfig, TerminalDomain
from reinforge.envs.tools import ToolCall, decode_transcript, render_call
from reinforge.rl.episodes import run_episode
from reinforge.rl.prompts import task_prompt_ids
from reinforge.rollout.client import Sample

ROW = {"instruction": "Write 1 into log.txt.", "max_turns": 8,
       "checks": [{"kind": "file_equals", "path": "log.txt", "content": "1"}]}


def bash(cmd: str) -> str:
    return render_call(ToolCall(name="bash", arguments={"command": cmd}))


def scripted_policy(tok, turns: list[str]):
    """`generate` that answers each turn with the next scripted text (closed with EOS)."""
    queue = list(turns)
    seen: list[list[int]] = []

    async def generate(ids, stop):
        seen.append(list(ids))
        text = queue.pop(0)
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Sample(text=text, output_ids=out, logprobs=[-0.5] * len(out),
                      finish_reason="stop", weight_version="0")

    return generate, seen


def play(make_runner, tok, turns, *, config=TerminalConfig()):
    async def main():
        async with make_runner() as runner:
            domain = TerminalDomain(config=config).with_runner(runner)
            task = domain.task_from_row(ROW, where="t:1")
            prompt = task_prompt_ids(tok, task.prompt, tools=domain.tools)
            generate, seen = scripted_policy(tok, turns)
            ep = await run_episode(domain, task, prompt, tokenizer=tok, generate=generate,
                                   version_of=int)
            return ep, prompt, seen, await domain.verify(task, ep.completion)

    return trio.run(main)


def rollout_of(ep, prompt) -> m.Rollout:
    """As the sampler publishes it: the turns must cover exactly the policy's tokens."""
    return m.Rollout(rollout_id="t:0:1", task_id="t", sample_index=0, domain="terminal",
                     tier=0, prompt="p", completion=ep.completion, prompt_ids=prompt,
                     output_ids=ep.output_ids, logprobs=ep.logprobs, loss_mask=ep.loss_mask,
                     turns=ep.turns, policy_version=0, tool_calls=ep.tool_calls,
                     tool_call_errors=ep.tool_call_errors)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.podman
def test_malformed_calls_a_hanging_and_a_flooding_tool_are_answered_and_the_episode_goes_on(
        sandbox_runner_only, tok):
    turns = [
        "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"\n</tool_call>",
        bash("ls") + "\n" + bash("pwd"),
        '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}}\n</tool_call>',
        bash("sleep 60"),
        bash("yes | head -c 5000000"),
        bash("echo 1 > log.txt"),
        "The file is written.",
    ]
    ep, prompt, seen, verdict = play(sandbox_runner_only, tok, turns,
                                     config=TerminalConfig(command_timeout_s=1.0))
    record = decode_transcript(ep.completion)
    assert [t.text for t in record] == turns  # every turn kept, in order
    obs = [t.observation for t in record]
    assert obs[0].startswith("[tool call error: the tool call is not valid JSON")
    assert obs[1] == "[tool call error: one tool call per turn, got 2]"
    assert obs[2] == "[tool call error: unknown tool 'shell'; the tools are bash]"
    assert obs[3] == "[exit timeout]"
    assert obs[4].endswith("[output truncated][exit 0]") and len(obs[4]) < 2100
    assert obs[5] == "[exit 0]" and obs[6] == ""
    assert (ep.tool_calls, ep.tool_call_errors, ep.finish_reason) == (3, 3, "stop")
    assert (verdict.reward, verdict.outcome) == (1.0, "pass"), verdict
    # token accounting: the policy's turns exactly, each observation in between as context
    r = rollout_of(ep, prompt)
    assert len(r.turns) == len(turns) and sum(r.loss_mask) == sum(t.end - t.start for t in r.turns)
    assert [ep.output_ids[t.start:t.end] for t in r.turns] == [
        tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
    assert all(lp == 0.0 for lp, keep in zip(r.logprobs, r.loss_mask, strict=True) if not keep)
    # each turn was generated from everything before it
    assert seen == [prompt + ep.output_ids[:t.start] for t in r.turns]
    assert "[tool call error: one tool call per turn" in tok.decode(seen[2])


@pytest.mark.podman
def test_a_session_killed_mid_episode_ends_it_and_scores_as_the_agents_error(
        sandbox_runner_only, tok):
    turns = [bash("echo 1 > log.txt"), bash("kill -9 -1"), bash("echo never"), "Done."]
    ep, prompt, _, verdict = play(sandbox_runner_only, tok, turns)
    record = decode_transcript(ep.completion)
    assert len(record) == 2 and record[1].observation.startswith("[the shell session ended: ")
    assert ep.finish_reason == "stop" and rollout_of(ep, prompt).tool_calls == 2
    assert (verdict.reward, verdict.outcome) == (0.0, "error"), verdict


def test_an_episode_without_a_final_answer_stops_at_max_turns(tok, tmp_path):
    from reinforge.envs.sandbox.runner import UnsafeLocalRunner

    turns = ["<tool_call>oops</tool_call>"] * 20
    ep, _, seen, verdict = play(lambda: nullcontext(UnsafeLocalRunner()), tok, turns)
    assert len(seen) == ROW["max_turns"] and ep.tool_call_errors == ROW["max_turns"]
    assert ep.finish_reason == "length" and verdict.outcome == "fail"
