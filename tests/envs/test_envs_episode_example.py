"""The example of docs/environments.md, run as written: a plug-in tool domain found by its
spec, its reference passes, and an episode driven by a scripted policy (the policy's turns
fixed text; a unit test of the protocol) finds the number through a malformed call."""

import random
import re
import sys
from pathlib import Path

import pytest
import trio
from reinforge.envs.domain import DomainRegistry
from reinforge.envs.tools import ToolCall, decode_transcript, render_call
from reinforge.rl.episodes import run_episode
from reinforge.rollout.client import Sample

DOC = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


@pytest.fixture
def guess(tmp_path, monkeypatch):
    text = DOC.read_text(encoding="utf-8")
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (tmp_path / "guess_domain.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield DomainRegistry.default(["guess=guess_domain:GuessDomain"]).get("guess")
    sys.modules.pop("guess_domain", None)


def test_the_documented_example_domain_plays_and_verifies(guess, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    task = guess.sample_task(random.Random(7), 0)
    secret = task.spec["secret"]
    turns = ["<tool_call>\n{\"name\": \"guess\", \"arguments\": {\"number\": \"fifty\"}}\n"
             "</tool_call>",
             render_call(ToolCall(name="guess", arguments={"number": secret - 1})),
             render_call(ToolCall(name="guess", arguments={"number": secret}))]

    async def generate(ids, stop):
        text = turns.pop(0)
        out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        return Sample(text=text, output_ids=out, logprobs=[-0.1] * len(out),
                      finish_reason="stop", weight_version="0")

    async def main():
        ep = await run_episode(guess, task, [1], tokenizer=tok, generate=generate,
                               version_of=int)
        return ep, await guess.verify(task, ep.completion), await guess.verify(task,
                                                                            task.reference)

    ep, verdict, reference = trio.run(main)
    record = decode_transcript(ep.completion)
    assert record[0].observation.startswith("[tool call error: guess: `number` must be a JSON")
    assert [t.observation for t in record[1:]] == ["higher", "right"]
    assert (ep.tool_calls, ep.tool_call_errors, ep.finish_reason) == (2, 1, "stop")
    assert (verdict.outcome, verdict.reason) == ("pass", "found in 3 turns")
    assert reference.outcome == "pass"
