"""The contract between node and cluster: names, annotation keys, device-ID formats, units, and the node-state schema."""
