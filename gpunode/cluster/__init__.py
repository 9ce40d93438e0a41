"""The cluster side: the kube-scheduler extender and the trace simulator."""
