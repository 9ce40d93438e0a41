"""Who runs when: queues, quotas, fair share over time, gangs, preemption, backfill and energy.

Pure, deterministic policy code: no clock, no I/O, no Kubernetes. The time
simulator (gpunode.cluster.timesim) and the live queue controller drive the same
Scheduler with their own notion of time.
"""
