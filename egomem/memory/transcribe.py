"""A session's transcript: the user's words (client lines, else the recogniser) plus the model's monologue.

Which text stands for the user (the rule, per session):
1. The client sent transcript lines (0x11) inside the session: those lines are what the user said,
   per the client (its own ASR or a script), and they are used alone. The recogniser does not run
   on that session, so the extractor never sees one statement twice in two spellings and never
   stores the same fact twice.
2. No client line in the session: the recogniser (`[asr]`, `egomem.memory.asr`; PocketSphinx offline
   by default) transcribes the session's user (listen-channel) audio.
3. No client line and no recogniser (`asr.backend = "none"`) or no audio: only the monologue.

Every line is labelled with where it came from ('USER (client transcript)', 'USER (asr:<name>)',
'ASSISTANT (inner monologue)') and `Transcript.source` says which path ran, so the agents and anyone
reading a stored transcript can tell. Audio the recogniser refuses (NaN samples, an impossible
sample rate) is logged and skipped (retrying would not help); a recogniser that cannot be reached
raises `AsrUnavailable`, so the memory job fails and the queue retries it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from egomem.memory.asr import AsrInputError, Recogniser, make_recogniser

log = logging.getLogger(__name__)

SOURCE_FALLBACK = "client+monologue"


@dataclass(frozen=True)
class Transcript:
    text: str  # lines 'USER (<source>): ...' and 'ASSISTANT (inner monologue): ...'
    source: str  # 'asr:<recogniser>' when the recogniser gave the user's words, else 'client+monologue'


def _join(pieces: Sequence[tuple[int, str]]) -> str:
    return " ".join(t.strip() for _, t in sorted(pieces, key=lambda p: p[0]) if t.strip())


class Transcriber:
    """`Transcriber(cfg.asr, cfg.llm)`; or pass `recogniser=` (any `Recogniser`, or None for none)."""

    _UNSET: Any = object()

    def __init__(self, asr_cfg: Any = None, llm_cfg: Any = None, recogniser: Recogniser | None = _UNSET):
        if recogniser is Transcriber._UNSET:
            recogniser = make_recogniser(asr_cfg, llm_cfg) if asr_cfg is not None else None
        self.recogniser: Recogniser | None = recogniser

    @property
    def uses_asr(self) -> bool:
        return self.recogniser is not None

    def transcribe(self, listen_audio: np.ndarray | None, sample_rate: int, user_pieces: Sequence[tuple[int, str]],
                   monologue: Sequence[tuple[int, str]]) -> Transcript:
        """listen_audio [S] float32 of the session (the user's channel); pieces are (step, text)."""
        lines, source = [], SOURCE_FALLBACK
        client = _join(user_pieces)
        if client:
            lines.append(f"USER (client transcript): {client}")
        elif self.recogniser is not None and listen_audio is not None and len(listen_audio) > 0:
            name = self.recogniser.name
            try:
                heard = self.recogniser.recognise(listen_audio, sample_rate)
                source = f"asr:{name}"
                if heard.strip():
                    lines.append(f"USER (asr:{name}): {heard.strip()}")
            except AsrInputError as e:
                log.warning("transcript: the recogniser %s refused this session's audio (%s); "
                            "the transcript has no user line", name, e)
        if _join(monologue):
            lines.append(f"ASSISTANT (inner monologue): {_join(monologue)}")
        return Transcript("\n".join(lines), source)
