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
want="$(cat go.mod go.sum | sha256sum | cut -d' ' -f1) $(go version)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
   [[ -x "$out/etcd" && -x "$out/kube-apiserver" && -x "$out/kube-controller-manager" && -x "$out/kube-scheduler" && -x "$out/kubectl" ]]; then
  exit 0
fi
echo "bij cluster: building etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl into $out" >&2
start=$SECONDS
go build -ldflags="-s -w" -o "$out/" \
  go.etcd.io/etcd/server/v3 \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
# go build names the etcd main after its module path's last element ("v3").
mv -f "$out/v3" "$out/etcd"
echo "$want" > "$stamp"
echo "bij cluster: built in $((SECONDS - start)) s" >&2
