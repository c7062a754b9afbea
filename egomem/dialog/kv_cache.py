"""The MemChunk KV cache: per layer and slot, time laid out as `[ L1 (N1) | L2 (N2) | dialog ring (W) ]`.

Buffers are allocated once at full shape (gpt-fast style) and written by index. Chunk keys are stored
rotated only to their position inside the chunk (L1 step j at j, L2 step j at l1_len + j): they do not
depend on the dialog, and `decode_attention` rotates the chunk on to its virtual positions at read time
(one rotation of the query per row, the same maths as rotating each stored key). Ring keys are stored
rotated at their real dialog position. Per slot we track how much of L1/L2 is valid and how many
dialog steps were written; the ring keeps the last W of them (ring index `step % W`).

Position rule (docs/kv-cache.md#positions-rotate-on-read): after writing dialog step t, the ring holds steps
max(0, t + 1 - W) .. t, and the valid chunk (c = l1_len + l2_len steps) sits at virtual positions
`oldest - c .. oldest - 1`, right before the oldest ring step. Dialog step t has position t, so while
t < W the layout is the training one (chunk then dialog) shifted by a constant, which RoPE ignores.
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
    """K/V buffers `[L, S, Hkv, N1 + N2 + W, D]` plus per-slot valid lengths (host ints: no syncs)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 n1: int, n2: int, ring: int, device: torch.device, dtype: torch.dtype, impl: Impl = "auto"):
        assert n1 >= 0 and n2 >= 0 and ring > 0, (n1, n2, ring)
        self.n1, self.n2, self.ring = n1, n2, ring
        self.impl: Impl = impl
        shape = (num_layers, num_slots, num_kv_heads, n1 + n2 + ring, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.l1_len = [0] * num_slots
        self.l2_len = [0] * num_slots
        self.steps = [0] * num_slots  # dialog steps written so far

    @property
    def device(self) -> torch.device:
        return self.k.device

    def reset(self, slot: int) -> None:
        """Forget a slot's chunks and dialog (buffers are left as they are: lengths gate every read)."""
        self.l1_len[slot] = self.l2_len[slot] = self.steps[slot] = 0

    def write_chunk(self, slot: int, level: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store chunk K/V `[L, Hkv, n, D]` (keys at chunk-internal positions) for `slot`; L1 clears L2."""
        n = k.shape[2]
        cap = self.n1 if level == 1 else self.n2
        assert n <= cap, f"level-{level} chunk of {n} steps exceeds its {cap}-step region"
        _, memchunk_write = _kernels()
        memchunk_write(k, v, self.k, self.v, slot, 0 if level == 1 else self.n1, impl=self.impl)
        if level == 1:
            self.l1_len[slot], self.l2_len[slot] = n, 0
        else:
            self.l2_len[slot] = n

    def chunk_kv(self, slot: int, layer: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's valid chunk K and V `[Hkv, n, D]` at `layer` (used by the L2 refresh pass)."""
        start, n = (0, self.l1_len[slot]) if level == 1 else (self.n1, self.l2_len[slot])
        return self.k[layer, slot, :, start:start + n], self.v[layer, slot, :, start:start + n]

    def step_meta(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """Per-row metadata of one tick in which each slot writes its next dialog step."""
        steps = [self.steps[s] for s in slots]
        oldest = [max(0, t + 1 - self.ring) for t in steps]
        chunk = [self.l1_len[s] + self.l2_len[s] for s in slots]
        rows = {
            "slots": slots,
            "pos": steps,  # position of this tick's query and new key
            "ring_idx": [self.n1 + self.n2 + t % self.ring for t in steps],
            "ring_len": [min(t + 1, self.ring) for t in steps],
            "l1_len": [self.l1_len[s] for s in slots],
            "l2_len": [self.l2_len[s] for s in slots],
            "chunk_pos0": [o - c for o, c in zip(oldest, chunk)],
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
