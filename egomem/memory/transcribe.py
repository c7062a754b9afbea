"""A session's transcript: ASR when an endpoint is configured, else what the stream already carries.

With `[llm] transcription_base_url` set, the user's (listen-channel) audio of the session is sent
to that OpenAI-compatible `/audio/transcriptions` endpoint. Without it, the transcript is the
client's own transcript of the user plus the model's inner monologue, each line labelled with
where it came from, so the agents (and anyone reading the stored transcript) can tell.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

SOURCE_FALLBACK = "client+monologue"


@dataclass(frozen=True)
class Transcript:
    text: str  # lines 'USER (<source>): ...' and 'ASSISTANT (inner monologue): ...'
    source: str  # 'asr:<model>' or 'client+monologue'


def _join(pieces: Sequence[tuple[int, str]]) -> str:
    return " ".join(t.strip() for _, t in sorted(pieces, key=lambda p: p[0]) if t.strip())


class Transcriber:
    def __init__(self, llm_cfg: Any, api_key: str | None = None):
        self.model = llm_cfg.transcription_model
        self._client = None
        if llm_cfg.transcription_base_url:
            import openai

            env = llm_cfg.transcription_api_key_env or llm_cfg.api_key_env
            key = api_key if api_key is not None else os.environ.get(env, "")
            self._client = openai.OpenAI(base_url=llm_cfg.transcription_base_url, api_key=key or "none",
                                         timeout=llm_cfg.timeout_s, max_retries=max(0, llm_cfg.max_attempts - 1))

    @property
    def uses_asr(self) -> bool:
        return self._client is not None

    def transcribe(self, listen_audio: np.ndarray | None, sample_rate: int, user_pieces: Sequence[tuple[int, str]],
                   monologue: Sequence[tuple[int, str]]) -> Transcript:
        """listen_audio [S] float32 of the session (the user's channel); pieces are (step, text)."""
        lines = []
        if self._client is not None and listen_audio is not None and len(listen_audio) > 0:
            import soundfile as sf

            buf = io.BytesIO()
            sf.write(buf, np.asarray(listen_audio, dtype=np.float32), sample_rate, format="WAV", subtype="PCM_16")
            r = self._client.audio.transcriptions.create(model=self.model, file=("session.wav", buf.getvalue()))
            source = f"asr:{self.model}"
            if r.text.strip():
                lines.append(f"USER (asr:{self.model}): {r.text.strip()}")
        else:
            source = SOURCE_FALLBACK
            if _join(user_pieces):
                lines.append(f"USER (client transcript): {_join(user_pieces)}")
        if _join(monologue):
            lines.append(f"ASSISTANT (inner monologue): {_join(monologue)}")
        return Transcript("\n".join(lines), source)
