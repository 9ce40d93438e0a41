"""gpunode: a node-level GPU sharing and telemetry agent with a cluster scheduler component."""

__version__ = "0.1.0"
