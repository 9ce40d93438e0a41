//go:build tools

// Package tools pins the JobSet controller (sigs.k8s.io/jobset, its main package at the module root) that
// scripts/get-kube.sh --jobset builds.
package tools

import (
	_ "sigs.k8s.io/jobset"
)
