#!/usr/bin/env bash
# Installs Azurite, Microsoft's Azure Storage emulator (MIT), the Blob service the az:// tests run against,
# from npm at one pinned release into $BIJ_AZURITE_DIR (default: <repo>/.azurite), which git ignores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${BIJ_AZURITE_DIR:-$here/../../.azurite}"
version=3.37.0  # tests/azureserver/__init__.py names the same
if ! command -v npm >/dev/null 2>&1; then
  echo "bij azure: npm is missing, so Azurite (the Blob service the az:// tests use) cannot be installed." >&2
  echo "  Install Node.js >= 18 with npm (apt-get install nodejs npm), then run make azure-bin." >&2
  exit 3
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
stamp="$out/.installed-from"
want="azurite $version"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$out/node_modules/.bin/azurite-blob" ]]; then
  exit 0
fi
echo "bij azure: installing azurite $version into $out" >&2
start=$SECONDS
npm install --no-audit --no-fund --silent --prefix "$out" "azurite@$version" >&2
echo "$want" > "$stamp"
echo "bij azure: installed in $((SECONDS - start)) s" >&2
