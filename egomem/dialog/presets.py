"""Named `LMModel` shapes (gpt-fast style presets as data).

`7b` is Moshi-7B's architecture (moshi.models.loaders._lm_kwargs); `tiny` keeps the same classes and
token layout (17 streams, Mimi's 2048-entry codebooks, Moshi's delays) at a size that steps in real
time on a 2-core CPU; its text vocabulary is the byte-level tokenizer's (`ByteTokenizer`, 260 ids).

`out_norm` is not an `LMModel` argument but EgoMem's: whether the model keeps moshi's final norm
(`LMModel.out_norm`, between the last layer and the text head / depformer). `build_lm` drops it when
False. The tiny preset has none: trained from scratch, a final norm kept both the tiny moshi model and a
textbook transformer from learning to copy a span out of their context by content (induction heads)
within thousands of steps, and without it both learn it (docs/training.md, "The skill itself,
isolated"). Moshi-7B's checkpoints carry the norm, so `7b` keeps it.

`text_emb_std` is EgoMem's too: when set, a randomly initialised model's text embedding is drawn at
this std instead of moshi's 1/sqrt(dim) (a checkpoint's weights replace it). The input of a step is the
sum of the text embedding and 16 audio embeddings; at moshi's init the text is one of 17 equal parts,
and with speech codes in the audio rows the from-scratch tiny model did not learn to copy text out of
its context (0.13 of a drill by 700 steps); at std 1 it copied 0.97 by step 300 (docs/training.md,
"The skill itself, isolated"). Moshi-7B's checkpoints carry their embeddings, so `7b` leaves it unset.
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
    "out_norm": True,  # EgoMem's key (module docstring): keep LMModel.out_norm
    "text_emb_std": None,  # EgoMem's key (module docstring): moshi's text embedding init
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
        "out_norm": False,  # lets the from-scratch model learn to copy from its MemChunks (module docstring)
        "text_emb_std": 1.0,  # the text stands out of the summed speech embeddings (module docstring)
    },
}


def lm_kwargs(preset: str, **overrides: Any) -> dict[str, Any]:
    """The `LMModel(**kwargs)` of a preset plus EgoMem's `out_norm` and `text_emb_std` keys, with overrides applied (tests shrink
    `tiny` further). `build_lm` is what turns these into a model."""
    if preset not in PRESETS:
        raise ValueError(f"unknown dialog preset {preset!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[preset]) | overrides
