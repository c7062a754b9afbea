"""The dialog engine's attention operations, each with two production paths (installed as `egomem.kernels`).

Nothing here imports from `egomem` above it: kernels are leaves of the dependency graph.
Each operation's file holds its `@triton.jit` kernel (the CUDA path), its PyTorch path `*_torch`
(the CPU path, production too) and one host wrapper taking `impl="auto"|"triton"|"torch"`
(auto: Triton on CUDA, PyTorch elsewhere):
  - `egomem.kernels.memchunk_write`: scatter a slot's chunk K/V (all layers) into its cache region;
  - `egomem.kernels.decode_attention`: batched single-query attention over `[chunk (rotate-on-read) | ring]`.
`egomem.kernels.reference` holds the naive, obviously-correct versions both paths are tested against.
The kernel files import `triton`, so this package does not import them eagerly: `TRITON_INTERPRET=1`
(CPU tests) only takes effect if it is set before triton's first import.
"""

from ._impl import Impl, resolve_impl
from .rope import rope_freqs, rope_rotate

__all__ = ["Impl", "resolve_impl", "rope_freqs", "rope_rotate"]
