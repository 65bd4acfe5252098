#!/usr/bin/env bash
# Screenshots of `reinforge ui` for the docs: the overview, the rollout browser and one
# task's history, taken by headless Chromium from a run's exported message log.
#   scripts/ui_screenshots.sh RUN.log OUT_DIR TASK_ID
set -euo pipefail
log=$1 out=$2 task=$3
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'kill "$ui" 2>/dev/null; rm -rf "$tmp"' EXIT
.venv/bin/reinforge ui --log "$log" --port 0 --port-file "$tmp/port" >/dev/null 2>&1 &
ui=$!
for _ in $(seq 300); do [ -s "$tmp/port" ] && break; sleep 0.1; done
read -r port token < "$tmp/port" || true  # no newline at its end
base="http://127.0.0.1:$port"
quoted=$(.venv/bin/python -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1]))' "$task")
shoot() {  # NAME PATH: each shot is a new browser, so the token rides in every URL
  chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-sync --disable-component-update --hide-scrollbars --window-size=1200,900 \
    --user-data-dir="$tmp/profile" --screenshot="$out/$1.png" "$base$2&token=$token" 2>/dev/null
  echo "$out/$1.png"
}
shoot overview "/?"
shoot rollouts "/rollouts?outcome=fail"
shoot task "/task?id=$quoted"
