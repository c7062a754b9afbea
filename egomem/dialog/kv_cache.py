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


def _kernels():
    """The kernel wrappers, imported on first use: they import triton, whose interpreter mode (CPU tests)
    is fixed at its first import, so importing the engine must not import triton."""
    from egomem.kernels.decode_attention import decode_attention
    from egomem.kernels.memchunk_write import memchunk_write

    return decode_attention, memchunk_write


class MemChunkKVCache:
    """K/V buffers `[L, S, Hkv, N1 + N2 + W, D]` plus per-slot dialog step counts (host ints: no syncs)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 n1: int, n2: int, ring: int, device: torch.device, dtype: torch.dtype, impl: Impl = "auto"):
        assert n1 >= 0 and n2 >= 0 and ring > 0, (n1, n2, ring)
        self.n1, self.n2, self.ring = n1, n2, ring
        self.impl: Impl = impl
        shape = (num_layers, num_slots, num_kv_heads, n1 + n2 + ring, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.steps = [0] * num_slots  # dialog steps written so far

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

    def step_meta(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """Per-row metadata of one tick in which each slot writes its next dialog step.

        The kernels take per-row chunk lengths (`l1_len`, `l2_len`); here they are always N1 and N2."""
        steps = [self.steps[s] for s in slots]
        rows = {
            "slots": slots,
            "pos": steps,  # position of this tick's query and new key
            "ring_idx": [self.n1 + self.n2 + t % self.ring for t in steps],
            "ring_len": [min(t + 1, self.ring) for t in steps],
            "l1_len": [self.n1] * len(slots),
            "l2_len": [self.n2] * len(slots),
            "chunk_pos0": [max(0, t + 1 - self.ring) - (self.n1 + self.n2) for t in steps],  # oldest - chunk
        }
        packed = torch.tensor(list(rows.values()), dtype=torch.int64, device=self.device)  # [7, B]: one copy
        return dict(zip(rows, packed.unbind(0)))

    def append_and_attend(self, layer: int, meta: dict[str, torch.Tensor], q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, max_period: float, interleave: bool) -> torch.Tensor:
        """Write this tick's rotated k/v `[B, Hkv, D]` into the ring, then attend with q `[B, H, D]`."""
        kl, vl = self.k[layer], self.v[layer]  # [S, Hkv, T, D] views
        kl[meta["slots"], :, meta["ring_idx"]] = k.to(kl.dtype)
        vl[meta["slots"], :, meta["ring_idx"]] = v.to(vl.dtype)
        decode_attention, _ = _kernels()
        return decode_attention(
            q, kl, vl, meta["slots"], meta["l1_len"], meta["l2_len"], meta["ring_len"], meta["chunk_pos0"],
            n1=self.n1, n2=self.n2, max_period=max_period, interleave=interleave, impl=self.impl)

    def advance(self, slots: list[int]) -> None:
        for s in slots:
            self.steps[s] += 1
