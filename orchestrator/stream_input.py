"""One stream's client input, buffered between the WebSocket reader and the tick.

Audio: the decoded PCM waits here until a tick takes its 1920 samples (`next_frame`); a client that
runs ahead of real time loses its oldest audio beyond `orchestrator.max_input_buffer_s`. The last
`orchestrator.identify_window_s` seconds of what the client sent are kept apart (`recent`) for
identification, however fast the ticks run. Video: only the newest frame is kept, until the polling
loop takes it.
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np

from egomem.config import OrchestratorConfig
from egomem.protocol import FRAME_SAMPLES, SAMPLE_RATE

from .metrics import Metrics


class StreamInput:
    def __init__(self, oc: OrchestratorConfig, metrics: Metrics):
        self.metrics = metrics
        self._pcm: collections.deque[np.ndarray] = collections.deque()
        self.samples = 0  # client samples buffered, not yet taken by a tick
        self.frame_ready = asyncio.Event()  # set when a whole frame is buffered
        self.recent = np.zeros(int(oc.identify_window_s * SAMPLE_RATE), np.float32)  # last tau s of user audio
        self._limit = int(oc.max_input_buffer_s * SAMPLE_RATE) + FRAME_SAMPLES
        self._video: bytes | None = None  # latest video frame, not yet looked at

    # -- from the WebSocket reader ----------------------------------------------------------------
    def push_pcm(self, pcm: np.ndarray) -> None:
        pcm = np.asarray(pcm, np.float32).reshape(-1)
        if pcm.size == 0:
            return
        self._pcm.append(pcm)
        self.samples += pcm.size
        if self.samples >= FRAME_SAMPLES:
            self.frame_ready.set()
        keep = self.recent.size  # identification hears what the client sent, however fast the ticks run
        self.recent = np.concatenate([self.recent, pcm])[-keep:] if pcm.size < keep else pcm[-keep:].copy()
        while self.samples > self._limit:  # the client runs ahead of real time: drop the oldest audio
            old = self._pcm.popleft()
            self.samples -= old.size
            self.metrics.inc("egomem_dropped_input_seconds_total", old.size / SAMPLE_RATE)

    def push_video(self, data: bytes) -> None:
        self._video = data  # only the newest frame matters to the polling loop

    # -- to the tick and the polling loop ---------------------------------------------------------
    @property
    def has_frame(self) -> bool:
        return self.samples >= FRAME_SAMPLES

    def next_frame(self) -> np.ndarray:
        """This tick's 1920 samples of client audio; silence (counted as a late frame) when none are ready."""
        if self.samples < FRAME_SAMPLES:
            self.metrics.inc("egomem_late_frames_total")
            return np.zeros(FRAME_SAMPLES, np.float32)
        parts, need = [], FRAME_SAMPLES
        while need:
            head = self._pcm.popleft()
            take = head[:need]
            parts.append(take)
            need -= take.size
            if take.size < head.size:
                self._pcm.appendleft(head[take.size:])
        self.samples -= FRAME_SAMPLES
        return np.concatenate(parts)

    def take_video(self) -> bytes | None:
        """The newest video frame not yet looked at (None when none came since the last look)."""
        frame, self._video = self._video, None
        return frame
