"""Tensor-parallel process groups (gloo on CPU, NCCL on GPU) and the typed messages between the driver and its ranks."""
