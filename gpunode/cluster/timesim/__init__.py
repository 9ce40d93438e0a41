"""The time simulator (`gpunode simulate --mode time`): trace replays through the queueing policies over time."""
