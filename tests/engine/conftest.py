"""Fixtures of the engine tests: one tiny policy per session (`reinforge model init`'s code)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reinforge.engine.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_dir))
