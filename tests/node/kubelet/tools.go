//go:build tools

// Package kubelet pins the kubelet command built by tests/node/build.sh, so that
// `go mod tidy` keeps every module it needs.
package kubelet

import (
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
