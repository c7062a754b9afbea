"""Triton-language kernels with their PyTorch references (installed as `egomem.kernels`).

Nothing here imports from `egomem` above it: kernels are leaves of the dependency graph.
Each kernel file holds its `@triton.jit` code, its PyTorch reference and one host wrapper taking
`impl="auto"|"triton"|"torch"` (auto: Triton on CUDA, PyTorch elsewhere):
  - `egomem.kernels.memchunk_write`: scatter a slot's chunk K/V (all layers) into its cache region;
  - `egomem.kernels.decode_attention`: batched single-query attention over `[chunk (rotate-on-read) | ring]`.
They import `triton`, so this package does not import them eagerly: `TRITON_INTERPRET=1` (CPU tests)
only takes effect if it is set before triton's first import.
"""

from ._impl import Impl, resolve_impl
from .rope import rope_freqs, rope_rotate

__all__ = ["Impl", "resolve_impl", "rope_freqs", "rope_rotate"]
