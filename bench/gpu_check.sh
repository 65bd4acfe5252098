#!/usr/bin/env bash
# GPU checks, in one prepared script. The GPU host has no network and no TVM, so:
#
#   1. here (the CPU dev machine, with the venv):   bash bench/gpu_check.sh prepare
#      builds .gpu/ (~16 MiB): TVM's runtime without its compiler, the apache-tvm-ffi wheel
#      for the GPU host's Python, and the int8 cuda kernels compiled here (sm_90).
#      Keep .gpu/ out of git (.git/info/exclude) and carry it to the GPU host.
#   2. on the GPU host:                              bash bench/gpu_check.sh
#      installs the bundle under /tmp, then runs bench/kv_kernels.py on the GPU (same
#      benchmark: TVM cuda kernels vs the torch twin on the GPU, read bandwidth of the GPU);
#      the last line is one JSON object. CUDA source in the module is compiled by nvcc there
#      at first use.
#
# Environment: PYTHON (default: .venv/bin/python to prepare, python3 to run), GPU_BUNDLE
# (default .gpu), GPU_ARCH (default sm_90), GPU_PYTHON_VERSION (default 3.12).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${GPU_BUNDLE:-$ROOT/.gpu}

if [ "${1:-run}" = "prepare" ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  "$PY" -m reinforge.kernels.gpu_bundle "$BUNDLE" \
    --python-version "${GPU_PYTHON_VERSION:-3.12}" --arch "${GPU_ARCH:-sm_90}"
  exit 0
fi

[ "${1:-}" = "run" ] && shift
PY=${PYTHON:-python3}
[ -d "$BUNDLE/site/tvm" ] || { echo "gpu_check: no bundle at $BUNDLE: run 'bash bench/gpu_check.sh prepare' on the dev machine and carry it" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi -L

SITE=$(mktemp -d /tmp/rf-site.XXXXXX)
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$BUNDLE"/wheels/*.whl
cp -r "$BUNDLE/site/tvm" "$SITE/"
# reinforge.kernels without installing the project: a package dir whose kernels/ is ours
mkdir -p "$SITE/reinforge"
cp "$ROOT/reinforge/__init__.py" "$SITE/reinforge/"
ln -sfn "$ROOT/kernels" "$SITE/reinforge/kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1

# libcudart.so.13 for libtvm_runtime_cuda.so: the toolkit's, or the one torch ships
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -e "$d/libcudart.so.13" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
if ! ls ${LD_LIBRARY_PATH//:/ } 2>/dev/null | grep -q 'libcudart.so.13'; then
  d=$("$PY" - <<'EOF'
import pathlib, site
for root in site.getsitepackages():
    for p in pathlib.Path(root, "nvidia").rglob("libcudart.so.13*"):
        print(p.parent); raise SystemExit
EOF
)
  [ -n "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PATH="$PATH:/usr/local/cuda/bin"

"$PY" "$ROOT/bench/kv_kernels.py" --json --device cuda --cuda-module "$BUNDLE/kv_int8_cuda.so" "$@"
