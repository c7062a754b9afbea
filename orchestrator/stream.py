"""One chat stream's loops: the 12.5 Hz dialog tick, the 2 s polling loop, query detection, recording.

Dialog tick (every 80 ms, docs/architecture.md#one-80-ms-tick; driven by the grid clock shared by all streams, orchestrator/grid.py,
or with `tick_clock = "input"` by the stream's own loop; the model calls for a cohort of streams are in
orchestrator/cohort.py):
  1. take 1920 samples of client audio (`next_frame`); none ready -> silence is fed (a late frame), the
     model keeps talking;
  2. `mimi_codec`: encode this frame -> listen codes;
  3. at once, side by side: `dialog_lm` (listen codes in, + a pending MemChunk refresh -> text token +
     speak codes out) and `mimi_codec` decoding the PREVIOUS tick's speak codes (`speak_pending`);
  4. `finish_tick`: the decoded audio goes out as Opus (0x01), the text piece as 0x02; everything is recorded.
The critical path is two Triton round trips (encode, then dialog); the model's voice leaves one tick
(80 ms) after it was generated.
The handshake (0x00) is sent after the first tick, once both models hold the stream, so a client
that gets it has a slot; otherwise it gets a close with the reason (1013 no free slot, 1011 down).

Polling loop (every `poll_interval_s`): the latest video frame -> `face_encoder`, the last tau seconds
of audio -> `speaker_encoder`, then `identify`; a change of user triggers an L1 refresh with that
user's rendered profile. Query detection: a complete `<retr>...<answer>` on the text channel ->
Level-2 retrieval -> L2 refresh. Outbound messages go through `send` (a bounded queue drained by
the WebSocket writer), so a slow client never slows any tick.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import sphn

from egomem.protocol import AUDIO, CLOSE_INTERNAL, FRAME_SAMPLES, HANDSHAKE, SAMPLE_RATE, TEXT, TICK_S, pack, pack_event
from egomem.retrieval import parse_query
from egomem.serving.client import TritonRequestError, TritonUnavailable

from .cohort import DialogOut, StreamFailed, end_cohort, tick_cohort
from .perception import decode_image
from .recording import Recorder, submit
from .services import Services

log = logging.getLogger(__name__)
MAX_TEXT_CHANNEL = 4000  # characters of the model's text kept for query detection


@dataclass
class Refresh:
    level: int  # 1 profile, 2 retrieved facts
    text: str
    user_id: str | None
    asked_at: float


class Stream:
    def __init__(self, services: Services, stream_id: str, send: Callable[[bytes], None]):
        self.s = services
        self.cfg = services.cfg
        self.oc = services.cfg.orchestrator
        self.stream_id = stream_id
        self.sequence_id = next(services.sequence_ids)
        self.send = send
        self.user_id: str | None = None
        self.closed = asyncio.Event()
        self.failure: StreamFailed | None = None
        self.ticks = 0  # ticks finished (dialog step done)
        self.encoded = 0  # client frames encoded (one tick ahead of `ticks` while the grid overlaps ticks)
        self.polls = 0  # polling rounds that had a face or a voice to look at
        self.opened_at = time.time()
        self._pcm_in: collections.deque[np.ndarray] = collections.deque()
        self._pcm_in_len = 0
        self._input_ready = asyncio.Event()
        self._recent = np.zeros(int(self.oc.identify_window_s * SAMPLE_RATE), np.float32)  # last tau s of user audio
        self._frame: bytes | None = None  # latest video frame, not yet looked at
        self.speak_pending: np.ndarray | None = None  # speak codes of the previous tick, decoded this tick
        self._refreshes: collections.deque[Refresh] = collections.deque()
        self._text_channel = ""
        self._opus_out = sphn.OpusStreamWriter(SAMPLE_RATE)
        self.recorder = Recorder(stream_id, self.oc.record_audio)
        self._tasks: list[asyncio.Task] = []  # tick loop, polling loop, retrievals
        self._flushes: list[asyncio.Task] = []  # memory hand-overs: awaited, never cancelled
        self._poll_task: asyncio.Task | None = None

    # -- inputs (called by the WebSocket reader) ------------------------------------------------
    def push_pcm(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, np.float32).reshape(-1)
        if pcm.size == 0:
            return
        self._pcm_in.append(pcm)
        self._pcm_in_len += pcm.size
        if self._pcm_in_len >= FRAME_SAMPLES:
            self._input_ready.set()
        keep = self._recent.size  # identification hears what the client sent, however fast the ticks run
        self._recent = np.concatenate([self._recent, pcm])[-keep:] if pcm.size < keep else pcm[-keep:].copy()
        limit = int(self.oc.max_input_buffer_s * SAMPLE_RATE) + FRAME_SAMPLES
        while self._pcm_in_len > limit:  # the client runs ahead of real time: drop the oldest audio
            old = self._pcm_in.popleft()
            self._pcm_in_len -= old.size
            self.s.metrics.inc("egomem_dropped_input_seconds_total", old.size / SAMPLE_RATE)

    def push_video(self, data: bytes) -> None:
        self._frame = data  # only the newest frame matters to the polling loop

    def push_transcript(self, text: str) -> None:
        self.recorder.transcript_line(text)

    def push_model_text(self, text: str) -> None:
        """Text appended to the model's text channel as if the model wrote it (orchestrator.accept_model_text)."""
        self.recorder.monologue.append((max(self.recorder.steps - 1, 0), text))
        self._on_text(text)

    def request_refresh(self, level: int, text: str, user_id: str | None) -> None:
        if level == 1:  # a new L1 clears L2 in the engine: drop any L2 still waiting
            self._refreshes = collections.deque(r for r in self._refreshes if r.level != 2)
        self._refreshes.append(Refresh(level, text, user_id, time.monotonic()))

    def forget_user(self, user_id: str) -> None:
        """The user was forgotten: stop personalising for them now. Another user's stream reloads its
        profile, which forget may have redacted (the person's name, the relation to them); the new L1
        also clears an L2 that may hold the forgotten person's facts."""
        if self.user_id == user_id:
            self.user_id = None
            self.request_refresh(1, "", None)
        elif self.user_id is not None and self.s.perception is not None:
            self._tasks.append(asyncio.create_task(self._reload_profile(self.user_id)))

    async def _reload_profile(self, user_id: str) -> None:
        text = await asyncio.to_thread(self.s.perception.profile_text, user_id,  # type: ignore[union-attr]
                                       self.cfg.memory.profile_max_chars)
        if self.user_id == user_id:  # still the same person in front of the camera
            self.request_refresh(1, _fit(text, self.cfg.dialog.l1_steps), user_id)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until `stop()` or a model failure; always closes the Triton sequences and flushes memory."""
        tick = asyncio.create_task(self._tick_loop())
        self._tasks = [tick]
        if self.s.perception is not None and self.oc.identify_models:
            self._poll_task = asyncio.create_task(self._poll_loop())
            self._tasks.append(self._poll_task)
        try:
            await tick
        except StreamFailed as e:
            self.failure = e
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a bug in one stream ends that stream only, loudly
            log.exception("stream %s failed", self.stream_id)
            self.failure = StreamFailed(f"internal error: {type(e).__name__}", CLOSE_INTERNAL)
        finally:
            self.closed.set()
            await self._last_look()
            for t in self._tasks[1:]:
                t.cancel()
            await asyncio.gather(*self._tasks[1:], return_exceptions=True)
            await self._end_sequences()
            await asyncio.gather(*self._flushes, return_exceptions=True)
            await self.flush_memory()

    def stop(self) -> None:
        self.closed.set()

    async def _last_look(self, timeout_s: float = 15.0) -> None:
        """Let a running identification finish, and look once if the stream never was: a short
        stream still leaves a face/voice in its memory chunk, or the worker cannot tell whose it is."""
        poll = self._poll_task
        if poll is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(poll), timeout_s)
            if self.polls == 0 and self.failure is None:
                await asyncio.wait_for(self.poll_once(), timeout_s)
        except Exception as e:  # noqa: BLE001 - best effort; the chunk is handed over either way
            log.info("stream %s: last identification skipped: %s", self.stream_id, e)

    async def _end_sequences(self) -> None:
        if self.encoded == 0:  # no model holds state for this stream yet
            return
        failure, = await end_cohort([self])
        if failure is not None:
            log.info("stream %s: closing its model state: %s", self.stream_id, failure)

    # -- the dialog tick ------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        """With `tick_clock = "global"` the grid clock ticks this stream in lockstep with every other
        one (orchestrator/grid.py: one batch per model call, throughput over latency). Otherwise tick
        when the client's next frame is complete (no phase lag between client and server), but never
        more than one tick ahead of the stream's 12.5 Hz clock, and at the latest `late_grace_s` after
        the clock's due time: then silence is fed and the model keeps talking."""
        if self.oc.tick_clock == "global":
            await self.s.clock.run(self)
            return
        loop = asyncio.get_running_loop()
        m = self.s.metrics
        due = loop.time()
        while not self.closed.is_set():
            while True:
                now = loop.time()
                ready = self._pcm_in_len >= FRAME_SAMPLES
                if (ready and now >= due - TICK_S) or now >= due + self.oc.late_grace_s:
                    break
                wake = (due - TICK_S if ready else due + self.oc.late_grace_s) - now
                self._input_ready.clear()
                waiters = [asyncio.ensure_future(self.closed.wait())]
                if not ready:
                    waiters.append(asyncio.ensure_future(self._input_ready.wait()))
                done, pending = await asyncio.wait(waiters, timeout=max(wake, 0.0), return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
                if self.closed.is_set():
                    return
            if now - due > self.oc.max_tick_lag_s:  # far behind (a stall): skip ahead, count what was lost
                skipped = int((now - due) / TICK_S)
                m.inc("egomem_tick_deadline_misses_total", skipped)
                due += skipped * TICK_S
            t0 = loop.time()
            failure = (await tick_cohort([self])).get(self)
            if failure is not None:
                raise failure
            t1 = loop.time()
            m.observe("egomem_tick_seconds", t1 - t0)
            if t1 > max(due, t0) + TICK_S:
                m.inc("egomem_tick_deadline_misses_total")
            due += TICK_S

    def next_frame(self) -> np.ndarray:
        """This tick's 1920 samples of client audio; silence (counted as a late frame) when none are ready."""
        if self._pcm_in_len < FRAME_SAMPLES:
            self.s.metrics.inc("egomem_late_frames_total")
            return np.zeros(FRAME_SAMPLES, np.float32)
        parts, need = [], FRAME_SAMPLES
        while need:
            head = self._pcm_in.popleft()
            take = head[:need]
            parts.append(take)
            need -= take.size
            if take.size < head.size:
                self._pcm_in.appendleft(head[take.size:])
        self._pcm_in_len -= FRAME_SAMPLES
        return np.concatenate(parts)

    def take_refresh(self) -> Refresh | None:
        """The MemChunk refresh to apply with this tick's dialog step, if one is waiting."""
        return self._refreshes.popleft() if self._refreshes else None

    def finish_tick(self, pcm: np.ndarray, listen: np.ndarray, d: DialogOut, audio: np.ndarray | None,
                    refresh: Refresh | None) -> None:
        """After the model calls: send the previous tick's voice, this tick's text and events; record the tick."""
        start = self.ticks == 0
        self.ticks += 1
        if start:  # both models hold the stream now: Moshi's handshake means "send audio"
            self.send(pack(HANDSHAKE))
            self.send(pack_event("stream_open", stream_id=self.stream_id, sequence_id=self.sequence_id))
        if refresh is not None:
            dt = time.monotonic() - refresh.asked_at
            self.s.metrics.observe("egomem_refresh_seconds", dt)
            self.send(pack_event("memchunk_refreshed", level=refresh.level, user_id=refresh.user_id,
                                 text=refresh.text, latency_ms=round(dt * 1000, 1)))
        if audio is not None:
            opus = self._opus_out.append_pcm(audio.reshape(-1).astype(np.float32))
            if len(opus):
                self.send(pack(AUDIO, opus))
        self.speak_pending = d.speak if (d.speak >= 0).all() else None  # -2 while the acoustic delays warm up
        self.recorder.tick(d.text_token, d.speak, listen, pcm, d.piece)
        if d.piece:
            self.send(pack(TEXT, d.piece.encode("utf-8")))
            self._on_text(d.piece)
        if self.recorder.steps >= self.oc.chunk_steps:
            self._flushes.append(asyncio.create_task(self.flush_memory()))

    # -- query detection -> Level-2 --------------------------------------------------------------
    def _on_text(self, piece: str) -> None:
        self._text_channel = (self._text_channel + piece)[-MAX_TEXT_CHANNEL:]
        if ">" not in piece or self.s.perception is None or not self.oc.retrieval:
            return
        query = parse_query(self._text_channel, self.cfg.retrieval.max_query_chars)
        if query is None:
            return
        self._text_channel = ""  # this query is handled; the next one starts fresh
        task = asyncio.create_task(self._retrieve(query))
        self._tasks.append(task)

    async def _retrieve(self, query) -> None:
        t0 = time.monotonic()
        user = self.user_id
        try:
            hits = await asyncio.to_thread(self.s.perception.retrieve, user, query)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a failed retrieval must not end the dialog
            self.s.metrics.inc("egomem_triton_errors_total")
            self.send(pack_event("warning", message=f"retrieval failed: {e}"))
            return
        dt = time.monotonic() - t0
        self.s.metrics.observe("egomem_retrieval_seconds", dt)
        if self.user_id != user:  # the person changed or was forgotten meanwhile: these facts are not theirs
            return
        texts = [h.document.text() for h in hits]
        self.send(pack_event("retrieval", user_id=user, query={"relations": list(query.relations),
                                                              "keywords": list(query.keywords)},
                             results=texts, latency_ms=round(dt * 1000, 1)))
        self.request_refresh(2, "\n".join(texts), user)

    # -- polling loop: who is there ----------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while not self.closed.is_set():
            try:
                await asyncio.wait_for(self.closed.wait(), self.oc.poll_interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.poll_once()
            except (TritonUnavailable, TritonRequestError) as e:
                self.s.metrics.inc("egomem_triton_errors_total")
                log.warning("stream %s: identification skipped: %s", self.stream_id, e)
            except Exception as e:  # noqa: BLE001 - the polling loop never ends the dialog
                log.exception("stream %s: identification failed", self.stream_id)
                self.send(pack_event("warning", message=f"identification failed: {e}"))

    async def poll_once(self) -> None:
        p = self.s.perception
        assert p is not None
        t0 = time.monotonic()
        frame, self._frame = self._frame, None
        faces, speaker = None, -1
        if frame is not None:
            try:
                image = await asyncio.to_thread(decode_image, frame, self.cfg.identity.max_image_pixels)
            except ValueError as e:
                self.send(pack_event("warning", message=str(e)))
            else:
                fr = await p.faces(image)
                if fr.embeddings.shape[0]:
                    faces, speaker = fr.embeddings, fr.speaker
                    self.recorder.face(fr.embeddings[max(fr.speaker, 0)])
        voice = None
        if np.abs(self._recent).max() > 1e-4:  # silence is nobody
            voice = await p.voice(self._recent.copy())
            if voice is not None and voice.size:
                self.recorder.voice(voice)
            else:
                voice = None
        if faces is None and voice is None:
            return
        self.polls += 1
        forgets = p.forgets
        ident = await asyncio.to_thread(p.identify, faces, speaker, voice)
        dt = time.monotonic() - t0
        self.s.metrics.observe("egomem_identification_seconds", dt)
        if ident.user_id is None or ident.user_id == self.user_id:
            return
        if p.forgets != forgets:  # a forget landed during the search: its answer may name the forgotten
            return  # person; the next poll asks the rebuilt index
        name = await asyncio.to_thread(p.user_name, ident.user_id)
        if name is None:  # gone since (forgotten, or merged away): never personalise for them
            return
        previous, self.user_id = self.user_id, ident.user_id
        self.send(pack_event("user_recognised", user_id=ident.user_id, name=name, decided_by=ident.decided_by,
                             previous_user_id=previous, latency_ms=round(dt * 1000, 1), poll=self.polls,
                             face_distance=ident.face_distance, voice_score=ident.voice_score))
        text = await asyncio.to_thread(p.profile_text, ident.user_id, self.cfg.memory.profile_max_chars)
        self.request_refresh(1, _fit(text, self.cfg.dialog.l1_steps), ident.user_id)

    # -- memory ------------------------------------------------------------------------------------
    async def flush_memory(self) -> None:
        """Hand what was recorded to the memory manager (a durable job)."""
        chunk = self.recorder.cut()
        if chunk is None:
            return
        try:
            job_id = await asyncio.to_thread(submit, self.s.store, self.cfg.memory.chunk_dir, chunk)
        except Exception as e:  # noqa: BLE001
            log.error("stream %s: memory chunk %d could not be stored: %s", self.stream_id, chunk.chunk_index, e)
            self.send(pack_event("warning", message=f"memory chunk {chunk.chunk_index} not stored: {e}"))
            return
        self.s.metrics.inc("egomem_memory_jobs_total")
        self.send(pack_event("memory_written", chunk_index=chunk.chunk_index, steps=chunk.steps, job_id=job_id))


def _fit(text: str, max_bytes: int) -> str:
    """Cut `text` to at most `max_bytes` UTF-8 bytes at a line boundary (one byte = one MemChunk step
    with the offline byte tokenizer; SentencePiece needs fewer steps, never more)."""
    out, used = [], 0
    for line in text.split("\n"):
        cost = len(line.encode("utf-8")) + (1 if out else 0)
        if used + cost > max_bytes:
            break
        out.append(line)
        used += cost
    return "\n".join(out)
