"""Naive references the kernels and their PyTorch paths are checked against (tests only).

Production has two paths per operation, both in the kernel's own file: the `@triton.jit` kernel
(CUDA) and the `*_torch` function (CPU; batched, span-limited, reads caches as views). The functions
here are neither: each spells its operation out one row, one head and one key at a time, so that it
is obviously right rather than fast (as vLLM keeps `ref_*` implementations beside its attention ops).
Used by tests/test_kernels_triton.py; nothing in the serving path imports this module.
"""

from __future__ import annotations

import math

import torch

from .rope import rope_rotate


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, l1_len: torch.Tensor, l2_len: torch.Tensor,
                               ring_len: torch.Tensor, chunk_pos0: torch.Tensor, *, n1: int, n2: int,
                               max_period: float = 10_000.0, interleave: bool = True,
                               sm_scale: float | None = None) -> torch.Tensor:
    """`decode_attention`'s result [B, H, D] (fp32), by an explicit loop: each row's keys listed one by
    one -- chunk keys (stored at their position inside the chunk) rotated on by chunk_pos0 to their
    virtual positions, then the valid ring keys -- and a softmax per query head over them."""
    B, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float32)
    for b in range(B):
        s = int(slots[b])
        shift = torch.tensor([int(chunk_pos0[b])])
        keys, vals = [], []
        for j in list(range(int(l1_len[b]))) + [n1 + j for j in range(int(l2_len[b]))]:
            keys.append(rope_rotate(k_cache[s, :, j:j + 1], shift, max_period, interleave))
            vals.append(v_cache[s, :, j:j + 1])
        for j in range(int(ring_len[b])):
            keys.append(k_cache[s, :, n1 + n2 + j:n1 + n2 + j + 1])
            vals.append(v_cache[s, :, n1 + n2 + j:n1 + n2 + j + 1])
        K = torch.cat(keys, dim=1).float()  # [Hkv, n, D]
        V = torch.cat(vals, dim=1).float()
        for h in range(H):
            kv = h // (H // Hkv)
            logits = K[kv] @ q[b, h].float()
            w = torch.softmax(logits / math.sqrt(D) if sm_scale is None else logits * sm_scale, dim=0)
            out[b, h] = w @ V[kv]
    return out


def memchunk_write_reference(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                             slot: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New caches: copies of dst_k, dst_v with chunk step i of every layer and kv head at time
    `start + i` of `slot`, cast to the cache dtype, written one (layer, head, step) at a time."""
    k, v = dst_k.clone(), dst_v.clone()
    L, Hkv, N, _ = src_k.shape
    for layer in range(L):
        for h in range(Hkv):
            for i in range(N):
                k[layer, slot, h, start + i] = src_k[layer, h, i].to(k.dtype)
                v[layer, slot, h, start + i] = src_v[layer, h, i].to(v.dtype)
    return k, v
