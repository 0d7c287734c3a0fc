"""Cluster mode: membership, the byte-aware pipeline planner, the mx.distributed group, stages."""
