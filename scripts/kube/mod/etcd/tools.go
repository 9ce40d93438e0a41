//go:build tools

// Package tools pins the etcd server that scripts/get-kube.sh builds.
package tools

import (
	_ "go.etcd.io/etcd/etcdctl/v3"
	_ "go.etcd.io/etcd/server/v3"
)
