"""The engine's model against transformers on the same weights (float32, unquantized cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reinforge.engine.engine import Engine, EngineConfig, Group, Sequence
from reinforge.engine.loader import load_config, load_model
from reinforge.engine.sampling import SamplingParams

PROMPTS = [
    "Question: What is 12 + 30?\nAnswer:",
    "```python\ndef add(a, b):",
    "$ ls -la",
    "| Item | Q1 | Q2 | Q3 | Q4 |",
    "Ava has 3 apples.",
]


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    results: dict = {}
    for i, ids in enumerate(prompts):
        seqs = [
            Sequence(
                rid=f"r{i}-{j}",
                index=i * params.n + j,
                prompt_ids=ids,
                params=params,
                sink=lambda u: results.__setitem__(u.index, u),
            )
            for j in range(params.n)
        ]
        engine.submit(Group(prompt_ids=ids, seqs=seqs))
    engine.run_until_idle()
    return results


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    prompt = torch.tensor([ids])
    out = hf.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )
    gen = out[0, len(ids) :]
    with torch.no_grad():
        logits = hf(out).logits[0].float()
    lps = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(1, gen[:, None]).flatten()
    return gen.tolist(), lps


def test_greedy_tokens_and_logprobs_match_transformers_with_a_float_cache(tiny_model_dir, hf_tiny):
    hf, tok = hf_tiny
    engine = Engine(
        load_model(tiny_model_dir), EngineConfig(kv_cache_dtype="float32", max_total_tokens=4096)
    )
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    results = run_engine(engine, prompts, params)
    for i, ids in enumerate(prompts):
        gen, lps = hf_greedy(hf, ids, 20)
        assert results[i].output_ids == gen, f"prompt {i}"
        err = (lps - torch.tensor(results[i].output_logprobs)).abs().max().item()
        assert err < 1e-4, f"prompt {i}: logprob error {err}"


def test_int8_cache_agreement_with_transformers_is_measured(tiny_model_dir, hf_tiny):
    hf, tok = hf_tiny
    engine = Engine(
        load_model(tiny_model_dir), EngineConfig(kv_cache_dtype="int8", max_total_tokens=4096)
    )
    prompts = [tok.encode(p) for p in PROMPTS]
    results = run_engine(
        engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    )
    first_errors, agree = [], 0
    for i, ids in enumerate(prompts):
        gen, lps = hf_greedy(hf, ids, 16)
        ours = results[i].output_ids
        n = next((k for k, (a, b) in enumerate(zip(gen, ours)) if a != b), len(gen))
        agree += n
        first_errors.append(abs(lps[0].item() - results[i].output_logprobs[0]))
    print(
        f"int8 KV: greedy tokens agreeing before first divergence {agree}/{16 * len(prompts)}; "
        f"first-token logprob errors {first_errors}"
    )
    # The first token comes from the prefill, which attends over the prompt's KV as stored
    # (int8), as every decode step does: a cached prefix then gives the same token.
    assert max(first_errors) < 0.1
    assert agree >= len(prompts)


def test_model_init_is_deterministic_and_loadable_by_transformers(tiny_model_dir, tmp_path):
    from reinforge.engine.tiny import IM_END, init_tiny_model
    from transformers import AutoTokenizer

    again = init_tiny_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(str(again))
    assert tok.eos_token == IM_END and tok.pad_token is not None
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    text = "Answer: 12 + 30 = 42. #### 42 and \\boxed{42}\ndef f(x):\n    return x"
    assert tok.decode(tok.encode(text)) == text
    config = load_config(again)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    n_params = sum(
        t.numel()
        for t in __import__("safetensors.torch")
        .torch.load_file(str(again / "model.safetensors"))
        .values()
    )
    assert 1_000_000 < n_params < 10_000_000


def _llama_checkpoint(out: Path) -> Path:
    """A Llama-architecture checkpoint with the features real ones have: bf16 weights, untied
    embeddings, attention biases, llama3 rope scaling, a non-default rope_theta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=True,
        initializer_range=0.1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out))
    return out


def test_a_bf16_llama_checkpoint_with_biases_and_rope_scaling_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _llama_checkpoint(tmp_path / "llama")
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_model(path)
    assert ours.config.torch_dtype == "bfloat16" and not ours.config.tie_word_embeddings
    assert ours.weights.layers[0].qkv_bias is not None and ours.weights.layers[0].o_bias is not None
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
        got = ours.prefill(ids, all_logits=True)
    assert (want - got).abs().max().item() < 1e-4
    engine = Engine(ours, EngineConfig(kv_cache_dtype="float32", max_total_tokens=1024))
    results = run_engine(
        engine,
        [ids[:150].tolist()],
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
    )
    gen = hf.generate(
        ids[None, :150],
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, 150, dtype=torch.long),
    )[0, 150:].tolist()
    assert results[0].output_ids == gen


def test_a_checkpoint_with_a_missing_tensor_fails_naming_it(tiny_model_dir, tmp_path):
    from reinforge.engine.loader import load_weights
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_weights(broken, load_config(broken))


def test_a_qwen3_checkpoint_with_per_head_qk_norms_matches_transformers(tmp_path):
    """Qwen3: q and k RMS-normalised per head before RoPE, head_dim not hidden / heads."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1000, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=48, max_position_embeddings=512, tie_word_embeddings=True,
                         initializer_range=0.1)
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so skipping them would show
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(tmp_path / "qwen3"))
    ours = load_model(tmp_path / "qwen3")
    assert ours.config.qk_norm and ours.config.head_dim == 48
    assert ours.weights.layers[0].q_norm.shape == (48,)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3"), dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (120,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
        got = ours.prefill(ids, all_logits=True)
    assert (want - got).abs().max().item() < 1e-4
    engine = Engine(ours, EngineConfig(kv_cache_dtype="float32", max_total_tokens=1024))
    results = run_engine(engine, [ids[:100].tolist()],
                         SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    gen = hf.generate(ids[None, :100], max_new_tokens=20, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, 100, dtype=torch.long))
    assert results[0].output_ids == gen[0, 100:].tolist()
