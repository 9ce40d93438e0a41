//go:build tools

// Package tools pins the runc that scripts/get-kube.sh builds.
package tools

import _ "github.com/opencontainers/runc"
