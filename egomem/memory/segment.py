"""Interfaces to the episodic trigger: label the 17-token stream per step, decode labels into sessions.

The real tagger lives in `egomem.trigger` (issue 5's trigger work); this module only defines what
the memory manager needs from it, so any labeler plugs in: an object with
`label(tokens [T, 17] int) -> labels [T] int` in {0 none, 1 start, 2 in session, 3 end}. A labeler
whose `reads_voices` is true also gets the chunk's recorded voice polls: `label(tokens, voices=[(step, [D])])`.
`decode_sessions` uses `egomem.trigger.decode.decode_sessions` when that module exists (one rule set for
the whole project) and a plain decoder otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

NONE, START, IN_SESSION, END = 0, 1, 2, 3
STREAM_WIDTH = 17  # 1 text + 8 speak + 8 listen tokens per 80 ms step (docs/kv-cache.md#the-token-stream)


class TriggerLabeler(Protocol):
    def label(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [T, 17] int (T <= 8192) -> labels [T] int in {0, 1, 2, 3}."""
        ...


def decode_sessions(labels: np.ndarray) -> list[tuple[int, int]]:
    """Sessions as (start step, end step inclusive), ordered."""
    try:
        from egomem.trigger.decode import decode_sessions as real
    except ImportError:
        real = None
    if real is not None:
        return [(int(s), int(e)) for s, e in real(np.asarray(labels))]
    return decode_sessions_plain(labels)


def decode_sessions_plain(labels: np.ndarray) -> list[tuple[int, int]]:
    """Start at 1 (or at a 2 that follows no open session), end at 3 (inclusive), at a 0 (before
    it), at a new 1 (before it), or at the last step."""
    out: list[tuple[int, int]] = []
    start = None
    for t, y in enumerate(np.asarray(labels).reshape(-1).tolist()):
        if y == START:
            if start is not None:
                out.append((start, t - 1))
            start = t
        elif y == IN_SESSION:
            if start is None:
                start = t
        elif y == END:
            out.append((t if start is None else start, t))
            start = None
        else:
            if start is not None:
                out.append((start, t - 1))
            start = None
    if start is not None:
        out.append((start, len(np.asarray(labels).reshape(-1)) - 1))
    return out


def label_stream(labeler: TriggerLabeler, tokens: np.ndarray, window: int = 8192,
                 voices: Sequence[tuple[int, np.ndarray]] = ()) -> np.ndarray:
    """Label a stream of any length in windows of at most `window` steps; returns [T] int64.
    `voices` (the recorded (step, embedding) polls) go to a labeler that `reads_voices`, steps re-based
    to each window (polls just outside it still describe its edges)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] != STREAM_WIDTH:
        raise ValueError(f"tokens must be [T, {STREAM_WIDTH}], got {tokens.shape}")
    reads = bool(voices) and bool(getattr(labeler, "reads_voices", False))
    parts = []
    for s in range(0, tokens.shape[0], window):
        if reads:
            lab = labeler.label(tokens[s:s + window], voices=[(int(t) - s, v) for t, v in voices])
        else:
            lab = labeler.label(tokens[s:s + window])
        lab = np.asarray(lab).reshape(-1)  # [<=window]
        if lab.shape[0] != min(window, tokens.shape[0] - s):
            raise ValueError(f"labeler returned {lab.shape[0]} labels for {min(window, tokens.shape[0] - s)} steps")
        parts.append(lab.astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def spans_to_labels(spans: list[tuple[int, int]], length: int) -> np.ndarray:
    """The labels [length] a perfect trigger gives for these sessions (inverse of decoding)."""
    lab = np.zeros(length, np.int64)
    for s, e in spans:
        lab[s:e + 1] = IN_SESSION
        lab[s] = START
        lab[e] = END
    return lab
