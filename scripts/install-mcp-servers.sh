#!/usr/bin/env bash
# Installs the third-party MCP servers the proxy's tests run as upstreams, at pinned versions, into a
# project-local directory (default .cache/mcp-servers, gitignored; override with MCP_SERVERS_DIR). The npm
# servers speak the 2025-11-25 protocol (handshake era): the TypeScript SDK is pinned too, because the servers
# accept any ^1.30 and a later SDK could move them to another protocol era under the tests' feet.
#
# Idempotent and fast when already installed (a stamp records the pinned set). Needs node and npm; without them
# it says so and exits 3 (the tests skip, naming why). Prints the install directory on stdout.
set -euo pipefail

PACKAGES=(
    "@modelcontextprotocol/server-memory@2026.8.31"
    "@modelcontextprotocol/server-filesystem@2026.8.31"
    "@modelcontextprotocol/server-everything@2026.8.31"
    "@modelcontextprotocol/sdk@1.32.2"
)

root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${MCP_SERVERS_DIR:-$root/.cache/mcp-servers}"
stamp="$dir/.installed"
wanted="${PACKAGES[*]}"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "$dir"
    exit 0
fi
for tool in node npm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install-mcp-servers: '$tool' is not installed; the tests that run npm MCP servers will be skipped" >&2
        exit 3
    fi
done

mkdir -p "$dir"
# Two test runs starting at once must not interleave two npm installs into one directory.
exec 9>"$dir/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "$dir"
    exit 0
fi
started=$(date +%s)
rm -f "$stamp"
npm install --prefix "$dir" --save-exact --no-audit --no-fund --loglevel=error "${PACKAGES[@]}" >&2
echo "$wanted" >"$stamp"
echo "install-mcp-servers: installed ${PACKAGES[*]} in $dir in $(( $(date +%s) - started )) s" >&2
echo "$dir"
