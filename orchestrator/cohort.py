"""One dialog tick for a cohort of streams: three Triton requests in all, whatever the number of streams.

  1. `mimi_codec`: every stream's client frame (silence when late) -> its listen codes;
  2. side by side: `dialog_lm` over every stream's listen codes (+ its pending MemChunk refresh) -> text
     token + speak codes, and `mimi_codec` decoding the speak codes each stream got on the PREVIOUS
     tick. The two run in different model processes, so the decode costs no tick time while a core is free;
  3. each stream sends its audio, text and events, and records the tick (`Stream.finish_tick`).
Phase 1 is `encode_cohort`, phases 2-3 `step_cohort`: the grid clock overlaps one tick's encode with
the previous tick's step when that step runs late (orchestrator/grid.py).

Each call is one cohort request (egomem.serving.wire) sent through the model gateway (orchestrator/gateway.py,
the `gateway` argument): one row per stream, so the model steps every stream at once however long the sends
take, and the orchestrator, tritonserver and the model stubs handle one request per phase instead of one
per stream. The grid clock ticks all its streams as one
cohort; a `tick_clock = "input"` stream ticks as a cohort of one (Triton's sequence batcher still puts
cohorts that meet in its queue window into one model step). A row that fails fails its own stream only;
a request that fails fails the streams in it. Nothing here keeps state between ticks: streams do, and
`CohortStream` is what these phases need of one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from egomem.protocol import FRAME_SAMPLES
from egomem.serving.wire import DIALOG_LM, MIMI_CODEC, SEQUENCE_END, SEQUENCE_START

from .gateway import ModelGateway, StreamFailed

__all__ = ["CohortStream", "DialogOut", "EncodedRow", "StreamFailed", "encode_cohort", "end_cohort", "step_cohort",
           "tick_cohort"]


@dataclass
class DialogOut:
    """One stream's row of a `dialog_lm` answer."""

    text_token: int  # -2 while Moshi's acoustic delays warm up
    speak: np.ndarray  # [8] speak codes, -2 while warming up
    piece: str  # the text token as text ("" for pad / special tokens)
    step: int  # ticks the stream's dialog has taken (counts again from 1 after a restart)


class RefreshRow(Protocol):
    """A MemChunk refresh to apply with a stream's dialog step (stream.py's `Refresh` is one)."""

    level: int  # 1 profile, 2 retrieved facts
    text: str
    restart: bool  # the stream's dialog restarts (START) with this refresh


class CohortStream(Protocol):
    """What the cohort phases need of a stream (orchestrator/stream.py's Stream)."""

    sequence_id: int  # its Triton correlation id
    encoded: int  # client frames encoded
    ticks: int  # ticks finished
    speak_pending: np.ndarray | None  # the previous tick's speak codes, to decode this tick

    def next_frame(self) -> np.ndarray: ...

    def take_refresh(self) -> RefreshRow | None: ...

    def finish_tick(self, pcm: np.ndarray, listen: np.ndarray, d: DialogOut, audio: np.ndarray | None,
                    refresh: Any) -> None: ...


Failures = dict[CohortStream, BaseException]


async def _call(gateway: ModelGateway, model: str, streams: list[CohortStream], flags: list[int],
                inputs: dict[str, np.ndarray], outputs: list[str]
                ) -> tuple[dict[str, np.ndarray], list[StreamFailed | None]]:
    """One cohort request: (outputs, one row per stream; per stream its failure or None)."""
    return await gateway.cohort(model, [s.sequence_id for s in streams], flags, inputs, outputs)


@dataclass
class EncodedRow:
    """Phase 1's hand-over for one stream: its client frame and the frame's listen codes."""

    stream: CohortStream
    pcm: np.ndarray  # [1920]
    listen: np.ndarray  # [8]


async def encode_cohort(streams: list[CohortStream], gateway: ModelGateway) -> tuple[list[EncodedRow], Failures]:
    """Phase 1: every stream's client frame -> `mimi_codec` -> listen codes; (rows, streams that failed)."""
    if not streams:
        return [], {}
    frames = [s.next_frame() for s in streams]
    flags = [SEQUENCE_START if s.encoded == 0 else 0 for s in streams]
    enc, fails = await _call(gateway, MIMI_CODEC, streams, flags, {"COHORT_PCM": np.stack(frames)},
                             ["COHORT_CODES"])
    rows, failed = [], {}
    for r, (s, f) in enumerate(zip(streams, fails)):
        if f is not None:
            failed[s] = f
        else:
            s.encoded += 1
            rows.append(EncodedRow(s, frames[r], enc["COHORT_CODES"][r].astype(np.int64)))
    return rows, failed


