"""Named `LMModel` shapes (gpt-fast style presets as data).

`7b` is Moshi-7B's architecture (moshi.models.loaders._lm_kwargs); `tiny` keeps the same classes and
token layout (17 streams, Mimi's 2048-entry codebooks, Moshi's delays) at a size that steps in real
time on a 2-core CPU; its text vocabulary is the byte-level tokenizer's (`ByteTokenizer`, 260 ids).
"""

from __future__ import annotations

from typing import Any

MOSHI_DELAYS = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]  # text, 8 speak, 8 listen

_COMMON: dict[str, Any] = {
    "n_q": 16,  # 8 speak + 8 listen codebooks
    "dep_q": 8,
    "card": 2048,  # Mimi codebook size, so codes from mimi_codec fit any preset
    "causal": True,
    "layer_scale": None,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",  # the engine's rotate-on-read cache needs RoPE (relative positions)
    "depformer_multi_linear": True,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "depformer_layer_scale": None,
    "delays": MOSHI_DELAYS,
    "existing_text_padding_id": 3,
}

PRESETS: dict[str, dict[str, Any]] = {
    "7b": _COMMON | {
        "dim": 4096, "text_card": 32000, "num_heads": 32, "num_layers": 32, "hidden_scale": 4.125,
        "context": 3000, "depformer_dim": 1024, "depformer_dim_feedforward": int(4.125 * 1024),
        "depformer_num_heads": 16, "depformer_num_layers": 6, "depformer_context": 8,
    },
    "tiny": _COMMON | {
        "dim": 256, "text_card": 260, "num_heads": 4, "num_layers": 4, "hidden_scale": 4.125,
        "context": 3000,  # as 7B: 768 chunk steps + a 2232-step dialog ring
        "depformer_dim": 128, "depformer_dim_feedforward": int(4.125 * 128),
        "depformer_num_heads": 2, "depformer_num_layers": 2, "depformer_context": 8,
    },
}


def lm_kwargs(preset: str, **overrides: Any) -> dict[str, Any]:
    """The `LMModel(**kwargs)` of a preset, with overrides applied (tests shrink `tiny` further)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown dialog preset {preset!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[preset]) | overrides
