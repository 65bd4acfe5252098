"""Benchmark: decode's weight products (kernels/tvm_gemv.py) by weight format and row tile.

The products of one decode step of a Llama-shaped model (default SmolLM2-135M's: 30 layers
of q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536, and the 49152 x 576
head) at `--rows` activation rows, on one TVM thread (the engine's default), random weights
in each format. Each format runs with a tile of 4 rows (the baseline) and of 8, the runs
interleaved; the figure per format is the median time of a step's products and the
ratio tile 8 / tile 4 (below 1: tile 8 is faster). The engine's choice is
`tvm_gemv.TILES`.

    python bench/gemv.py --json     # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def shapes(layers: int, hidden: int, ffn: int, qkv: int, vocab: int) -> list[tuple[int, int]]:
    per_layer = [(qkv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
    return per_layer * layers + [(vocab, hidden)]


def weights(fmt: str, out: int, k: int, gen):
    import torch

    if fmt in ("int8", "q8b"):
        w = torch.randint(-127, 128, (out, k), dtype=torch.int8, generator=gen)
    elif fmt == "q4b":
        w = torch.randint(0, 256, (out, k // 2), dtype=torch.uint8, generator=gen)
    else:
        w = torch.randn(out, k, generator=gen).to(torch.bfloat16).view(torch.uint16)
    s = torch.rand(out, generator=gen) if fmt in ("int8", "bf16") else torch.rand(
        out, k // 16, generator=gen)
    return w, s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--rows", type=int, default=8, help="activation rows (decode batch)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--formats", default="int8,bf16,q8b,q4b")
    args = ap.parse_args()

    import torch
    import tvm
    from reinforge.kernels.tvm_build import configure_threads, host_target
    from reinforge.kernels.tvm_gemv import TILES, make_gemv

    configure_threads(1)
    torch.set_num_threads(1)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    target, gen = host_target(), torch.Generator().manual_seed(0)
    step = shapes(30, 576, 1536, 960, 49152)
    built: dict = {}

    def kernel(fmt: str, k: int, tile: int):
        if (fmt, k, tile) not in built:
            funcs = {f"gemv_{fmt}": make_gemv(fmt, k, tile=tile)}
            built[fmt, k, tile] = tvm.compile(tvm.IRModule(funcs), target=target)[f"gemv_{fmt}"]
        return built[fmt, k, tile]

    formats = args.formats.split(",")
    calls = {}
    for fmt in formats:
        packed = [weights(fmt, out, k, gen) for out, k in step]
        for tile in (4, 8):
            calls[fmt, tile] = [(kernel(fmt, k, tile), w, s, torch.randn(args.rows, k),
                                 torch.empty(args.rows, out))
                                for (out, k), (w, s) in zip(step, packed)]
    times: dict = {key: [] for key in calls}
    for r in range(args.repeats):
        for key, products in calls.items():
            t0 = time.perf_counter()
            for f, w, s, x, y in products:
                f(x, w, s, y)
            times[key].append(time.perf_counter() - t0)
        say(f"repeat {r}: " + ", ".join(f"{f}/{t} {times[f, t][-1] * 1e3:.1f} ms"
                                        for f, t in calls))
    result = {"bench": "gemv", "rows": args.rows, "tvm_threads": 1, "repeats": args.repeats,
              "engine_tiles": {f: TILES[f] for f in formats}, "formats": {}}
    for fmt in formats:
        t4, t8 = (statistics.median(times[fmt, t]) for t in (4, 8))
        result["formats"][fmt] = {"tile4_ms": round(t4 * 1e3, 2), "tile8_ms": round(t8 * 1e3, 2),
                                  "tile8_over_tile4": round(t8 / t4, 3)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