async def step_cohort(rows: list[EncodedRow], gateway: ModelGateway) -> Failures:
    """Phase 2: `dialog_lm` over the rows, beside the decode of each stream's previous speak codes; then
    each stream finishes its tick. Returns the streams that failed."""
    if not rows:
        return {}
    group = [row.stream for row in rows]
    failed: Failures = {}
    refreshes = [s.take_refresh() for s in group]
    d_in = {"COHORT_LISTEN_CODES": np.stack([row.listen for row in rows])}
    if any(refreshes):
        d_in["COHORT_MEMCHUNK_LEVEL"] = np.array([r.level if r else 0 for r in refreshes], np.int32)
        d_in["COHORT_MEMCHUNK_TEXT"] = np.array([(r.text if r else "").encode("utf-8") for r in refreshes],
                                                dtype=np.object_)
    starts = [SEQUENCE_START if s.ticks == 0 or (r is not None and r.restart) else 0 for s, r in zip(group, refreshes)]
    calls = [_call(gateway, DIALOG_LM, group, starts, d_in,
                   ["COHORT_TEXT_TOKEN", "COHORT_SPEAK_CODES", "COHORT_TEXT_PIECE", "COHORT_STEP"])]
    voiced = [s for s in group if s.speak_pending is not None]  # the previous tick's voice, decoded beside
    if voiced:
        calls.append(_call(gateway, MIMI_CODEC, voiced, [0] * len(voiced),
                           {"COHORT_CODES_IN": np.stack([s.speak_pending for s in voiced])}, ["COHORT_AUDIO"]))
    answers = await asyncio.gather(*calls)
    (d_out, d_fails), audio_of = answers[0], {}
    if voiced:
        a_out, a_fails = answers[1]
        for r, (s, f) in enumerate(zip(voiced, a_fails)):
            if f is not None:
                failed[s] = f
            else:
                audio_of[s] = a_out["COHORT_AUDIO"][r]
    for r, (row, refresh, f) in enumerate(zip(rows, refreshes, d_fails)):
        s = row.stream
        if f is not None:
            failed.setdefault(s, f)
        if s in failed:
            continue
        raw = d_out["COHORT_TEXT_PIECE"][r]
        piece = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        out = DialogOut(int(d_out["COHORT_TEXT_TOKEN"][r]), d_out["COHORT_SPEAK_CODES"][r].astype(np.int64), piece,
                        int(d_out["COHORT_STEP"][r]))
        try:
            s.finish_tick(row.pcm, row.listen, out, audio_of.get(s), refresh)
        except Exception as e:  # noqa: BLE001 - a bug in one stream's bookkeeping ends that stream only
            failed[s] = e
    return failed


async def tick_cohort(streams: list[CohortStream], gateway: ModelGateway) -> Failures:
    """Both phases, one after the other (a `tick_clock = "input"` stream's tick); the streams that failed."""
    rows, failed = await encode_cohort(streams, gateway)
    failed.update(await step_cohort(rows, gateway))
    return failed


async def end_cohort(streams: list[CohortStream], gateway: ModelGateway) -> list[StreamFailed | None]:
    """Close the streams' model state (END rows to both models); per stream what failed, if anything."""
    if not streams:
        return []
    ends, n = [SEQUENCE_END] * len(streams), len(streams)
    answers = await asyncio.gather(
        _call(gateway, MIMI_CODEC, streams, ends, {"COHORT_PCM": np.zeros((n, FRAME_SAMPLES), np.float32)},
              ["COHORT_CODES"]),
        _call(gateway, DIALOG_LM, streams, ends, {"COHORT_LISTEN_CODES": np.zeros((n, 8), np.int64)}, ["COHORT_STEP"]))
    return [a or b for a, b in zip(answers[0][1], answers[1][1])]
