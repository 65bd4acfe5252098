"""Benchmark: the embedded engine against transformers `generate`, same model, prompts, settings.

Workload: 32 prompts in the task formats x n=4 samples, temperature 1, top_p 1, a fixed number
of new tokens (EOS ignored, so both sides generate exactly the same count). The engine runs
in-process (no HTTP) with its default int8 KV cache; transformers runs one padded batch of
32*4 sequences (`num_return_sequences=4`) with its own KV cache, float32.

Also measured: KV bytes per token (int8 vs float32 cache), and greedy agreement with
transformers' greedy `generate` (per prompt, unpadded): the fraction of generated tokens equal
up to the first divergence, for the headline engine's weights (`--weight-dtype`) with a
float32 cache (`greedy_match_fp`) and with its int8 cache (`greedy_match_int8`), plus the
largest logprob error over agreeing tokens. `--weight-dtype lossless` keeps a GGUF import's
Q4_1/Q8_0 blocks as they are (the same float32 values transformers computes with).

Prefix-heavy lines (`prefix_cache`), each run with the prefix cache on and off on one int8
engine, interleaved, median of the repeats:
  * `grpo_group_8`: 8 prompts, each sent as 8 requests of n=1 that arrive one engine step
    apart (a client's GRPO group), 32 new tokens each;
  * `episode_10_turns`: 8 episodes of 10 turns, advanced together: each turn's prompt is the
    last turn's prompt, its output and a new 24-token message, 32 new tokens each.
Long-context line (`long_context`): while 8 sequences decode, a 16k-token prompt arrives
(the tiny policy made with 32k positions); with chunked prefill (1024 tokens per step) and
without: the prompt's prefill tokens/s and the inter-token latency of the running decodes
(median and p99 of the engine steps until the long prompt's first token), int8 cache.
Speculative line (`speculative`): the task prompts, n=1, greedy and temperature 1, with
prompt-lookup drafts of 4 tokens and without: tokens/s, draft tokens accepted per verification
and tokens per engine step. It pays only where outputs repeat their context: give a trained
policy with --model (the tiny random policy rarely repeats).
Roofline line (`weights_roofline`): batch-1 decode (one sequence, greedy, 64 new tokens after
a short prompt) of the wider policy (about 26 M parameters: its float32 weights do not fit
the last-level cache), with the projections served in float32, bfloat16 and int8, and the
fraction of the roofline each reaches: decode tokens/s x weight bytes read per token / this
machine's read bandwidth (bench/kv_kernels.py's probe, in the same run). With it, each
packed format's logprob error against float32 on float32's greedy tokens (teacher-forced).
`--only speedup` runs the headline comparison and the greedy agreement alone (for a
pretrained model given with --model, where the other lines would take long).
The headline comparison with transformers runs without the prefix cache (each repeat sends
the same prompts again, which the cache would turn into a different workload).

Prints ONE JSON object as its last line (`--json` prints only that).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path


def task_prompts(tokenizer, count: int) -> list[list[int]]:
    from reinforge.engine.tiny import synthetic_corpus

    docs = synthetic_corpus(seed=1234, num_docs=count * 4)
    prompts = []
    for doc in docs[:count]:
        head = doc[: max(16, len(doc) // 2)]
        chat = [{"role": "user", "content": head}]
        prompts.append(
            tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return [list(p) for p in prompts]


def run_engine(engine, prompts, params) -> tuple[float, dict]:
    from reinforge.engine.engine import Group, Sequence, make_generator

    results: dict = {}
    for i, ids in enumerate(prompts):
        seqs = [
            Sequence(
                rid=f"{i}-{j}",
                index=i * params.n + j,
                prompt_ids=ids,
                params=params,
                sink=lambda u: results.__setitem__(u.index, u),
                generator=make_generator(params.sampling_seed, j),
            )
            for j in range(params.n)
        ]
        engine.submit(Group(prompt_ids=ids, seqs=seqs))
    t0 = time.perf_counter()
    engine.run_until_idle()
    return time.perf_counter() - t0, results


def grpo_groups(engine, prompts, group: int, params) -> tuple[float, int]:
    """Each prompt sent as `group` requests of n=1, one engine step apart; returns the wall
    time and the generated tokens."""
    from reinforge.engine.engine import Group, Sequence

    done: list = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        for j in range(group):
            seq = Sequence(rid=f"g{i}-{j}", index=j, prompt_ids=ids, params=params,
                           sink=lambda u: u.finish_reason is not None and done.append(u))
            engine.submit(Group(prompt_ids=ids, seqs=[seq]))
            engine.step()
    engine.run_until_idle()
    return time.perf_counter() - t0, sum(len(u.output_ids) for u in done)


def episodes(engine, openings, turns: int, message: list[int], params) -> tuple[float, int]:
    """Multi-turn episodes advanced together: each turn resends the whole history, then the
    output and a new message join it. Returns the wall time and the generated tokens."""
    from reinforge.engine.engine import Group, Sequence

    histories = [list(o) for o in openings]
    generated = 0
    t0 = time.perf_counter()
    for _ in range(turns):
        outs: dict = {}
        for i, ids in enumerate(histories):
            seq = Sequence(
                rid=f"e{i}", index=i, prompt_ids=ids, params=params,
                sink=lambda u: u.finish_reason is not None and outs.__setitem__(u.index, u))
            engine.submit(Group(prompt_ids=ids, seqs=[seq]))
        engine.run_until_idle()
        for i, u in outs.items():
            histories[i] = histories[i] + u.output_ids + message
            generated += len(u.output_ids)
    return time.perf_counter() - t0, generated


def prefix_lines(model, prompts, repeats: int, kernel_backend: str, say) -> dict:
    """Tokens/s with and without the prefix cache on the prefix-heavy workloads."""
    from reinforge.engine.engine import Engine, EngineConfig
    from reinforge.engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True)
    message = [(17 * k) % 500 + 10 for k in range(24)]
    workloads = {
        "grpo_group_8": lambda e: grpo_groups(e, prompts[:8], 8, params),
        "episode_10_turns": lambda e: episodes(e, prompts[:8], 10, message, params),
    }
    out = {}
    for name, work in workloads.items():
        tps: dict[str, list[float]] = {"cache": [], "no_cache": []}
        prefilled: dict[str, int] = {}
        for r in range(repeats):
            for mode in ("cache", "no_cache"):
                engine = Engine(model, EngineConfig(
                    kv_cache_dtype="int8", kernel_backend=kernel_backend, max_total_tokens=65536,
                    prefix_cache=mode == "cache"))
                dt, tokens = work(engine)
                tps[mode].append(tokens / dt)
                prefilled[mode] = engine.statistics().prompt_tokens
            say(f"{name} run {r}: cache {tps['cache'][-1]:.0f} tok/s, "
                f"no cache {tps['no_cache'][-1]:.0f} tok/s")
        ratios = [a / b for a, b in zip(tps["cache"], tps["no_cache"])]
        out[name] = {
            "tokens_per_s_cache": round(statistics.median(tps["cache"]), 1),
            "tokens_per_s_no_cache": round(statistics.median(tps["no_cache"]), 1),
            "cache_speedup": round(statistics.median(ratios), 2),
            "prefilled_tokens_cache": prefilled["cache"],
            "prefilled_tokens_no_cache": prefilled["no_cache"],
        }
    return out


def long_context_lines(prompt_tokens: int, chunk: int, repeats: int, kernel_backend: str,
                       say) -> dict:
    """A long prompt arriving while 8 sequences decode, with and without chunked prefill."""
    from reinforge.engine.engine import Engine, EngineConfig, Group, Sequence
    from reinforge.engine.loader import load_model
    from reinforge.engine.sampling import SamplingParams
    from reinforge.engine.tiny import TinyModelSpec, init_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(max_position_embeddings=2 * prompt_tokens)
        model = load_model(init_tiny_model(Path(tmp) / "long", spec))
    long_prompt = [(7 * i) % 3000 + 10 for i in range(prompt_tokens)]
    decode = SamplingParams(max_new_tokens=2000, temperature=1.0, ignore_eos=True)
    out: dict = {}
    for mode, size in (("chunked", chunk), ("whole", -1)):
        rates, p50s, p99s = [], [], []
        for _ in range(repeats):
            engine = Engine(model, EngineConfig(
                kv_cache_dtype="int8", kernel_backend=kernel_backend, prefix_cache=False,
                max_total_tokens=prompt_tokens + 9 * 2048, chunked_prefill_size=size,
                context_length=2 * prompt_tokens))
            for i in range(8):
                ids = [10 + i, 20, 30, 40]
                engine.submit(Group(prompt_ids=ids, seqs=[Sequence(
                    rid=f"d{i}", index=i, prompt_ids=ids, params=decode, sink=lambda u: None)]))
            for _ in range(3):
                engine.step()
            first: list = []
            engine.submit(Group(prompt_ids=long_prompt, seqs=[Sequence(
                rid="long", index=0, prompt_ids=long_prompt, params=decode, stream=True,
                sink=lambda u: first.append(u))]))
            steps = []
            t0 = time.perf_counter()
            while not first:
                t = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t)
            rates.append(prompt_tokens / (time.perf_counter() - t0))
            steps.sort()
            p50s.append(steps[len(steps) // 2])
            p99s.append(steps[min(len(steps) - 1, math.ceil(0.99 * len(steps)) - 1)])
            engine.abort(abort_all=True)
            engine.run_until_idle()
        out[mode] = {
            "prefill_tokens_per_s": round(statistics.median(rates), 1),
            "inter_token_latency_p50_s": round(statistics.median(p50s), 4),
            "inter_token_latency_p99_s": round(statistics.median(p99s), 4),
        }
        say(f"long context ({prompt_tokens} tokens, {mode}): {out[mode]}")
    return {"prompt_tokens": prompt_tokens, "chunked_prefill_size": chunk, "running": 8,
            **out,
            "p99_latency_ratio_whole_vs_chunked": round(
                out["whole"]["inter_token_latency_p99_s"]
                / out["chunked"]["inter_token_latency_p99_s"], 2)}


def speculative_lines(model, prompts, max_new: int, repeats: int, kernel_backend: str,
                      say) -> dict:
    """Tokens/s with and without prompt-lookup speculative decoding (4 draft tokens)."""
    from reinforge.engine.engine import Engine, EngineConfig
    from reinforge.engine.sampling import SamplingParams

    out: dict = {}
    for name, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                ignore_eos=True, sampling_seed=0)
        tps: dict[str, list[float]] = {"spec": [], "plain": []}
        figures: dict = {}
        for _ in range(repeats):
            for mode, k in (("spec", 4), ("plain", 0)):
                engine = Engine(model, EngineConfig(
                    kv_cache_dtype="int8", kernel_backend=kernel_backend, prefix_cache=False,
                    max_total_tokens=65536, speculative_num_draft_tokens=k))
                dt, res = run_engine(engine, prompts, params)
                tokens = sum(len(u.output_ids) for u in res.values())
                tps[mode].append(tokens / dt)
                st = engine.statistics()
                figures[mode] = {"tokens_per_step": round(tokens / max(1, st.steps), 2),
                                 "accepted_per_verify": round(
                                     st.spec_accepted_tokens / max(1, st.spec_verify_steps), 2),
                                 "draft_acceptance": round(
                                     st.spec_accepted_tokens / max(1, st.spec_draft_tokens), 3)}
        ratios = [a / b for a, b in zip(tps["spec"], tps["plain"])]
        out[name] = {"tokens_per_s_spec": round(statistics.median(tps["spec"]), 1),
                     "tokens_per_s_plain": round(statistics.median(tps["plain"]), 1),
                     "spec_speedup": round(statistics.median(ratios), 2),
                     **{f"spec_{k}": v for k, v in figures["spec"].items()},
                     "plain_tokens_per_step": figures["plain"]["tokens_per_step"]}
        say(f"speculative ({name}): {out[name]}")
    return out


def decode_s(engine, prompt: list[int], new_tokens: int) -> float:
    """Seconds of `new_tokens` batch-1 greedy decode steps after the prompt's first token."""
    from reinforge.engine.sampling import SamplingParams

    times = []
    for n in (1, new_tokens + 1):
        dt, _ = run_engine(engine, [prompt], SamplingParams(
            max_new_tokens=n, temperature=0.0, ignore_eos=True))
        times.append(dt)
    return max(times[1] - times[0], 1e-9)


