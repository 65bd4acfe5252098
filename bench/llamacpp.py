"""Benchmark: the embedded engine against llama.cpp on the same pretrained model.

llama.cpp (through llama-cpp-python's low-level API: one context, one batch of every live
sequence per `llama_decode`, greedy by argmax of its logits) runs the GGUF file as it is,
in its own weight format (a Q4_1 file reads about 4.5 bits a weight); the engine runs the
Hugging Face folder `reinforge model import` made from that file, with its weights in
float32, in int8, and lossless (the file's own Q4_1/Q8_0 blocks, found in the folder's
float32 values: the bits llama.cpp reads) (`--weight-dtypes`), and its default int8 KV
cache. Both sides: the same
prompts (math tasks in the model's chat template), the same number of new tokens (EOS
ignored), greedy, every CPU thread the engine uses, the prompt's prefill included in the
time. Batches of 1, 8 and 32 concurrent sequences, interleaved repeats, medians.

    pip install llama-cpp-python      # builds llama.cpp from source (several minutes)
    reinforge model import model.gguf --out models/pre
    python bench/llamacpp.py --gguf model.gguf --model models/pre --json

Prints ONE JSON object as its last line (`--json` prints only that).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np


class LlamaCpp:
    """One llama.cpp context that decodes up to `max_seqs` sequences together."""

    def __init__(self, gguf: Path, max_seqs: int, n_ctx: int, threads: int):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        # No extra buffer types: llama.cpp's AMX path crashed on a VM whose CPU reports AMX
        # (segfault in ggml_backend_amx_mul_mat); plain CPU buffers keep its AVX-512 kernels.
        mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = min(n_ctx, 512)
        params.n_seq_max = max_seqs
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.batch = lc.llama_batch_init(n_ctx, 0, max_seqs)
        self.version = getattr(lc, "__version__", "?")

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, want) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(entries)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                    shape=(self.n_vocab,))
        return int(row.argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy `new_tokens` after each prompt, all sequences in one batch per step."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        entries, last = [], []
        for s, ids in enumerate(prompts):  # every prompt in one prefill batch
            entries += [(t, p, s, p == len(ids) - 1) for p, t in enumerate(ids)]
            last.append(len(entries) - 1)
        self._decode(entries)
        outs = [[self._argmax(i)] for i in last]
        for step in range(1, new_tokens):
            self._decode([(out[-1], len(ids) + step - 1, s, True)
                          for s, (ids, out) in enumerate(zip(prompts, outs))])
            for s, out in enumerate(outs):
                out.append(self._argmax(s))
        return outs


def engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy `new_tokens` after each prompt through bench/engine.py's `run_engine`."""
    from reinforge.engine.sampling import SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))  # bench/ is not a package
    from engine import run_engine

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    _, done = run_engine(engine, prompts, params)
    return [done[i].output_ids for i in range(len(prompts))]


def math_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from reinforge.engine.tokenizer import load_tokenizer
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.prompts import task_prompt_ids

    tok = load_tokenizer(model_dir)
    math = DomainRegistry.default().get("math")
    rng = random.Random(0)
    return [task_prompt_ids(tok, math.prompt(math.sample_task(rng, rng.randrange(3))))
            for _ in range(count)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file llama.cpp runs")
    ap.add_argument("--model", required=True,
                    help="the Hugging Face folder `reinforge model import` made from it")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weight-dtypes", default="float32,int8,lossless",
                    help="the engine's weight formats, one side each")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("bench/llamacpp.py needs llama-cpp-python: pip install llama-cpp-python",
              file=sys.stderr)
        return 2

    import torch
    from reinforge.engine.engine import Engine, EngineConfig, default_torch_threads
    from reinforge.engine.loader import load_model

    threads = default_torch_threads()
    torch.set_num_threads(threads)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = math_prompts(Path(args.model), max(batches))
    n_ctx = sum(map(len, prompts)) + max(batches) * (args.new_tokens + 1)
    cpp = LlamaCpp(Path(args.gguf), max(batches), n_ctx, threads)
    sides = {"llama.cpp": lambda ps: cpp.generate(ps, args.new_tokens)}
    for fmt in args.weight_dtypes.split(","):
        engine = Engine(load_model(args.model, fmt),
                        EngineConfig(max_total_tokens=2 * n_ctx, prefix_cache=False))
        sides[f"engine-{fmt}"] = (lambda e: lambda ps: engine_generate(e, ps, args.new_tokens)
                                  )(engine)
    for run in sides.values():  # warm-up: kernels built, caches touched
        run(prompts[:2])

    result: dict = {"bench": "llamacpp", "gguf": args.gguf, "model": args.model,
                    "new_tokens": args.new_tokens, "threads": threads,
                    "llama_cpp_version": cpp.version, "batches": {}}
    for b in batches:
        times: dict[str, list[float]] = {name: [] for name in sides}
        outs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):  # interleaved: every side sees the same background
            for name, run in sides.items():
                t0 = time.perf_counter()
                outs[name] = run(prompts[:b])
                times[name].append(time.perf_counter() - t0)
        line: dict = {}
        for name, ts in times.items():
            assert all(len(o) == args.new_tokens for o in outs[name])
            line[name] = {"tokens_per_s": round(b * args.new_tokens / statistics.median(ts), 1)}
        ref = line["llama.cpp"]["tokens_per_s"]
        for name in sides:
            if name != "llama.cpp":
                line[name]["vs_llama_cpp"] = round(line[name]["tokens_per_s"] / ref, 3)
                line[name]["greedy_match_vs_llama_cpp"] = round(_agreement(
                    outs[name], outs["llama.cpp"]), 4)
        result["batches"][str(b)] = line
        say(f"batch {b}: " + ", ".join(f"{n} {v['tokens_per_s']} tok/s" for n, v in line.items()))
    print(json.dumps(result))
    return 0


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of tokens equal up to each pair's first divergence (the formats differ: a Q4
    file's llama.cpp logits and the dequantized weights' need not pick the same tokens)."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, sum(map(len, a)))


if __name__ == "__main__":
    raise SystemExit(main())
