"""Triton-language kernels with their PyTorch references (installed as `egomem.kernels`).

Nothing here imports from `egomem` above it: kernels are leaves of the dependency graph.
"""
