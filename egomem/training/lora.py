"""LoRA on a Moshi `LMModel`, with moshi's own `LoRALinear`, merged back on save.

As kyutai-labs/moshi-finetune (`finetune/wrapped_model.py`): every `nn.Linear` of the chosen modules is
replaced by `moshi.modules.lora.LoRALinear` (frozen W + B @ A * scaling, no bias, no dropout); A starts
Kaiming-uniform, B at zero, so the adapted model starts equal to the base one; only `lora_A` / `lora_B`
train. Scope "transformers" (default) adapts the temporal transformer's and the depformer's linears
(attention `in_projs` / `out_projs`, gating `linear_in` / `linear_out`); scope "all" adapts every
linear of the LMModel, as moshi-finetune does (also `text_linear`, `depformer_in` and the output heads).
`merged_state_dict` folds the adapters in, giving a plain LMModel state dict (the layout
`egomem.dialog.checkpoint.build_lm` loads).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from moshi.models.lm import LMModel
from moshi.modules.lora import LoRALinear, replace_all_linear_with_lora

LoraScope = Literal["transformers", "all"]


def _targets(lm: LMModel, scope: LoraScope) -> list[torch.nn.Module]:
    if scope == "all":
        return [lm]
    if scope == "transformers":
        return [m for m in (lm.transformer, lm.depformer) if m is not None]
    raise ValueError(f"unknown LoRA scope {scope!r}: use 'transformers' or 'all'")


def apply_lora(lm: LMModel, rank: int, alpha: float, seed: int, scope: LoraScope = "transformers") -> LMModel:
    """Wrap `lm`'s linears in place with LoRA (scaling = alpha / rank), freeze everything else; returns `lm`.

    The adapters' A matrices are drawn from a generator seeded with `seed` (same seed -> same init).
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    if any(isinstance(m, LoRALinear) for m in lm.modules()):
        raise ValueError("this LMModel already has LoRA adapters")
    for t in _targets(lm, scope):
        replace_all_linear_with_lora(t, rank, alpha / rank)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for m in lm.modules():
        if isinstance(m, LoRALinear):
            with torch.no_grad():
                a = torch.empty(m.lora_A.weight.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # moshi-finetune's init
                m.lora_A.weight.copy_(a)
                m.lora_B.weight.zero_()
    for name, p in lm.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return lm


def has_lora(lm: torch.nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in lm.modules())


@torch.no_grad()
def merged_state_dict(lm: LMModel) -> dict[str, torch.Tensor]:
    """`lm`'s state dict with every LoRALinear folded into a plain `<prefix>.weight` = W + scaling * B @ A.

    The model itself is left unchanged (training may continue); without adapters this is `state_dict()`.
    """
    merged = {}
    for prefix, m in lm.named_modules():
        if isinstance(m, LoRALinear):
            # in float32, then back to the weight's dtype: one rounding, as a merged bf16 model would hold it
            w = m.frozen_W.weight.float() + m.scaling * (m.lora_B.weight.float() @ m.lora_A.weight.float())
            merged[f"{prefix}.frozen_W.weight"] = (f"{prefix}.weight", w.to(m.frozen_W.weight.dtype))
    state = {}
    for key, value in lm.state_dict().items():  # keeps the model's key order
        if key in merged:
            state[merged[key][0]] = merged[key][1]
        elif not key.endswith((".lora_A.weight", ".lora_B.weight")):
            state[key] = value
    return state
