"""Build the dialog `LMModel` from config: a Moshi-format safetensors checkpoint, or random weights.

Loading checks every key and shape and fails with the file name and the first offending keys
(never a silent `strict=False`). Random weights are seeded so every process builds the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from moshi.models.lm import LMModel

from .presets import lm_kwargs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint file is missing or does not match the model it should fill."""


def _first(keys: list[str], n: int = 5) -> str:
    return ", ".join(sorted(keys)[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def _without_out_norm(model: LMModel, keep: bool) -> LMModel:
    """Drop moshi's final norm unless the preset keeps it (presets.py). moshi's `forward_text` skips a
    falsy `out_norm`, and so does `DialogEngine`; a checkpoint of such a model has no `out_norm.alpha`."""
    if not keep:
        model.out_norm = None
    return model


def build_lm(preset: str = "tiny", weights: Path | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, seed: int = 1234, **overrides: Any) -> LMModel:
    """An eval-mode LMModel of `preset` shape, with weights from `weights` (safetensors) or seeded random."""
    kwargs = lm_kwargs(preset, **overrides)
    keep_out_norm = kwargs.pop("out_norm")
    text_emb_std = kwargs.pop("text_emb_std")
    if weights is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _without_out_norm(LMModel(device=device, dtype=dtype, **kwargs), keep_out_norm)
            if text_emb_std is not None:  # presets.py: the text stands out of the summed audio embeddings
                with torch.no_grad():
                    model.text_emb.weight.normal_(0.0, text_emb_std)
            return model.eval()
    path = Path(weights)
    if not path.is_file():
        raise CheckpointError(f"dialog checkpoint {path} does not exist: set dialog.weights to a local Moshi "
                              f"safetensors file (weights are never downloaded), or unset it for random weights")
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own SafetensorError (a bare Exception subclass)
        raise CheckpointError(f"dialog checkpoint {path} is not a readable safetensors file: {e}") from e
    # a checkpoint that carries the final norm keeps it (tiny models trained before the preset dropped it)
    keep_out_norm = keep_out_norm or "out_norm.alpha" in state
    model = _without_out_norm(LMModel(device="meta", dtype=dtype, **kwargs), keep_out_norm)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # moshi's load hook renames fused `in_proj_weight` keys; apply it before comparing
    for name, module in model.named_modules():
        for hook in module._load_state_dict_pre_hooks.values():
            hook(state, name + "." if name else "", {}, True, [], [], [])
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {tuple(state[k].shape)} != {expected[k]}" for k in expected
                  if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys: {_first(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys: {_first(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatches: {_first(mismatched)}")
        raise CheckpointError(f"dialog checkpoint {path} does not match preset {preset!r}: " + "; ".join(parts))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
