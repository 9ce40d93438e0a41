"""The NVML backend: real NVIDIA GPUs through pynvml."""
