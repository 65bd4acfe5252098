"""bench/gemv.py runs the kernels it names at both tiles and reports the engine's choice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reinforge.kernels.tvm_gemv import TILES


def test_the_gemv_bench_times_both_tiles_of_each_format_it_is_given():
    bench = Path(__file__).parent.parent.parent / "bench" / "gemv.py"
    out = subprocess.run([sys.executable, str(bench), "--json", "--rows", "3", "--repeats", "1",
                          "--formats", "int8,q4b"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rows"] == 3 and sorted(result["formats"]) == ["int8", "q4b"]
    assert result["engine_tiles"] == {"int8": TILES["int8"], "q4b": TILES["q4b"]}
    for fmt in ("int8", "q4b"):
        line = result["formats"][fmt]
        assert line["tile4_ms"] > 0 and line["tile8_ms"] > 0 and line["tile8_over_tile4"] > 0
