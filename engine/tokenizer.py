"""The one way reinforge loads a model's tokenizer (rollout server, sampler, evaluator, SFT, benches)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path) -> Any:
    """The Hugging Face tokenizer saved with a model.

    Its Rust thread pool is turned off unless the user chose otherwise: the actors fork
    (sandboxes, servers), and a pool that existed before a fork deadlocks or warns in the
    child."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
