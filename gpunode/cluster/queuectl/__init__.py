"""The live queue controller (`gpunode queue`): the queueing policies admitting and preempting pods on Kubernetes."""
