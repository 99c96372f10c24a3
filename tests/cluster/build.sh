#!/usr/bin/env bash
# Builds the control plane bij is tested against from Kubernetes' own modules:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl of one
# release (go.mod pins it). The first build takes 15-25 minutes on 2 cores; the Go
# build cache makes a rebuild take seconds. Binaries go to $BIJ_CLUSTER_BIN
# (default: <repo>/.cluster/bin), which git ignores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${BIJ_CLUSTER_BIN:-$here/../../.cluster/bin}"
if ! command -v go >/dev/null 2>&1; then
  echo "bij cluster: the Go toolchain is missing (need Go >= 1.26 and the Go module proxy)." >&2
  echo "  Install it from your package manager or https://go.dev/dl, then run this again." >&2
  exit 3
fi
mkdir -p "$out"
cd "$here"
stamp="$out/.built-from"
want="$(cat go.mod go.sum build.sh | sha256sum | cut -d' ' -f1) $(go version)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
   [[ -x "$out/etcd" && -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/kube-scheduler" && -x "$out/kubectl" ]]; then
  exit 0
fi
echo "bij cluster: building etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl into $out" >&2
start=$SECONDS
# The version a release build stamps in (hack/lib/version.sh): clients and Helm read it.
release="$(sed -n 's/^\s*k8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' go.mod)"
minor="$(echo "$release" | cut -d. -f2)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$release -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
go build -ldflags="$ldflags" -o "$out/" \
  go.etcd.io/etcd/server/v3 \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
# go build names etcd's main after the path element before its major version: "server".
mv -f "$out/server" "$out/etcd"
echo "$want" > "$stamp"
echo "bij cluster: built in $((SECONDS - start)) s" >&2
