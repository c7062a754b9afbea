"""The grid clock: one task ticks every `tick_clock = "global"` stream in lockstep on one 80 ms grid.

Every 80 ms it hands all its streams to the tick's two phases as one cohort (orchestrator/cohort.py:
one request per model call for all of them), so the models step N streams at once. Per-stream clocks
drift apart as soon as the machine is loaded; their requests then stop meeting in Triton's queue
window, N streams cost N model steps, and that loads the machine more: the lockstep keeps the batch at
N whatever the load.

Overlap (`orchestrator.overlap_ticks`): a tick is `encode` (the codec process) then `step` (the dialog
process, beside the codec's decode). When a step runs past the next due time, the next tick's encode
runs beside it instead of after it, so the grid keeps pace as long as each model process alone fits in
80 ms; a tick's own latency (encode + step) may then reach two periods. Order is kept: a tick's encode
follows the previous encode, its step the previous step; at most two ticks are in flight. A grid far
behind its clock skips ahead, counting the misses.

A stream whose tick fails leaves the grid with its error (`run` raises it); the others go on.

The grid knows nothing of models: it is handed its two phases (orchestrator/cohort.py's, which call the
models through orchestrator/gateway.py), and of a stream it needs only `GridStream`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from egomem.protocol import TICK_S

from .metrics import Metrics

log = logging.getLogger(__name__)


class GridStream(Protocol):
    """What the grid needs of a stream (hashable, as every object is): that it has closed."""

    closed: asyncio.Event


Failures = dict[Any, BaseException]  # GridStream -> its error
EncodeFn = Callable[[list[Any]], Awaitable[tuple[list[Any], Failures]]]  # streams -> (rows with .stream, failures)
StepFn = Callable[[list[Any]], Awaitable[Failures]]


@dataclass(eq=False)
class _Tick:
    members: list[GridStream]
    due: float
    encoded: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class GridClock:
    def __init__(self, metrics: Metrics, max_lag_s: float, encode: EncodeFn, step: StepFn, overlap: bool = True):
        """`encode(streams)` runs phase 1 for a cohort, `step(rows)` phase 2 for its rows; each returns the
        streams that failed, with their errors."""
        self.metrics = metrics
        self.max_lag_s = max_lag_s
        self.encode, self.step, self.overlap = encode, step, overlap
        self._members: dict[GridStream, asyncio.Future] = {}  # stream -> its failure, if any
        self._task: asyncio.Task | None = None
        self._inflight: list[_Tick] = []  # oldest first

    @property
    def size(self) -> int:
        return len(self._members)

    async def run(self, stream: GridStream) -> None:
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
        # let its calls in flight finish before the stream ends its model state
        mine = [t.task for t in self._inflight if stream in t.members and t.task is not None]
        if mine:
            await asyncio.wait(mine)
        if failure.done():
            failure.result()  # raises the stream's error

    def _fail(self, stream: GridStream, error: BaseException) -> None:
        failure = self._members.get(stream)
        if failure is not None and not failure.done():
            failure.set_exception(error)

    def _alive(self, stream: GridStream) -> bool:
        failure = self._members.get(stream)
        return failure is None or not failure.done()  # a closed stream finishes the ticks it is in

    async def _run(self) -> None:
        try:
            while self._members:  # no await between this check and the return: a stream joining later
                await self._loop()  # finds this task done and starts a new one
                pending = [t.task for t in self._inflight if t.task is not None and not t.task.done()]
                if pending:
                    await asyncio.wait(pending)
        except Exception as e:  # a bug here must end the streams loudly, not hang them
            log.exception("grid clock failed")
            for stream in list(self._members):
                self._fail(stream, e)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        m = self.metrics
        due = math.ceil(loop.time() / TICK_S) * TICK_S
        while self._members:
            now = loop.time()
            if now < due:
                await asyncio.sleep(due - now)
                now = loop.time()
            self._inflight = [t for t in self._inflight if not t.task.done()]
            if self._inflight and (not self.overlap or len(self._inflight) >= 2):
                await asyncio.wait([self._inflight[0].task])
                continue  # re-read the clock and the members
            members = [s for s, f in self._members.items() if not f.done() and not s.closed.is_set()]
            if now - due > self.max_lag_s:  # far behind (a stall): skip ahead, count what was lost
                skipped = int((now - due) / TICK_S)
                m.inc("egomem_tick_deadline_misses_total", skipped * len(members))
                due += skipped * TICK_S
            if members:
                tick = _Tick(members, due)
                previous = self._inflight[-1] if self._inflight else None
                tick.task = asyncio.create_task(self._tick(tick, previous))
                self._inflight.append(tick)
                await tick.encoded.wait()  # the next tick's encode follows this one's
            due += TICK_S

    async def _tick(self, tick: _Tick, previous: _Tick | None) -> None:
        try:
            await self._phases(tick, previous)
        except Exception as e:  # a bug here must end this tick's streams loudly, not hang them
            log.exception("grid tick failed")
            for stream in tick.members:
                self._fail(stream, e)

    async def _phases(self, tick: _Tick, previous: _Tick | None) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            rows, failed = await self.encode(tick.members)
        finally:
            tick.encoded.set()  # the grid goes on to the next tick's encode, even after a failure here
        for stream, error in failed.items():
            self._fail(stream, error)
        if previous is not None and previous.task is not None:
            await asyncio.wait([previous.task])  # its step is over: speak codes known, dialog model free
        rows = [r for r in rows if self._alive(r.stream)]  # a stream failed in the previous step stops here
        for stream, error in (await self.step(rows)).items():
            self._fail(stream, error)
        t1 = loop.time()
        for _ in tick.members:  # one observation per stream-tick, as per-stream clocks report them
            self.metrics.observe("egomem_tick_seconds", t1 - t0)
        # a tick may overlap the next one's period when overlapping; past that its voice is late
        if t1 > max(tick.due, t0) + TICK_S * (2 if self.overlap else 1):
            self.metrics.inc("egomem_tick_deadline_misses_total", len(tick.members))
