#!/usr/bin/env bash
# Set up a fresh machine for reinforge: system packages (when root), rootless Podman
# and its sandbox image, the virtual environment at .venv, and the package itself.
# Idempotent: a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY' || { echo "bootstrap: reinforge needs Python >= 3.11" >&2; exit 1; }
import sys; raise SystemExit(sys.version_info < (3, 11))
PY

step() { printf '\n==> %s\n' "$*"; }

# iproute2 (network namespaces of the multi-host test) and openssl (its route TLS).
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v openssl; } >/dev/null 2>&1; then
  step "system packages: iproute2 openssl"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 openssl
fi

if [ -f scripts/setup_podman.sh ]; then
  step "rootless Podman (sandboxes)"
  bash scripts/setup_podman.sh
fi

if [ ! -x .venv/bin/python ]; then
  step "virtual environment .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi

# A plain `torch` would pull a multi-GB CUDA build; the CPU wheel is pinned first.
# Set REINFORGE_TORCH to another spec (e.g. "torch" on a GPU machine) to change it.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  step "torch (${REINFORGE_TORCH:-torch==2.13.0})"
  .venv/bin/pip install -q "${REINFORGE_TORCH:-torch==2.13.0}"
fi

# Everything else at the exact versions of requirements.lock (`make lock` refreshes it),
# then reinforge itself, editable, with nothing resolved anew. Skipped when the venv
# already holds this lock.
stamp=.venv/.reinforge-lock.sha256
want="$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "locked dependencies (requirements.lock) and reinforge"
  .venv/bin/pip install -q -r requirements.lock
  # setuptools warns that the folder reinforge/ could shadow the package: it is the
  # package. (The folders that could shadow others are handled in reinforge/__init__.py.)
  PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/pip install -q --no-deps --no-build-isolation -e .
  .venv/bin/pip check
  echo "$want" > "$stamp"
fi
.venv/bin/reinforge --help >/dev/null
echo "bootstrap: ready (.venv/bin/reinforge)"
