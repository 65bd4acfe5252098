"""Multi-turn episodes, token by token: the policy's turns and the environment's answers.

`run_episode` drives one episode of a multi-turn domain with a `generate` callable (one
policy turn from the ids so far) and returns an `EpisodeTrace`: the output tokens after
the prompt, each policy token with its behaviour logprob and loss mask 1, each environment
token with logprob 0.0 and mask 0, and the policy's turns with the version of each.

Two protocols, chosen by the domain:

- **tool calls** (a domain with `tools`): each turn is one generation up to the end-of-turn
  token; a `<tool_call>` runs through `episode.step_call(call)`, a malformed one is answered
  with what was wrong (and counted), a turn without a call is the final answer. Observations
  go back as `tool` messages in the chat template (`prompts.observation_ids`). The
  completion is the transcript (`envs.tools.encode_transcript`).
- **lines** (other multi-turn domains): each turn is one line (`episode.step(line)`); the
  completion is the `$ action` / `| observation` transcript.

An episode ends when the episode says so, after `max_turns` policy turns (tool protocol),
or when the transcript outgrows the server's context (`generate` returns None).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import msgspec

from reinforge.core.messages import Turn
from reinforge.envs.tools import (
    MalformedToolCall,
    Tool,
    TranscriptTurn,
    encode_transcript,
    parse_tool_call,
)
from reinforge.rl.prompts import observation_ids, turn_closer

Generate = Callable[[list[int], list[str]], Awaitable[Any]]
"""(ids so far, stop strings) -> one `Sample` of the policy, or None: the server refused the
ids (the transcript outgrew its context). Raises for the first turn's refusal."""


class EpisodeTrace(msgspec.Struct, kw_only=True):
    """A finished multi-turn episode, token by token."""

    completion: str = ""
    output_ids: list[int] = []
    logprobs: list[float] = []
    loss_mask: list[int] = []
    finish_reason: str = "length"
    weight_versions: list[str] = []
    turns: list[Turn] = []
    """The policy's turns: output-token spans and the version of each."""
    tool_calls: int = 0
    tool_call_errors: int = 0
    """Malformed tool calls (each answered with what was wrong)."""

    def add_policy(self, sample: Any, version: int) -> None:
        self.weight_versions.append(sample.weight_version)
        if sample.output_ids:
            start = len(self.output_ids)
            self.turns.append(Turn(start=start, end=start + len(sample.output_ids),
                                   policy_version=version))
        self.output_ids += sample.output_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.output_ids)

    def add_environment(self, ids: list[int]) -> None:
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)


def domain_tools(domain: Any) -> tuple[Tool, ...]:
    """The tools a domain declares (none: the line protocol)."""
    return tuple(getattr(domain, "tools", ()))


async def run_episode(domain: Any, task: Any, prompt_ids: list[int], *, tokenizer: Any,
                      generate: Generate, version_of: Callable[[str], int],
                      chat_template: bool = True,
                      step_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
                      ) -> EpisodeTrace:
    """Run one episode of `task` (see the module docstring); the episode is closed after."""
    episode = domain.start_episode(task)
    try:
        tools = domain_tools(domain)
        if tools:
            return await _tool_episode(episode, tools, prompt_ids, tokenizer, generate,
                                       version_of, chat_template, step_context)
        return await _line_episode(episode, prompt_ids, tokenizer, generate, version_of,
                                   step_context)
    finally:
        await episode.aclose()


async def _tool_episode(episode: Any, tools: Sequence[Tool], prompt_ids: list[int],
                        tokenizer: Any, generate: Generate, version_of: Callable[[str], int],
                        chat_template: bool,
                        step_context: Callable[[], AbstractContextManager[Any]]) -> EpisodeTrace:
    ep = EpisodeTrace()
    ids = list(prompt_ids)
    transcript: list[TranscriptTurn] = []
    for _ in range(episode.max_turns):
        s = await generate(ids, [])
        if s is None:
            break
        ep.add_policy(s, version_of(s.weight_version))
        ids += s.output_ids
        try:
            call = parse_tool_call(s.text, tools)
        except MalformedToolCall as exc:
            ep.tool_call_errors += 1
            obs, done = f"[tool call error: {exc}]", False
        else:
            if call is None:  # the final answer
                transcript.append(TranscriptTurn(text=s.text))
                ep.finish_reason = "stop"
                break
            ep.tool_calls += 1
            with step_context():
                obs, done = await episode.step_call(call)
        transcript.append(TranscriptTurn(text=s.text, observation=obs))
        if done:
            ep.finish_reason = "stop"
            break
        env = observation_ids(tokenizer, obs, tools=tools, chat_template=chat_template,
                              closed_by=turn_closer(tokenizer, s.output_ids))
        ids += env
        ep.add_environment(env)
    ep.completion = encode_transcript(transcript)
    return ep


async def _line_episode(episode: Any, prompt_ids: list[int], tokenizer: Any,
                        generate: Generate, version_of: Callable[[str], int],
                        step_context: Callable[[], AbstractContextManager[Any]]) -> EpisodeTrace:
    ep = EpisodeTrace()
    ids = list(prompt_ids)
    lines: list[str] = []
    done = False
    while not done:
        s = await generate(ids, ["\n"])
        if s is None:
            break
        ep.add_policy(s, version_of(s.weight_version))
        ids += s.output_ids
        action = s.text.strip().splitlines()[0] if s.text.strip() else ""
        action = action[2:] if action.startswith("$ ") else action
        lines.append(f"$ {action}")
        with step_context():
            obs, done = await episode.step(action)
        if done and not obs:
            ep.finish_reason = "stop"
            break
        obs_text = "".join(f"| {ln}\n" for ln in obs.splitlines()) or "|\n"
        lines.append(obs_text.rstrip("\n"))
        env = list(tokenizer.encode("\n" + obs_text, add_special_tokens=False))
        ids += env
        ep.add_environment(env)
    ep.completion = "\n".join(lines) + "\n"
    return ep
