"""GGUF files for the engine tests: the tiny policy written as llama.cpp's converter writes
a Qwen2 model (its tensor names, its tokenizer metadata), a matrix as a GGUF quantization
keeps it, and the logits of a folder."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch


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


def roundtrip(w: torch.Tensor, quant: str) -> torch.Tensor:
    """`w` (float32) as llama.cpp's quantizer keeps it (the gguf package's reference of
    `quant`, e.g. "Q8_0"), back in float32."""
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype),
                                                   qtype).copy())


def logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]
