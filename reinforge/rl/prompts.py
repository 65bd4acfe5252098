"""The token ids the policy sees for a task: one definition for SFT, sampling and evaluation.

Three places build a prompt from a task (the SFT warm start, the sampler, the evaluator);
if any of them formats it differently, SFT trains a format RL never shows and the
evaluation measures a third. So they all call `task_prompt_ids`.
"""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]], *,
                     chat_template: bool = True) -> list[int]:
    """The prompt of a conversation: the tokenizer's chat template with the generation
    prompt when it has one (and `chat_template`), else the messages' contents, one per
    line. Special tokens come from the template only (no tokenizer-added BOS)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages) + "\n"
    return list(tokenizer.encode(text, add_special_tokens=False))


def task_prompt_ids(tokenizer: Any, prompt: str, *, chat_template: bool = True) -> list[int]:
    """A task's prompt as the policy sees it: one user turn."""
    return prompt_token_ids(tokenizer, [{"role": "user", "content": prompt}],
                            chat_template=chat_template)
