"""The episodic trigger network: one label per 80 ms step over a 17-token RQ-Transformer stream.

Follows the EgoMem paper's trigger (a sequence tagger over the dialog model's own token stream)
and moshi's `LMModel` input organisation: per step the text token and the 16 audio tokens
(8 speak + 8 listen Mimi codebooks) are each embedded and the 17 embeddings are summed
(`LMModel.forward_text`). Unlike the dialog LM, attention is full (non-causal): the trigger reads
a whole recorded chunk (up to 8,192 steps) after the fact, so a label may use the future.

Labels: 0 no dialog, 1 start of a user's session, 2 in session, 3 end of session.

Deviations from a full-size model, and why:
  - audio embeddings are low rank (moshi's `ScaledEmbedding(low_rank=...)`) and text ids are hashed
    into `text_buckets` rows, so the shipped checkpoint stays under 5 MB (training may set the audio
    tables from the codec's codebook centroids: `train.init_audio_emb_from_codebooks`);
  - no absolute positions: dilated depthwise convolutions give relative order (a few seconds) and
    attention is position-free, so a model trained on ~1,000-step streams runs unchanged on 8,192-step chunks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from egomem.trigger.voice_track import CHANGE_FEATURES

NUM_LABELS = 4
NO_DIALOG, START, IN_SESSION, END = 0, 1, 2, 3
NUM_TOKENS = 17  # 1 text + 8 speak + 8 listen codebooks
AUDIO_CARD = 2048  # Mimi codebook size; id 2048 is moshi's initial (start-of-stream) token
ZERO_TOKEN = -1  # moshi's zero_token_id: "no input" -> the embedding is exactly 0


@dataclass
class TriggerModelConfig:
    """Architecture of a trigger network (stored in the checkpoint's metadata)."""

    dim: int = 64
    num_layers: int = 3
    num_heads: int = 4
    emb_rank: int = 16
    text_buckets: int = 1024
    conv_kernel: int = 9
    audio_card: int = AUDIO_CARD
    ffn_mult: int = 4
    voice_dim: int = 0  # > 0: also reads the recorded voice track (voice_track.voice_features), e.g. 256 for GE2E
    voice_window_steps: int = 38  # steps one voice poll covers (orchestrator.identify_window_s = 3 s)
    dropout: float = 0.0  # training only (model.train()): on each residual branch (not on the attention weights:
    # on CPU that leaves SDPA's fused kernel for one that holds [T, T] per head, 2-3x slower on 8,192-step streams)

    def to_dict(self) -> dict:
        return asdict(self)


class _ShiftConv(nn.Module):
    """Depthwise 1-D convolution over time written as K shifted, per-channel-weighted copies.

    Same function as `nn.Conv1d(C, C, K, dilation=d, groups=C, padding="same")` on [B, T, C], but
    its backward is ~10x cheaper on CPU than torch's depthwise-conv kernel (the training bottleneck).
    """

    def __init__(self, dim: int, kernel: int, dilation: int):
        super().__init__()
        self.kernel, self.dilation = kernel, dilation
        self.weight = nn.Parameter(torch.randn(kernel, dim) / kernel)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        half = (self.kernel // 2) * self.dilation
        xp = F.pad(x, (0, 0, half, half))  # B,T+2h,C (zeros beyond the chunk)
        out = self.bias.expand(B, T, C)
        for k in range(self.kernel):
            o = k * self.dilation
            out = out + xp[:, o:o + T] * self.weight[k]
        return out  # B,T,C


class _Block(nn.Module):
    """Pre-norm block: dilated depthwise conv (local order), full bidirectional attention, FFN."""

    def __init__(self, dim: int, heads: int, ffn_mult: int, kernel: int, dilation: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.drop = nn.Dropout(dropout)  # identity in eval mode, and with p = 0
        self.norm0 = nn.LayerNorm(dim)
        self.conv = _ShiftConv(dim, kernel, dilation)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_mult * dim), nn.GELU(), nn.Linear(ffn_mult * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x + self.drop(self.conv(self.norm0(x)))  # B,T,C
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # B,H,T,D
        y = F.scaled_dot_product_attention(q, k, v)  # B,H,T,D; no mask: every step sees the whole chunk
        x = x + self.drop(self.out(y.transpose(1, 2).reshape(B, T, C)))  # B,T,C
        return x + self.drop(self.ffn(self.norm2(x)))


class TriggerModel(nn.Module):
    """tokens [B, T, 17] (int64) -> logits [B, T, 4]."""

    def __init__(self, cfg: TriggerModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        K = NUM_TOKENS - 1
        self.text_emb = nn.Embedding(cfg.text_buckets, d)
        # 16 low-rank audio embeddings (one per codebook) stored as one table + one projection each.
        self.audio_emb = nn.Parameter(torch.randn(K, cfg.audio_card + 1, cfg.emb_rank))
        self.audio_proj = nn.Parameter(torch.randn(K, cfg.emb_rank, d) / cfg.emb_rank**0.5)
        self.register_buffer("_cb", torch.arange(K), persistent=False)
        # bias-free: a step no poll covers (all-zero features) adds nothing, so "no track" is the codes alone
        self.voice_proj = nn.Linear(cfg.voice_dim + CHANGE_FEATURES, d, bias=False) if cfg.voice_dim else None
        self.conv = _ShiftConv(d, cfg.conv_kernel, 1)
        self.conv_norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(
            [_Block(d, cfg.num_heads, cfg.ffn_mult, cfg.conv_kernel, 2**i, cfg.dropout) for i in range(cfg.num_layers)]
        )  # dilations 1, 2, 4, ...: receptive field of the convs ~ (kernel - 1) * 2**layers steps
        self.out_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, NUM_LABELS)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sum of the 17 per-token embeddings, as moshi's LMModel builds its transformer input."""
        text = tokens[..., 0]
        is_zero = text == ZERO_TOKEN
        x = self.text_emb(text.clamp(min=0) % self.cfg.text_buckets).masked_fill(is_zero[..., None], 0.0)
        audio = tokens[..., 1:]  # B,T,16
        low = self.audio_emb[self._cb, audio.clamp(min=0)]  # B,T,16,r
        low = low.masked_fill((audio == ZERO_TOKEN)[..., None], 0.0)
        return x + torch.einsum("btkr,krd->btd", low, self.audio_proj)  # B,T,C: sum over the 16 codebooks

    def features(self, tokens: torch.Tensor, voices: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T, 17] (+ voices [B, T, voice_dim + 2] from `voice_features`, None = no track)
        -> the normalised last hidden state [B, T, dim] the label head reads."""
        if tokens.dim() != 3 or tokens.shape[-1] != NUM_TOKENS:
            raise ValueError(f"tokens must be [B, T, {NUM_TOKENS}], got {tuple(tokens.shape)}")
        x = self.embed(tokens)
        if voices is not None and self.voice_proj is not None:
            if voices.shape != (*tokens.shape[:2], self.voice_proj.in_features):
                raise ValueError(f"voices must be [B, T, {self.voice_proj.in_features}] beside tokens "
                                 f"{tuple(tokens.shape)}, got {tuple(voices.shape)}")
            x = x + self.voice_proj(voices.to(x.dtype))
        x = self.conv_norm(x + self.conv(x))  # B,T,C
        for blk in self.blocks:
            x = blk(x)
        return self.out_norm(x)

    def forward(self, tokens: torch.Tensor, voices: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of a batch must be real streams of equal length (no padding: convs would mix it in).
        `voices` is ignored by a model trained without the voice track (voice_dim = 0)."""
        return self.head(self.features(tokens, voices))  # B,T,4


# ----------------------------------------------------------------------------------------------
# checkpoint files (safetensors: fp16 weights + JSON metadata)


class TriggerCheckpointError(RuntimeError):
    """A trigger checkpoint is missing or does not fit the model it describes."""


def save_trigger(model: TriggerModel, path: Path, meta: dict) -> None:
    """Write fp16 weights + metadata (model config, codec fingerprint, training command)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"config": json.dumps(model.cfg.to_dict()),
                                          **{k: str(v) for k, v in meta.items()}})


def load_trigger(path: Path, device: str | torch.device = "cpu") -> tuple[TriggerModel, dict]:
    """Load a trigger checkpoint, asserting every key and shape; returns (model in eval mode, metadata)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise TriggerCheckpointError(
            f"trigger checkpoint {path} not found (trigger.checkpoint). Train one with "
            f"`egomem train-trigger --data <LibriSpeech root> --out {path}` or unset trigger.checkpoint "
            f"for the shipped default."
        )
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        state = {k: f.get_tensor(k) for k in f.keys()}
    if "config" not in meta:
        raise TriggerCheckpointError(f"{path} has no 'config' metadata: not a trigger checkpoint")
    model = TriggerModel(TriggerModelConfig(**json.loads(meta["config"])))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise TriggerCheckpointError(
            f"{path} does not fit its own config: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape {wrong[:5]}"
        )
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.to(device).eval(), meta
