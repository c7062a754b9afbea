"""One chat stream: its lifecycle and its 12.5 Hz dialog tick, composed from one part per concern.

  - client input buffering: stream_input.py (`StreamInput`);
  - identity polling (the 2 s loop): polling.py (`IdentityPoller`);
  - query detection -> Level-2 retrieval: queries.py (`QueryDetector`);
  - who is there and the MemChunk refreshes waiting for the next tick: memchunk.py (`MemChunk`);
  - recording each tick for the memory manager: recording.py (`Recorder`, `submit`).

Dialog tick (every 80 ms, docs/architecture.md#one-80-ms-tick; driven by the grid clock shared by all streams
on the stream's Triton replica, orchestrator/grid.py and replicas.py, or with `tick_clock = "input"` by the
stream's own loop; the model calls for a cohort of streams are in orchestrator/cohort.py):
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

Outbound messages go through `send` (a bounded queue drained by the WebSocket writer), so a slow
client never slows any tick. `run()` awaits every task it started: the tick loop, then the polling
loop's last look, the retrievals, the memory hand-overs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
import sphn

from egomem.memory.errors import StoreError
from egomem.protocol import AUDIO, CLOSE_INTERNAL, HANDSHAKE, SAMPLE_RATE, TEXT, TICK_S, pack, pack_event

from .cohort import DialogOut, end_cohort, tick_cohort
from .gateway import StreamFailed
from .memchunk import MemChunk, Refresh
from .polling import IdentityPoller
from .queries import QueryDetector
from .recording import Recorder, submit
from .services import Services
from .stream_input import StreamInput

log = logging.getLogger(__name__)


class Stream:
    """One chat. The grid clock and the cohort calls (grid.py, cohort.py) use `closed`, `s`, `sequence_id`,
    `encoded`, `ticks`, `speak_pending`, `next_frame`, `take_refresh` and `finish_tick`; the WebSocket
    handler the `push_*` inputs, `run`, `stop` and `failure`; the REST API `user_id`, `recorder`, `forget_user`."""

    def __init__(self, services: Services, stream_id: str, send: Callable[[bytes], None]):
        self.s = services
        self.cfg = services.cfg
        self.oc = services.cfg.orchestrator
        self.stream_id = stream_id
        self.replica = services.replicas.pin()  # its model state lives there until it ends (unpinned in run)
        self.sequence_id = self.replica.gateway.new_sequence_id()
        self.send = send
        self.closed = asyncio.Event()  # set by stop(), or when the ticks end on their own
        self.ticking_ended = asyncio.Event()  # the tick loop is over and `failure` says why, if it failed
        self.failure: StreamFailed | None = None
        self.ticks = 0  # ticks finished (dialog step done)
        self.encoded = 0  # client frames encoded (one tick ahead of `ticks` while the grid overlaps ticks)
        self.opened_at = time.time()
        self.speak_pending: np.ndarray | None = None  # speak codes of the previous tick, decoded this tick
        self.input = StreamInput(self.oc, services.metrics)
        self.memchunk = MemChunk(self.cfg.dialog.l1_steps)
        self.recorder = Recorder(stream_id, self.oc.record_audio, services.forgets)
        self.queries = QueryDetector(services.perception, self.cfg, services.metrics, self.memchunk, send)
        self.poller: IdentityPoller | None = None
        if services.perception is not None and self.oc.identify_models:
            self.poller = IdentityPoller(services.perception, self.cfg, services.metrics, stream_id, self.input,
                                         self.recorder, self.memchunk, send)
        self._opus_out = sphn.OpusStreamWriter(SAMPLE_RATE)
        self._reloads: list[asyncio.Task] = []  # profile reloads after a forget
        self._flushes: list[asyncio.Task] = []  # memory hand-overs: awaited, never cancelled

    @property
    def user_id(self) -> str | None:
        return self.memchunk.user_id

    @user_id.setter
    def user_id(self, user_id: str | None) -> None:
        self.memchunk.user_id = user_id

    @property
    def polls(self) -> int:
        """Polling rounds that had a face or a voice to look at."""
        return self.poller.polls if self.poller is not None else 0

    @property
    def _recent(self) -> np.ndarray:
        """The last `identify_window_s` seconds of the client's audio (what identification hears)."""
        return self.input.recent

    # -- inputs (called by the WebSocket reader) ------------------------------------------------
    def push_pcm(self, pcm: np.ndarray) -> None:
        self.input.push_pcm(pcm)

    def push_video(self, data: bytes) -> None:
        self.input.push_video(data)

    def push_transcript(self, text: str) -> None:
        self.recorder.transcript_line(text)

    def push_model_text(self, text: str) -> None:
        """Text appended to the model's text channel as if the model wrote it (orchestrator.accept_model_text)."""
        self.recorder.monologue.append((max(self.recorder.steps - 1, 0), text))
        self.queries.on_text(text)

    def request_refresh(self, level: int, text: str, user_id: str | None) -> None:
        self.memchunk.request(level, text, user_id)

    def forget_user(self, user_id: str) -> None:
        """The user was forgotten: stop personalising for them now. Another user's stream reloads its
        profile, which forget may have redacted (the person's name, the relation to them); the new L1
        also clears an L2 that may hold the forgotten person's facts."""
        if self.user_id == user_id:
            self.user_id = None
            self.request_refresh(1, "", None)
        else:
            self.refresh_profile()

    def refresh_profile(self) -> None:
        """Reload the current user's profile into the Level-1 MemChunk (it changed in the store)."""
        if self.user_id is not None:
            self._reloads = [t for t in self._reloads if not t.done()]
            self._reloads.append(asyncio.create_task(self._reload_profile(self.user_id)))

    async def _reload_profile(self, user_id: str) -> None:
        try:
            text = await asyncio.to_thread(self.s.store.render_profile, user_id,
                                           max_chars=self.cfg.memory.profile_max_chars)
        except StoreError:  # forgotten or merged away meanwhile: the change feed's next change says which
            return
        if self.user_id == user_id:  # still the same person in front of the camera
            self.memchunk.profile(text, user_id)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until `stop()` or a model failure; always closes the Triton sequences and flushes memory."""
        if self.poller is not None:
            self.poller.start(self.closed)
        try:
            await self._tick_loop()
        except StreamFailed as e:
            self.failure = e
        except asyncio.CancelledError:
            pass
        except Exception as e:  # a bug in one stream ends that stream only, loudly
            log.exception("stream %s failed", self.stream_id)
            self.failure = StreamFailed(f"internal error: {type(e).__name__}", CLOSE_INTERNAL)
        finally:
            self.closed.set()
            self.ticking_ended.set()
            if self.poller is not None:
                await self.poller.finish(look=self.failure is None)
            for t in self._reloads:
                t.cancel()
            await asyncio.gather(self.queries.close(), *self._reloads, return_exceptions=True)
            try:
                await self._end_sequences()
            finally:
                self.s.replicas.unpin(self.replica)  # even when cancelled: the count places new streams
            await asyncio.gather(*self._flushes, return_exceptions=True)
            await self.flush_memory()

    def stop(self) -> None:
        self.closed.set()

    async def _end_sequences(self) -> None:
        if self.encoded == 0:  # no model holds state for this stream yet
            return
        failure, = await end_cohort([self], self.replica.gateway)
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
            await self.replica.clock.run(self)
            return
        loop = asyncio.get_running_loop()
        m = self.s.metrics
        due = loop.time()
        while not self.closed.is_set():
            while True:
                now = loop.time()
                ready = self.input.has_frame
                if (ready and now >= due - TICK_S) or now >= due + self.oc.late_grace_s:
                    break
                wake = (due - TICK_S if ready else due + self.oc.late_grace_s) - now
                self.input.frame_ready.clear()
                waiters = [asyncio.ensure_future(self.closed.wait())]
                if not ready:
                    waiters.append(asyncio.ensure_future(self.input.frame_ready.wait()))
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
            failure = (await tick_cohort([self], self.replica.gateway)).get(self)
            if failure is not None:
                raise failure
            t1 = loop.time()
            m.observe("egomem_tick_seconds", t1 - t0)
            if t1 > max(due, t0) + TICK_S:
                m.inc("egomem_tick_deadline_misses_total")
            due += TICK_S

    def next_frame(self) -> np.ndarray:
        """This tick's 1920 samples of client audio; silence (counted as a late frame) when none are ready."""
        return self.input.next_frame()

    def take_refresh(self) -> Refresh | None:
        """The MemChunk refresh to apply with this tick's dialog step, if one is waiting."""
        return self.memchunk.take()

    def finish_tick(self, pcm: np.ndarray, listen: np.ndarray, d: DialogOut, audio: np.ndarray | None,
                    refresh: Refresh | None) -> None:
        """After the model calls: send the previous tick's voice, this tick's text and events; record the tick."""
        start = self.ticks == 0
        self.ticks += 1
        if start:  # both models hold the stream now: Moshi's handshake means "send audio"
            self.send(pack(HANDSHAKE))
            self.send(pack_event("stream_open", stream_id=self.stream_id, sequence_id=self.sequence_id,
                                 replica=self.replica.index))
        if refresh is not None:
            dt = time.monotonic() - refresh.asked_at
            self.s.metrics.observe("egomem_refresh_seconds", dt)
            self.send(pack_event("memchunk_refreshed", level=refresh.level, user_id=refresh.user_id,
                                 text=refresh.text, latency_ms=round(dt * 1000, 1), restarted=refresh.restart,
                                 dialog_step=d.step))
        if audio is not None:
            opus = self._opus_out.append_pcm(audio.reshape(-1).astype(np.float32))
            if len(opus):
                self.send(pack(AUDIO, opus))
        self.speak_pending = d.speak if (d.speak >= 0).all() else None  # -2 while the acoustic delays warm up
        self.recorder.tick(d.text_token, d.speak, listen, pcm, d.piece)
        if d.piece:
            self.send(pack(TEXT, d.piece.encode("utf-8")))
            self.queries.on_text(d.piece)
        if self.recorder.steps >= self.oc.chunk_steps:
            self._flushes.append(asyncio.create_task(self.flush_memory()))

    # -- memory ------------------------------------------------------------------------------------
    async def flush_memory(self) -> None:
        """Hand what was recorded to the memory manager (a durable job). A forget waits for the hand-off."""
        with self.s.handoff():
            chunk = self.recorder.cut()
            if chunk is None:
                return
            try:
                job_id = await asyncio.to_thread(submit, self.s.store, self.cfg.memory.chunk_dir, chunk)
            except Exception as e:  # noqa: BLE001 - the stream goes on; the client is told this chunk was not stored
                log.error("stream %s: memory chunk %d could not be stored: %s", self.stream_id, chunk.chunk_index, e)
                self.send(pack_event("warning", message=f"memory chunk {chunk.chunk_index} not stored: {e}"))
                return
        self.s.metrics.inc("egomem_memory_jobs_total")
        self.send(pack_event("memory_written", chunk_index=chunk.chunk_index, steps=chunk.steps, job_id=job_id))
