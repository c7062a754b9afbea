"""The shared resources of one orchestrator process and the app keys they live under.

`Services` is opened and closed by app.py's cleanup context; routes (rest.py, ws.py) read it as
`request.app[SERVICES]`. The keys are defined here, beside what they hold, so routes import downward
(routes -> services) and never the module that builds the app.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from egomem.config import Config
from egomem.memory import MemoryStore

from .forgets import PendingForgets
from .metrics import Metrics
from .perception import Perception
from .recording import Recorder
from .replicas import Replicas


class OpenStream(Protocol):
    """What the app and the REST routes need of a live chat stream (stream.py's `Stream` is one)."""

    user_id: str | None
    ticks: int
    opened_at: float
    recorder: Recorder

    def stop(self) -> None: ...

    def forget_user(self, user_id: str) -> None: ...

    def refresh_profile(self) -> None: ...


@dataclass
class Services:
    cfg: Config
    store: MemoryStore
    metrics: Metrics
    perception: Perception | None  # None: identification/retrieval models are off
    # The tritonservers: each with its model gateway (mimi_codec, dialog_lm calls) and its grid clock
    # (ticks its global-clock streams in lockstep); a stream is pinned to one (replicas.py).
    replicas: Replicas
    streams: dict[str, OpenStream] = field(default_factory=dict)  # open chats by stream id (ws.py keeps it)
    # Recorded chunks cut and on their way into the job queue; a forget waits for them (`handoffs_done`).
    handoffs: set[asyncio.Future[None]] = field(default_factory=set)
    # People about to be forgotten (forgets.py, the two-phase forget): every chunk a recorder cuts is redacted
    forgets: PendingForgets = field(init=False)
    _no_streams: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        self._no_streams.set()
        self.forgets = PendingForgets(self.cfg.memory)

    @property
    def free_slots(self) -> int:
        return self.cfg.orchestrator.max_streams - len(self.streams)

    def add_stream(self, stream_id: str, stream: OpenStream) -> None:
        self.streams[stream_id] = stream
        self._no_streams.clear()
        self.metrics.set("egomem_open_streams", len(self.streams))

    def drop_stream(self, stream_id: str) -> None:
        self.streams.pop(stream_id, None)
        if not self.streams:
            self._no_streams.set()
        self.metrics.set("egomem_open_streams", len(self.streams))

    @contextlib.contextmanager
    def handoff(self) -> Iterator[None]:
        """Marks a recorded chunk on its way from a stream into the job queue (cut, then submitted)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.handoffs.add(done)
        try:
            yield
        finally:
            self.handoffs.discard(done)
            if not done.done():
                done.set_result(None)

    async def handoffs_done(self) -> None:
        """Wait until every chunk cut so far is in the job queue (or failed), so that a forget's pass over
        the queue sees it: a chunk cut before the forget redacted the recordings must not slip in after."""
        if self.handoffs:
            await asyncio.wait(list(self.handoffs))  # not gather: a cancelled forget must not cancel them

    def stop_streams(self) -> None:
        """Ask every open chat to end (each flushes its memory and ends its Triton sequences)."""
        for stream in list(self.streams.values()):
            stream.stop()

    async def closed_streams(self, timeout_s: float) -> bool:
        """Wait until every chat handler has dropped its stream, at most `timeout_s`; True if they all did."""
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


SERVICES = web.AppKey("services", Services)
CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
