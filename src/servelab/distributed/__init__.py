"""Tensor-parallel process groups and the worker processes that hold one shard each."""
