"""A recorded stream chunk, as the orchestrator hands it to the memory manager, and its files.

The job queue holds only a path: the chunk (tokens, embeddings, optional raw audio) sits in a
folder under `[memory] chunk_dir`, written atomically (temp folder + rename) before the job is
enqueued, and deleted once the job is done unless `keep_chunks` (raw audio is user data).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from egomem.memory.segment import STREAM_WIDTH
from egomem.memory.store import MemoryStore

STEP_SAMPLES = 1920  # 80 ms at 24 kHz
STEP_S = 0.08
JOB_KIND = "memory_chunk"


@dataclass
class StreamChunk:
    stream_id: str
    chunk_index: int  # position of this chunk in its stream (chunks of one stream never overlap)
    start_time: float  # epoch seconds of step 0
    tokens: np.ndarray  # [T, 17] int: text, 8 speak, 8 listen codebooks
    monologue: list[tuple[int, str]] = field(default_factory=list)  # (step, text) of the model's text channel
    client_transcript: list[tuple[int, str]] = field(default_factory=list)  # (step, text) of the user, from the client
    faces: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (step, [Df]) face embeddings seen
    voices: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (step, [Dv]) voice embeddings heard
    listen_audio: np.ndarray | None = None  # [T * 1920] float32, 24 kHz (the user's channel)
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens)
        if self.tokens.ndim != 2 or self.tokens.shape[1] != STREAM_WIDTH:
            raise ValueError(f"tokens must be [T, {STREAM_WIDTH}], got {self.tokens.shape}")

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    def embeddings(self, which: str, start: int, end: int) -> np.ndarray:
        """[N, D] embeddings of `which` ('faces'/'voices') seen at steps start..end inclusive."""
        rows = [np.asarray(v, np.float32) for t, v in getattr(self, which) if start <= t <= end]
        return np.stack(rows) if rows else np.zeros((0, 0), np.float32)

    def save(self, folder: Path) -> Path:
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.save(tmp / "tokens.npy", self.tokens)
        arrays: dict[str, np.ndarray] = {}
        for which in ("faces", "voices"):
            items = getattr(self, which)
            arrays[f"{which}_steps"] = np.array([t for t, _ in items], np.int64)
            arrays[which] = np.stack([np.asarray(v, np.float32) for _, v in items]) if items else np.zeros((0, 0))
        if self.listen_audio is not None:
            arrays["listen_audio"] = np.asarray(self.listen_audio, np.float32)
        np.savez(tmp / "arrays.npz", **arrays)
        meta = {"stream_id": self.stream_id, "chunk_index": self.chunk_index, "start_time": self.start_time,
                "monologue": self.monologue, "client_transcript": self.client_transcript,
                "sample_rate": self.sample_rate}
        (tmp / "meta.json").write_text(json.dumps(meta))
        for f in tmp.iterdir():  # make the files durable before the job that points at them exists
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return folder

    @classmethod
    def load(cls, folder: Path) -> "StreamChunk":
        folder = Path(folder)
        if not (folder / "meta.json").is_file():
            raise FileNotFoundError(f"stream chunk folder {folder} is missing or incomplete (no meta.json)")
        meta = json.loads((folder / "meta.json").read_text())
        a = np.load(folder / "arrays.npz")
        return cls(
            stream_id=meta["stream_id"], chunk_index=meta["chunk_index"], start_time=meta["start_time"],
            tokens=np.load(folder / "tokens.npy"),
            monologue=[(int(t), s) for t, s in meta["monologue"]],
            client_transcript=[(int(t), s) for t, s in meta["client_transcript"]],
            faces=list(zip(a["faces_steps"].tolist(), list(a["faces"]))),
            voices=list(zip(a["voices_steps"].tolist(), list(a["voices"]))),
            listen_audio=a["listen_audio"] if "listen_audio" in a.files else None,
            sample_rate=meta["sample_rate"],
        )


def job_key(stream_id: str, chunk_index: int) -> str:
    return f"chunk:{stream_id}:{chunk_index}"


def submit_chunk(store: MemoryStore, chunk_dir: Path, chunk: StreamChunk, max_attempts: int | None = None) -> Any:
    """The orchestrator's entry: write the chunk's files, then enqueue its job (idempotent by
    stream + chunk index). Returns the `Job`."""
    folder = chunk.save(Path(chunk_dir) / _safe(chunk.stream_id) / f"{chunk.chunk_index:08d}")
    job = store.enqueue_job(JOB_KIND, job_key(chunk.stream_id, chunk.chunk_index), {"chunk_dir": str(folder)},
                            max_attempts)
    if job.status == "done":  # submitted twice: the first one is already processed
        shutil.rmtree(folder, ignore_errors=True)
    return job


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "_"
