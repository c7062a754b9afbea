"""The MemChunk KV cache: per layer and slot, time laid out as `[ L1 (N1) | L2 (N2) | dialog ring (W) ]`.

Buffers are allocated once at full shape (gpt-fast style) and written by index. Both MemChunks are always
full and always attended (paper §4.1: an empty chunk is text pad, still attended), so the only per-slot
state is how many dialog steps were written; the ring keeps the last W of them (ring index `step % W`).
Chunk keys are stored rotated only to their position inside the chunk region (L1 step j at j, L2 step j
at N1 + j): they do not depend on the dialog, and `decode_attention` rotates the chunk on to its virtual
positions at read time (one rotation of the query per row, the same maths as rotating each stored key).
Ring keys are stored rotated at their real dialog position.

Position rule (docs/kv-cache.md#positions-rotate-on-read): after writing dialog step t, the ring holds steps
max(0, t + 1 - W) .. t, and the chunk (N1 + N2 steps) sits at virtual positions `oldest - N1 - N2 ..
oldest - 1`, right before the oldest ring step. Dialog step t has position t, so while t < W the layout is
the training one (L1 at 0..N1-1, L2 at N1..N1+N2-1, dialog from N1+N2) shifted by a constant, which RoPE
ignores.
"""

from __future__ import annotations

import torch

from egomem.kernels import Impl


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (a uint8 view), any other as itself: indexing, `where` and scatter then
    work on every device for the fp8 KV cache (`kv_dtype=torch.float8_e4m3fn`)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _kernels():
    """The kernel wrappers, imported on first use: they import triton, whose interpreter mode (CPU tests)
    is fixed at its first import, so importing the engine must not import triton."""
    from egomem.kernels.decode_attention import decode_attention
    from egomem.kernels.memchunk_write import memchunk_write

    return decode_attention, memchunk_write


class KVCacheTooLarge(RuntimeError):
    """The KV cache asked for does not fit on its device (the message says what to change)."""


def check_fits(shape: tuple[int, ...], dtype: torch.dtype, free_bytes: int, device: str) -> None:
    """Raise KVCacheTooLarge when K and V of `shape` `[L, S, Hkv, T, D]` need more than `free_bytes`.

    At Moshi-7B shape a 3,000-step bf16 cache holds 1.46 GiB per stream slot, so `dialog.max_streams`
    decides whether the engine fits at all (an H200: ~85 slots beside the weights)."""
    L, S, Hkv, T, D = shape
    per_slot = 2 * L * Hkv * T * D * dtype.itemsize
    if per_slot * S <= free_bytes:
        return
    gib = 2**30
    raise KVCacheTooLarge(
        f"the dialog KV cache needs {per_slot * S / gib:.1f} GiB ({S} stream slots x {per_slot / gib:.2f} GiB: "
        f"{L} layers x {Hkv} KV heads x {T} steps x {D} x K and V in {str(dtype).removeprefix('torch.')}), more than "
        f"the {free_bytes / gib:.1f} GiB free on {device}: lower dialog.max_streams (at most "
        f"{free_bytes // per_slot} fit), set dialog.kv_cache_dtype = \"fp8\" (half of bf16's bytes), or shorten "
        f"dialog.ring_steps")


class MemChunkKVCache:
    """K/V buffers `[L, S, Hkv, N1 + N2 + W, D]` plus per-slot dialog step counts `steps` `[S]`, kept on the
    cache's device so a tick computes every position there (no host sync: CUDA-graph capturable)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 n1: int, n2: int, ring: int, device: torch.device, dtype: torch.dtype, impl: Impl = "auto"):
        assert n1 >= 0 and n2 >= 0 and ring > 0, (n1, n2, ring)
        self.n1, self.n2, self.ring = n1, n2, ring
        self.impl: Impl = impl
        shape = (num_layers, num_slots, num_kv_heads, n1 + n2 + ring, head_dim)
        if torch.device(device).type == "cuda":  # a clear error before the allocation fails half-way
            check_fits(shape, dtype, torch.cuda.mem_get_info(device)[0], str(device))
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.steps = torch.zeros(num_slots, device=device, dtype=torch.int64)  # dialog steps written so far

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reset(self, slot: int) -> None:
        """Forget a slot's dialog (its ring is gated by `steps`; the chunk region is rewritten by the engine)."""
        self.steps[slot] = 0

    def write_chunk(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store chunk K/V `[L, Hkv, n, D]` (keys at chunk-region positions) at chunk steps `start .. start+n-1`
        of `slot` (0 = L1, N1 = L2; L1 and L2 together are one write of N1 + N2 steps at 0)."""
        n = k.shape[2]
        assert 0 <= start and start + n <= self.n1 + self.n2, \
            f"chunk steps [{start}, {start + n}) exceed the {self.n1 + self.n2}-step MemChunk region"
        _, memchunk_write = _kernels()
        memchunk_write(k, v, self.k, self.v, slot, start, impl=self.impl)

    def l1_kv(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's L1 K and V `[Hkv, N1, D]` at `layer` (the prefix an L2 refresh attends to)."""
        return self.k[layer, slot, :, :self.n1], self.v[layer, slot, :, :self.n1]

    def step_meta(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row metadata `[B]` (int64, on the device) of one tick in which each of `slots` `[B]` writes its
        next dialog step; device ops only. The kernels take per-row chunk lengths (`l1_len`, `l2_len`); here
        they are always N1 and N2."""
        t = self.steps[slots]  # [B]
        n_chunk = self.n1 + self.n2
        return {
            "slots": slots,
            "pos": t,  # position of this tick's query and new key
            "ring_idx": n_chunk + t % self.ring,
            "ring_len": torch.clamp(t + 1, max=self.ring),
            "l1_len": torch.full_like(t, self.n1),
            "l2_len": torch.full_like(t, self.n2),
            "chunk_pos0": torch.clamp(t + 1 - self.ring, min=0) - n_chunk,  # oldest ring step - chunk length
        }

    def append_and_attend(self, layer: int, meta: dict[str, torch.Tensor], q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, max_period: float, interleave: bool,
                          exec_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write this tick's rotated k/v `[B, Hkv, D]` into the ring, then attend with q `[B, H, D]`.
        Rows where `exec_mask` `[B]` is False keep their ring entry (they are computed, not stepped)."""
        kl, vl = self.k[layer], self.v[layer]  # [S, Hkv, T, D] views
        at = (meta["slots"], slice(None), meta["ring_idx"])
        k, v = _bits(k.to(kl.dtype)), _bits(v.to(vl.dtype))
        kb, vb = _bits(kl), _bits(vl)  # fp8 caches are indexed through their bytes (CPU has no fp8 indexing)
        if exec_mask is not None:
            keep = ~exec_mask[:, None, None]
            k, v = torch.where(keep, kb[at], k), torch.where(keep, vb[at], v)
        kb[at] = k
        vb[at] = v
        decode_attention, _ = _kernels()
        return decode_attention(
            q, kl, vl, meta["slots"], meta["l1_len"], meta["l2_len"], meta["ring_len"], meta["chunk_pos0"],
            n1=self.n1, n2=self.n2, max_period=max_period, interleave=interleave, impl=self.impl)

    def advance(self, slots: torch.Tensor, exec_mask: torch.Tensor | None = None) -> None:
        """One more dialog step for each of `slots` `[B]` (only where `exec_mask` is True)."""
        self.steps.index_add_(0, slots, torch.ones_like(slots) if exec_mask is None else exec_mask.to(slots.dtype))
