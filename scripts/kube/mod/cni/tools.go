//go:build tools

// Package tools pins the CNI plugin that scripts/get-kube.sh builds (the test node's pods use the
// loopback network only).
package tools

import _ "github.com/containernetworking/plugins/plugins/main/loopback"
