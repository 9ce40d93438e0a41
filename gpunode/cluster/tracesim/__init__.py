"""The trace-driven cluster simulator (`gpunode simulate`): replays pod traces through the placement policies."""
