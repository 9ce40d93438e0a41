"""The node side: the agent, its devices, the kubelet-facing servers, allocation, memory caps, health, metrics and publishing."""
