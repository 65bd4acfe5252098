"""`reinforge model import FILE.gguf`: a GGUF file (llama.cpp's format) as a Hugging Face
model folder that the engine, the learner and SFT all load.

transformers reads the file (`gguf_file=`): it builds the tokenizer from the file's
vocabulary, merges, special tokens and chat template, and dequantizes every tensor. What it
loads that way is marked quantized and refuses to be saved, so the weights move into a
plain model built from the same config before they are written (float32 or bfloat16
safetensors). Quantization error stays: a Q4 file imports as the Q4 model, dequantized.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from reinforge.engine.loader import SUPPORTED_MODEL_TYPES

GGUF_MAGIC = b"GGUF"
IMPORT_DTYPES = ("float32", "bfloat16")


def gguf_architecture(path: Path) -> str:
    """The file's `general.architecture` (raises ValueError if `path` is not a GGUF file)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise RuntimeError("reading GGUF files needs the `gguf` package "
                           "(it is in requirements.lock: `pip install gguf`)") from None
    field = GGUFReader(str(path)).get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture: not a model file")
    return str(field.contents())


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *,
                dtype: str = "float32") -> dict[str, Any]:
    """Write `gguf_path` as a Hugging Face folder at `out_dir` (replaced only when the import
    succeeds). Returns what was written: architecture, parameters, dtype, vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such file")
    if dtype not in IMPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(IMPORT_DTYPES)}")
    arch = gguf_architecture(src)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{src}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

    where = {"pretrained_model_name_or_path": str(src.parent), "gguf_file": src.name}
    tokenizer = AutoTokenizer.from_pretrained(**where)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied LM head is not a tensor of its own; anything else missing is a failed import.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{src}: the file's tensors do not fill a {arch} model "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=eos, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)

    staging = out.with_name(f".{out.name}.importing")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return {
        "source": str(src), "out": str(out), "architecture": arch, "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": int(config.vocab_size), "layers": int(config.num_hidden_layers),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }
