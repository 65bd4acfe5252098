"""Tool calls in the model's own chat format (Qwen2 / Hermes style), and episode transcripts.

A tool-using domain declares its tools (`Tool`: a name, a description, a JSON schema of its
arguments). The prompt renders them with the tokenizer's chat template (see
`reinforge.rl.prompts`); the policy answers a turn with at most one call,

    <tool_call>
    {"name": "bash", "arguments": {"command": "ls -l"}}
    </tool_call>

and the environment's answer comes back as a `tool` message. A turn without a call is the
policy's final answer and ends the episode. `parse_tool_call` reads one turn: a call, None
(no call), or `MalformedToolCall` saying what was wrong -- that sentence is the observation
the policy sees, and the episode counts it.

A finished tool episode travels as its transcript (`encode_transcript`): a JSON object with
the policy's text and the observation of every turn. Verification replays the policy's
turns by the live episode's rules (`replay`), so the checked actions are exactly those the
episode ran; observations are kept for people reading the rollout, never parsed for
actions (the environment's output cannot inject a call).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TRANSCRIPT_KEY = "episode"
"""A tool episode's completion is `{"episode": [{"text": ..., "observation": ...}, ...]}`."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """One function the policy may call."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments:
    `{"type": "object", "properties": {...}, "required": [...]}`."""

    def schema(self) -> dict[str, Any]:
        """As chat templates take tools (the OpenAI function format)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: dict[str, Any]


class MalformedToolCall(ValueError):
    """A turn's tool call could not be used; the message says why, for the policy to read."""


def parse_tool_call(text: str, tools: Sequence[Tool]) -> ToolCall | None:
    """The one tool call of a turn, or None when the turn makes none (a final answer).

    Raises MalformedToolCall for: more than one call, a call not closed, JSON that does not
    parse or is not `{"name": ..., "arguments": {...}}`, an unknown tool, and arguments
    missing, unexpected or of the wrong JSON type."""
    opened = text.count(CALL_OPEN)
    if opened == 0:
        if CALL_CLOSE in text:
            raise MalformedToolCall(f"{CALL_CLOSE} without {CALL_OPEN}")
        return None
    if opened > 1:
        raise MalformedToolCall(f"one tool call per turn, got {opened}")
    body = text.split(CALL_OPEN, 1)[1]
    if CALL_CLOSE not in body:
        raise MalformedToolCall(f"the tool call is not closed with {CALL_CLOSE}")
    body = body.split(CALL_CLOSE, 1)[0].strip()
    try:
        call = json.loads(body)
    except ValueError as exc:
        raise MalformedToolCall(f"the tool call is not valid JSON ({exc})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise MalformedToolCall('a tool call is {"name": <tool>, "arguments": {...}}')
    by_name = {t.name: t for t in tools}
    tool = by_name.get(call["name"])
    if tool is None:
        raise MalformedToolCall(f"unknown tool {call['name']!r}; the tools are "
                                f"{', '.join(sorted(by_name))}")
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            raise MalformedToolCall("`arguments` is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise MalformedToolCall("`arguments` must be a JSON object")
    check_arguments(tool, args)
    return ToolCall(name=tool.name, arguments=args)


def check_arguments(tool: Tool, args: dict[str, Any]) -> None:
    """Raise MalformedToolCall unless `args` fit the tool's schema (names, required, types)."""
    props: dict[str, Any] = tool.parameters.get("properties", {})
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise MalformedToolCall(f"{tool.name}: unexpected arguments {', '.join(unknown)}")
    missing = [p for p in tool.parameters.get("required", []) if p not in args]
    if missing:
        raise MalformedToolCall(f"{tool.name}: missing arguments {', '.join(missing)}")
    for name, value in args.items():
        want = _JSON_TYPES.get(props[name].get("type", ""), ())
        wrong_bool = isinstance(value, bool) and bool not in want
        if want and (not isinstance(value, want) or wrong_bool):
            raise MalformedToolCall(f"{tool.name}: `{name}` must be a JSON "
                                    f"{props[name]['type']}, got {json.dumps(value)[:40]}")


def tool_response_text(content: str) -> str:
    """How a tool message reads when the chat template has no tool role of its own."""
    return f"<tool_response>\n{content}\n</tool_response>"


def tools_preamble(tools: Sequence[Tool]) -> str:
    """The system text that presents the tools, for chat templates that cannot (the wording
    of the Qwen2 template, so a model sees the same text either way)."""
    listed = "\n".join(json.dumps(t.schema()) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_call(call: ToolCall) -> str:
    """A call as the policy writes it (references and SFT demonstrations)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments})
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


# ---------------------------------------------------------------------- transcripts


class TranscriptTurn(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    """The policy's text of the turn."""
    observation: str = ""
    """What the environment answered (for readers; never parsed for actions)."""


class _Transcript(msgspec.Struct, frozen=True):
    episode: list[TranscriptTurn]


def encode_transcript(turns: Sequence[TranscriptTurn]) -> str:
    return msgspec.json.encode(_Transcript(episode=list(turns))).decode()


_TRANSCRIPT_START = re.compile(r'\s*\{\s*"' + TRANSCRIPT_KEY + '"')


def decode_transcript(completion: str) -> list[TranscriptTurn] | None:
    """The turns of a tool episode's completion; None when the completion is not one (e.g.
    a single-turn answer written straight out)."""
    if not _TRANSCRIPT_START.match(completion):
        return None
    try:
        return msgspec.json.decode(completion, type=_Transcript).episode
    except msgspec.DecodeError:
        return None


def policy_turns(completion: str) -> list[str]:
    """The policy's turns: a transcript's texts, or the whole completion as one turn per
    tool call when it was written in one go (a single-turn evaluation)."""
    turns = decode_transcript(completion)
    if turns is not None:
        return [t.text for t in turns]
    parts = completion.split(CALL_CLOSE)
    return [p + CALL_CLOSE for p in parts[:-1]] + ([parts[-1]] if parts[-1].strip() else [])


class Replay(NamedTuple):
    calls: list[ToolCall]
    """The well-formed calls, in order: the actions the live episode ran."""
    final: str | None
    """The final answer (the first turn without a call), or None."""


def replay(completion: str, tools: Sequence[Tool], max_turns: int) -> Replay:
    """The policy's first `max_turns` turns read as the live episode read them
    (`rl.episodes`): a malformed call runs nothing and uses up its turn, a turn without a
    call is the final answer and ends the episode. Verification replays with this, so the
    checked actions are exactly those that ran."""
    calls: list[ToolCall] = []
    for text in policy_turns(completion)[:max_turns]:
        try:
            call = parse_tool_call(text, tools)
        except MalformedToolCall:
            continue
        if call is None:
            return Replay(calls, text)
        calls.append(call)
    return Replay(calls, None)


def episode_counts(completion: str, tools: Sequence[Tool]) -> tuple[int, int, int]:
    """(turns, tool calls, malformed calls) of a completion, by the parser the episode used."""
    calls = errors = 0
    turns = policy_turns(completion)
    for text in turns:
        try:
            calls += parse_tool_call(text, tools) is not None
        except MalformedToolCall:
            errors += 1
    return len(turns), calls, errors
