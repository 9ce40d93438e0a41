"""gpunode as a Dynamic Resource Allocation (DRA) driver on the node.

The kubelet plugin (registration on the kubelet's plugins_registry, the DRAPlugin service in v1 and
v1beta1, the DRAResourceHealth stream) turns each prepared ResourceClaim's allocation into a
memory-cap region and a CDI spec; the ResourceSlice publisher advertises the GPUs DRA serves and
taints the unhealthy ones. Which GPUs DRA serves, instead of the device plugin, is configured in
gpunode.dra (gpunode.config.dra).
"""
