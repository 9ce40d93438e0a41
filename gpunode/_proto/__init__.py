"""Generated gRPC stubs for the kubelet APIs (see plugin/generate.py). Do not edit."""
