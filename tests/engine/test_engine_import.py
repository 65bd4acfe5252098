"""`reinforge model import`: a GGUF file in, a Hugging Face folder out that the engine loads.

The GGUF files here are written with the `gguf` package from the tiny policy, in float32
and in Q8_0 (the way llama.cpp's converter writes a Qwen2 model: its tensor names, its
tokenizer metadata), so the import can be checked against the weights it came from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import numpy as np
import torch
from reinforge.cli import reinforge_argv
from reinforge.engine.importer import import_gguf
from reinforge.engine.loader import load_config




def write_gguf(model_dir: Path, path: Path, *, quant: str = "F32",
               arch: str = "qwen2") -> Path:
    """The tiny Qwen2 policy as llama.cpp's converter would write it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == c.vocab_size
    special = set(tok.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        q = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(data, q),
                     raw_shape=gguf.quant_shape_to_byte_shape(data.shape, q)
                     if q != gguf.GGMLQuantizationType.F32 else None, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


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
    q8 = gguf.GGMLQuantizationType.Q8_0
    checked = 0
    for name, weight in ref.items():
        assert got[name].dtype == torch.bfloat16
        w = weight.float().numpy()
        if w.ndim == 2:  # what llama.cpp's Q8_0 keeps of it, then rounded to bf16
            w = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8)
            checked += 1
        torch.testing.assert_close(got[name], torch.from_numpy(w).to(torch.bfloat16),
                                   rtol=0, atol=0)
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
