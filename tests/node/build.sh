#!/usr/bin/env bash
# Builds what a real node of the test cluster runs, into $BIJ_NODE_BIN (default <repo>/.node/bin,
# git-ignored):
#   kubelet                  k8s.io/kubernetes/cmd/kubelet of the control plane's release (kubelet/go.mod)
#   containerd, containerd-shim-runc-v2, ctr   from containerd's own Go module ($CONTAINERD)
#   pause.tar                the sandbox image, built from Kubernetes' build/pause/linux/pause.c of
#                            the same release, packed as an OCI archive with umoci
# runc and the CNI plugins come from the distribution (apt-get install runc containernetworking-plugins).
# Cold: a few minutes on 2 cores when the control plane's Go build cache is warm; warm: seconds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${BIJ_NODE_BIN:-$here/../../.node/bin}"
containerd_version="${CONTAINERD:-v2.4.2}"
missing=()
for tool in go gcc umoci; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "bij node: missing ${missing[*]} (Go >= 1.26 with the Go module proxy, gcc with a static libc, umoci)" >&2
  exit 3
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$here"
start=$SECONDS

stamp="$out/.built-from"
want="$(cat kubelet/go.mod kubelet/go.sum build.sh | sha256sum | cut -d' ' -f1) $containerd_version $(go version)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
   [[ -x "$out/kubelet" && -x "$out/containerd" && -x "$out/containerd-shim-runc-v2" && -x "$out/ctr" && -f "$out/pause.tar" ]]; then
  exit 0
fi

release="$(sed -n 's/^\(require\)\{0,1\}\s*k8s.io\/kubernetes \(v[0-9.]*\)$/\2/p' kubelet/go.mod)"
minor="$(echo "$release" | cut -d. -f2)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
echo "bij node: building kubelet $release into $out" >&2
(cd kubelet && go build -ldflags="$ldflags" -o "$out/kubelet" k8s.io/kubernetes/cmd/kubelet)
echo "bij node: kubelet built at $((SECONDS - start)) s; building containerd $containerd_version" >&2
# Outside any module: go install PKG@VERSION builds with containerd's own go.mod.
(cd / && GOBIN="$out" go install -ldflags="-s -w" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version")
echo "bij node: containerd built at $((SECONDS - start)) s; building the pause image" >&2

# The pause image as Kubernetes builds it (build/pause/Makefile): one static binary, run as 65535.
src="$(go env GOMODCACHE)/k8s.io/kubernetes@$release/build/pause"
(cd kubelet && go mod download k8s.io/kubernetes)
tag="$(sed -n 's/^TAG ?= *//p' "$src/Makefile")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bundle"
umoci init --layout "$work/layout"
umoci new --image "$work/layout:$tag"
umoci unpack --image "$work/layout:$tag" "$work/bundle" >/dev/null
gcc -Os -Wall -Werror -static -DVERSION="v$tag-bij" -o "$work/bundle/rootfs/pause" "$src/linux/pause.c"
umoci repack --image "$work/layout:$tag" "$work/bundle"
umoci config --image "$work/layout:$tag" --config.entrypoint /pause --config.user 65535:65535 \
  --author "bij tests/node/build.sh" --history.created_by "gcc -static build/pause/linux/pause.c ($release)"
tar -C "$work/layout" -cf "$out/pause.tar" .
echo "$tag" > "$out/pause.tag"
echo "$want" > "$stamp"
echo "bij node: built in $((SECONDS - start)) s" >&2
