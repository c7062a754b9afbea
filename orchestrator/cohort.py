"""One dialog tick for a cohort of streams: three Triton requests in all, whatever the number of streams.

  1. `mimi_codec`: every stream's client frame (silence when late) -> its listen codes;
  2. side by side: `dialog_lm` over every stream's listen codes (+ its pending MemChunk refresh) -> text
     token + speak codes, and `mimi_codec` decoding the speak codes each stream got on the PREVIOUS
     tick. The two run in different model processes, so the decode costs no tick time while a core is free;
  3. each stream sends its audio, text and events, and records the tick (`Stream.finish_tick`).
Phase 1 is `encode_cohort`, phases 2-3 `step_cohort`: the grid clock overlaps one tick's encode with
the previous tick's step when that step runs late (orchestrator/grid.py).

Each call is one cohort request (egomem.serving.adapter): one row per stream, so the model steps every
stream at once however long the sends take, and the orchestrator, tritonserver and the model stubs
handle one request per phase instead of one per stream. The grid clock ticks all its streams as one
cohort; a `tick_clock = "input"` stream ticks as a cohort of one (Triton's sequence batcher still puts
cohorts that meet in its queue window into one model step). A row that fails fails its own stream only;
a request that fails fails the streams in it. Nothing here keeps state between ticks: streams do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from egomem.protocol import CLOSE_INTERNAL, CLOSE_TRY_LATER, FRAME_SAMPLES
from egomem.serving.adapter import SEQUENCE_END, SEQUENCE_START
from egomem.serving.client import TritonRequestError, TritonUnavailable

if TYPE_CHECKING:
    from .services import Services
    from .stream import Refresh, Stream


class StreamFailed(RuntimeError):
    """A model call failed under this stream; `close_code` tells the client why."""

    def __init__(self, message: str, close_code: int):
        super().__init__(message)
        self.close_code = close_code


@dataclass
class DialogOut:
    """One stream's row of a `dialog_lm` answer."""

    text_token: int  # -2 while Moshi's acoustic delays warm up
    speak: np.ndarray  # [8] speak codes, -2 while warming up
    piece: str  # the text token as text ("" for pad / special tokens)


def _row_failure(model: str, error: str) -> StreamFailed:
    if "no free stream slot" in error:
        return StreamFailed(f"no free stream slot in {model}", CLOSE_TRY_LATER)
    return StreamFailed(f"{model} refused the stream: {error}", CLOSE_INTERNAL)


async def _call(services: "Services", model: str, streams: list["Stream"], flags: list[int],
                inputs: dict[str, np.ndarray], outputs: list[str]) -> tuple[dict[str, np.ndarray], list[StreamFailed | None]]:
    """One cohort request: (outputs, one row per stream; per stream its failure or None)."""
    try:
        out, errors = await services.triton.infer_cohort(
            model, next(services.sequence_ids), [s.sequence_id for s in streams], flags, inputs, outputs,
            timeout_s=services.cfg.orchestrator.triton_timeout_s)
    except TritonUnavailable as e:
        services.metrics.inc("egomem_triton_errors_total", len(streams))
        return {}, [StreamFailed(f"model server unavailable: {e}", CLOSE_INTERNAL) for _ in streams]
    except TritonRequestError as e:
        services.metrics.inc("egomem_triton_errors_total", len(streams))
        return {}, [StreamFailed(f"{model} refused the request: {e}", CLOSE_INTERNAL) for _ in streams]
    failures = [_row_failure(model, err) if err else None for err in errors]
    services.metrics.inc("egomem_triton_errors_total", sum(f is not None for f in failures))
    return out, failures


@dataclass
class EncodedRow:
    """Phase 1's hand-over for one stream: its client frame and the frame's listen codes."""

    stream: "Stream"
    pcm: np.ndarray  # [1920]
    listen: np.ndarray  # [8]


async def encode_cohort(streams: list["Stream"]) -> tuple[list[EncodedRow], dict["Stream", BaseException]]:
    """Phase 1: every stream's client frame -> `mimi_codec` -> listen codes; (rows, streams that failed)."""
    if not streams:
        return [], {}
    frames = [s.next_frame() for s in streams]
    flags = [SEQUENCE_START if s.encoded == 0 else 0 for s in streams]
    enc, fails = await _call(streams[0].s, "mimi_codec", streams, flags, {"COHORT_PCM": np.stack(frames)},
                             ["COHORT_CODES"])
    rows, failed = [], {}
    for r, (s, f) in enumerate(zip(streams, fails)):
        if f is not None:
            failed[s] = f
        else:
            s.encoded += 1
            rows.append(EncodedRow(s, frames[r], enc["COHORT_CODES"][r].astype(np.int64)))
    return rows, failed


async def step_cohort(rows: list[EncodedRow]) -> dict["Stream", BaseException]:
    """Phase 2: `dialog_lm` over the rows, beside the decode of each stream's previous speak codes; then
    each stream finishes its tick. Returns the streams that failed."""
    if not rows:
        return {}
    group = [row.stream for row in rows]
    services = group[0].s
    failed: dict["Stream", BaseException] = {}
    refreshes: list["Refresh | None"] = [s.take_refresh() for s in group]
    d_in = {"COHORT_LISTEN_CODES": np.stack([row.listen for row in rows])}
    if any(refreshes):
        d_in["COHORT_MEMCHUNK_LEVEL"] = np.array([r.level if r else 0 for r in refreshes], np.int32)
        d_in["COHORT_MEMCHUNK_TEXT"] = np.array([(r.text if r else "").encode("utf-8") for r in refreshes],
                                                dtype=np.object_)
    calls = [_call(services, "dialog_lm", group, [SEQUENCE_START if s.ticks == 0 else 0 for s in group], d_in,
                   ["COHORT_TEXT_TOKEN", "COHORT_SPEAK_CODES", "COHORT_TEXT_PIECE"])]
    voiced = [s for s in group if s.speak_pending is not None]  # the previous tick's voice, decoded beside
    if voiced:
        calls.append(_call(services, "mimi_codec", voiced, [0] * len(voiced),
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
        out = DialogOut(int(d_out["COHORT_TEXT_TOKEN"][r]), d_out["COHORT_SPEAK_CODES"][r].astype(np.int64), piece)
        try:
            s.finish_tick(row.pcm, row.listen, out, audio_of.get(s), refresh)
        except Exception as e:  # noqa: BLE001 - a bug in one stream's bookkeeping ends that stream only
            failed[s] = e
    return failed


async def tick_cohort(streams: list["Stream"]) -> dict["Stream", BaseException]:
    """Both phases, one after the other (a `tick_clock = "input"` stream's tick); the streams that failed."""
    rows, failed = await encode_cohort(streams)
    failed.update(await step_cohort(rows))
    return failed


async def end_cohort(streams: list["Stream"]) -> list[StreamFailed | None]:
    """Close the streams' model state (END rows to both models); per stream what failed, if anything."""
    if not streams:
        return []
    services = streams[0].s
    ends = [SEQUENCE_END] * len(streams)
    answers = await asyncio.gather(
        _call(services, "mimi_codec", streams, ends, {"COHORT_PCM": np.zeros((len(streams), FRAME_SAMPLES), np.float32)},
              ["COHORT_CODES"]),
        _call(services, "dialog_lm", streams, ends, {"COHORT_LISTEN_CODES": np.zeros((len(streams), 8), np.int64)},
              ["COHORT_STEP"]))
    return [a or b for a, b in zip(answers[0][1], answers[1][1])]
