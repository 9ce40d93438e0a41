"""The contract between node and cluster, at the bottom of the package.

- names:     resource names, annotation keys, units (GIB, MIB, MILLI_PER_GPU) and the Sharing modes
- deviceids: the kubelet device-ID formats (<uuid>, <uuid>::<n>, <uuid>::mem<n>) and PCI bus IDs
- nodestate: the gpunode.io/gpu-state annotation (schema v1), encode and decode
- xids:      the XID catalog
- reader:    the strict reader of decoded YAML/JSON mappings every document is read with

It imports gpunode.errors and the standard library only; config, placement and
both sides build on it, never the other way round.
"""
