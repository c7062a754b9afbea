"""Who is there: one stream's identification polling (docs/architecture.md, "Identity polling").

Every `orchestrator.poll_interval_s`: the newest video frame -> `face_encoder`, the last tau seconds
of the client's audio -> `speaker_encoder`, then `identify`. A change of user is announced
(`user_recognised`) and triggers an L1 refresh with that user's rendered profile. Each face or voice
looked at is recorded for the memory worker. A failed poll is a warning; it never ends the dialog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np

from egomem.config import Config
from egomem.dialog.card import serving_settings
from egomem.protocol import pack_event
from egomem.serving.client import TritonRequestError, TritonUnavailable

from .memchunk import MemChunk
from .metrics import Metrics
from .perception import Perception, decode_image
from .recording import Recorder
from .stream_input import StreamInput

log = logging.getLogger(__name__)
LAST_LOOK_S = 15.0  # at stream end, a running identification (and the one last look) gets this long


class IdentityPoller:
    def __init__(self, perception: Perception, cfg: Config, metrics: Metrics, stream_id: str, inputs: StreamInput,
                 recorder: Recorder, memchunk: MemChunk, send: Callable[[bytes], None]):
        self.p, self.cfg, self.metrics, self.stream_id = perception, cfg, metrics, stream_id
        self.inputs, self.recorder, self.memchunk, self.send = inputs, recorder, memchunk, send
        self.polls = 0  # polling rounds that had a face or a voice to look at
        # a new person restarts the dialog stream for a model fine-tuned on conversations from their start
        self.restart_on_new_person = serving_settings(cfg.dialog).new_person == "restart"
        self._task: asyncio.Task | None = None

    def start(self, closed: asyncio.Event) -> None:
        """Poll every `poll_interval_s` until `closed` is set."""
        self._task = asyncio.create_task(self._loop(closed))

    async def _loop(self, closed: asyncio.Event) -> None:
        while not closed.is_set():
            try:
                await asyncio.wait_for(closed.wait(), self.cfg.orchestrator.poll_interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.poll_once()
            except (TritonUnavailable, TritonRequestError) as e:
                self.metrics.inc("egomem_triton_errors_total")
                log.warning("stream %s: identification skipped: %s", self.stream_id, e)
            except Exception as e:  # the polling loop never ends the dialog
                log.exception("stream %s: identification failed", self.stream_id)
                self.send(pack_event("warning", message=f"identification failed: {e}"))

    async def finish(self, look: bool, timeout_s: float = LAST_LOOK_S) -> None:
        """At stream end: let a running identification finish, and (when `look`) look once more if the
        stream never was, or was last looked at a whole session's length ago (`trigger.min_session_steps`):
        every session of the memory chunk then has a face/voice in it or just after it (the memory
        worker's rule E7), else the worker cannot tell whose it is and enrols a nameless stranger.
        Then the polling loop is over."""
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
            unseen = self.polls == 0 or self.recorder.steps_since_poll >= self.cfg.trigger.min_session_steps
            if unseen and look:
                await asyncio.wait_for(self.poll_once(), timeout_s)
        except Exception as e:  # noqa: BLE001 - best effort; the chunk is handed over either way
            log.info("stream %s: last identification skipped: %s", self.stream_id, e)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def poll_once(self) -> None:
        p = self.p
        t0 = time.monotonic()
        frame = self.inputs.take_video()
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
        recent = self.inputs.recent
        if np.abs(recent).max() > 1e-4:  # silence is nobody
            voice = await p.voice(recent.copy())
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
        self.metrics.observe("egomem_identification_seconds", dt)
        if ident.user_id is None or ident.user_id == self.memchunk.user_id:
            return
        if p.forgets != forgets:  # a forget landed during the search: its answer may name the forgotten
            return  # person; the next poll asks the rebuilt index
        name = await asyncio.to_thread(p.user_name, ident.user_id)
        if name is None:  # gone since (forgotten, or merged away): never personalise for them
            return
        previous, self.memchunk.user_id = self.memchunk.user_id, ident.user_id
        self.send(pack_event("user_recognised", user_id=ident.user_id, name=name, decided_by=ident.decided_by,
                             previous_user_id=previous, latency_ms=round(dt * 1000, 1), poll=self.polls,
                             face_distance=ident.face_distance, voice_score=ident.voice_score))
        text = await asyncio.to_thread(p.profile_text, ident.user_id, self.cfg.memory.profile_max_chars)
        self.memchunk.profile(text, ident.user_id, restart=self.restart_on_new_person)
