"""The grid clock: one task ticks every `tick_clock = "global"` stream in lockstep on one 80 ms grid.

Each tick runs in two phases over all streams at once: every stream's `encode` (its client frame ->
`mimi_codec`), then every stream's `step` (`dialog_lm`, with the previous voice's decode beside it).
All requests of a phase leave in one event-loop pass, so Triton's sequence batcher serves N streams
with one model step per phase. Per-stream clocks drift apart as soon as the machine is loaded; once
their requests stop meeting in the batcher's queue window, N streams cost N model steps, which loads
the machine more: the lockstep keeps the batch at N whatever the load. A tick that overruns delays
the next one for every stream alike (and a tick loop far behind skips ahead, counting the misses).

A stream whose call fails leaves the grid with its error (`run` raises it); the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from egomem.protocol import TICK_S

from .metrics import Metrics

if TYPE_CHECKING:
    from .stream import Stream

log = logging.getLogger(__name__)


class GridClock:
    def __init__(self, metrics: Metrics, max_lag_s: float):
        self.metrics = metrics
        self.max_lag_s = max_lag_s
        self._members: dict["Stream", asyncio.Future] = {}  # stream -> its failure, if any
        self._task: asyncio.Task | None = None
        self._ticking: set["Stream"] = set()  # the streams of the tick in progress
        self._tick_over = asyncio.Event()  # set when that tick is over (a new one per tick)

    @property
    def size(self) -> int:
        return len(self._members)

    async def run(self, stream: "Stream") -> None:
        """Tick `stream` with the others until it closes; raises what its tick raised."""
        failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self._members[stream] = failure
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        closed = asyncio.ensure_future(stream.closed.wait())
        try:
            await asyncio.wait([failure, closed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            self._members.pop(stream, None)
        if stream in self._ticking:  # let its calls in flight finish before the stream ends its sequences
            await self._tick_over.wait()
        if failure.done():
            failure.result()  # raises the stream's error

    def _fail(self, stream: "Stream", error: BaseException) -> None:
        failure = self._members.get(stream)
        if failure is not None and not failure.done():
            failure.set_exception(error)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # noqa: BLE001 - a bug here must end the streams loudly, not hang them
            log.exception("grid clock failed")
            for stream in list(self._members):
                self._fail(stream, e)
        finally:
            self._ticking = set()
            self._tick_over.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        m = self.metrics
        due = math.ceil(loop.time() / TICK_S) * TICK_S
        while self._members:
            now = loop.time()
            if now < due:
                await asyncio.sleep(due - now)
                now = loop.time()
            members = [s for s, f in self._members.items() if not f.done() and not s.closed.is_set()]
            if now - due > self.max_lag_s:  # far behind (a stall): skip ahead, count what was lost
                skipped = int((now - due) / TICK_S)
                m.inc("egomem_tick_deadline_misses_total", skipped * len(members))
                due += skipped * TICK_S
            t0 = loop.time()
            self._ticking, self._tick_over = set(members), asyncio.Event()
            encoded = await asyncio.gather(*(s.encode() for s in members), return_exceptions=True)
            ready = []
            for stream, enc in zip(members, encoded):
                if isinstance(enc, BaseException):
                    self._fail(stream, enc)
                else:
                    ready.append((stream, enc))
            stepped = await asyncio.gather(*(s.step(enc) for s, enc in ready), return_exceptions=True)
            for (stream, _), res in zip(ready, stepped):
                if isinstance(res, BaseException):
                    self._fail(stream, res)
            self._ticking = set()
            self._tick_over.set()
            t1 = loop.time()
            for _ in members:  # one observation per stream-tick, as per-stream clocks report them
                m.observe("egomem_tick_seconds", t1 - t0)
            if t1 > max(due, t0) + TICK_S:
                m.inc("egomem_tick_deadline_misses_total", len(members))
            due += TICK_S
