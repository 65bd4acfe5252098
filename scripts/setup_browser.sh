#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the UI's browser test (tests/ui/test_ui_chromium.py):
# Debian's chromium and chromium-driver, installed with apt-get when root and missing.
# Idempotent; without root it says what to install and leaves the test to say it is missing.
set -euo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  printf '\n==> %s\n' "system packages: chromium chromium-driver (the UI's browser test)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
  echo "setup_browser: chromium and chromedriver are missing; the browser test needs them:" \
       "apt-get install chromium chromium-driver" >&2
fi
