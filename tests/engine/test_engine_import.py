"""`reinforge model import`: a GGUF file in, a Hugging Face folder out that the engine loads.

The GGUF files here are the tiny policy written with the `gguf` package (`gguf_helpers`), in
float32 and in Q8_0, so the import can be checked against the weights it came from."""

from __future__ import annotations

import subprocess

import gguf
import torch
from reinforge.cli import reinforge_argv
from reinforge.engine.importer import import_gguf
from reinforge.engine.loader import load_config

from gguf_helpers import logits, roundtrip, write_gguf


def test_a_float32_gguf_imports_to_the_same_model_and_tokenizer(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    src = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    info = import_gguf(src, tmp_path / "imported")
    assert info["architecture"] == "qwen2" and info["chat_template"]

    before, after = (AutoTokenizer.from_pretrained(str(d))
                     for d in (tiny_model_dir, tmp_path / "imported"))
    convo = [{"role": "user", "content": "Compute 12 + 30. End with '#### <answer>'."}]
    text = before.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert after.apply_chat_template(convo, tokenize=False, add_generation_prompt=True) == text
    ids = before.encode(text, add_special_tokens=False)
    assert after.encode(text, add_special_tokens=False) == ids
    assert after.eos_token_id == before.eos_token_id

    torch.testing.assert_close(logits(tmp_path / "imported", ids), logits(tiny_model_dir, ids),
                               rtol=0, atol=1e-5)
    engine_config = load_config(tmp_path / "imported")  # the engine takes the folder as it is
    assert engine_config.model_type == "qwen2"
    assert tuple(engine_config.eos_token_ids) == (before.eos_token_id,)


def test_a_quantized_gguf_imports_as_its_dequantized_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    src = write_gguf(tiny_model_dir, tmp_path / "tiny-q8.gguf", quant="Q8_0")
    import_gguf(src, tmp_path / "imported", dtype="bfloat16")
    got = load_file(str(tmp_path / "imported" / "model.safetensors"))
    ref = load_file(str(tiny_model_dir / "model.safetensors"))
    checked = 0
    for name, weight in ref.items():
        assert got[name].dtype == torch.bfloat16
        w = weight.float()
        if w.ndim == 2:  # what llama.cpp's Q8_0 keeps of it, then rounded to bf16
            w = roundtrip(w, "Q8_0")
            checked += 1
        torch.testing.assert_close(got[name], w.to(torch.bfloat16), rtol=0, atol=0)
    assert checked == 1 + 7 * 4  # the embedding, and 7 projections in each of 4 layers


def test_the_command_refuses_what_it_cannot_import_with_a_clear_error(tiny_model_dir, tmp_path):
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    other_arch = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other_arch), "falcon")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cases = {
        not_gguf: "is not a GGUF file",
        other_arch: "architecture 'falcon' is not supported (supported: qwen2, qwen3, llama)",
        tmp_path / "missing.gguf": "no such file",
    }
    for path, message in cases.items():
        out = subprocess.run(reinforge_argv("model", "import", str(path), "--out",
                                            str(tmp_path / "out")),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (path, out.stderr)
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()
