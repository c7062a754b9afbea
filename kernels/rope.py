"""Rotary position embedding (RoPE) in PyTorch, bit-compatible with `moshi.modules.rope.apply_rope`.

Used by the PyTorch paths and the naive references of the kernels here, and by the dialog engine to
rotate queries and ring keys at their real positions (the chunk keys are rotated at read time, see
`decode_attention`).
"""

from __future__ import annotations

import math

import torch


def rope_freqs(dim: int, max_period: float, device: torch.device) -> torch.Tensor:
    """The D/2 rotation frequencies, computed exactly as moshi does (fp32)."""
    ds = torch.arange(dim // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / dim))


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, max_period: float, interleave: bool) -> torch.Tensor:
    """Rotate `x` [..., T, D] by positions `pos` broadcastable to [..., T]; fp32 maths, result in x.dtype.

    interleave=True pairs dims (2i, 2i+1) (moshi "rope"); False pairs (i, i + D/2) ("rope_concat").
    """
    D = x.shape[-1]
    freqs = rope_freqs(D, max_period, x.device)  # [D/2]
    phase = pos.to(torch.float32)[..., None] * freqs  # [..., T, D/2]
    cos, sin = torch.cos(phase), torch.sin(phase)
    if interleave:
        xp = x.view(*x.shape[:-1], D // 2, 2)  # [..., T, D/2, 2]
        xr, xi = xp[..., 0].float(), xp[..., 1].float()
    else:
        xr, xi = x[..., : D // 2].float(), x[..., D // 2 :].float()
    outr = xr * cos - xi * sin
    outi = xr * sin + xi * cos
    if interleave:
        return torch.stack([outr.to(x.dtype), outi.to(x.dtype)], dim=-1).view(x.shape)
    return torch.cat([outr.to(x.dtype), outi.to(x.dtype)], dim=-1)
