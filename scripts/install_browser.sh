#!/usr/bin/env bash
# Debian's chromium, for the web pages' browser tests (tests/test_webui_browser.py drives it with
# Playwright's Python package). Playwright's own browser download cannot be used here: only the
# package registries are reachable. Without root or apt-get it says so and the tests skip.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: chromium is missing and this needs root and apt-get to install it; the browser tests will skip" >&2
  exit 0
fi
echo "install_browser: installing Debian's chromium (first run only)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq chromium >/dev/null
