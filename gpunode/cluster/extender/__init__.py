"""The kube-scheduler extender: filter, prioritize and bind over the nodes' published GPU state."""
