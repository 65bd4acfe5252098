"""Load a Hugging Face-format model directory (config.json, *.safetensors, tokenizer files).

Reads the same files the learner writes and SGLang loads. Honours tied embeddings, q/k/v
biases (Qwen2; Llama's `attention_bias`), rope_theta and rope scaling (through transformers'
own rope functions, so every rope type transformers knows is computed identically), bf16 or
fp16 weights (upcast to float32 for the CPU), sharded checkpoints (`*.safetensors` with an
index). Dynamic-NTK rope is computed at its base length (no per-length re-scaling).
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import torch
from reinforge.engine.layer_ops import LayerOps
from reinforge.engine.linear import BlockWeight, Linear, Weight, check_format, pack
from reinforge.engine.model import LayerWeights, Model, ModelConfig, Rope, Weights

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} is missing: a model directory needs config.json and safetensors"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def _hf_config(model_dir: Path):
    from transformers import AutoConfig

    _read_json(model_dir / "config.json")  # a clear error first if it is missing
    return AutoConfig.from_pretrained(str(model_dir))


def _eos_ids(model_dir: Path, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(hf_config, "eos_token_id", None),):
        ids += source if isinstance(source, list) else ([source] if source is not None else [])
    gen = model_dir / "generation_config.json"
    if gen.exists():
        value = _read_json(gen).get("eos_token_id")
        ids += value if isinstance(value, list) else ([value] if value is not None else [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_config(model_dir: str | Path) -> ModelConfig:
    """The engine's view of `model_dir/config.json` (raises ValueError if unsupported)."""
    model_dir = Path(model_dir)
    hf = _hf_config(model_dir)
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{model_dir}/config.json: model_type {hf.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"{model_dir}/config.json: mlp_bias=true is not supported")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(f"{model_dir}/config.json: sliding-window attention is not supported")
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"
    return ModelConfig(
        model_type=hf.model_type,
        architectures=tuple(getattr(hf, "architectures", None) or ()),
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(hf.max_position_embeddings),
        eos_token_ids=_eos_ids(model_dir, hf),
        torch_dtype=str(dtype).removeprefix("torch."),
        qk_norm=hf.model_type == "qwen3",
    )


def load_rope(model_dir: str | Path) -> Rope:
    """inv_freq and attention scaling exactly as transformers computes them for this config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf_config(Path(model_dir))
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return Rope(inv_freq=inv_freq, attention_scaling=1.0)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"{model_dir}/config.json: rope_type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return Rope(inv_freq=inv_freq.float(), attention_scaling=float(scaling))


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (all shards), with the `model.` prefix kept."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors files (only safetensors checkpoints load)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def weights_from_state_dict(
    config: ModelConfig, state: dict[str, torch.Tensor], where: str = "checkpoint",
    weight_format: str = "float32",
) -> Weights:
    """Turn HF parameter names into `Weights` (float32, q/k/v and gate/up stacked; the
    projections and the LM head then stored in `weight_format`)."""
    check_format(weight_format)

    def packed(t: torch.Tensor) -> Weight:
        return pack(t.contiguous(), weight_format)

    def norm(name: str) -> torch.Tensor:  # Qwen3's per-head q/k RMSNorm weights
        return expect(name, take(name), (config.head_dim,)).contiguous()

    used: set[str] = set()

    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        if name not in state:
            if optional:
                return None
            raise KeyError(f"{where}: tensor {name!r} is missing")
        used.add(name)
        return state[name].to(torch.float32)

    def expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(t.shape)}, config says {shape}"
            )
        return t

    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        q = expect(p + "q_proj", take(p + "self_attn.q_proj.weight"), (q_out, c.hidden_size))
        k = expect(p + "k_proj", take(p + "self_attn.k_proj.weight"), (kv_out, c.hidden_size))
        v = expect(p + "v_proj", take(p + "self_attn.v_proj.weight"), (kv_out, c.hidden_size))
        biases = [take(p + f"self_attn.{n}_proj.bias", optional=True) for n in "qkv"]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError(f"{where}: layer {i} has biases on only some of q/k/v")
        gate = expect(
            p + "gate_proj", take(p + "mlp.gate_proj.weight"), (c.intermediate_size, c.hidden_size)
        )
        up = expect(
            p + "up_proj", take(p + "mlp.up_proj.weight"), (c.intermediate_size, c.hidden_size)
        )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight").contiguous(),
                qkv_proj=packed(torch.cat([q, k, v])),
                qkv_bias=None if biases[0] is None else torch.cat(biases).contiguous(),
                o_proj=packed(take(p + "self_attn.o_proj.weight")),
                o_bias=take(p + "self_attn.o_proj.bias", optional=True),
                post_norm=take(p + "post_attention_layernorm.weight").contiguous(),
                gate_up_proj=packed(torch.cat([gate, up])),
                down_proj=packed(take(p + "mlp.down_proj.weight")),
                q_norm=norm(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if c.qk_norm else None,
            )
        )
    embed = expect(
        "embed_tokens", take("model.embed_tokens.weight"), (c.vocab_size, c.hidden_size)
    ).contiguous()
    final_norm = take("model.norm.weight").contiguous()
    lm_head = take("lm_head.weight", optional=c.tie_word_embeddings)
    if lm_head is None or c.tie_word_embeddings:
        lm_head = embed
    unused = sorted(set(state) - used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(
            f"{where}: {len(unused)} tensors are not used by a {c.model_type} model, "
            f"e.g. {unused[:3]}"
        )
    weights = Weights(  # a tied LM head in another format is a packed copy of the embedding
        embed_tokens=embed, layers=layers, final_norm=final_norm, lm_head=packed(lm_head),
        weight_format=weight_format,
    )
    if weight_format == "lossless":
        kinds = collections.Counter(m.kind if isinstance(m, BlockWeight) else "float32"
                                    for m in weights.matrices())
        log.info("%s: lossless weights, matrices by form: %s", where, dict(sorted(kinds.items())))
    return weights


def load_weights(model_dir: str | Path, config: ModelConfig,
                 weight_format: str = "float32") -> Weights:
    """Read and convert the weights of `model_dir` for `config`."""
    return weights_from_state_dict(config, load_state_dict(model_dir), where=str(model_dir),
                                   weight_format=weight_format)


def load_model(model_dir: str | Path, weight_format: str = "float32", *,
               kernel_backend: str = "auto") -> Model:
    """Config, rope and weights of a Hugging Face-format directory, ready for the engine;
    `kernel_backend` picks how packed weights are multiplied (`linear.Linear`) and how
    RMSNorm and RoPE run (`layer_ops.LayerOps`)."""
    config = load_config(model_dir)
    return Model(config, load_weights(model_dir, config, weight_format), load_rope(model_dir),
                 Linear(kernel_backend), LayerOps(kernel_backend))
