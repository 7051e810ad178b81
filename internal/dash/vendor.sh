#!/usr/bin/env bash
# Refreshes assets/vendor from npm (the dashboard's only third-party code):
# xterm.js and its fit addon, as pinned in package.json. The copies are
# committed, so building shoal needs neither npm nor the network.
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp package.json "$tmp/"
(cd "$tmp" && npm install --no-audit --no-fund --no-package-lock >/dev/null)
m="$tmp/node_modules/@xterm"
cp "$m/xterm/lib/xterm.js" "$m/xterm/css/xterm.css" "$m/addon-fit/lib/addon-fit.js" assets/vendor/
cp "$m/xterm/LICENSE" assets/vendor/LICENSE.xterm
