"""Recording one stream for the memory manager: the 17-token stream, the user's raw audio, the text
channels and the embeddings seen, cut into `StreamChunk`s every `orchestrator.chunk_steps` ticks and
at stream end, each handed over with `egomem.memory.submit_chunk` (durable files, then the job).
While a forget is announced and not yet done, every chunk is cut without the person in it (`redactor`:
forgets.py `PendingForgets`), so nothing recorded between the announcement and the forget slips through."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from egomem.memory import MemoryStore, StreamChunk, submit_chunk
from egomem.protocol import FRAME_SAMPLES

log = logging.getLogger(__name__)
ZERO_TOKEN = -1  # moshi's "no token" id; the dialog model answers -2 while its acoustic delays warm up


class ChunkRedactor(Protocol):
    def redact_chunk(self, chunk: StreamChunk) -> dict[str, int]: ...


class Recorder:
    def __init__(self, stream_id: str, record_audio: bool, redactor: ChunkRedactor | None = None):
        self.stream_id = stream_id
        self.record_audio = record_audio
        self.redactor = redactor  # removes people about to be forgotten from each chunk cut
        self.chunk_index = 0
        self.step = 0  # ticks since the stream opened (all chunks)
        self._reset()

    def _reset(self) -> None:
        self.first_step = self.step
        self.start_time = time.time()
        self.tokens: list[np.ndarray] = []  # [17] rows
        self.audio: list[np.ndarray] = []  # [1920] frames
        self.monologue: list[tuple[int, str]] = []
        self.transcript: list[tuple[int, str]] = []
        self.faces: list[tuple[int, np.ndarray]] = []
        self.voices: list[tuple[int, np.ndarray]] = []

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def tick(self, text_token: int, speak: np.ndarray, listen: np.ndarray, pcm: np.ndarray, piece: str) -> None:
        row = np.concatenate([[text_token], speak, listen]).astype(np.int64)  # [17]: text, 8 speak, 8 listen
        row[row < 0] = ZERO_TOKEN
        self.tokens.append(row)
        if self.record_audio:
            self.audio.append(pcm.astype(np.float32))
        if piece:
            self.monologue.append((self.step - self.first_step, piece))
        self.step += 1

    def transcript_line(self, text: str) -> None:
        self.transcript.append((max(self.step - self.first_step - 1, 0), text))

    def face(self, vec: np.ndarray) -> None:
        self.faces.append((max(self.step - self.first_step - 1, 0), vec))

    def voice(self, vec: np.ndarray) -> None:
        self.voices.append((max(self.step - self.first_step - 1, 0), vec))

    @property
    def steps_since_poll(self) -> int:
        """Steps of this chunk after its last recorded face or voice (all of them when it has none)."""
        last = max([t for t, _ in self.faces + self.voices], default=-1)
        return self.steps - 1 - last

    def cut(self) -> StreamChunk | None:
        """The chunk recorded so far (None when empty), without anyone about to be forgotten; recording
        continues into the next one."""
        if not self.tokens:
            return None
        chunk = StreamChunk(
            stream_id=self.stream_id, chunk_index=self.chunk_index, start_time=self.start_time,
            tokens=np.stack(self.tokens),  # [T, 17]
            monologue=_merge(self.monologue), client_transcript=self.transcript,
            faces=self.faces, voices=self.voices,
            listen_audio=np.concatenate(self.audio) if self.audio else None,
        )
        assert chunk.listen_audio is None or chunk.listen_audio.shape[0] == chunk.steps * FRAME_SAMPLES
        if self.redactor is not None:
            self.redactor.redact_chunk(chunk)
        self.chunk_index += 1
        self._reset()
        return chunk


def _merge(pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join byte-level pieces into words: (step of the first piece, text) per whitespace-separated run."""
    out: list[tuple[int, str]] = []
    for step, p in pieces:
        if out and not p.startswith((" ", "\n")) and not out[-1][1].endswith((" ", "\n")):
            out[-1] = (out[-1][0], out[-1][1] + p)
        else:
            out.append((step, p))
    return out


def submit(store: MemoryStore, chunk_dir, chunk: StreamChunk, attempts: int = 3) -> str:
    """Blocking: write the chunk and enqueue its job, retrying a busy store; returns the job id."""
    for i in range(attempts):
        try:
            return submit_chunk(store, chunk_dir, chunk).job_id
        except Exception as e:  # retried, then re-raised for the caller to report
            if i == attempts - 1:
                raise
            log.warning("memory chunk %s/%d: submit failed (%s); retrying", chunk.stream_id, chunk.chunk_index, e)
            time.sleep(0.5 * 2 ** i)
    raise AssertionError("unreachable")
