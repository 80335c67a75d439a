"""Partition: split the joint graph into forward and backward, choosing what to recompute."""

from ortlab.partition.recompute import RecomputePlan, SavedActivation, partition_joint

__all__ = ["RecomputePlan", "SavedActivation", "partition_joint"]
