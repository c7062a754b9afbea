"""`TriggerLabeler`: tokens [T, 17] -> labels [T] with a trained trigger, any length T.

Inputs up to `window_steps` (1,024) are labelled in one full-attention pass. Longer ones (the
worker's 8,192-step chunks, `max_chunk_steps`) are labelled in windows of `window_steps` that overlap
by `2 * window_overlap_steps`; each window contributes only its centre, so every kept label saw at
least `window_overlap_steps` of context on both sides (except at the stream's own ends). Windows of
about the length the tagger was trained on label 8,192-step chunks as well as one pass over all of
them, in a third of the time (attention is quadratic): `bench/bench_trigger.py`'s 8,192-step rows.

A checkpoint trained with the voice track (`voice_dim` > 0) also takes the chunk's recorded voice polls
(`voices`: [(step, [D])], `StreamChunk.voices`); their features are built over the whole chunk once
(`voice_track.voice_features`) and sliced with the windows. Without polls it labels from the codes,
as it learnt to on the training streams whose track was withheld.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import torch

from egomem.config import TriggerConfig
from egomem.trigger.decode import configured_decode, decode_sessions
from egomem.trigger.model import AUDIO_CARD, NUM_TOKENS, load_trigger
from egomem.trigger.voice_track import Track, voice_features

log = logging.getLogger(__name__)

SHIPPED_CHECKPOINT = Path(__file__).resolve().parent.parent / "data" / "trigger_tiny.safetensors"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def windows(T: int, size: int, overlap: int) -> list[tuple[int, int, int, int]]:
    """Cover [0, T) with windows: (win_start, win_end, keep_start, keep_end), keeps tile [0, T)."""
    if T <= size:
        return [(0, T, 0, T)]
    if size <= 2 * overlap:
        raise ValueError(f"window size {size} must exceed twice the overlap {overlap}")
    out, keep = [], 0
    while keep < T:
        ws = max(0, min(keep - overlap, T - size))
        we = ws + size
        ke = T if we >= T else we - overlap
        out.append((ws, we, keep, ke))
        keep = ke
    return out


class TriggerLabeler:
    """The episodic trigger as the memory manager calls it: `label(tokens) -> labels`."""

    def __init__(self, cfg: TriggerConfig | None = None):
        self.cfg = cfg or TriggerConfig()
        path = Path(self.cfg.checkpoint) if self.cfg.checkpoint is not None else SHIPPED_CHECKPOINT
        self.device = _device(self.cfg.device)
        self.model, self.meta = load_trigger(path, self.device)
        self.checkpoint = path
        self.reads_voices = bool(self.model.cfg.voice_dim)  # label_stream hands such a labeler the voice track
        self._lock = threading.Lock()  # Triton may call from several threads; one forward at a time
        log.info("trigger: loaded %s (codec fingerprint %s)", path, self.meta.get("codec_fingerprint", "?"))

    @staticmethod
    def validate(tokens: np.ndarray) -> np.ndarray:
        """Check shape [T, 17], integer dtype and token ranges; return int64."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] != NUM_TOKENS:
            raise ValueError(f"trigger tokens must be [T, {NUM_TOKENS}] (text, 8 speak, 8 listen), got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"trigger tokens must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < -1 or tokens[:, 1:].max() > AUDIO_CARD):
            raise ValueError(f"trigger tokens out of range: audio codes must be in [-1, {AUDIO_CARD}], text >= -1")
        return tokens.astype(np.int64)

    def voice_input(self, voices: Track | None, steps: int) -> torch.Tensor | None:
        """The voice features [T, voice_dim + 2] of a poll track, or None (codes only: no track, a
        codes-only checkpoint, or vectors of another speaker encoder, which is logged, not fatal)."""
        c = self.model.cfg
        if not voices or not c.voice_dim:
            return None
        try:
            feats = voice_features(voices, steps, c.voice_dim, c.voice_window_steps)
        except ValueError as e:
            log.warning("trigger: labelling from the codes only: %s (%s)", e, self.checkpoint)
            return None
        return torch.from_numpy(feats).to(self.device)

    @torch.no_grad()
    def log_probs(self, tokens: np.ndarray, voices: Track | None = None) -> np.ndarray:
        """tokens [T, 17] (+ the voice poll track, steps relative to tokens) -> per-step label
        log-probabilities [T, 4] (windowed beyond window_steps)."""
        tokens = self.validate(tokens)
        T = tokens.shape[0]
        out = np.zeros((T, 4), np.float32)
        x = torch.from_numpy(tokens).to(self.device)
        v = self.voice_input(voices, T)
        with self._lock:
            for ws, we, ks, ke in windows(T, self.cfg.window_steps, self.cfg.window_overlap_steps):
                logits = self.model(x[None, ws:we], None if v is None else v[None, ws:we])[0]  # W,4
                out[ks:ke] = torch.log_softmax(logits[ks - ws:ke - ws].float(), -1).cpu().numpy()
        return out

    def label(self, tokens: np.ndarray, voices: Track | None = None) -> np.ndarray:
        """tokens [T, 17] (+ voice polls) -> labels [T] int64 in {0 no dialog, 1 start, 2 in session, 3 end}.

        The most probable well-formed sequence (`viterbi_labels`: sessions adjacent or at least
        `min_gap_steps` apart unless the tagger pays `short_gap_cost` for a shorter gap, none shorter
        than `min_session_steps`), not the per-step argmax: one stray start/end label would otherwise
        split a session; then each boundary moved to where its probability lies (`refine_boundaries`,
        `boundary_window_steps`)."""
        if np.asarray(tokens).shape[:1] == (0,):
            self.validate(tokens)
            return np.zeros(0, np.int64)
        return configured_decode(self.log_probs(tokens, voices), self.cfg)

    def sessions(self, tokens: np.ndarray, voices: Track | None = None) -> list[tuple[int, int]]:
        """Dialog sessions (start step, end step inclusive) in a token chunk."""
        return decode_sessions(self.label(tokens, voices))
