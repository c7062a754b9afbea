"""The training forward: what `DialogEngine` computes, as one teacher-forced pass over a whole sample.

A sample's context is `[L1 MemChunk (n1 steps) | L2 MemChunk (n2 steps) | dialog (T steps)]`
(paper §4.1; docs/kv-cache.md). Chunk steps enter the model as they are (text = memory token or
text pad, 16 audio rows = `chunk_audio_token`), exactly as `DialogEngine.write_memchunk` embeds
them. Dialog step t enters as moshi's `LMGen` (and so the engine) feeds tick t, with Moshi's delays
d_k: row k is the initial token while t <= d_k, else

- text and speak rows (k = 0..8): the token the model produced for frame t - 1 - d_k;
- listen rows (k = 9..16): the user's frame t - d_k.

`stream` below is always the *aligned* 17-row token stream `[text, 8 speak, 8 listen]` per frame
(the order `DialogEngine.step` returns and the recorder writes). At tick t the text head predicts
text frame t, and the depformer predicts what tick t generates: speak codebook k's frame t - d_k.
tests/test_training_parity.py checks these logits against the engine's, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from moshi.models.lm import LMModel

N_GEN = 9  # text + 8 speak rows: what the model produces


def dialog_inputs(lm: LMModel, stream: torch.Tensor) -> torch.Tensor:
    """The engine's inputs for ticks 0..T-1 of an aligned stream `[B, K, T]` -> `[B, K, T]` (module docstring)."""
    B, K, T = stream.shape
    assert K == lm.num_codebooks, (K, lm.num_codebooks)
    initial = lm._get_initial_token().to(stream.device)[:, :, 0]  # [1, K]
    out = torch.empty_like(stream)
    for k, d in enumerate(lm.delays):
        shift = 1 + d if k < N_GEN else d  # generated rows: frame t-1-d; listen rows: frame t-d
        out[:, k, :shift] = initial[0, k]
        out[:, k, shift:] = stream[:, k, :T - shift]
        out[:, k, :d + 1] = initial[0, k]  # LMGen: ticks t <= d read the initial token
    return out


def generated_targets(lm: LMModel, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What tick t generates, `[B, 9, T]` (row k: frame t - d_k), and where that frame exists (t >= d_k)."""
    B, K, T = stream.shape
    out = torch.full((B, N_GEN, T), lm.zero_token_id, dtype=torch.long, device=stream.device)
    valid = torch.zeros(B, N_GEN, T, dtype=torch.bool, device=stream.device)
    for k in range(N_GEN):
        d = lm.delays[k]
        out[:, k, d:] = stream[:, k, :T - d]
        valid[:, k, d:] = True
    return out, valid


@dataclass
class ForwardOut:
    text_logits: torch.Tensor  # [B, T, text_card]: tick t -> text frame t
    audio_logits: torch.Tensor  # [B, dep_q, T, card]: tick t -> speak codebook k's frame t - d_k
    targets: torch.Tensor  # [B, 9, T] what each tick generates (delayed layout)
    valid: torch.Tensor  # [B, 9, T] the target frame exists
    delays: list[int]  # the model's delays, text first


def forward(lm: LMModel, chunks: torch.Tensor, stream: torch.Tensor) -> ForwardOut:
    """Teacher-forced logits of every dialog tick. chunks: `[B, K, C]` MemChunk rows (C = n1 + n2);
    stream: the aligned dialog `[B, K, T]`. Only the dialog's logits are returned."""
    C = chunks.shape[2]
    inputs = torch.cat([chunks, dialog_inputs(lm, stream)], dim=2)  # [B, K, C + T]
    transformer_out, text_logits = lm.forward_text(inputs)  # [B, C+T, dim], [B, 1, C+T, text_card]
    targets, valid = generated_targets(lm, stream)
    depformer_seq = torch.zeros_like(stream)
    depformer_seq[:, :N_GEN] = targets.clamp_min(0)  # depformer teacher forcing: this tick's own tokens
    audio_logits = lm.forward_depformer_training(depformer_seq, transformer_out[:, C:])
    return ForwardOut(text_logits[:, 0, C:], audio_logits, targets, valid, list(lm.delays))


def turn_heads(text: torch.Tensor, pad_id: int, n: int) -> torch.Tensor:
    """Bool `[B, T]`: the first `n` tokens of every run of non-pad text tokens (where an utterance starts:
    "You live", "Hey Ada": what to say is decided there, the rest follows from it)."""
    B, T = text.shape
    spoken = text != pad_id
    starts = spoken & ~F.pad(spoken, (1, 0))[:, :T]
    t = torch.arange(T, device=text.device).expand(B, T)
    last_start = torch.where(starts, t, torch.full_like(t, -T)).cummax(dim=1).values
    return spoken & (t - last_start < n)


def masked_loss(out: ForwardOut, text_mask: torch.Tensor, speak_mask: torch.Tensor, text_pad_id: int,
                text_pad_weight: float = 0.5, first_codebook_weight: float = 1.0, turn_head_weight: float = 1.0,
                turn_head_tokens: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy over supervised frames (moshi-finetune's loss: text + audio codebooks, text pad
    down-weighted). text_mask / speak_mask: `[B, T]` over *frames*; a speak codebook's target at tick t
    is frame t - d_k, so its mask is read at that frame. `turn_head_weight` multiplies the text loss of
    the first `turn_head_tokens` tokens of each utterance (`turn_heads`), as moshi-finetune's first-codebook
    weight does for the semantic token: where the reply is chosen. Returns (loss, parts for logging)."""
    B, T, V = out.text_logits.shape
    tgt = out.targets
    tm = text_mask & out.valid[:, 0]
    ce = F.cross_entropy(out.text_logits.reshape(-1, V).float(), tgt[:, 0].reshape(-1).clamp_min(0),
                         reduction="none").view(B, T)
    w = torch.where(tgt[:, 0] == text_pad_id, text_pad_weight, 1.0) * tm
    if turn_head_weight != 1.0 and turn_head_tokens > 0:
        w = w * torch.where(turn_heads(tgt[:, 0], text_pad_id, turn_head_tokens), turn_head_weight, 1.0)
    text_loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    Ka, card = out.audio_logits.shape[1], out.audio_logits.shape[-1]
    audio_num = out.audio_logits.new_zeros(())
    audio_den = out.audio_logits.new_zeros(())
    for k in range(Ka):
        d = out.delays[1 + k]
        # frame-level mask shifted to the ticks that predict those frames
        m = torch.zeros_like(speak_mask)
        m[:, d:] = speak_mask[:, :T - d]
        m = m & out.valid[:, 1 + k]
        ce_k = F.cross_entropy(out.audio_logits[:, k].reshape(-1, card).float(), tgt[:, 1 + k].reshape(-1).clamp_min(0),
                               reduction="none").view(B, T)
        wk = m.float() * (first_codebook_weight if k == 0 else 1.0)
        audio_num = audio_num + (ce_k * wk).sum()
        audio_den = audio_den + wk.sum()
    audio_loss = audio_num / audio_den.clamp_min(1e-6)
    has_audio = bool(audio_den > 0)
    loss = text_loss + (audio_loss if has_audio else 0.0)
    return loss, {"text": float(text_loss.detach()), "audio": float(audio_loss.detach()) if has_audio else float("nan")}
