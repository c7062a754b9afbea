"""Batched single-query decode attention over a `[L1 | L2 | ring]` KV cache with rotate-on-read chunks.

One query per row (a stream slot at its current dialog step) attends, in one pass with an online
softmax, to three regions of that slot's cache:
  - L1 MemChunk (capacity N1, valid prefix `l1_len[b]`) and L2 MemChunk (N2, `l2_len[b]`): keys are
    stored rotated only to their position INSIDE the chunk (L1 step j at j, L2 step j at l1_len + j),
    so they do not depend on the dialog. At read time the whole chunk is rotated on to its virtual
    positions `chunk_pos0[b] + (position inside the chunk)`, i.e. just before the oldest ring entry,
    so query-to-chunk distances stay in the trained range however long the stream lives (docs/kv-cache.md#positions-rotate-on-read).
    RoPE rotations compose and are orthogonal, so rotating every chunk key by +chunk_pos0 equals
    rotating the query by -chunk_pos0 once: q.R(p0)k = (R(-p0)q).k -- one rotation per row, not per key;
  - the dialog ring (capacity W, valid prefix `ring_len[b]`): keys already rotated at their real
    positions when written (order inside the ring does not matter to softmax attention).
Grouped KV heads (GQA): the H query heads share Hkv = H / G key/value heads.

File layout: `@triton.jit` helpers, the kernel (CUDA path), the PyTorch path `decode_attention_torch`
(CPU path, span-limited), then the host wrapper. The naive reference both are tested against:
`reference.decode_attention_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._impl import Impl, resolve_impl
from .rope import rope_freqs, rope_rotate


@triton.jit
def _attend_region(
    q,  # [G, D] query (pre-scaled by sm_scale) in this region's rotation frame
    m_i, l_i, acc,  # [G], [G], [G, D] online-softmax state
    k_base, v_base,  # pointers to this (slot, kv head)'s [T, D] keys / values
    region_start,  # first cache time index of the region
    n_valid,  # valid entries (prefix) in the region
    offs_d,  # [D]
    stride_kt: tl.int64, stride_vt: tl.int64,
    INPUT_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr, UP: tl.constexpr,
):
    for t0 in range(0, n_valid, BLOCK_T):  # an empty region: no iteration at all
        offs_t = t0 + tl.arange(0, BLOCK_T)
        valid = offs_t < n_valid
        t_idx = region_start + offs_t
        k = tl.load(k_base + t_idx[:, None] * stride_kt + offs_d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:  # fp8 is a storage format here (half the bytes read), upcast losslessly to the query's
            k = k.to(UP)  # dtype: bf16 keeps the dots on tensor cores (fp32 "ieee" dots ran 12x slower, H200)
        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=INPUT_PRECISION)  # [G, BLOCK_T]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block holds >= 1 valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [G, BLOCK_T]
        v = tl.load(v_base + t_idx[:, None] * stride_vt + offs_d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:
            v = v.to(UP)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, H, D] queries, rotated at their own positions
    k_ptr,  # [S, Hkv, T, D] key cache of one layer, T = N1 + N2 + W
    v_ptr,  # [S, Hkv, T, D] value cache of one layer
    out_ptr,  # [B, H, D] attention output
    slot_ptr,  # [B] int64: cache slot of each row
    l1_len_ptr,  # [B] int32/int64: valid L1 steps
    l2_len_ptr,  # [B] int32/int64: valid L2 steps
    ring_len_ptr,  # [B] int32/int64: valid ring steps
    chunk_pos0_ptr,  # [B] int64: virtual position of the first chunk step
    freqs_ptr,  # [D/2] fp32 RoPE frequencies (host-computed exactly as moshi does)
    stride_qb: tl.int64, stride_qh: tl.int64,
    stride_ks: tl.int64, stride_kh: tl.int64, stride_kt: tl.int64,
    stride_vs: tl.int64, stride_vh: tl.int64, stride_vt: tl.int64,
    stride_ob: tl.int64, stride_oh: tl.int64,
    sm_scale,  # float: softmax scale
    part_m_ptr, part_l_ptr, part_acc_ptr,  # split-KV partials [B, H, SPLITS] (m, l) and [B, H, SPLITS, D]
    N1: tl.constexpr, N2: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot minimum)
    HEAD_DIM: tl.constexpr,
    INTERLEAVE: tl.constexpr,  # RoPE pairs (2i, 2i+1) if True, else (i, i + D/2)
    INPUT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,  # 1: one program per (row, kv head) writes the output; > 1: flash-decoding partials
    KV_FP8: tl.constexpr,  # the caches hold float8_e4m3fn: upcast on load to the query's dtype
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    if INTERLEAVE:
        freq_idx = offs_d // 2
        partner = offs_d ^ 1
        first = (offs_d % 2) == 0  # real part of its pair
    else:
        freq_idx = offs_d % HALF
        partner = (offs_d + HALF) % HEAD_DIM
        first = offs_d < HALF
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads sharing this kv head

    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * sm_scale
    q_partner = tl.load(q_rows + partner[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * sm_scale
    # rotate-on-read: the chunk is seen at chunk_pos0 + (position inside it), so its keys are read
    # rotated by +chunk_pos0; equivalently the query is rotated once by -chunk_pos0:
    # real' = real*cos + imag*sin, imag' = imag*cos - real*sin
    pos0 = tl.load(chunk_pos0_ptr + row).to(tl.float32)
    phase = pos0 * tl.load(freqs_ptr + freq_idx)  # [D]
    sign = tl.where(first, 1.0, -1.0)
    q_chunk = q * tl.cos(phase)[None, :] + (sign * tl.sin(phase))[None, :] * q_partner  # [G, D]

    slot = tl.load(slot_ptr + row)
    l1_len = tl.load(l1_len_ptr + row)
    l2_len = tl.load(l2_len_ptr + row)
    ring_len = tl.load(ring_len_ptr + row)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM], 0.0, tl.float32)
    # each split reads its own share of every region (whole BLOCK_T blocks; a share may be empty)
    for region in tl.static_range(3):
        if region == 0:
            r_start, r_len = 0, l1_len
        elif region == 1:
            r_start, r_len = N1, l2_len
        else:
            r_start, r_len = N1 + N2, ring_len
        share = tl.cdiv(tl.cdiv(r_len, SPLITS), BLOCK_T) * BLOCK_T
        lo = tl.minimum(split * share, r_len)
        n = tl.minimum(share, r_len - lo)
        q_region = q if region == 2 else q_chunk
        m_i, l_i, acc = _attend_region(q_region, m_i, l_i, acc, k_base, v_base, r_start + lo, n, offs_d,
                                       stride_kt, stride_vt, INPUT_PRECISION, BLOCK_T, KV_FP8,
                                       q_ptr.dtype.element_ty)
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:  # partials, merged by _merge_splits: (B * H * SPLITS) m and l, (B * H * SPLITS * D) acc
        part = (row * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split  # [GROUP_PAD]
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


FP8_DTYPES = (torch.float8_e4m3fn,)  # the fp8 KV-cache format (`dialog.kv_cache_dtype = "fp8"`)


def _readable(x: torch.Tensor) -> torch.Tensor:
    """A cache slice in a dtype matmuls take: fp8 (a storage format) upcast to fp32, others as they are."""
    return x.float() if x.dtype in FP8_DTYPES else x


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Split rows into runs of consecutive slots: [(first row, row count)], so caches are read as views."""
    runs: list[tuple[int, int]] = []
    for i, s in enumerate(slots):
        if runs and slots[i - 1] + 1 == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def decode_attention_torch(q, k_cache, v_cache, slots, l1_len, l2_len, ring_len, chunk_pos0, *,
                           n1: int, n2: int, max_period: float, interleave: bool, sm_scale: float) -> torch.Tensor:
    """The PyTorch path (CPU): the query rotated by -chunk_pos0 for the chunk, masked softmax over chunk +
    ring scores, reading only the spans some row can see."""
    B, H, D = q.shape
    slot_list = slots.tolist()
    outs = []
    for r0, n in _runs(slot_list):  # views of consecutive slots: no copy of the (large) caches
        s0 = slot_list[r0]
        rows = slice(r0, r0 + n)
        outs.append(_attend_rows(q[rows], k_cache[s0:s0 + n], v_cache[s0:s0 + n], l1_len[rows], l2_len[rows],
                                 ring_len[rows], chunk_pos0[rows], n1, n2, max_period, interleave, sm_scale))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attend_rows(q, k, v, l1_len, l2_len, ring_len, chunk_pos0, n1, n2, max_period, interleave, sm_scale):
    """decode_attention_torch for rows whose caches are k, v [B, Hkv, T, D].

    Reads only the cache positions one of these rows can see: L1 up to the longest L1 among them, L2
    likewise, the ring up to the longest ring. The pass over K and V is the cost (memory-bound), and a
    young stream's ring is mostly empty: a 10 s old stream sees 125 of the tiny preset's 2232 ring steps."""
    B, H, D = q.shape
    _, Hkv, T, _ = k.shape
    G, n_chunk = H // Hkv, n1 + n2
    qg = q.view(B, Hkv, G, D).float() * sm_scale  # [B, Hkv, G, D]: query heads grouped by kv head
    spans = [(0, int(l1_len.max()), l1_len), (n1, int(l2_len.max()), l2_len), (n_chunk, int(ring_len.max()), ring_len)]
    spans = [(start, width, lens) for start, width, lens in spans if width > 0]
    q_chunk = None
    if any(start < n_chunk for start, _, _ in spans):
        q_chunk = rope_rotate(qg, -chunk_pos0.view(B, 1, 1), max_period, interleave)  # rotate-on-read
    scores = []
    for start, width, lens in spans:
        query = q_chunk if start < n_chunk else qg
        keys = _readable(k[:, :, start:start + width])
        s = (query.to(keys.dtype) @ keys.transpose(-1, -2)).float()  # [B, Hkv, G, width]
        valid = torch.arange(width, device=q.device) < lens[:, None]  # [B, width]
        scores.append(s.masked_fill(~valid[:, None, None, :], float("-inf")))
    p = torch.softmax(torch.cat(scores, dim=-1), dim=-1).to(_readable(v[:, :, :0]).dtype)
    out, at = 0, 0
    for start, width, _ in spans:
        out = out + p[..., at:at + width] @ _readable(v[:, :, start:start + width])  # [B, Hkv, G, D]
        at += width
    return out.reshape(B, H, D).to(q.dtype)


