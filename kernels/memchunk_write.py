"""MemChunk write: scatter one slot's chunk K/V (all layers at once) into its reserved cache region.

The dialog engine keeps, per layer and slot, a KV cache `[L1 | L2 | ring]` along time. A MemChunk
refresh computes the chunk's keys/values for one slot (one forward pass) and this kernel copies them
into `cache[:, slot, :, start:start + n]` for every layer in one launch, casting to the cache dtype.
Keys arrive rotated only to their position inside the chunk; `decode_attention` rotates the chunk on to
its virtual positions at read time.

File layout: Triton kernel (CUDA), PyTorch path `memchunk_write_torch` (CPU), then the host wrapper
`memchunk_write`. The naive reference both are tested against: `reference.memchunk_write_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._impl import Impl, resolve_impl


@triton.jit
def _memchunk_write_kernel(
    src_k_ptr,  # [L, Hkv, N, D] chunk keys for one slot
    src_v_ptr,  # [L, Hkv, N, D] chunk values
    dst_k_ptr,  # [L, S, Hkv, T, D] key cache
    dst_v_ptr,  # [L, S, Hkv, T, D] value cache
    slot,  # int: the slot (second cache axis) written
    start,  # int: first time index written in the cache
    n,  # int: number of chunk steps N
    num_kv_heads,  # int: Hkv
    stride_sl: tl.int64, stride_sh: tl.int64, stride_sn: tl.int64,  # src strides (K and V share them)
    stride_dl: tl.int64, stride_ds: tl.int64, stride_dh: tl.int64, stride_dt: tl.int64,  # dst strides
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_lh = tl.program_id(0)  # one program per (layer, kv head) ...
    pid_n = tl.program_id(1)  # ... and per block of BLOCK_N chunk steps
    layer = pid_lh // num_kv_heads
    head = pid_lh % num_kv_heads
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_n < n)[:, None]
    # int64 strides promote every offset to int64: caches of many slots exceed 2**31 elements.
    src_off = layer * stride_sl + head * stride_sh + offs_n[:, None] * stride_sn + offs_d[None, :]
    dst_off = (layer * stride_dl + slot * stride_ds + head * stride_dh
               + (start + offs_n)[:, None] * stride_dt + offs_d[None, :])
    k = tl.load(src_k_ptr + src_off, mask=mask)
    v = tl.load(src_v_ptr + src_off, mask=mask)
    tl.store(dst_k_ptr + dst_off, k.to(dst_k_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v_ptr + dst_off, v.to(dst_v_ptr.dtype.element_ty), mask=mask)


def memchunk_write_torch(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                         slot: int, start: int) -> None:
    """The PyTorch path (CPU): plain slice assignment."""
    n = src_k.shape[2]
    dst_k[:, slot, :, start:start + n] = src_k.to(dst_k.dtype)
    dst_v[:, slot, :, start:start + n] = src_v.to(dst_v.dtype)


def memchunk_write(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                   slot: int, start: int, impl: Impl = "auto") -> None:
    """Write chunk K/V `[L, Hkv, N, D]` into caches `[L, S, Hkv, T, D]` at `[:, slot, :, start:start+N]`."""
    L, Hkv, N, D = src_k.shape
    assert src_v.shape == src_k.shape, (src_v.shape, src_k.shape)
    assert dst_k.shape == dst_v.shape and dst_k.dim() == 5, (dst_k.shape, dst_v.shape)
    assert dst_k.shape[0] == L and dst_k.shape[2] == Hkv and dst_k.shape[4] == D, (src_k.shape, dst_k.shape)
    if not 0 <= slot < dst_k.shape[1]:
        raise IndexError(f"slot {slot} outside the cache's {dst_k.shape[1]} slots")
    if start < 0 or start + N > dst_k.shape[3]:
        raise IndexError(f"chunk [{start}, {start + N}) does not fit the cache's {dst_k.shape[3]} time steps")
    if resolve_impl(impl, dst_k.device) == "torch":
        memchunk_write_torch(src_k, src_v, dst_k, dst_v, slot, start)
        return
    assert D & (D - 1) == 0, f"head dim {D} must be a power of two for the Triton kernel"
    src_k, src_v = src_k.contiguous(), src_v.contiguous()
    if dst_k.dtype == torch.float8_e4m3fn:  # cast by torch (round to nearest even), so every path stores the same
        src_k, src_v = src_k.to(dst_k.dtype), src_v.to(dst_v.dtype)  # bytes; the kernel then copies them
    assert dst_k.stride() == dst_v.stride() and dst_k.stride(-1) == 1, "caches must share a row-major layout"
    BLOCK_N = 64
    grid = (L * Hkv, triton.cdiv(N, BLOCK_N))
    _memchunk_write_kernel[grid](
        src_k, src_v, dst_k, dst_v,
        slot=slot, start=start, n=N, num_kv_heads=Hkv,
        stride_sl=src_k.stride(0), stride_sh=src_k.stride(1), stride_sn=src_k.stride(2),
        stride_dl=dst_k.stride(0), stride_ds=dst_k.stride(1), stride_dh=dst_k.stride(2), stride_dt=dst_k.stride(3),
        HEAD_DIM=D, BLOCK_N=BLOCK_N,
    )
