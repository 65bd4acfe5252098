"""The token ids the policy sees for a task: one definition for SFT, sampling and evaluation.

Three places build a prompt from a task (the SFT warm start, the sampler, the evaluator);
if any of them formats it differently, SFT trains a format RL never shows and the
evaluation measures a third. So they all call `task_prompt_ids`.

Tool-using domains pass their tools: the tokenizer's chat template renders them (and the
`tool` messages of the environment) when it knows how -- Qwen2-style templates do; for a
template that does not, the same text is built here (`reinforge.envs.tools`): the tools in
a system message, each tool message as a user turn wrapped in `<tool_response>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reinforge.envs.tools import Tool, tool_response_text, tools_preamble


def render_messages(tokenizer: Any, messages: list[dict[str, str]], *,
                    tools: Sequence[Tool] = (), chat_template: bool = True,
                    add_generation_prompt: bool = True) -> str:
    """A conversation as text: the tokenizer's chat template (with the generation prompt)
    when it has one and `chat_template`, else the messages' contents, one per line."""
    template = getattr(tokenizer, "chat_template", None) if chat_template else None
    extra: dict[str, Any] = {}
    if tools and template and "tools" in template:
        extra["tools"] = [t.schema() for t in tools]
    elif tools or any(m["role"] == "tool" for m in messages):
        messages = _tools_as_text(messages, tools)
    if template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **extra)
    return "\n".join(m["content"] for m in messages) + "\n"


def _tools_as_text(messages: list[dict[str, str]], tools: Sequence[Tool]) -> list[dict[str, str]]:
    out = [{"role": "user", "content": tool_response_text(m["content"])}
           if m["role"] == "tool" else dict(m) for m in messages]
    if tools:
        preamble = tools_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}"
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]], *,
                     chat_template: bool = True, tools: Sequence[Tool] = ()) -> list[int]:
    """The prompt of a conversation (see `render_messages`). Special tokens come from the
    template only (no tokenizer-added BOS)."""
    text = render_messages(tokenizer, messages, tools=tools, chat_template=chat_template)
    return list(tokenizer.encode(text, add_special_tokens=False))


def task_prompt_ids(tokenizer: Any, prompt: str, *, chat_template: bool = True,
                    tools: Sequence[Tool] = ()) -> list[int]:
    """A task's prompt as the policy sees it: one user turn (after the tools, if any)."""
    return prompt_token_ids(tokenizer, [{"role": "user", "content": prompt}],
                            chat_template=chat_template, tools=tools)


def observation_ids(tokenizer: Any, content: str, *, closed_by: str | None,
                    tools: Sequence[Tool] = (), chat_template: bool = True) -> list[int]:
    """The tokens the environment appends after a policy turn: the rest of the turn's end,
    the tool message with `content`, and the prompt of the next assistant turn.

    `closed_by`: the special token that ended the policy's turn (`turn_closer`), whose text
    the template's end of turn then starts with; None when the turn was cut (all of the end
    is the environment's). Taken as the difference of two renderings of one conversation,
    so it is exactly what the template would produce for the whole episode."""
    convo = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
    before = render_messages(tokenizer, convo, tools=tools, chat_template=chat_template,
                             add_generation_prompt=False)
    after = render_messages(tokenizer, [*convo, {"role": "tool", "content": content}],
                            tools=tools, chat_template=chat_template)
    if not after.startswith(before):
        raise ValueError("the chat template rewrites earlier turns when a tool message is "
                         "added; tool episodes need an append-only template")
    closing = before[before.rindex("!") + 1:]  # what ends an assistant turn, e.g. <|im_end|>\n
    if closed_by and closing.startswith(closed_by):
        closing = closing[len(closed_by):]  # the policy wrote that token itself
    return list(tokenizer.encode(closing + after[len(before):], add_special_tokens=False))


def turn_closer(tokenizer: Any, output_ids: list[int]) -> str | None:
    """The text of the special token that ended a turn (EOS, Llama-3's <|eot_id|>, ...), or
    None when the turn ended on an ordinary token (cut by the length limit)."""
    if not output_ids or output_ids[-1] not in set(tokenizer.all_special_ids):
        return None
    return tokenizer.convert_ids_to_tokens(output_ids[-1])
