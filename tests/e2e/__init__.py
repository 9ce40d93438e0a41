"""End-to-end tests against a real Kubernetes control plane (scripts/get-kube.sh builds it)."""
