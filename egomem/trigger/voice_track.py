"""The recorded voice track as per-step trigger input: who was heard, and how much it changed.

The orchestrator's polling loop records a voice embedding every 2 s (`StreamChunk.voices`: (step, [D])
pairs, the speaker encoder's view of the last `identify_window_s` of user audio). The trigger's codes
carry only part of who speaks (the tiny codec), while a user switch after a short pause hangs on
exactly that; the memory manager has the track anyway (the identity split reads it). So a trigger
trained with `voice_dim > 0` also reads it, as dense per-step features:

    [T, D + 2]: each step holds the unit embedding of the first poll whose window covers it (the
    poll at step t covers steps t - window + 1 .. t), then 1 - cos to the previous poll and
    1 - cos to the next one (0 where there is none: no evidence of a change); all zeros on steps
    no poll covers.

The same function builds them in training (`synth.poll_voices`) and in serving, so both see one thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Track = Sequence[tuple[int, np.ndarray]]
CHANGE_FEATURES = 2  # 1 - cos to the previous poll, 1 - cos to the next poll


def _unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, np.float32).reshape(-1)
    return v / max(float(np.linalg.norm(v)), 1e-12)


def voice_features(track: Track, steps: int, dim: int, window_steps: int) -> np.ndarray:
    """The poll track of a chunk ([(step, [dim])], steps relative to the chunk) -> [steps, dim + 2] float32.

    Polls outside 0..steps-1 still cover the steps of their window inside it (a track sliced with
    some margin labels a window's edges as the whole track would). Raises ValueError on a vector of
    another dimension (another speaker encoder than the trigger learnt on)."""
    out = np.zeros((steps, dim + CHANGE_FEATURES), np.float32)
    polls = sorted(((int(t), _unit(v)) for t, v in track), key=lambda p: p[0])
    for _, v in polls:
        if v.shape[0] != dim:
            raise ValueError(f"voice embeddings have {v.shape[0]} dims, the trigger reads {dim} "
                             f"(trained on another speaker encoder)")
    for i in range(len(polls) - 1, -1, -1):  # earlier polls written last: a step keeps the first poll covering it
        t, v = polls[i]
        lo, hi = max(0, t - window_steps + 1), min(steps, t + 1)
        if lo >= hi:
            continue
        prev = 1.0 - float(v @ polls[i - 1][1]) if i > 0 else 0.0
        nxt = 1.0 - float(v @ polls[i + 1][1]) if i + 1 < len(polls) else 0.0
        out[lo:hi, :dim] = v
        out[lo:hi, dim] = prev
        out[lo:hi, dim + 1] = nxt
    return out



def track_from_rows(rows: np.ndarray | None) -> list[tuple[int, np.ndarray]]:
    """A track sent as one float array [N, 1 + D] (step, then the embedding; Triton's VOICES) -> [(step, [D])]."""
    if rows is None:
        return []
    rows = np.asarray(rows, np.float32)
    if rows.ndim != 2 or rows.shape[1] < 2 or not np.isfinite(rows).all():
        raise ValueError(f"VOICES must be finite rows [N, 1 + D] (step, embedding), got shape {rows.shape}")
    return [(int(r[0]), r[1:]) for r in rows]
