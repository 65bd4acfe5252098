#!/usr/bin/env bash
# Tomorrow's releases, today: install reinforge with the NEWEST versions pyproject.toml
# allows (not requirements.lock) into a throwaway venv, and run the smoke subset (every
# module imports, one actor round-trip, one engine request, one sandbox check, one learner
# step, the model imports from the repo root). A failure here is what a fresh machine will
# see once the lock is refreshed: fix it, or tighten the range, before `make lock`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="$(mktemp -d -t reinforge-latest.XXXXXX)"
trap 'rm -rf "$VENV"' EXIT
echo "==> a throwaway venv: $VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "${REINFORGE_TORCH:-torch==2.13.0}"  # the CPU build first, as bootstrap
# torch stays the build just installed: an eager upgrade would swap in the CUDA build.
"$VENV/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' > "$VENV/torch.txt"
echo "==> the newest allowed versions of everything else"
PYTHONWARNINGS="ignore:Editable installation" \
  "$VENV/bin/pip" install -q --upgrade --upgrade-strategy eager -c "$VENV/torch.txt" -e '.[test]'
"$VENV/bin/pip" check

echo "==> versions that differ from requirements.lock"
"$VENV/bin/pip" freeze 2>/dev/null | grep -v -e '^-e ' -e '^#' -e '^torch==' | sort > "$VENV/latest.txt"
grep -E '^[A-Za-z0-9_.-]+==' requirements.lock | sed 's/ .*//' | sort > "$VENV/locked.txt"
python3 - "$VENV/locked.txt" "$VENV/latest.txt" <<'PY'
import re, sys
def read(path):
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
    return dict((norm(a), b) for a, b in (l.strip().split("==", 1) for l in open(path) if "==" in l))
locked, latest = read(sys.argv[1]), read(sys.argv[2])
changed = [f"  {n}: {locked.get(n, '(new)')} -> {v}" for n, v in sorted(latest.items()) if locked.get(n) != v]
print("\n".join(changed) or "  none: the lock is the newest")
PY

echo "==> the smoke subset"
# Editable: the throwaway venv's reinforge is this checkout; .venv is left as the lock has it.
CI="${CI:-true}" "$VENV/bin/python" -m pytest -m smoke -p no:cacheprovider -q "$@"
