"""The kubelet-facing gRPC servers and clients: device plugin (v1beta1) and pod-resources (v1)."""