def roofline_lines(prompt: list[int], new_tokens: int, repeats: int, kernel_backend: str,
                   say) -> dict:
    """Batch-1 decode tokens/s per weight format of the wider policy, against the roofline."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))  # bench/ is not a package
    from kv_kernels import read_bandwidth_gbps

    from reinforge.cli.demo import policy_spec
    from reinforge.engine.engine import Engine, EngineConfig
    from reinforge.engine.linear import WEIGHT_FORMATS
    from reinforge.engine.loader import load_model
    from reinforge.engine.model import decode_weight_bytes
    from reinforge.engine.sampling import SamplingParams
    from reinforge.engine.tiny import init_tiny_model

    from reinforge.kernels.tvm_build import available_cpus

    threads = available_cpus()  # the machine's read bandwidth, every core reading
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny_model(Path(tmp) / "wide", policy_spec("wide"))
        models = {f: load_model(model_dir, f, kernel_backend=kernel_backend)
                  for f in WEIGHT_FORMATS}
    config = EngineConfig(kv_cache_dtype="int8", kernel_backend=kernel_backend,
                          max_total_tokens=4096, prefix_cache=False)
    engines = {f: Engine(m, config) for f, m in models.items()}
    for e in engines.values():
        decode_s(e, prompt, 4)  # warm-up: kernels built or loaded
    read_gbps = read_bandwidth_gbps(threads)
    per_format: dict[str, list[float]] = {f: [] for f in engines}
    for _ in range(repeats):  # interleaved, so every format sees the same background load
        for f, e in engines.items():
            per_format[f].append(new_tokens / decode_s(e, prompt, new_tokens))
    read_gbps = max(read_gbps, read_bandwidth_gbps(threads))
    _, ref = run_engine(engines["float32"], [prompt], SamplingParams(
        max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    seq = torch.tensor(prompt + ref[0].output_ids)
    tokens, pos = seq[len(prompt):], torch.arange(len(prompt) - 1, len(seq) - 1)
    with torch.no_grad():
        lp = {f: torch.log_softmax(m.prefill(seq, all_logits=True), -1)[pos, tokens]
              for f, m in models.items()}
    out: dict = {"read_gbps": round(read_gbps, 2), "read_threads": threads,
                 "new_tokens": new_tokens}
    for f, tps in per_format.items():
        weight_bytes = decode_weight_bytes(models[f].weights)
        tok_s = statistics.median(tps)
        roof = read_gbps * 1e9 / weight_bytes
        err = (lp[f] - lp["float32"]).abs()
        out[f] = {"tokens_per_s": round(tok_s, 1), "weight_bytes": weight_bytes,
                  "roofline_tokens_per_s": round(roof, 1),
                  "vs_roofline": round(tok_s / roof, 3),
                  "kernel_path": models[f].linear.path if f != "float32" else "torch",
                  "logprob_err_max": round(float(err.max()), 4),
                  "logprob_err_mean": round(float(err.mean()), 5)}
        say(f"roofline {f}: {tok_s:.1f} tok/s at batch 1, roofline {roof:.1f} tok/s "
            f"({tok_s / roof:.2f}); logprob error max {float(err.max()):.4f}")
    return out


def greedy_agreement(engine, hf, prompts, max_new: int) -> tuple[float, float]:
    import torch
    from reinforge.engine.sampling import SamplingParams

    _, res = run_engine(
        engine, prompts, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    )
    agree, total, max_err = 0, 0, 0.0
    for i, ids in enumerate(prompts):
        prompt = torch.tensor([ids])
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        gen = out[0, len(ids) :]
        with torch.inference_mode():
            lps = (
                torch.log_softmax(hf(out).logits[0].float(), -1)[len(ids) - 1 : -1]
                .gather(1, gen[:, None])
                .flatten()
            )
        ours = res[i].output_ids
        n = next((k for k, (a, b) in enumerate(zip(gen.tolist(), ours)) if a != b), max_new)
        agree += n
        total += max_new
        if n:
            max_err = max(
                max_err, (lps[:n] - torch.tensor(res[i].output_logprobs[:n])).abs().max().item()
            )
    return agree / total, max_err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--model", help="HF model dir (default: a fresh `reinforge model init`)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each side (median reported)"
    )
    ap.add_argument("--kernel-backend", default="auto")
    ap.add_argument("--weight-dtype", choices=["float32", "bfloat16", "int8", "lossless"],
                    default="float32",
                    help="the engine's weights in the headline comparison and the greedy "
                         "agreement (transformers keeps float32)")
    ap.add_argument("--long-prompt-tokens", type=int, default=16384)
    ap.add_argument("--only", choices=["roofline", "speedup"], default=None,
                    help="run only this line (and print it as the JSON object)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for BOTH sides (default: the engine's policy, default_torch_threads())",
    )
    args = ap.parse_args()

    import torch
    from reinforge.engine.engine import Engine, EngineConfig, default_torch_threads
    from reinforge.engine.loader import load_model
    from reinforge.engine.sampling import SamplingParams
    from reinforge.engine.tiny import init_tiny_model
    from reinforge.engine.tokenizer import load_tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads or default_torch_threads())
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if args.only == "roofline":
        with tempfile.TemporaryDirectory() as tmp:
            tok = load_tokenizer(init_tiny_model(Path(tmp) / "tiny"))
        roofline = roofline_lines(task_prompts(tok, 1)[0], 64, max(args.repeats, 3),
                                  args.kernel_backend, say)
        print(json.dumps({"bench": "engine", "weights_roofline": roofline,
                          "torch_threads": torch.get_num_threads()}))
        return 0
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(args.model) if args.model else init_tiny_model(Path(tmp.name) / "tiny")
    tok = load_tokenizer(model_dir)
    prompts = task_prompts(tok, args.prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = load_model(model_dir)
    headline_model = model if args.weight_dtype == "float32" else load_model(
        model_dir, args.weight_dtype, kernel_backend=args.kernel_backend)
    total_new = len(prompts) * args.n * args.max_new_tokens
    capacity = 2 * len(prompts) * args.n * (max(map(len, prompts)) + args.max_new_tokens + 16)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, n=args.n, ignore_eos=True
    )

    engine = Engine(
        headline_model,
        EngineConfig(
            kv_cache_dtype="int8", kernel_backend=args.kernel_backend, max_total_tokens=capacity,
            prefix_cache=False,
        ),
    )
    # transformers: one padded batch, left padding, num_return_sequences=n.
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def hf_run(rows: int, new_tokens: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids[:rows],
                attention_mask=mask[:rows],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                num_return_sequences=args.n,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        assert out.shape == (rows * args.n, width + new_tokens)
        return time.perf_counter() - t0

    run_engine(
        engine, prompts[:4], SamplingParams(max_new_tokens=4, n=args.n)
    )  # warm-up (TVM load)
    hf_run(min(4, len(prompts)), 4)  # fewer than 4 prompts: a batch of 8 is 2 x n=4
    # Interleaved runs, so both sides see the same background load; the ratio is per pair.
    engine_times, hf_times, ratios = [], [], []
    for r in range(args.repeats):
        dt, res = run_engine(engine, prompts, params)
        assert sum(len(u.output_ids) for u in res.values()) == total_new
        hf_dt = hf_run(len(prompts), args.max_new_tokens)
        engine_times.append(dt)
        hf_times.append(hf_dt)
        ratios.append(hf_dt / dt)
        say(
            f"run {r}: engine {dt:.2f} s ({total_new / dt:.0f} tok/s), transformers {hf_dt:.2f} s "
            f"({total_new / hf_dt:.0f} tok/s), ratio {hf_dt / dt:.2f}"
        )

    fp_engine = Engine(headline_model, EngineConfig(kv_cache_dtype="float32",
                                                    max_total_tokens=capacity, prefix_cache=False))
    lines: dict = {}
    if args.only != "speedup":
        lines["prefix_cache"] = prefix_lines(model, prompts, args.repeats, args.kernel_backend,
                                             say)
        lines["long_context"] = long_context_lines(args.long_prompt_tokens, 1024, args.repeats,
                                                   args.kernel_backend, say)
        lines["speculative"] = speculative_lines(model, prompts, args.max_new_tokens,
                                                 args.repeats, args.kernel_backend, say)
        lines["weights_roofline"] = roofline_lines(prompts[0], 64, max(args.repeats, 3),
                                                   args.kernel_backend, say)
    greedy_fp, err_fp = greedy_agreement(fp_engine, hf, prompts, args.greedy_tokens)
    greedy_i8, err_i8 = greedy_agreement(engine, hf, prompts, args.greedy_tokens)
    engine_tps = total_new / statistics.median(engine_times)
    hf_tps = total_new / statistics.median(hf_times)
    result = {
        "bench": "engine",
        "model": str(model_dir) if args.model else "tiny (reinforge model init)",
        "model_type": model.config.model_type,
        "model_params": sum(t.numel() for t in hf.parameters()),
        "prompts": len(prompts),
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "kv_backend": engine.pool.ops.name,
        "engine_weight_dtype": args.weight_dtype,
        "weight_kernel_path": headline_model.linear.path,
        "layer_ops_path": headline_model.ops.path,
        "engine_tokens_per_s": round(engine_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "speedup": round(statistics.median(ratios), 2),
        "speedup_per_run": [round(x, 2) for x in ratios],
        "engine_s": [round(t, 3) for t in engine_times],
        "hf_s": [round(t, 3) for t in hf_times],
        "kv_bytes_per_token": {
            "int8": engine.pool.bytes_per_token(),
            "float32": fp_engine.pool.bytes_per_token(),
        },
        "kv_compression": round(
            fp_engine.pool.bytes_per_token() / engine.pool.bytes_per_token(), 2
        ),
        "greedy_match_fp": round(greedy_fp, 4),
        "greedy_match_int8": round(greedy_i8, 4),  # the headline engine: its weights, int8 KV
        "max_logprob_err_fp": err_fp,
        "max_logprob_err_int8": err_i8,
        **lines,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
