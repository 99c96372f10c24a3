#!/usr/bin/env bash
# Builds versitygw, the S3 server the tests run against (Apache-2.0, posix backend), from its Go
# module at one pinned release into $BIJ_S3_BIN (default: <repo>/.s3/bin), which git ignores.
# The first build takes a few CPU-minutes; the Go build cache makes a rebuild take seconds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${BIJ_S3_BIN:-$here/../../.s3/bin}"
version=v1.8.0  # tests/s3server/__init__.py names the same
if ! command -v go >/dev/null 2>&1; then
  echo "bij s3: the Go toolchain is missing, so versitygw (the S3 server the tests use) cannot be built." >&2
  echo "  Install Go >= 1.25 (package manager or https://go.dev/dl) with the Go module proxy, then run make s3-bin." >&2
  exit 3
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
stamp="$out/.built-from"
want="versitygw $version $(go version)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$out/versitygw" ]]; then
  exit 0
fi
echo "bij s3: building versitygw $version into $out" >&2
start=$SECONDS
# Outside any module, so the pinned version is the one built (not a go.mod's).
cd /
GOBIN="$out" go install "github.com/versity/versitygw/cmd/versitygw@$version"
echo "$want" > "$stamp"
echo "bij s3: built in $((SECONDS - start)) s" >&2
