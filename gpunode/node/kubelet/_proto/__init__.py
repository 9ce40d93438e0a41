"""Generated gRPC stubs for the kubelet APIs (see protos/generate.py). Do not edit."""
