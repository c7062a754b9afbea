"""Choosing between an operation's Triton kernel and its PyTorch path (`impl="auto"|"triton"|"torch"`)."""

from __future__ import annotations

import os
from typing import Literal

import torch

Impl = Literal["auto", "triton", "torch"]


def triton_interpreting() -> bool:
    """True when TRITON_INTERPRET=1: Triton kernels then run on CPU tensors (slowly; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_impl(impl: Impl, device: torch.device) -> Literal["triton", "torch"]:
    """auto = the Triton kernel on CUDA, the PyTorch path elsewhere."""
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton":
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"impl='triton' needs CUDA tensors (got {device}); on CPU use impl='torch' or set TRITON_INTERPRET=1"
            )
        return "triton"
    if impl == "torch":
        return "torch"
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