def decode_attention(
    q: torch.Tensor,  # [B, H, D] rotated queries
    k_cache: torch.Tensor,  # [S, Hkv, N1 + N2 + W, D]
    v_cache: torch.Tensor,  # [S, Hkv, N1 + N2 + W, D]
    slots: torch.Tensor,  # [B] int64
    l1_len: torch.Tensor,  # [B] int32 or int64
    l2_len: torch.Tensor,  # [B] int32 or int64
    ring_len: torch.Tensor,  # [B] int32 or int64
    chunk_pos0: torch.Tensor,  # [B] int64
    *,
    n1: int,
    n2: int,
    max_period: float = 10_000.0,
    interleave: bool = True,
    sm_scale: float | None = None,
    impl: Impl = "auto",
    input_precision: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention output [B, H, D] of one query per row over its slot's `[L1 | L2 | ring]` cache.

    input_precision (Triton path): None = "ieee" for an fp32 model (fp32 queries over an fp32 or fp8
    cache: exact, as the tests compare), else the target's default (it only concerns fp32 operands;
    fp16/bf16 dots accumulate in fp32 regardless). An fp8 cache is upcast to the queries' dtype on load.
    num_splits (Triton path): split-KV / flash-decoding (as vLLM's Triton decode attention): each
    (row, kv head) is read by this many programs, each over its share of every region, and their
    partial softmax states are merged (`_merge_splits`). None = `default_splits` (enough programs to
    fill the GPU at small batch; 1 when B x Hkv already does). The result does not depend on it.
    """
    B, H, D = q.shape
    S, Hkv, T, Dk = k_cache.shape
    assert v_cache.shape == k_cache.shape and Dk == D, (q.shape, k_cache.shape, v_cache.shape)
    assert H % Hkv == 0, f"{H} query heads cannot share {Hkv} kv heads"
    assert 0 <= n1 and 0 <= n2 and n1 + n2 < T, (n1, n2, T)
    for name, t in (("slots", slots), ("l1_len", l1_len), ("l2_len", l2_len),
                    ("ring_len", ring_len), ("chunk_pos0", chunk_pos0)):
        assert t.shape == (B,) and not t.is_floating_point(), \
            f"{name} must be integer [B={B}], got {t.dtype} {tuple(t.shape)}"
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if resolve_impl(impl, q.device) == "torch":
        return decode_attention_torch(q, k_cache, v_cache, slots, l1_len, l2_len, ring_len, chunk_pos0,
                                      n1=n1, n2=n2, max_period=max_period, interleave=interleave,
                                      sm_scale=sm_scale)
    assert D >= 32 and D & (D - 1) == 0, f"head dim {D} must be a power of two >= 32 for the Triton kernel"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "last dim must be contiguous"
    out = torch.empty_like(q)
    G = H // Hkv
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 0
        num_splits = default_splits(B * Hkv, T, sms) if sms else 1
    splits = int(num_splits)
    assert splits >= 1, f"num_splits must be >= 1, got {splits}"
    if splits > 1:
        part_m = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    _decode_attention_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, out,
        slots.to(torch.int64).contiguous(), l1_len.contiguous(), l2_len.contiguous(), ring_len.contiguous(),
        chunk_pos0.to(torch.int64).contiguous(), rope_freqs(D, max_period, q.device),
        stride_qb=q.stride(0), stride_qh=q.stride(1),
        stride_ks=k_cache.stride(0), stride_kh=k_cache.stride(1), stride_kt=k_cache.stride(2),
        stride_vs=v_cache.stride(0), stride_vh=v_cache.stride(1), stride_vt=v_cache.stride(2),
        stride_ob=out.stride(0), stride_oh=out.stride(1),
        sm_scale=sm_scale, part_m_ptr=part_m, part_l_ptr=part_l, part_acc_ptr=part_acc,
        N1=n1, N2=n2, GROUP=G, GROUP_PAD=max(16, triton.next_power_of_2(G)), HEAD_DIM=D,
        INTERLEAVE=interleave, BLOCK_T=32,
        # "ieee" where the dots run in fp32 (fp32 caches; fp8 caches of an fp32 model, upcast to fp32)
        INPUT_PRECISION=input_precision or ("ieee" if q.dtype == torch.float32 and k_cache.dtype in
                                            (torch.float32, *FP8_DTYPES) else "tf32"),
        SPLITS=splits, KV_FP8=k_cache.dtype in FP8_DTYPES,
    )
    if splits > 1:
        out.copy_(_merge_splits(part_m, part_l, part_acc))
    return out


def _merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """Merge split-KV partial softmax states (m, l [B, H, S], acc [B, H, S, D]) into [B, H, D] (fp32).
    An empty split has m = -inf, l = 0, acc = 0 and weighs nothing; the ring always holds a key."""
    m_all = m.max(dim=-1, keepdim=True).values  # [B, H, 1]
    w = torch.exp(m - m_all)  # [B, H, S]
    return (w[..., None] * acc).sum(-2) / (w * l).sum(-1, keepdim=True).clamp_min(1e-30)


def default_splits(rows: int, cache_steps: int, sms: int) -> int:
    """Split-KV programs per (row, kv head) on a GPU with `sms` multiprocessors: enough to give every SM
    two programs when rows x kv heads alone do not (a few long streams), at most one split per 256
    cache steps, at most 16."""
    want = -(-2 * sms // max(1, rows))
    return max(1, min(16, want, cache_steps // 256))
