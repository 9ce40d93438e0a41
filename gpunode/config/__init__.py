"""Configuration reading: the agent's file, environment and flags, and every section parser (shared by node and cluster)."""
