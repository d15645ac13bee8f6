#!/usr/bin/env bash
# Installs what the dashboard's browser test needs: Debian's Chromium and ChromeDriver (/usr/bin/chromium,
# /usr/bin/chromedriver). Idempotent: does nothing when both are already installed. Needs root (apt-get);
# without it, or without the package mirror, it says so and exits 0 -- the browser test then skips, naming why.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: not root or no apt-get; skipping (tests/test_dashboard_browser.py will be skipped)" >&2
    exit 0
fi
started=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }; then
    echo "install-browser: apt-get failed; the browser test will be skipped" >&2
    exit 0
fi
echo "install-browser: chromium and chromedriver installed in $(( $(date +%s) - started )) s" >&2
