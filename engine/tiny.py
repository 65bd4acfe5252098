"""`reinforge model init`: a tiny Qwen2-architecture policy and its tokenizer, for the CPU.

The tokenizer is a byte-level BPE trained with `tokenizers` on a synthetic corpus covering
the task formats (arithmetic and word problems answered `#### 42` or `\\boxed{42}`, short
Python functions, financial-statement-like tables, shell commands), with a Qwen-style chat
template and `<|im_end|>` as EOS. The weights are randomly initialised by transformers'
own Qwen2 initialiser under a fixed seed. Everything is saved in Hugging Face format
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so transformers
and SGLang load it. The same seed and sizes give byte-identical files.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgspec

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TinyModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Sizes of the default CPU policy (about 4 M parameters with the defaults)."""

    vocab_size: int = 4096
    """BPE vocabulary size, special tokens included."""
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    initializer_range: float = 0.08
    """Std of the random init; larger than HF's 0.02 so greedy choices are not near-ties."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.vocab_size < 300:
            raise ValueError(
                f"vocab_size {self.vocab_size} is below the 256 byte tokens plus merges"
            )


def synthetic_corpus(seed: int, num_docs: int = 3000) -> list[str]:
    """Documents in the task formats, deterministic for a seed."""
    rng = random.Random(seed)
    names = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun"]
    items = ["apples", "books", "coins", "pencils", "tickets", "marbles", "cookies", "stamps"]
    companies = [
        "Acme Corp",
        "Globex",
        "Initech",
        "Umbrella Ltd",
        "Stark Industries",
        "Wayne Enterprises",
    ]
    rows = [
        "Revenue",
        "Cost of revenue",
        "Gross profit",
        "Operating expenses",
        "Net income",
        "Total assets",
    ]
    cmds = [
        "ls -la",
        "grep -rn TODO src/",
        "find . -name '*.py'",
        "cat /etc/os-release",
        "wc -l data.csv",
        "tar -czf out.tar.gz build/",
        "python3 -m pytest -q",
        "sort -n nums.txt | uniq -c",
        "df -h /",
    ]
    docs: list[str] = []
    for _ in range(num_docs):
        kind = rng.randrange(6)
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        if kind == 0:
            op = rng.choice("+-*")
            ans = a + b if op == "+" else a - b if op == "-" else a * b
            tail = f"#### {ans}" if rng.random() < 0.5 else f"\\boxed{{{ans}}}"
            docs.append(f"Question: What is {a} {op} {b}?\nAnswer: {a} {op} {b} = {ans}. {tail}")
        elif kind == 1:
            who, what = rng.choice(names), rng.choice(items)
            c = rng.randint(1, 50)
            docs.append(
                f"{who} has {a} {what}. {who} buys {c} more and gives away {min(c, a)}. "
                f"How many {what} does {who} have now?\nStep 1: {a} + {c} = {a + c}.\n"
                f"Step 2: {a + c} - {min(c, a)} = {a + c - min(c, a)}.\n#### {a + c - min(c, a)}"
            )
        elif kind == 2:
            fname = rng.choice(["add", "mul", "clamp", "is_even", "fib", "mean", "count_words"])
            body = {
                "add": "def add(a, b):\n    return a + b\n",
                "mul": "def mul(a, b):\n    return a * b\n",
                "clamp": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
                "is_even": "def is_even(n):\n    return n % 2 == 0\n",
                "fib": (
                    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                    "        a, b = b, a + b\n    return a\n"
                ),
                "mean": (
                    "def mean(xs):\n    if not xs:\n        return 0.0\n"
                    "    return sum(xs) / len(xs)\n"
                ),
                "count_words": "def count_words(s):\n    return len(s.split())\n",
            }[fname]
            docs.append(f"```python\n{body}```\nassert {fname}.__name__ == '{fname}'")
        elif kind == 3:
            comp, year = rng.choice(companies), rng.randint(2015, 2026)
            lines = [
                f"{comp} — Consolidated statement, fiscal year {year} (in thousands USD)",
                "| Item | Q1 | Q2 | Q3 | Q4 |",
                "|---|---|---|---|---|",
            ]
            for row in rng.sample(rows, 4):
                vals = [f"{rng.randint(100, 99999):,}" for _ in range(4)]
                lines.append(f"| {row} | " + " | ".join(vals) + " |")
            lines.append(
                f"Net margin: {rng.uniform(-20, 40):.1f}%. EPS: ${rng.uniform(0, 12):.2f}."
            )
            docs.append("\n".join(lines))
        elif kind == 4:
            docs.append(f"$ {rng.choice(cmds)}\n$ echo $?\n{rng.choice([0, 0, 1, 2])}")
        else:
            q = f"Compute {a} + {b}."
            docs.append(
                f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n"
                f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.{IM_END}\n"
            )
    return docs


def train_tokenizer(spec: TinyModelSpec):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `synthetic_corpus(spec.seed)`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(spec.seed), trainer=trainer)
    return tok


def init_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the tiny policy (weights, config, tokenizer) to out_dir in Hugging Face format."""
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=spec.max_position_embeddings,
    )
    tok.chat_template = CHAT_TEMPLATE
    vocab = len(tok)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    _make_tokenizer_config_portable(out / "tokenizer_config.json")
    return out


def _make_tokenizer_config_portable(path: Path) -> None:
    """Name the generic fast tokenizer class and inline the chat template, so that
    transformers 4.x (which older SGLang pins) loads the tokenizer as transformers 5 does."""
    import json

    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["additional_special_tokens"] = [IM_START]
    data["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
