"""A recorded stream chunk, as the orchestrator hands it to the memory manager, and its files.

The job queue holds only a path: the chunk (tokens, embeddings, optional raw audio) sits in a
folder under `[memory] chunk_dir`, written atomically (temp folder + rename) before the job is
enqueued, and deleted once the job is done unless `keep_chunks` (raw audio is user data).
Folders are created 0700 and files 0600: they hold people's words, faces, voices and audio.

Forgetting someone while their chunk waits in the queue (`redact_chunk`): the store's forget
rewrites the chunk in place: polls (face / voice embeddings) of the forgotten person are removed,
their client-transcript lines, the model's monologue and their listen audio in the steps attributed
to them are dropped / silenced, and their name(s) elsewhere in the text become `redact.MARKER`.
Other people's words, polls and audio stay. Each rewrite bumps `redactions` (kept in meta.json and
on the job row), so a worker that read the chunk before the forget cannot commit what it read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from egomem.memory.redact import MARKER
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
    redactions: int = 0  # forgets that rewrote these files (the store's commit check compares it with the job's)

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
        """Write the chunk atomically (temp folder + rename): 0700 folders, 0600 files."""
        folder = Path(folder)
        folder.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # chunk_dir: 0700 when we make it
        folder.parent.mkdir(mode=0o700, exist_ok=True)  # the stream's folder is ours: always owner-only
        os.chmod(folder.parent, 0o700)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        with _private_open(tmp / "tokens.npy") as fh:
            np.save(fh, self.tokens)
        self._write_arrays(tmp / "arrays.npz")
        self._write_meta(tmp / "meta.json")
        for f in tmp.iterdir():  # make the files durable before the job that points at them exists
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        return folder

    def _write_arrays(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        for which in ("faces", "voices"):
            items = getattr(self, which)
            arrays[f"{which}_steps"] = np.array([t for t, _ in items], np.int64)
            arrays[which] = np.stack([np.asarray(v, np.float32) for _, v in items]) if items else np.zeros((0, 0))
        if self.listen_audio is not None:
            arrays["listen_audio"] = np.asarray(self.listen_audio, np.float32)
        with _private_open(path) as fh:
            np.savez(fh, **arrays)

    def _write_meta(self, path: Path) -> None:
        meta = {"stream_id": self.stream_id, "chunk_index": self.chunk_index, "start_time": self.start_time,
                "monologue": self.monologue, "client_transcript": self.client_transcript,
                "sample_rate": self.sample_rate, "redactions": self.redactions}
        with _private_open(path) as fh:
            fh.write(json.dumps(meta).encode())

    def rewrite(self, folder: Path) -> None:
        """Replace the files of an existing chunk folder in place, each atomically (temp file +
        rename), arrays before meta.json: `load` reads meta.json first, so a reader that sees the new
        `redactions` also sees the new arrays (tokens are never rewritten)."""
        folder = Path(folder)
        for name, write in (("arrays.npz", self._write_arrays), ("meta.json", self._write_meta)):
            tmp = folder / (name + ".tmp")
            write(tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, folder / name)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @classmethod
    def load(cls, folder: Path) -> StreamChunk:
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
            sample_rate=meta["sample_rate"], redactions=int(meta.get("redactions", 0)),
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


def _private_open(path: Path) -> IO[bytes]:
    """A new file only its owner can read (0600 from creation, not chmod'ed after; a leftover of a
    crashed write is removed first, since O_CREAT keeps an existing file's mode)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _unit_rows(vectors: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
    """dim -> [N, dim] L2-normalised rows (vectors of different models differ in dim and never mix)."""
    by_dim: dict[int, list[np.ndarray]] = {}
    for v in vectors:
        v = np.asarray(v, np.float32).reshape(-1)
        by_dim.setdefault(v.shape[0], []).append(v / max(float(np.linalg.norm(v)), 1e-12))
    return {d: np.stack(rows) for d, rows in by_dim.items()}


def _nearest(v: np.ndarray, keys: dict[int, np.ndarray]) -> float:
    """Cosine distance from `v` to the nearest key of its dimension (inf when there is none)."""
    mat = keys.get(v.shape[0])
    if mat is None:
        return float("inf")
    return float(np.min(1.0 - mat @ (v / max(float(np.linalg.norm(v)), 1e-12))))


def _owner_mask(polls: Sequence[tuple[int, bool]], steps: int) -> np.ndarray:
    """[steps] bool: step s is the forgotten person's when the nearest poll to s, of either modality,
    is theirs (a tie goes to them: forget errs on the side of forgetting). Polls are (step, is_theirs)."""
    mine = np.array([t for t, m in polls if m], np.int64)
    if mine.size == 0:
        return np.zeros(steps, bool)
    rest = np.array([t for t, m in polls if not m], np.int64)
    s = np.arange(steps)[:, None]
    d_mine = np.abs(s - mine[None, :]).min(axis=1)  # [steps]
    if rest.size == 0:
        return np.ones(steps, bool)
    return d_mine <= np.abs(s - rest[None, :]).min(axis=1)


def redact_pieces(pieces: list[tuple[int, str]], pat: re.Pattern[str] | None) -> tuple[list[tuple[int, str]], int]:
    """Replace the name in a text track whose pieces may split it ("Max", " Moe"): pieces are matched
    joined as the transcriber joins them (stripped, one space apart); a match becomes MARKER in the
    piece it starts in and is cut from the others. Returns (pieces, matches)."""
    if pat is None or not pieces:
        return pieces, 0
    spans, text, pos = [], [], 0
    for _, t in pieces:
        core = t.strip()
        spans.append((pos, pos + len(core)))
        text.append(core)
        pos += len(core) + 1
    joined = " ".join(text)
    matches = list(pat.finditer(joined))
    if not matches:
        return pieces, 0
    out = []
    for (step, orig), (a, b) in zip(pieces, spans):
        new, cur = "", a
        for m in matches:
            if m.end() <= a or m.start() >= b:
                continue
            new += joined[cur:max(m.start(), a)]
            if a <= m.start() < b:
                new += MARKER
            cur = min(m.end(), b)
        new += joined[cur:b]
        lead = orig[:len(orig) - len(orig.lstrip())]
        if new.strip():
            out.append((step, lead + new))
    return out, len(matches)


def redact_chunk(folder: Path, pat: re.Pattern[str] | None, forgotten: Mapping[str, Sequence[np.ndarray]],
                 others: Mapping[str, Sequence[np.ndarray]], max_distance: Mapping[str, float]) -> dict[str, int]:
    """Remove a forgotten person from the files of a chunk still to be processed (`redact_in_memory`).
    Returns what changed (empty: nothing of theirs, the files are untouched); otherwise the files are
    rewritten with `redactions` + 1. Forget holds the store's write lock meanwhile, so a chunk is
    first checked from its text and polls alone; tokens and audio are read only when it holds them."""
    meta = json.loads((Path(folder) / "meta.json").read_text())
    with np.load(Path(folder) / "arrays.npz") as a:
        polls = {w: list(zip(a[f"{w}_steps"].tolist(), list(a[w]))) for w in ("faces", "voices")}
    light = StreamChunk(meta["stream_id"], meta["chunk_index"], meta["start_time"], np.zeros((0, STREAM_WIDTH)),
                        monologue=[(int(t), x) for t, x in meta["monologue"]],
                        client_transcript=[(int(t), x) for t, x in meta["client_transcript"]], **polls)
    if not redact_in_memory(light, pat, forgotten, others, max_distance):
        return {}
    chunk = StreamChunk.load(folder)
    counts = redact_in_memory(chunk, pat, forgotten, others, max_distance)
    if counts:
        chunk.redactions += 1
        chunk.rewrite(folder)
    return counts


def redact_in_memory(chunk: StreamChunk, pat: re.Pattern[str] | None, forgotten: Mapping[str, Sequence[np.ndarray]],
                     others: Mapping[str, Sequence[np.ndarray]], max_distance: Mapping[str, float]) -> dict[str, int]:
    """Remove a forgotten person from `chunk` (see the module docstring); returns what changed.

    forgotten / others: modality ('face' / 'voice') -> the forgotten person's / everyone else's key
    vectors. A poll is theirs when its nearest key is one of theirs and lies within
    `max_distance[modality]` (cosine distance); a poll nearer to someone else's key stays. Steps whose
    nearest poll (either modality; `_owner_mask`) is theirs are theirs: their client-transcript lines
    and the monologue there are dropped, their listen audio silenced, and any poll there that matches
    no one else is removed too. Their name(s) elsewhere in the text become MARKER (`pat`)."""
    keys_f = {m: _unit_rows(v) for m, v in forgotten.items()}
    keys_o = {m: _unit_rows(v) for m, v in others.items()}
    steps = max([chunk.steps] + [t + 1 for t, _ in chunk.faces + chunk.voices + chunk.client_transcript
                                 + chunk.monologue])
    theirs: dict[str, list[bool]] = {}
    near_other: dict[str, list[bool]] = {}
    polls: list[tuple[int, bool]] = []
    for modality, track in (("face", chunk.faces), ("voice", chunk.voices)):
        lim = max_distance.get(modality, 0.0)
        df = [_nearest(np.asarray(v, np.float32).reshape(-1), keys_f.get(modality, {})) for _, v in track]
        do = [_nearest(np.asarray(v, np.float32).reshape(-1), keys_o.get(modality, {})) for _, v in track]
        theirs[modality] = [f <= lim and f < o for f, o in zip(df, do)]
        near_other[modality] = [o <= lim and o <= f for f, o in zip(df, do)]
        polls += [(t, m) for (t, _), m in zip(track, theirs[modality])]
    mask = _owner_mask(polls, steps)
    counts: dict[str, int] = {}

    def inside(step: int) -> bool:
        return 0 <= step < steps and bool(mask[step])

    for modality, attr in (("face", "faces"), ("voice", "voices")):
        track = getattr(chunk, attr)
        keep = [p for p, mine, other in zip(track, theirs[modality], near_other[modality])
                if not mine and (other or not inside(p[0]))]
        if len(keep) != len(track):
            counts[attr] = len(track) - len(keep)
            setattr(chunk, attr, keep)
    for attr in ("client_transcript", "monologue"):
        track = getattr(chunk, attr)
        keep = [p for p in track if not inside(p[0])]
        if len(keep) != len(track):
            counts[f"{attr}_dropped"] = len(track) - len(keep)
        keep, n = redact_pieces(keep, pat)
        if n:
            counts[f"{attr}_names"] = n
        setattr(chunk, attr, keep)
    if chunk.listen_audio is not None and mask[:chunk.steps].any():
        audio = np.array(chunk.listen_audio, np.float32)
        for s in np.flatnonzero(mask[:chunk.steps]):
            audio[s * STEP_SAMPLES:(s + 1) * STEP_SAMPLES] = 0.0
        counts["audio_steps_silenced"] = int(mask[:chunk.steps].sum())
        chunk.listen_audio = audio
    return counts


def redact_recording(rec: Any, pat: re.Pattern[str] | None, forgotten: Mapping[str, Sequence[np.ndarray]],
                     others: Mapping[str, Sequence[np.ndarray]], max_distance: Mapping[str, float]) -> dict[str, int]:
    """The same for a stream's recording not yet cut into a chunk (orchestrator/recording.py `Recorder`:
    `tokens` rows, `audio` frames, `monologue` / `transcript` pieces, `faces` / `voices` polls), so
    the chunk it is cut into after the forget does not hold the person. Call it on the thread that
    records (the event loop): the text and polls are checked first, tokens and audio copied only
    when the recording holds the person."""
    light = StreamChunk("recording", 0, 0.0, np.zeros((0, STREAM_WIDTH)), monologue=list(rec.monologue),
                        client_transcript=list(rec.transcript), faces=list(rec.faces), voices=list(rec.voices))
    if not redact_in_memory(light, pat, forgotten, others, max_distance):
        return {}
    rows = np.stack(rec.tokens) if rec.tokens else np.zeros((0, STREAM_WIDTH), np.int64)
    view = StreamChunk("recording", 0, 0.0, rows, monologue=list(rec.monologue),
                       client_transcript=list(rec.transcript), faces=list(rec.faces), voices=list(rec.voices),
                       listen_audio=np.concatenate(rec.audio) if rec.audio else None)
    counts = redact_in_memory(view, pat, forgotten, others, max_distance)
    if counts:
        rec.monologue, rec.transcript = view.monologue, view.client_transcript
        rec.faces, rec.voices = view.faces, view.voices
        if view.listen_audio is not None:
            rec.audio = list(view.listen_audio.reshape(len(rec.audio), -1))
    return counts


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name) or "_"
