"""Shared helpers for the memory tests: a labeler test double and hand-made stream chunks whose
sessions, transcript lines and face/voice polls the test chooses."""

from __future__ import annotations

import numpy as np

from egomem.memory.chunk import StreamChunk
from egomem.memory.segment import spans_to_labels

T = 160  # steps per test chunk (12.8 s)


class ColumnLabeler:
    """Test double for the trigger model: the test writes each step's label into the text-token column."""

    def label(self, tokens: np.ndarray) -> np.ndarray:
        return tokens[:, 0] % 4


def unit(seed: int, d: int = 128) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def near(v: np.ndarray, seed: int) -> np.ndarray:
    """Another sighting of the same face: a little noise."""
    return v + 0.05 * unit(seed + 1000, v.shape[0])


FACE_Z, VOICE_Z, FACE_B = unit(1), unit(2, 256), unit(3)


def make_chunk(stream: str, index: int, sessions: list[dict], audio: bool = False) -> StreamChunk:
    """sessions: dicts with span=(start, end), user=[(step, text)], face=vec|None, voice=vec|None and
    optionally monologue=[(step, text)]; `audio` adds a constant listen channel (user audio to redact)."""
    tokens = np.random.default_rng(index).integers(0, 2048, size=(T, 17))
    tokens[:, 0] = spans_to_labels([s["span"] for s in sessions], T)  # the labeler test double reads these
    chunk = StreamChunk(stream, index, 1000.0 + index * T * 0.08, tokens,
                        listen_audio=np.full(T * 1920, 0.25, np.float32) if audio else None)
    for k, s in enumerate(sessions):
        a, b = s["span"]
        chunk.client_transcript += s["user"]
        chunk.monologue += s.get("monologue", [(a + 2, "Nice to talk to you.")])
        for j, step in enumerate(range(a + 5, b, 10)):
            if s.get("face") is not None:
                chunk.faces.append((step, near(s["face"], 10 * index + j + 100 * k)))
            if s.get("voice") is not None:
                chunk.voices.append((step, near(s["voice"], 10 * index + j + 100 * k)))
    return chunk
